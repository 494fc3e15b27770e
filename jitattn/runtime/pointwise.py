"""Launches of the row-wise kernels beside attention: RMSNorm (``kernels.norm``) and gated activations
(``kernels.act``), with the checks every public function relies on (shapes, dtypes, devices, aliasing).

Rows: every dimension but the last, collapsed (a ``[tokens, hidden]`` tensor, or ``[tokens, heads, dim]`` for a
per-head norm); the last dimension must be contiguous. The kernels read rows of one stride (a slice of a
wider buffer along the last dimension is read in place); a tensor whose leading dimensions do not collapse
into one stride (some heads of a wider ``[tokens, heads, dim]`` buffer, say) goes through a contiguous copy,
and an output or in-place tensor of that kind is written back from it.
"""

from __future__ import annotations

import math
import numbers

import torch

from ..abi import ACT_CODES
from ..jit import load
from ..spec import Op
from .checks import check_no_overlap, check_tensor, cpu_threads, launch_on, shares_memory, target_of, written_over
from .grad import check_writable, mark_written
from .specs import dtype_spec

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(name: str, t: torch.Tensor) -> None:
    check_tensor(name, t, dtypes=DTYPES)
    if t.dim() < 2:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected at least 2 dimensions ([tokens, hidden])")


def _row_stride(t: torch.Tensor) -> int | None:
    """Elements between consecutive rows of ``t``'s collapsed leading dimensions; None when they do not
    collapse into one stride."""
    if t.is_contiguous():  # the usual case, in a fraction of the loop's host time
        return t.shape[-1]
    row_stride, expected = None, None
    for n, st in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):  # inner to outer; size-1 dims step nowhere
        if n == 1:
            continue
        if expected is not None and st != expected:
            return None
        row_stride = st if row_stride is None else row_stride
        expected = st * n
    return row_stride if row_stride is not None else t.shape[-1]


def _rowwise(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(``t``, its row stride) when its rows share one stride, else (a contiguous copy, which a written tensor gets
    back, and its row length)."""
    stride = _row_stride(t)
    return (t, stride) if stride is not None else (t.contiguous(), t.shape[-1])


def check_eps(eps) -> float:
    if isinstance(eps, torch.Tensor):  # (its repr would not trace under torch.compile)
        raise TypeError("eps is a tensor; it must be a Python float (for a one-element tensor pass .item())")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise TypeError(f"eps={eps!r} must be a Python float")
    if not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps={eps!r} must be a finite number >= 0")
    return float(eps)


def _same(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.dtype != like.dtype:
        raise TypeError(f"{name} is {str(t.dtype).removeprefix('torch.')} but {like_name} is "
                        f"{str(like.dtype).removeprefix('torch.')}; give them one dtype")


def rms_norm(what: str, input: torch.Tensor, weight: torch.Tensor, eps, out: torch.Tensor,
             residual: torch.Tensor | None = None, weight_offset: float = 0.0) -> None:
    """``out = input / rms(input) * (weight_offset + weight)`` per row; with ``residual``: ``residual += input``
    first and the norm of that sum (``out`` is then ``input``, written in place)."""
    _check("input", input)
    _check("out", out)
    hidden = input.shape[-1]
    if hidden == 0:
        raise ValueError(f"{what}: input has shape {tuple(input.shape)}; its last dimension (hidden) must be >= 1")
    if tuple(out.shape) != tuple(input.shape):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)}; expected the input's {tuple(input.shape)}")
    check_tensor("weight", weight, ndim=1, dtypes=DTYPES)
    if weight.shape[0] != hidden:
        raise ValueError(f"{what}: weight has shape {tuple(weight.shape)}; expected ({hidden},) (the input's last "
                         "dimension)")
    _same("weight", weight, input, "input")
    _same("out", out, input, "input")
    check_no_overlap("input" if out is input else "out", out)  # (fused_add_rmsnorm writes its input)
    check_writable(what, **{"input" if out is input else "out": out, "residual": residual})
    # the devices before the addresses (a meta tensor's are all 0); a residual that is no tensor is named below
    target, device = target_of(what, [input, weight, out] + ([residual] if isinstance(residual, torch.Tensor) else []))
    if out is not input and out.device == input.device and (out.data_ptr(), out.stride()) == (input.data_ptr(),
                                                                                               input.stride()):
        out = input  # another view object of the same elements: in place, as FlashInfer takes it
    if residual is not None:
        _check("residual", residual)
        if tuple(residual.shape) != tuple(input.shape):
            raise ValueError(f"{what}: residual has shape {tuple(residual.shape)}; expected the input's "
                             f"{tuple(input.shape)}")
        _same("residual", residual, input, "input")
        check_no_overlap("residual", residual)
        if shares_memory(residual, input):
            raise ValueError(f"{what}: residual and input share memory; both are written (the sum into residual, "
                             "the norm into input): pass two tensors")
    elif out is not input and shares_memory(out, input):
        raise ValueError(f"{what}: out overlaps input without being it; pass input itself (in place) or a "
                         "tensor of its own")
    for name, written in (("input" if out is input else "out", out), ("residual", residual)):
        if written is not None and written_over(written, (("weight", weight),)):
            raise ValueError(f"{what}: weight shares memory with {name}, which this call writes; pass a weight of "
                             "its own (weight.clone())")
    eps = check_eps(eps)
    rows = math.prod(input.shape[:-1])
    if rows == 0:
        return
    src, in_stride = _rowwise(input)
    dst, out_stride = (src, in_stride) if out is input else _rowwise(out)
    res, res_stride = _rowwise(residual) if residual is not None else (None, 0)
    module = load(dtype_spec(Op.NORM, target, input.dtype))
    launch_on(module, "rmsnorm", device,
        input=src.data_ptr(), residual=res.data_ptr() if res is not None else None,
        weight=weight.data_ptr(), out=dst.data_ptr(), rows=rows, hidden=hidden, in_stride=in_stride,
        res_stride=res_stride, out_stride=out_stride, eps=eps, weight_offset=float(weight_offset),
        num_threads=cpu_threads())
    mark_written(out, residual)
    for written, staged in ((out, dst), (residual, res)):  # copies of tensors whose rows had no one stride
        if written is not None and staged is not written:
            written.copy_(staged)


def act_and_mul(what: str, act: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out[..., i] = act(input[..., i]) * input[..., d + i]`` for ``input`` of ``[..., 2 d]``; returns out."""
    _check("input", input)
    if input.shape[-1] % 2:
        raise ValueError(f"{what}: input has shape {tuple(input.shape)}; its last dimension must be even (the "
                         "activation's half, then the half it multiplies)")
    d = input.shape[-1] // 2
    shape = (*input.shape[:-1], d)
    if out is None:
        out = torch.empty(shape, dtype=input.dtype, device=input.device)
    else:
        _check("out", out)
        if tuple(out.shape) != shape:
            raise ValueError(f"{what}: out has shape {tuple(out.shape)}; expected {shape} (the input's, its last "
                             "dimension halved)")
        _same("out", out, input, "input")
        check_no_overlap("out", out)
        if shares_memory(out, input):
            raise ValueError(f"{what}: out shares memory with input; pass a tensor of its own")
        check_writable(what, out=out)
    target, device = target_of(what, [input, out])
    rows = math.prod(input.shape[:-1])
    if rows == 0 or d == 0:
        return out
    (src, in_stride), (dst, out_stride) = _rowwise(input), _rowwise(out)
    module = load(dtype_spec(Op.ACT, target, input.dtype))
    launch_on(module, "act_and_mul", device,
        input=src.data_ptr(), out=dst.data_ptr(), rows=rows, d=d, in_stride=in_stride,
        out_stride=out_stride, act=ACT_CODES[act], num_threads=cpu_threads())
    mark_written(out)
    if dst is not out:
        out.copy_(dst)
    return out

"""Launches of the row-wise kernels beside attention: RMSNorm (``kernels.norm``) and gated activations
(``kernels.act``), with the checks every public function relies on (shapes, dtypes, devices, aliasing).

Rows: every dimension but the last, collapsed (a ``[tokens, hidden]`` tensor, or ``[tokens, heads, dim]`` for a
per-head norm); the last dimension must be contiguous and the others must collapse into one row stride
(a slice of a wider buffer is fine, a transposed view is not).
"""

from __future__ import annotations

import math
import numbers

import torch

from ..abi import ACT_CODES
from ..jit import load
from ..spec import Target
from .checks import check_no_overlap, check_tensor, cpu_threads, stream_handle, target_of
from .specs import act_spec, norm_spec

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _rows(name: str, t: torch.Tensor) -> tuple[int, int]:
    """(rows, elements between consecutive rows) of ``t``'s leading dimensions, collapsed."""
    check_tensor(name, t, dtypes=DTYPES)
    if t.dim() < 2:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected at least 2 dimensions ([tokens, hidden])")
    row_stride, expected = None, None
    for n, st in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):  # inner to outer; size-1 dims step nowhere
        if n == 1:
            continue
        if expected is not None and st != expected:
            raise ValueError(f"{name} (shape {tuple(t.shape)}, strides {tuple(t.stride())}) cannot be read as rows "
                             "of one stride; call .contiguous() on it")
        row_stride = st if row_stride is None else row_stride
        expected = st * n
    return math.prod(t.shape[:-1]), row_stride if row_stride is not None else t.shape[-1]


def _eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps={eps!r} must be a finite number >= 0")
    return float(eps)


def _same(name: str, t: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    if t.dtype != like.dtype:
        raise TypeError(f"{name} is {str(t.dtype).removeprefix('torch.')} but {like_name} is "
                        f"{str(like.dtype).removeprefix('torch.')}; give them one dtype")


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 or b.numel() == 0:
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    a1 = a0 + a.element_size() * (1 + sum((n - 1) * st for n, st in zip(a.shape, a.stride())))
    b1 = b0 + b.element_size() * (1 + sum((n - 1) * st for n, st in zip(b.shape, b.stride())))
    return a0 < b1 and b0 < a1


def _launch(module, entry: str, target: Target, device: torch.device, params: dict) -> None:
    if target is Target.CUDA:
        with torch.cuda.device(device):
            module.launch(entry, stream_handle(device), **params)
    else:
        module.launch(entry, None, **params)


def rms_norm(what: str, input: torch.Tensor, weight: torch.Tensor, eps, out: torch.Tensor,
             residual: torch.Tensor | None = None, weight_offset: float = 0.0) -> None:
    """``out = input / rms(input) * (weight_offset + weight)`` per row; with ``residual``: ``residual += input``
    first and the norm of that sum (``out`` is then ``input``, written in place)."""
    rows, in_stride = _rows("input", input)
    _, out_stride = _rows("out", out)
    hidden = input.shape[-1]
    if tuple(out.shape) != tuple(input.shape):
        raise ValueError(f"{what}: out has shape {tuple(out.shape)}; expected the input's {tuple(input.shape)}")
    check_tensor("weight", weight, ndim=1, dtypes=DTYPES)
    if weight.shape[0] != hidden:
        raise ValueError(f"{what}: weight has shape {tuple(weight.shape)}; expected ({hidden},) (the input's last "
                         "dimension)")
    _same("weight", weight, input, "input")
    _same("out", out, input, "input")
    check_no_overlap("out", out)
    res_stride = 0
    if residual is not None:
        _, res_stride = _rows("residual", residual)
        if tuple(residual.shape) != tuple(input.shape):
            raise ValueError(f"{what}: residual has shape {tuple(residual.shape)}; expected the input's "
                             f"{tuple(input.shape)}")
        _same("residual", residual, input, "input")
        check_no_overlap("residual", residual)
        if _shares_memory(residual, input):
            raise ValueError(f"{what}: residual and input share memory; both are written (the sum into residual, "
                             "the norm into input): pass two tensors")
    elif out is not input and _shares_memory(out, input):
        raise ValueError(f"{what}: out overlaps input without being it; pass input itself (in place) or a "
                         "tensor of its own")
    target, device = target_of(what, [input, weight, out, residual])
    eps = _eps(eps)
    if rows == 0:
        return
    module = load(norm_spec(target, input.dtype))
    _launch(module, "rmsnorm", target, device, dict(
        input=input.data_ptr(), residual=residual.data_ptr() if residual is not None else None,
        weight=weight.data_ptr(), out=out.data_ptr(), rows=rows, hidden=hidden, in_stride=in_stride,
        res_stride=res_stride, out_stride=out_stride, eps=eps, weight_offset=float(weight_offset),
        num_threads=cpu_threads()))


def act_and_mul(what: str, act: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out[..., i] = act(input[..., i]) * input[..., d + i]`` for ``input`` of ``[..., 2 d]``; returns out."""
    rows, in_stride = _rows("input", input)
    if input.shape[-1] % 2:
        raise ValueError(f"{what}: input has shape {tuple(input.shape)}; its last dimension must be even (the "
                         "activation's half, then the half it multiplies)")
    d = input.shape[-1] // 2
    shape = (*input.shape[:-1], d)
    if out is None:
        out = torch.empty(shape, dtype=input.dtype, device=input.device)
    else:
        _rows("out", out)
        if tuple(out.shape) != shape:
            raise ValueError(f"{what}: out has shape {tuple(out.shape)}; expected {shape} (the input's, its last "
                             "dimension halved)")
        _same("out", out, input, "input")
        check_no_overlap("out", out)
        if _shares_memory(out, input):
            raise ValueError(f"{what}: out shares memory with input; pass a tensor of its own")
    _, out_stride = _rows("out", out)
    target, device = target_of(what, [input, out])
    if rows == 0 or d == 0:
        return out
    module = load(act_spec(target, input.dtype))
    _launch(module, "act_and_mul", target, device, dict(
        input=input.data_ptr(), out=out.data_ptr(), rows=rows, d=d, in_stride=in_stride, out_stride=out_stride,
        act=ACT_CODES[act], num_threads=cpu_threads()))
    return out

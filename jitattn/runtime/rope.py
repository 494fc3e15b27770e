"""The RoPE launch: checks, the angle parameters, and one call of the rope kernel for q and k.

``rotate`` is the one entry every public RoPE function goes through (``jitattn.ops.rope``). It rotates
``q`` into ``q_out`` and ``k`` into ``k_out`` (the same tensors for the in-place functions); positions
come from ``Positions`` and angles from ``Angles``. See ``jitattn.kernels.rope`` for the kernel's
arithmetic, field by field.

Checks run on the host and never read a device tensor: index arrays on the cpu target are checked
before the launch (``indptr`` runs from 0 to nnz without decreasing, cache positions are inside the
cache), as the cpu kernel does again; on a CUDA device an invalid position is not reported (that would
need a sync) and its token's rotated dimensions become NaN.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from ..abi import ROPE_POSITION_CODES
from ..jit import load
from .checks import check_no_overlap, check_tensor, cpu_threads, launch_on, target_of
from .grad import check_writable, mark_written
from .options import f32_scale, resolve_flag
from .specs import rope_spec

__all__ = ["Angles", "Positions", "llama31_angles", "rope_angles", "rotate", "rotary_dim_of", "split_heads"]

ELEMENT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Positions:
    """Where each token's position comes from: ``indptr`` + ``offsets`` (token ``t`` of request ``r``
    sits at ``offsets[r] + t - indptr[r]``), or ``pos_ids`` (one position per token). ``pos_ids_name``, what the
    caller calls it (``pos_ids``, or ``positions`` in vLLM / SGLang's signature), marks ``pos_ids`` as the source
    even when it is missing (so the error names it)."""

    indptr: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    pos_ids: torch.Tensor | None = None
    pos_ids_name: str | None = None


@dataclass(frozen=True)
class Angles:
    """How pair ``i`` turns at position ``p``: by ``p * freq_i`` (``rope_theta``, ``rope_scale`` and
    Llama 3.1's smoothing line ``smooth_a``, ``smooth_b``), or by the angles of ``cos_sin_cache``'s row ``p``
    (float32 ``[max_pos, rotary_dim]``: each pair's cos in the first half, its sin in the second)."""

    rope_scale: float = 1.0
    rope_theta: float = 1e4
    smooth_a: float = 0.0
    smooth_b: float = 0.0
    cos_sin_cache: torch.Tensor | None = None


def _positive(name: str, value) -> float:
    """A positive number whose float32 reciprocal is finite too (the kernels take both in float32), as the attention
    wrappers check rope_scale and rope_theta."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r} must be a number")
    if not 0 < value < math.inf:  # (comparisons: under torch.compile a value that changes between calls is symbolic)
        raise ValueError(f"{name}={value!r} must be a finite number > 0")
    if not (f32_scale(float(value)) and f32_scale(1.0 / float(value))):
        raise ValueError(f"{name}={value!r} must be a positive finite number (its reciprocal too, in float32)")
    return float(value)


def rope_angles(rope_scale, rope_theta) -> Angles:
    """Plain RoPE: ``freq_i = rope_theta^(-2i / rotary_dim) / rope_scale``."""
    return Angles(_positive("rope_scale", rope_scale), _positive("rope_theta", rope_theta))


def llama31_angles(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len) -> Angles:
    """Llama 3.1's frequency rule as one clamped line: wavelengths shorter than ``old_context_len /
    high_freq_factor`` keep their frequency, those longer than ``old_context_len / low_freq_factor`` are
    divided by ``rope_scale``, and in between the two are blended linearly in ``old_context_len / wavelength``."""
    low, high = _positive("low_freq_factor", low_freq_factor), _positive("high_freq_factor", high_freq_factor)
    context = _positive("old_context_len", old_context_len)
    if high <= low:
        raise ValueError(f"high_freq_factor={high_freq_factor!r} must be larger than low_freq_factor="
                         f"{low_freq_factor!r} (Llama 3.1 uses 4 and 1)")
    smooth_a = context / (2 * math.pi * (high - low))
    return Angles(_positive("rope_scale", rope_scale), _positive("rope_theta", rope_theta), smooth_a, -low / (high - low))


def rotary_dim_of(rotary_dim, head_dim: int) -> int:
    """``rotary_dim`` checked against ``head_dim`` (None: the whole head)."""
    if rotary_dim is None:
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} is odd: RoPE turns pairs of dimensions, so the whole head cannot "
                             "be rotated; pass an even rotary_dim (the leading dimensions rotated)")
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, numbers.Integral):
        raise TypeError(f"rotary_dim={rotary_dim!r} must be an int or None (the whole head_dim)")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim={rotary_dim} must be even and in [2, head_dim={head_dim}]: it counts the "
                         "leading dimensions of each head that are rotated, two per pair")
    return int(rotary_dim)


def split_heads(name: str, x: torch.Tensor, head_size) -> torch.Tensor:
    """``x`` of ``[nnz, num_heads * head_size]`` (or already 3-D) as a ``[nnz, num_heads, head_size]`` view."""
    check_tensor(name, x)
    if isinstance(head_size, bool) or not isinstance(head_size, numbers.Integral) or head_size < 2:
        raise ValueError(f"head_size={head_size!r} must be an int >= 2")
    if x.dim() < 2 or math.prod(x.shape[1:]) % head_size:
        raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [nnz, num_heads * head_size] with "
                         f"head_size={head_size}")
    try:
        return x.view(x.shape[0], math.prod(x.shape[1:]) // head_size, head_size)
    except RuntimeError:
        raise ValueError(f"{name} (shape {tuple(x.shape)}, strides {tuple(x.stride())}) cannot be viewed as "
                         f"[nnz, num_heads, {head_size}]; pass a tensor whose heads are contiguous rows") from None


def _check_qk(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor,
              names: tuple[str, str]) -> None:
    qn, kn = names
    for name, t in ((qn, q), (kn, k)):
        check_tensor(name, t, ndim=3, dtypes=ELEMENT_DTYPES)
    if k.dtype != q.dtype:
        raise TypeError(f"{qn} is {_name(q.dtype)} but {kn} is {_name(k.dtype)}; {qn} and {kn} must have one dtype")
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"{qn} has {q.shape[0]} tokens but {kn} has {k.shape[0]}; both take one row per token "
                         "(the same nnz)")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{qn} has head_dim {q.shape[2]} but {kn} has {k.shape[2]}; they must match")
    overlap = _heads_overlap(q, k) if q_out is q else False
    if overlap is not False:
        what = ("share head rows (views of one buffer that overlap)" if overlap else
                "may share head rows (views of one buffer with two token strides, too many rows to compare)")
        raise ValueError(f"{qn} and {kn} {what}, so rotating both in place "
                         "would rotate those rows twice; pass separate query and key heads (e.g. qkv[:, :Hq] and "
                         "qkv[:, Hq:Hq + Hk])")
    for name, t in ((f"the rotated {qn}", q_out), (f"the rotated {kn}", k_out)):
        check_no_overlap(name, t)
        if t.dtype != q.dtype and ({t.dtype, q.dtype} != {torch.float16, torch.bfloat16} or t is q or t is k):
            raise TypeError(f"{name} is {_name(t.dtype)} but {qn} and {kn} are {_name(q.dtype)}; the outputs take "
                            "the inputs' dtype, or out of place the other 16-bit one (float16 <-> bfloat16)")
    if q_out.dtype != k_out.dtype:
        raise TypeError(f"the rotated {qn} is {_name(q_out.dtype)} but the rotated {kn} {_name(k_out.dtype)}; give "
                        "them one dtype")


def _heads_overlap(q: torch.Tensor, k: torch.Tensor) -> bool | None:
    """Whether views ``q`` and ``k`` (``[nnz, heads, head_dim]`` of one nnz, unit stride in head_dim) share an
    element; None when it cannot tell. Views of one token stride ``s`` whose heads lie side by side (fused qkv
    buffers) take O(1) arithmetic on each token's span; other views of one token stride (NeoX's ``[nnz, heads, 3,
    head_dim]``) are decided per pair of heads: k's row at ``b + t s`` meets q's at ``a`` (``head_dim`` = w wide)
    when ``a - w < b + t s < a + w`` for a token shift ``t`` in (-nnz, nnz). Views of two token strides compare
    every head row (sorted by start) up to ``_EXACT_ROWS`` rows; beyond that, None."""
    if q.numel() == 0 or k.numel() == 0:
        return False
    nnz, s, w, d = q.shape[0], q.stride(0), q.shape[2], (k.data_ptr() - q.data_ptr()) // q.element_size()
    q_end = (nnz - 1) * q.stride(0) + (q.shape[1] - 1) * q.stride(1) + w
    k_end = (nnz - 1) * k.stride(0) + (k.shape[1] - 1) * k.stride(1) + w
    if d >= q_end or -d >= k_end:  # the views' whole spans are apart
        return False
    qw, kw = q.shape[1] * w, k.shape[1] * w
    if k.stride(0) == s > 0 and q.stride(1) == w and k.stride(1) == w:  # each token's heads one span: O(1)
        t = max((-kw - d) // s + 1, 1 - nnz)  # the first token of k whose span ends past q's start
        return t < nnz and t * s < qw - d
    if nnz == 1 or k.stride(0) == s > 0:
        a = np.arange(q.shape[1], dtype=np.int64)[:, None] * q.stride(1)  # q's head rows in token 0
        b = d + np.arange(k.shape[1], dtype=np.int64)[None, :] * k.stride(1)
        if nnz == 1:
            return bool(((a - w < b) & (b < a + w)).any())
        t = np.maximum((a - w - b) // s + 1, 1 - nnz)  # the least shift whose k row starts past a - w
        return bool(((t < nnz) & (b + t * s < a + w)).any())
    if nnz * (q.shape[1] + k.shape[1]) <= _EXACT_ROWS:
        return _rows_meet(_head_rows(q, 0), _head_rows(k, d), w)
    return None


_EXACT_ROWS = 1 << 22  # head rows compared one by one (int64 temporaries of ~50 bytes each)


def _head_rows(t: torch.Tensor, base: int) -> torch.Tensor:
    """The element offsets where the head rows of ``t`` start (``base`` plus each token's and head's stride)."""
    tokens = torch.arange(t.shape[0], dtype=torch.int64).mul_(t.stride(0))
    heads = torch.arange(t.shape[1], dtype=torch.int64).mul_(t.stride(1))
    return (tokens[:, None] + heads[None, :]).flatten().add_(base)


def _rows_meet(a: torch.Tensor, b: torch.Tensor, width: int) -> bool:
    """Whether a row of ``width`` elements starting at an offset of ``a`` shares an element with one starting at an
    offset of ``b``. Sorted together by start, two rows of the two sets meet exactly when one starts before the
    furthest end among the other set's rows that start before it."""
    starts = torch.cat([a, b])
    from_b = torch.cat([torch.zeros_like(a, dtype=torch.bool), torch.ones_like(b, dtype=torch.bool)])
    order = torch.sort(starts, stable=True).indices
    starts, from_b = starts[order], from_b[order]
    ends = starts + width
    floor = torch.iinfo(torch.int64).min
    end_a = torch.where(from_b, floor, ends).cummax(0).values  # the furthest end of a's rows so far
    end_b = torch.where(from_b, ends, floor).cummax(0).values
    before_a = torch.cat([end_a.new_full((1,), floor), end_a[:-1]])  # of the rows strictly before each one
    before_b = torch.cat([end_b.new_full((1,), floor), end_b[:-1]])
    return bool(torch.where(from_b, before_a > starts, before_b > starts).any())


def _check_index(name: str, t: torch.Tensor, device: torch.device, length: int | None = None,
                 q_name: str = "q") -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 or int64), got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} has dtype {_name(t.dtype)}; use int32 or int64")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but {q_name} is on {device}; move it to {q_name}'s device")
    if length is not None and t.shape[0] != length:
        raise ValueError(f"{name} has {t.shape[0]} entries; expected {length}")
    return t.contiguous()


def _index_arrays(positions: Positions, nnz: int, device: torch.device,
                  q_name: str = "q") -> tuple[dict, int, int, int]:
    """The index pointers, the batch size, the position source code and the index width in bytes."""
    if positions.pos_ids is not None or positions.pos_ids_name is not None:
        pos_ids = _check_index(positions.pos_ids_name or "pos_ids", positions.pos_ids, device, nnz, q_name)
        ptrs = dict(indptr=None, offsets=None, pos_ids=pos_ids)
        return ptrs, 0, ROPE_POSITION_CODES["pos_ids"], pos_ids.element_size()
    offsets = _check_index("offsets", positions.offsets, device)
    indptr = _check_index("indptr", positions.indptr, device)
    if indptr.shape[0] != offsets.shape[0] + 1:
        raise ValueError(f"indptr has {indptr.shape[0]} entries and offsets {offsets.shape[0]}: a batch of B requests "
                         "takes B + 1 entries of indptr and B of offsets (each request's first position)")
    if indptr.dtype != offsets.dtype:
        raise TypeError(f"indptr is {_name(indptr.dtype)} but offsets is {_name(offsets.dtype)}; give them one dtype")
    if device.type == "cpu":
        steps = indptr[1:] - indptr[:-1]
        if int(indptr[0]) != 0 or int(indptr[-1]) != nnz or bool((steps < 0).any()):
            raise ValueError(f"indptr {indptr.tolist()[:8]}... must start at 0, never decrease and end at nnz={nnz} "
                             "(request r holds tokens indptr[r] to indptr[r+1])")
    ptrs = dict(indptr=indptr, offsets=offsets, pos_ids=None)
    return ptrs, offsets.shape[0], ROPE_POSITION_CODES["indptr"], indptr.element_size()


def _check_cache(cache: torch.Tensor, head_dim: int, device: torch.device, pos_ids: torch.Tensor | None,
                 q_name: str = "q") -> None:
    if not isinstance(cache, torch.Tensor):
        raise TypeError(f"cos_sin_cache must be a torch.Tensor, got {type(cache).__name__}")
    if cache.dtype != torch.float32:
        raise ValueError(f"cos_sin_cache is {_name(cache.dtype)}; it must be float32 (as FlashInfer's)")
    check_tensor("cos_sin_cache", cache, ndim=2)
    if cache.device != device:
        raise ValueError(f"cos_sin_cache is on {cache.device} but {q_name} is on {device}; move it to {q_name}'s "
                         "device")
    rotary_dim = cache.shape[1]
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"cos_sin_cache has shape {tuple(cache.shape)}: its width is the rotary dim (cos then sin "
                         f"of each pair), so it must be even and in [2, head_size={head_dim}]")
    if pos_ids is not None and device.type == "cpu" and pos_ids.numel():
        bad = (pos_ids < 0) | (pos_ids >= cache.shape[0])
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            fix = "positions index the cache's rows from 0" if int(pos_ids[t]) < 0 else \
                "extend the cache to the longest position"
            raise IndexError(f"positions[{t}]={int(pos_ids[t])} is outside cos_sin_cache's {cache.shape[0]} rows; "
                             f"{fix}")


def rotate(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, positions: Positions,
           rotary_dim: int | None, interleave: bool, angles: Angles, names: tuple[str, str] = ("q", "k")) -> None:
    """Rotate ``q`` into ``q_out`` and ``k`` into ``k_out`` (``[nnz, heads, head_dim]``; the outputs may be the
    inputs, which leaves the dimensions past ``rotary_dim`` as they are; otherwise they are copied, and may be of
    the other 16-bit dtype than the inputs').

    ``rotary_dim`` None rotates the whole head, or as many dimensions as ``cos_sin_cache`` is wide. ``names``: what
    the caller calls ``q`` and ``k`` (its errors say those)."""
    _check_qk(q, k, q_out, k_out, names)
    check_writable("rope", **({names[0]: q_out, names[1]: k_out} if q_out is q else {}))  # (new outputs: ours)
    interleave = resolve_flag(interleave, "interleave")
    target, device = target_of("rope", [q, k, q_out, k_out])
    nnz, head_dim = q.shape[0], q.shape[2]
    ptrs, batch_size, pos_source, index_bytes = _index_arrays(positions, nnz, device, names[0])
    cache = angles.cos_sin_cache
    if cache is not None:
        _check_cache(cache, head_dim, device, ptrs["pos_ids"], names[0])
        rotary_dim = cache.shape[1] if rotary_dim is None else rotary_dim
    rotary_dim = rotary_dim_of(rotary_dim, head_dim)
    if nnz == 0 or q.shape[1] + k.shape[1] == 0:
        return
    module = load(rope_spec(target, q.dtype, q_out.dtype))
    params = dict(
        q=q.data_ptr(), k=k.data_ptr(), q_out=q_out.data_ptr(), k_out=k_out.data_ptr(),
        **{name: (t.data_ptr() if t is not None else None) for name, t in ptrs.items()},
        cos_sin_cache=cache.data_ptr() if cache is not None else None,
        nnz=nnz, batch_size=batch_size, num_q_heads=q.shape[1], num_k_heads=k.shape[1], head_dim=head_dim,
        rotary_dim=rotary_dim, q_stride_n=q.stride(0), q_stride_h=q.stride(1), k_stride_n=k.stride(0),
        k_stride_h=k.stride(1), q_out_stride_n=q_out.stride(0), q_out_stride_h=q_out.stride(1),
        k_out_stride_n=k_out.stride(0), k_out_stride_h=k_out.stride(1),
        cache_rows=cache.shape[0] if cache is not None else 0, cache_stride=cache.stride(0) if cache is not None else 0,
        rope_rcp_scale=1.0 / angles.rope_scale, rope_theta=angles.rope_theta, smooth_a=angles.smooth_a,
        smooth_b=angles.smooth_b, pos_source=pos_source, index_bytes=index_bytes, interleave=int(interleave),
        copy_unrotated=int(q_out is not q), num_threads=cpu_threads(),
    )
    launch_on(module, "rope", device, **params)
    mark_written(q_out, k_out)

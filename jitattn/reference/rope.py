"""Float64 reference of the standalone RoPE functions (``jitattn.ops.rope``, FlashInfer's ``apply_rope*``).

Written the textbook way, independently of the kernels' one-line clamp: Llama 3.1's frequencies
by the wavelength rule of its reference code, the rotation as complex multiplication of each pair.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from .common import F64


def rope_frequencies(rotary_dim: int, rope_scale: float = 1.0, rope_theta: float = 1e4,
                     llama31: Optional[dict] = None) -> Tensor:
    """The angular frequency of each of the ``rotary_dim // 2`` pairs, float64.

    Plain: ``rope_theta^(-2i / rotary_dim) / rope_scale``. ``llama31`` (``low_freq_factor``,
    ``high_freq_factor``, ``old_context_len``): a wavelength ``2 pi / f`` shorter than ``old_context_len /
    high_freq_factor`` keeps ``f``, one longer than ``old_context_len / low_freq_factor`` gets ``f /
    rope_scale``, and in between ``(1 - s) f / rope_scale + s f`` with ``s = (old_context_len / wavelength -
    low) / (high - low)``.
    """
    i = torch.arange(rotary_dim // 2, dtype=F64)
    base = float(rope_theta) ** (-2.0 * i / rotary_dim)
    if llama31 is None:
        return base / float(rope_scale)
    low, high = float(llama31["low_freq_factor"]), float(llama31["high_freq_factor"])
    context = float(llama31["old_context_len"])
    out = []
    for f in base.tolist():
        wavelength = 2 * math.pi / f
        if wavelength < context / high:
            out.append(f)
        elif wavelength > context / low:
            out.append(f / rope_scale)
        else:
            s = (context / wavelength - low) / (high - low)
            out.append((1 - s) * f / rope_scale + s * f)
    return torch.tensor(out, dtype=F64)


def positions_from_indptr(indptr: Tensor, offsets: Tensor) -> Tensor:
    """Token ``t`` of request ``r`` sits at ``offsets[r] + t - indptr[r]`` (int64 ``[nnz]``)."""
    bounds, starts = indptr.cpu().tolist(), offsets.cpu().tolist()
    return torch.tensor([starts[r] + j for r in range(len(starts)) for j in range(bounds[r + 1] - bounds[r])],
                        dtype=torch.int64)


def rotate_pairs(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of ``x`` ``[n, H, D]`` by per-token angles ``[n, pairs]``.

    Pairs are ``(2i, 2i+1)`` when ``interleave``, else ``(i, i + pairs)``; the other dims pass through.
    Returns float64 on the CPU.
    """
    xd = x.detach().cpu().to(F64)
    pairs = cos.shape[-1]
    rot, rest = xd[..., : 2 * pairs], xd[..., 2 * pairs:]
    if interleave:
        z = torch.complex(rot[..., 0::2], rot[..., 1::2])
    else:
        z = torch.complex(rot[..., :pairs], rot[..., pairs:])
    turned = z * torch.complex(cos, sin).to(torch.complex128)[:, None, :]
    if interleave:
        rotated = torch.stack([turned.real, turned.imag], dim=-1).flatten(-2)
    else:
        rotated = torch.cat([turned.real, turned.imag], dim=-1)
    return torch.cat([rotated, rest], dim=-1)


def apply_rope(x: Tensor, positions: Tensor, rotary_dim: Optional[int] = None, interleave: bool = False,
               rope_scale: float = 1.0, rope_theta: float = 1e4, llama31: Optional[dict] = None) -> Tensor:
    """``x`` ``[n, H, D]`` with its first ``rotary_dim`` dims rotated by ``positions`` ``[n]``; float64."""
    rotary_dim = x.shape[-1] if rotary_dim is None else rotary_dim
    freq = rope_frequencies(rotary_dim, rope_scale, rope_theta, llama31)
    angle = positions.detach().cpu().to(F64)[:, None] * freq[None, :]
    return rotate_pairs(x, torch.cos(angle), torch.sin(angle), interleave)


def cos_sin_cache(max_position: int, rotary_dim: int, rope_theta: float = 1e4) -> Tensor:
    """A vLLM-layout table, float32 ``[max_position, rotary_dim]``: each row the cos of every pair, then the sin."""
    freq = rope_frequencies(rotary_dim, 1.0, rope_theta)
    angle = torch.arange(max_position, dtype=F64)[:, None] * freq[None, :]
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=-1).to(torch.float32)


def apply_rope_cos_sin_cache(x: Tensor, positions: Tensor, table: Tensor, interleave: bool) -> Tensor:
    """``x`` ``[n, H, D]`` rotated by the angles of ``table``'s rows ``positions``; float64."""
    rows = table.detach().cpu().to(F64)[positions.detach().cpu().to(torch.int64)]
    pairs = table.shape[1] // 2
    return rotate_pairs(x, rows[:, :pairs], rows[:, pairs:], interleave)

"""Rotary position embedding of queries and keys, mirroring ``flashinfer.rope`` (FlashInfer 0.5.3's names,
arguments, defaults and return values).

``q`` is ``[nnz, num_q_heads, head_dim]`` and ``k`` ``[nnz, num_k_heads, head_dim]`` (any head counts:
GQA/MQA included), float16, bfloat16 or float32, one dtype for both, on one device (the cuda target
on a CUDA device, the cpu target on the CPU). They may be strided views, slices of a fused qkv
buffer for instance: only the last dimension must be contiguous.

Positions: the ``apply_*rope`` functions take ``indptr`` (``[batch_size + 1]``: request ``r`` holds
tokens ``indptr[r]`` to ``indptr[r+1]``) and ``offsets`` (``[batch_size]``: its first token's
position), the ``*_pos_ids`` ones a position per token; int32 or int64 on q's device.

What turns: the first ``rotary_dim`` dimensions of every head (default: all), in pairs ``(i, i +
rotary_dim/2)`` (``interleave=False``, the NeoX / Llama halves) or ``(2i, 2i+1)`` (``interleave=True``,
GPT-J). Pair ``i`` at position ``p`` turns by ``p * rope_theta^(-2i / rotary_dim) / rope_scale``; the
``llama31`` functions apply Llama 3.1's rule instead (frequencies of wavelength beyond
``old_context_len / low_freq_factor`` are divided by ``rope_scale``, those below ``old_context_len /
high_freq_factor`` are kept, those in between blended). ``apply_rope_with_cos_sin_cache*`` read each
position's angles from a float32 ``[max_pos, rotary_dim]`` table (cos of every pair, then sin), with
``is_neox=True`` meaning the halves layout.

Arithmetic is float32 and the results are rounded to the input dtype. The plain functions return new
``(q_rope, k_rope)`` tensors (the dimensions past ``rotary_dim`` copied); the ``_inplace`` ones rotate
``q`` and ``k`` themselves and return None. On a CUDA device nothing waits for the device: an invalid
device-side position (a token outside ``indptr``'s requests, a position outside the cos/sin cache)
is not reported but gives that token NaN in its rotated dimensions; on the cpu target it raises. Under
torch.compile each call is one custom op (``runtime/compiled_ops.py``): a model calling them compiles with
``fullgraph=True``.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..runtime import compiled_ops
from ..runtime.checks import check_tensor
from ..runtime.grad import no_backward
from ..runtime.options import resolve_flag
from ..runtime.rope import Angles, Positions, llama31_angles, rope_angles, rotate, split_heads

__all__ = [
    "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
]


def _rotate(*args) -> None:
    """``rotate``; under torch.compile one custom op of the graph (its checks run when the graph does)."""
    (compiled_ops.rotate if torch.compiler.is_compiling() else rotate)(*args)


def _like(q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Output tensors shaped as q and k (checked first, so a wrong argument reads as such)."""
    check_tensor("q", q)
    check_tensor("k", k)
    return torch.empty_like(q), torch.empty_like(k)


@no_backward
def apply_rope(
    q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 1, rope_theta: float = 1e4,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate ragged ``q``/``k`` by positions ``offsets[r] + (t - indptr[r])``; returns ``(q_rope, k_rope)``."""
    angles = rope_angles(rope_scale, rope_theta)
    q_rope, k_rope = _like(q, k)
    _rotate(q, k, q_rope, k_rope, Positions(indptr=indptr, offsets=offsets), rotary_dim, interleave, angles)
    return q_rope, k_rope


def apply_rope_inplace(
    q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 1, rope_theta: float = 1e4,
) -> None:
    """:func:`apply_rope` written into ``q`` and ``k``."""
    angles = rope_angles(rope_scale, rope_theta)
    _rotate(q, k, q, k, Positions(indptr=indptr, offsets=offsets), rotary_dim, interleave, angles)


@no_backward
def apply_rope_pos_ids(
    q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 1, rope_theta: float = 1e4,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Rotate token ``t`` of ``q``/``k`` by position ``pos_ids[t]``; returns ``(q_rope, k_rope)``."""
    angles = rope_angles(rope_scale, rope_theta)
    q_rope, k_rope = _like(q, k)
    _rotate(q, k, q_rope, k_rope, Positions(pos_ids=pos_ids, pos_ids_name="pos_ids"), rotary_dim, interleave, angles)
    return q_rope, k_rope


def apply_rope_pos_ids_inplace(
    q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 1, rope_theta: float = 1e4,
) -> None:
    """:func:`apply_rope_pos_ids` written into ``q`` and ``k``."""
    angles = rope_angles(rope_scale, rope_theta)
    _rotate(q, k, q, k, Positions(pos_ids=pos_ids, pos_ids_name="pos_ids"), rotary_dim, interleave, angles)


@no_backward
def apply_llama31_rope(
    q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
    high_freq_factor: float = 4, old_context_len: int = 8192,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope` with Llama 3.1's frequencies; returns ``(q_rope, k_rope)``."""
    angles = llama31_angles(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    q_rope, k_rope = _like(q, k)
    _rotate(q, k, q_rope, k_rope, Positions(indptr=indptr, offsets=offsets), rotary_dim, interleave, angles)
    return q_rope, k_rope


def apply_llama31_rope_inplace(
    q: torch.Tensor, k: torch.Tensor, indptr: torch.Tensor, offsets: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
    high_freq_factor: float = 4, old_context_len: int = 8192,
) -> None:
    """:func:`apply_llama31_rope` written into ``q`` and ``k``."""
    angles = llama31_angles(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    _rotate(q, k, q, k, Positions(indptr=indptr, offsets=offsets), rotary_dim, interleave, angles)


@no_backward
def apply_llama31_rope_pos_ids(
    q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
    high_freq_factor: float = 4, old_context_len: int = 8192,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`apply_rope_pos_ids` with Llama 3.1's frequencies; returns ``(q_rope, k_rope)``."""
    angles = llama31_angles(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    q_rope, k_rope = _like(q, k)
    _rotate(q, k, q_rope, k_rope, Positions(pos_ids=pos_ids, pos_ids_name="pos_ids"), rotary_dim, interleave, angles)
    return q_rope, k_rope


def apply_llama31_rope_pos_ids_inplace(
    q: torch.Tensor, k: torch.Tensor, pos_ids: torch.Tensor, rotary_dim: Optional[int] = None,
    interleave: bool = False, rope_scale: float = 8, rope_theta: float = 5e5, low_freq_factor: float = 1,
    high_freq_factor: float = 4, old_context_len: int = 8192,
) -> None:
    """:func:`apply_llama31_rope_pos_ids` written into ``q`` and ``k``."""
    angles = llama31_angles(rope_scale, rope_theta, low_freq_factor, high_freq_factor, old_context_len)
    _rotate(q, k, q, k, Positions(pos_ids=pos_ids, pos_ids_name="pos_ids"), rotary_dim, interleave, angles)


@no_backward
def apply_rope_with_cos_sin_cache(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """vLLM / SGLang style: ``query`` ``[nnz, num_q_heads * head_size]``, ``key`` ``[nnz, num_k_heads *
    head_size]``, each token turned by row ``positions[t]`` of ``cos_sin_cache`` (float32 ``[max_pos,
    rotary_dim]``, cos then sin); ``is_neox`` picks the halves layout. Returns ``(query_out, key_out)``."""
    check_tensor("cos_sin_cache", cos_sin_cache, last_dim_contiguous=False)  # (None would mean plain RoPE below)
    q, k = split_heads("query", query, head_size), split_heads("key", key, head_size)
    query_out, key_out = _like(query, key)
    q_out, k_out = split_heads("query", query_out, head_size), split_heads("key", key_out, head_size)
    _rotate(q, k, q_out, k_out, Positions(pos_ids=positions, pos_ids_name="positions"), None,
            not resolve_flag(is_neox, "is_neox"), Angles(cos_sin_cache=cos_sin_cache), ("query", "key"))
    return query_out, key_out


def apply_rope_with_cos_sin_cache_inplace(
    positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, head_size: int, cos_sin_cache: torch.Tensor,
    is_neox: bool = True,
) -> None:
    """:func:`apply_rope_with_cos_sin_cache` written into ``query`` and ``key``."""
    check_tensor("cos_sin_cache", cos_sin_cache, last_dim_contiguous=False)
    q, k = split_heads("query", query, head_size), split_heads("key", key, head_size)
    _rotate(q, k, q, k, Positions(pos_ids=positions, pos_ids_name="positions"), None,
            not resolve_flag(is_neox, "is_neox"), Angles(cos_sin_cache=cos_sin_cache), ("query", "key"))

"""torch.library custom ops of the per-layer ops beside attention: RMSNorm, the gated activations, RoPE and the
paged cache writes, so a model calling them compiles with ``torch.compile(fullgraph=True)``.

Traced by Dynamo, these launches' checks (addresses, inference mode, index arrays read on the host) would break
the graph. Under compilation ``jitattn.ops`` calls the functions here instead: each is one opaque op whose checks
and launch run when the compiled graph runs (the eager errors, raised then), and whose fake implementation
writes nothing (they write into tensors the caller made). An op's schema names the tensors it writes; a tensor
written in place is passed once, as the written one (its ``input`` is then None). Arguments an op's schema
cannot carry (a list where a tensor belongs, say) take the eager path, whose checks name them.
"""

from __future__ import annotations

import numbers
from typing import Optional

import torch

from . import page, pointwise, rope


def _tensors(*values) -> bool:
    return all(isinstance(v, torch.Tensor) for v in values)


def _optional_tensors(*values) -> bool:
    return all(v is None or isinstance(v, torch.Tensor) for v in values)


def _real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@torch.library.custom_op("jitattn::rms_norm", mutates_args=("out", "residual"))
def _rms_norm_op(what: str, input: Optional[torch.Tensor], weight: torch.Tensor, eps: float, out: torch.Tensor,
                 residual: Optional[torch.Tensor], weight_offset: float) -> None:
    pointwise.rms_norm(what, out if input is None else input, weight, eps, out, residual, weight_offset)


@_rms_norm_op.register_fake
def _rms_norm_fake(what, input, weight, eps, out, residual, weight_offset) -> None:
    return None


def rms_norm(what: str, input: torch.Tensor, weight: torch.Tensor, eps, out: torch.Tensor,
             residual: torch.Tensor | None = None, weight_offset: float = 0.0) -> None:
    """``pointwise.rms_norm`` as one op of the graph."""
    if not (_tensors(input, weight, out) and _optional_tensors(residual) and _real(eps)):
        return pointwise.rms_norm(what, input, weight, eps, out, residual, weight_offset)
    torch.ops.jitattn.rms_norm(what, None if out is input else input, weight, float(eps), out, residual,
                               float(weight_offset))


@torch.library.custom_op("jitattn::act_and_mul", mutates_args=("out",))
def _act_and_mul_op(what: str, act: str, input: torch.Tensor, out: torch.Tensor) -> None:
    pointwise.act_and_mul(what, act, input, out)


@_act_and_mul_op.register_fake
def _act_and_mul_fake(what, act, input, out) -> None:
    return None


def act_and_mul(what: str, act: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``pointwise.act_and_mul`` as one op of the graph (``out`` made here when None)."""
    if not (_tensors(input) and _optional_tensors(out)) or input.dim() == 0 or input.shape[-1] % 2:
        return pointwise.act_and_mul(what, act, input, out)
    if out is None:
        out = input.new_empty((*input.shape[:-1], input.shape[-1] // 2))
    torch.ops.jitattn.act_and_mul(what, act, input, out)
    return out


@torch.library.custom_op("jitattn::rotate", mutates_args=("q_out", "k_out"))
def _rotate_op(q: Optional[torch.Tensor], k: Optional[torch.Tensor], q_out: torch.Tensor, k_out: torch.Tensor,
               indptr: Optional[torch.Tensor], offsets: Optional[torch.Tensor], pos_ids: Optional[torch.Tensor],
               pos_ids_name: Optional[str], cos_sin_cache: Optional[torch.Tensor], angles: list[float],
               rotary_dim: Optional[int], interleave: bool, names: str) -> None:
    positions = rope.Positions(indptr=indptr, offsets=offsets, pos_ids=pos_ids, pos_ids_name=pos_ids_name)
    rope_scale, rope_theta, smooth_a, smooth_b = angles
    turns = rope.Angles(rope_scale, rope_theta, smooth_a, smooth_b, cos_sin_cache)
    rope.rotate(q_out if q is None else q, k_out if k is None else k, q_out, k_out, positions, rotary_dim,
                interleave, turns, tuple(names.split()))


@_rotate_op.register_fake
def _rotate_fake(q, k, q_out, k_out, indptr, offsets, pos_ids, pos_ids_name, cos_sin_cache, angles, rotary_dim,
                 interleave, names) -> None:
    return None


def rotate(q: torch.Tensor, k: torch.Tensor, q_out: torch.Tensor, k_out: torch.Tensor, positions: rope.Positions,
           rotary_dim: int | None, interleave: bool, angles: rope.Angles, names: tuple[str, str] = ("q", "k")) -> None:
    """``rope.rotate`` as one op of the graph."""
    p = positions
    if not (_tensors(q, k, q_out, k_out) and _optional_tensors(p.indptr, p.offsets, p.pos_ids, angles.cos_sin_cache)
            and (rotary_dim is None or isinstance(rotary_dim, int) and not isinstance(rotary_dim, bool))
            and isinstance(interleave, bool)):
        return rope.rotate(q, k, q_out, k_out, positions, rotary_dim, interleave, angles, names)
    torch.ops.jitattn.rotate(
        None if q_out is q else q, None if k_out is k else k, q_out, k_out, p.indptr, p.offsets, p.pos_ids,
        p.pos_ids_name, angles.cos_sin_cache, [angles.rope_scale, angles.rope_theta, angles.smooth_a, angles.smooth_b],
        rotary_dim, interleave, " ".join(names))  # (a schema has no list of strings)



@torch.library.custom_op("jitattn::append_paged_kv_cache", mutates_args=("k_cache", "v_cache"))
def _append_op(append_key: torch.Tensor, append_value: torch.Tensor, index: list[torch.Tensor],
               k_cache: torch.Tensor, v_cache: Optional[torch.Tensor], kv_layout: str) -> None:
    cache = k_cache if v_cache is None else (k_cache, v_cache)
    page.append_paged_kv_cache(append_key, append_value, index[0], index[1], cache, *index[2:], kv_layout=kv_layout)


@_append_op.register_fake
def _append_fake(append_key, append_value, index, k_cache, v_cache, kv_layout) -> None:
    return None


def append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
                          kv_last_page_len, kv_layout: str = "NHD") -> None:
    """``page.append_paged_kv_cache`` as one op of the graph (a ``(k, v)`` cache's halves may be views of one
    buffer)."""
    index = [batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len]
    caches = tuple(paged_kv_cache) if isinstance(paged_kv_cache, (tuple, list)) else (paged_kv_cache,)
    if not (_tensors(append_key, append_value, *index, *caches) and len(caches) in (1, 2)
            and isinstance(kv_layout, str)):
        return page.append_paged_kv_cache(append_key, append_value, batch_indices, positions, paged_kv_cache,
                                          kv_indices, kv_indptr, kv_last_page_len, kv_layout)
    torch.ops.jitattn.append_paged_kv_cache(append_key, append_value, index, caches[0],
                                            caches[1] if len(caches) == 2 else None, kv_layout)


@torch.library.custom_op("jitattn::append_paged_mla_kv_cache", mutates_args=("ckv_cache", "kpe_cache"))
def _append_mla_op(append_ckv: torch.Tensor, append_kpe: torch.Tensor, index: list[torch.Tensor],
                   ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> None:
    page.append_paged_mla_kv_cache(append_ckv, append_kpe, index[0], index[1], ckv_cache, kpe_cache, *index[2:])


@_append_mla_op.register_fake
def _append_mla_fake(append_ckv, append_kpe, index, ckv_cache, kpe_cache) -> None:
    return None


def append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices,
                              kv_indptr, kv_last_page_len) -> None:
    """``page.append_paged_mla_kv_cache`` as one op of the graph (the caches may be views of one buffer)."""
    index = [batch_indices, positions, kv_indices, kv_indptr, kv_last_page_len]
    if not _tensors(append_ckv, append_kpe, *index, ckv_cache, kpe_cache):
        return page.append_paged_mla_kv_cache(append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache,
                                              kv_indices, kv_indptr, kv_last_page_len)
    torch.ops.jitattn.append_paged_mla_kv_cache(append_ckv, append_kpe, index, ckv_cache, kpe_cache)

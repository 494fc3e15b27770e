"""torch.library custom ops of the per-layer ops beside attention: RMSNorm, the gated activations, RoPE and the
paged cache writes, so a model calling them compiles with ``torch.compile(fullgraph=True)``.

Traced by Dynamo, these launches' checks (addresses, inference mode, index arrays read on the host) would break
the graph. Under compilation ``jitattn.ops`` calls the functions here instead: each checks what Dynamo can see
at trace time (argument types, scalars, a written tensor that requires grad: the op itself gets copies of what
it writes), then calls one opaque op whose own checks and launch run when the compiled graph runs (eager's
errors, raised then), and whose fake implementation writes nothing (the ops write into tensors the caller
made). An op's schema names the tensors it writes; a tensor written in place is passed once, as the written
one (its ``input`` is then None). Under ``fullgraph=True`` an error raised at trace time reaches the caller as
Dynamo's ``Unsupported`` whose cause is eager's error; without it the call falls back to eager, which raises it.
A backend that does not write in place (``aot_eager``) hands an op copies of what it writes: its checks of an output
overlapping an input then see two tensors apart, and the op computes from the input's values (Inductor, which
writes in place, passes the caller's tensors and the op refuses them, as eager does).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..spec import KVLayout
from . import page, pointwise, rope
from .checks import check_tensor
from .grad import refuse_grad_writes
from .compiled import OUTSIDE_CUDA_GRAPHS
from .options import resolve_flag


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
    for name, t in dict(input=input, weight=weight, out=out, residual=residual).items():
        if t is not None or name != "residual":
            check_tensor(name, t, last_dim_contiguous=False)
    refuse_grad_writes(what, **{"input" if out is input else "out": out, "residual": residual})
    torch.ops.jitattn.rms_norm(what, None if out is input else input, weight, pointwise.check_eps(eps), out, residual,
                               float(weight_offset))


@torch.library.custom_op("jitattn::act_and_mul", mutates_args=("out",))
def _act_and_mul_op(what: str, act: str, input: torch.Tensor, out: torch.Tensor) -> None:
    pointwise.act_and_mul(what, act, input, out)


@_act_and_mul_op.register_fake
def _act_and_mul_fake(what, act, input, out) -> None:
    return None


def act_and_mul(what: str, act: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``pointwise.act_and_mul`` as one op of the graph (``out`` made here when None)."""
    check_tensor("input", input)
    if input.dim() == 0 or input.shape[-1] % 2:
        raise ValueError(f"{what}: input has shape {tuple(input.shape)}; its last dimension must be even (the "
                         "activation's half, then the half it multiplies)")
    if out is None:
        out = input.new_empty((*input.shape[:-1], input.shape[-1] // 2))
    check_tensor("out", out, last_dim_contiguous=False)
    refuse_grad_writes(what, out=out)
    torch.ops.jitattn.act_and_mul(what, act, input, out)
    return out


@torch.library.custom_op("jitattn::rotate", mutates_args=("q_out", "k_out"), tags=OUTSIDE_CUDA_GRAPHS)
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
    for name, t in zip(names, (q, k)):
        check_tensor(name, t, last_dim_contiguous=False)
    for name, t in ((p.pos_ids_name, p.pos_ids),) if p.pos_ids_name else (("indptr", p.indptr), ("offsets", p.offsets)):
        check_tensor(name, t, last_dim_contiguous=False)
    if angles.cos_sin_cache is not None:
        check_tensor("cos_sin_cache", angles.cos_sin_cache, last_dim_contiguous=False)
    if rotary_dim is not None:
        rotary_dim = rope.rotary_dim_of(rotary_dim, q.shape[-1])
    refuse_grad_writes("rope", **({names[0]: q_out, names[1]: k_out} if q_out is q else {}))
    torch.ops.jitattn.rotate(
        None if q_out is q else q, None if k_out is k else k, q_out, k_out, p.indptr, p.offsets, p.pos_ids,
        p.pos_ids_name, angles.cos_sin_cache, [angles.rope_scale, angles.rope_theta, angles.smooth_a, angles.smooth_b],
        rotary_dim, resolve_flag(interleave, "interleave"), " ".join(names))  # (a schema has no list of strings)


@torch.library.custom_op("jitattn::append_paged_kv_cache", mutates_args=("k_cache", "v_cache"),
                         tags=OUTSIDE_CUDA_GRAPHS)
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
    for name, t in zip(("append_key", "append_value", "batch_indices", "positions", "kv_indices", "kv_indptr",
                        "kv_last_page_len"), (append_key, append_value, *index)):
        check_tensor(name, t, last_dim_contiguous=False)
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"paged_kv_cache as a tuple must be (k_cache, v_cache); got {len(paged_kv_cache)} items")
        k_cache, v_cache = paged_kv_cache
        check_tensor("paged_kv_cache's k", k_cache, last_dim_contiguous=False)
        check_tensor("paged_kv_cache's v", v_cache, last_dim_contiguous=False)
    else:
        (k_cache, v_cache) = (paged_kv_cache, None)
        check_tensor("paged_kv_cache", k_cache, last_dim_contiguous=False)
    refuse_grad_writes("append_paged_kv_cache", paged_kv_cache=k_cache, **{"paged_kv_cache's v": v_cache})
    torch.ops.jitattn.append_paged_kv_cache(append_key, append_value, index, k_cache, v_cache,
                                            KVLayout.parse(kv_layout, "kv_layout").value)


@torch.library.custom_op("jitattn::append_paged_mla_kv_cache", mutates_args=("ckv_cache", "kpe_cache"),
                         tags=OUTSIDE_CUDA_GRAPHS)
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
    for name, t in zip(("append_ckv", "append_kpe", "batch_indices", "positions", "ckv_cache", "kpe_cache",
                        "kv_indices", "kv_indptr", "kv_last_page_len"),
                       (append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache, *index[2:])):
        check_tensor(name, t, last_dim_contiguous=False)
    refuse_grad_writes("append_paged_mla_kv_cache", ckv_cache=ckv_cache, kpe_cache=kpe_cache)
    torch.ops.jitattn.append_paged_mla_kv_cache(append_ckv, append_kpe, index, ckv_cache, kpe_cache)

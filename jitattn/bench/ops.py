"""The ``ops`` suite's runners: standalone RoPE and block-sparse prefill (cases: ``ops_cases``).

RoPE rows: one call of the public function (in place: it keeps turning the same q and k, call after call),
timed as every row (``Timer.measure``, L2 evicted before each call); the error is checked on the first call
over the first and last ``REF_TOKENS`` tokens against ``jitattn.reference``'s float64 RoPE; the fraction is
against the copy ceiling. ``--peer flashinfer``: the same function of ``flashinfer`` on the same data
(restored to the inputs first), its output compared with jitattn's.

Block-sparse rows: ``BlockSparseAttentionWrapper`` planned once (host index arrays), ``run`` timed into one
output; the error over the first ``REF_QUERIES`` queries (whole block rows) against
``jitattn.reference.block_sparse_attention``; ``baseline``: the dense twin's row (its TFLOP/s, and this row's
TFLOP/s over the unmasked pairs / the dense one: the target is >= 0.9).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .inputs import random_tensor, seed_of
from .ops_cases import BlockSparse, Rope
from .peers import available, measure_flashinfer
from .rows import (
    REF_QUERIES, TORCH_DTYPES, BudgetExceeded, Context, join_notes, new_row, rel_err, set_time,
)

REF_TOKENS = 128  # RoPE: the first and the last REF_TOKENS tokens are checked


# --------------------------------------------------------------------------- #
# RoPE
# --------------------------------------------------------------------------- #
@dataclass
class RopeData:
    q: torch.Tensor  # [nnz, H_q, D] (the cos/sin-cache case: a view of ``query``)
    k: torch.Tensor  # [nnz, H_k, D]
    positions: torch.Tensor  # [nnz] int32 (int64 for the cos/sin cache)
    q0: torch.Tensor  # the inputs, kept to check the first call and to restore before the peer
    k0: torch.Tensor
    query: torch.Tensor | None = None  # cos/sin cache: [nnz, H_q * D], a column slice of the fused qkv buffer
    key: torch.Tensor | None = None
    cache: torch.Tensor | None = None  # float32 [max_position, D]


def make_rope_data(case: Rope, device: torch.device) -> RopeData:
    from jitattn import reference

    gen = torch.Generator(device=device).manual_seed(seed_of(case.name))
    dt, hq, hk, d = TORCH_DTYPES[case.dtype], case.num_q_heads, case.num_k_heads, case.head_dim
    if case.api == "cos_sin_cache_inplace":
        qkv = random_tensor((case.nnz, (hq + 2 * hk) * d), dt, device, gen)
        query, key = qkv[:, : hq * d], qkv[:, hq * d:(hq + hk) * d]
        q, k = query.view(case.nnz, hq, d), key.view(case.nnz, hk, d)
        positions = torch.arange(case.nnz, device=device) % case.max_position
        cache = reference.rope.cos_sin_cache(case.max_position, d).to(device)
        return RopeData(q, k, positions, q.clone(), k.clone(), query, key, cache)
    q = random_tensor((case.nnz, hq, d), dt, device, gen)
    k = random_tensor((case.nnz, hk, d), dt, device, gen)
    positions = (torch.arange(case.nnz, device=device) % case.max_position).to(torch.int32)
    return RopeData(q, k, positions, q.clone(), k.clone())


def rope_call(lib, case: Rope, data: RopeData) -> Callable[[], tuple]:
    """One call of ``lib``'s (jitattn's or flashinfer's) function for the case; returns (q out, k out)."""
    if case.api == "pos_ids":
        return lambda: lib.apply_rope_pos_ids(data.q, data.k, data.positions, interleave=case.interleave)
    if case.api == "pos_ids_inplace":
        def inplace():
            lib.apply_rope_pos_ids_inplace(data.q, data.k, data.positions, interleave=case.interleave)
            return data.q, data.k
        return inplace

    def cos_sin():
        lib.apply_rope_with_cos_sin_cache_inplace(data.positions, data.query, data.key, case.head_dim, data.cache,
                                                  is_neox=not case.interleave)
        return data.q, data.k
    return cos_sin


def rope_error(case: Rope, data: RopeData, out: tuple) -> float:
    from jitattn import reference

    n = data.q.shape[0]
    idx = torch.unique(torch.cat([torch.arange(min(REF_TOKENS, n)), torch.arange(max(0, n - REF_TOKENS), n)]))
    pos = data.positions.cpu()[idx]
    got, ref = [], []
    for x0, x in zip((data.q0, data.k0), out):
        part = x0[idx.to(x0.device)]
        if data.cache is not None:
            ref.append(reference.rope.apply_rope_cos_sin_cache(part, pos, data.cache, case.interleave))
        else:
            ref.append(reference.rope.apply_rope(part, pos, interleave=case.interleave))
        got.append(x[idx.to(x.device)])
    return rel_err(got, ref)


def run_rope(case: Rope, ctx: Context) -> list[dict]:
    import jitattn

    row = new_row(case)
    data = make_rope_data(case, ctx.device)
    fn = rope_call(jitattn, case, data)
    out = fn()
    ctx.sync()
    row["max_rel_err"] = rope_error(case, data, out)
    first = [t.clone() for t in out]
    try:
        ctx.check_budget("timing")
        set_time(row, ctx.timer.measure(fn, ctx.measure_s), ctx, fn)
        if "flashinfer" in ctx.peers:
            def restore():
                data.q.copy_(data.q0)
                data.k.copy_(data.k0)

            row["peers"] = {"flashinfer": run_peer(
                case, ctx, lambda fi: rope_call(fi, case, data), first, row["time_us"], before=restore,
                needs=(case.function,))}
    except BudgetExceeded as exc:
        row["note"] = join_notes(row["note"], str(exc))
    row["sdpa_na"] = "not attention (compared with the copy ceiling)"
    return [row]


# --------------------------------------------------------------------------- #
# Block-sparse prefill
# --------------------------------------------------------------------------- #
@dataclass
class BsrData:
    q: torch.Tensor  # [M, H_qo, D]
    k: torch.Tensor  # [N, H_kv, D]
    v: torch.Tensor
    indptr: torch.Tensor  # host int32 [row blocks + 1]
    indices: torch.Tensor  # host int32 [nonzero blocks]
    out: torch.Tensor


def make_bsr_data(case: BlockSparse, device: torch.device) -> BsrData:
    gen = torch.Generator(device=device).manual_seed(seed_of(case.name))
    gen_host = torch.Generator().manual_seed(seed_of(case.name))
    dt, n = TORCH_DTYPES[case.dtype], case.seq
    q = random_tensor((n, case.num_qo_heads, case.head_dim), dt, device, gen)
    k = random_tensor((n, case.num_kv_heads, case.head_dim), dt, device, gen)
    v = random_tensor((n, case.num_kv_heads, case.head_dim), dt, device, gen)
    rows = [torch.randperm(case.row_blocks, generator=gen_host)[: case.blocks_per_row].sort().values
            for _ in range(case.row_blocks)]
    indices = torch.cat(rows).to(torch.int32)
    indptr = (torch.arange(case.row_blocks + 1) * case.blocks_per_row).to(torch.int32)
    return BsrData(q, k, v, indptr, indices, torch.full_like(q, float("nan")))


def bsr_call(lib, case: BlockSparse, data: BsrData, device: torch.device, out: torch.Tensor,
             on_device: bool = False) -> Callable[[], torch.Tensor]:
    """Plan ``lib.BlockSparseAttentionWrapper`` once; the callable runs it into ``out``."""
    dt = TORCH_DTYPES[case.dtype]
    wrapper = lib.BlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=device))
    indptr, indices = (data.indptr.to(device), data.indices.to(device)) if on_device else (data.indptr, data.indices)
    wrapper.plan(indptr, indices, case.seq, case.seq, case.block, case.block, case.num_qo_heads, case.num_kv_heads,
                 case.head_dim, causal=False, q_data_type=dt, kv_data_type=dt, o_data_type=dt)
    return lambda: wrapper.run(data.q, data.k, data.v, out=out)


def bsr_error(case: BlockSparse, data: BsrData) -> float:
    from jitattn import reference

    m = min(case.seq, max(case.block, REF_QUERIES // case.block * case.block))
    blocks = m // case.block
    ptr = data.indptr[: blocks + 1]
    o, _ = reference.block_sparse_attention(data.q[:m], data.k, data.v, ptr, data.indices[: int(ptr[-1])],
                                            case.block, case.block)
    return rel_err([data.out[:m]], [o])


def dense_baseline(row: dict, dense: dict | None, name: str) -> dict:
    if dense is None or dense.get("rate") is None:
        return {"name": name, "error": "the dense twin did not run"}
    return {"name": name, "of": "the dense prefill", "time_us": dense["time_us"], "rate": dense["rate"],
            "rate_unit": dense["rate_unit"], "ratio": row["rate"] / dense["rate"] if row.get("rate") else None,
            "what": "TFLOP/s over the unmasked pairs / the dense prefill's TFLOP/s (target >= 0.9)"}


def run_block_sparse(case: BlockSparse, ctx: Context) -> list[dict]:
    import jitattn

    row = new_row(case)
    data = make_bsr_data(case, ctx.device)
    fn = bsr_call(jitattn, case, data, ctx.device, data.out)
    fn()
    ctx.sync()
    row["max_rel_err"] = bsr_error(case, data)

    def peer() -> dict:
        out = torch.empty_like(data.out)
        return run_peer(case, ctx, lambda fi: bsr_call(fi, case, data, ctx.device, out, on_device=True), [data.out],
                        row["time_us"], needs=("BlockSparseAttentionWrapper",))

    time_beside_dense(case, ctx, row, fn, peer)
    row["sdpa_na"] = f"compared with {case.dense}" if case.dense else "block-sparse"
    return [row]


def time_beside_dense(case, ctx: Context, row: dict, fn: Callable, peer: Callable[[], dict]) -> None:
    """Time ``fn`` into ``row``, with the dense twin's row as its ``baseline`` and, with ``--peer flashinfer``,
    ``peer()``'s figures (a budget running out is the row's note)."""
    try:
        ctx.check_budget("timing")
        set_time(row, ctx.timer.measure(fn, ctx.measure_s), ctx, fn)
        if case.dense:
            row["baseline"] = dense_baseline(row, ctx.plain_rows.get(case.dense), case.dense)
        if "flashinfer" in ctx.peers:
            row["peers"] = {"flashinfer": peer()}
    except BudgetExceeded as exc:
        row["note"] = join_notes(row["note"], str(exc))


# --------------------------------------------------------------------------- #
# FlashInfer beside both
# --------------------------------------------------------------------------- #
def flashinfer_ops_unsupported(ctx: Context, needs: tuple[str, ...]) -> str | None:
    if not ctx.cuda:
        return "FlashInfer needs CUDA"
    if not available("flashinfer"):
        return "flashinfer is not installed"
    import flashinfer

    missing = [name for name in needs if not hasattr(flashinfer, name)]
    return f"flashinfer has no {', '.join(missing)}" if missing else None


def run_peer(case, ctx: Context, build: Callable, jit_out: list[torch.Tensor], jit_time_us: float | None,
             before: Callable[[], None] | None = None, needs: tuple[str, ...] = ()) -> dict:
    """FlashInfer's call from ``build(flashinfer)`` on jitattn's data (``peers.measure_flashinfer``) | {n/a}."""
    why = flashinfer_ops_unsupported(ctx, needs)
    if why is not None:
        return {"n/a": why}

    def build_call():
        import flashinfer

        return build(flashinfer)

    return measure_flashinfer(case, ctx, build_call, jit_out, jit_time_us, before)

"""The ``ops`` suite's mixed-batch runners: POD and BatchAttention (cases: ``ops_cases.Mixed``).

One KV pool holds the decode requests' pages and the chunk's (request ``batch``, last); POD reads the chunk's
k/v as one contiguous copy of its pages. Each case gives three rows: the one call (``NAME``), then the
separate launches of the same work, the chunk alone (``NAME:prefill``) and the decodes alone
(``NAME:decode``), each timed as every row. ``baseline`` of ``NAME``: their summed time / its time (the
case's ``target`` is the least). The error of every row: the first ``REF_REQUESTS`` decodes and the last
``REF_QUERIES`` chunk queries against ``jitattn.reference.single_attention``. ``--peer flashinfer``: the
same wrapper of ``flashinfer`` on the same data beside ``NAME``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .inputs import PageTable, indptr_of, pool_pages, random_page_table, random_tensor, seed_of
from .ops import run_peer
from .ops_cases import Mixed
from .rows import REF_QUERIES, REF_REQUESTS, TORCH_DTYPES, BudgetExceeded, Context, join_notes, new_row, rel_err, set_time

WORKSPACE_BYTES = 128 << 20


@dataclass
class MixedData:
    q_p: torch.Tensor  # [chunk, H_qo, D]
    k_p: torch.Tensor  # [chunk, H_kv, D]: the chunk's pages, contiguous
    v_p: torch.Tensor
    q_d: torch.Tensor  # [batch, H_qo, D]
    cache: tuple  # (k, v), each [pool, page, H_kv, D]
    table: PageTable  # batch decode requests, then the chunk

    def decode_table(self, batch: int, on: torch.device | None = None) -> tuple:
        """(indptr, indices, last page lens) of the decode requests (host, or on ``on``)."""
        t = self.table
        out = (t.indptr[: batch + 1], t.indices[: int(t.indptr[batch])], t.last[:batch])
        return tuple(x.to(on) for x in out) if on is not None else out


def make_mixed_data(case: Mixed, device: torch.device) -> MixedData:
    gen = torch.Generator(device=device).manual_seed(seed_of(case.name))
    gen_host = torch.Generator().manual_seed(seed_of(case.name))
    dt, hq, hk, d = TORCH_DTYPES[case.dtype], case.num_qo_heads, case.num_kv_heads, case.head_dim
    lens = (case.kv_len,) * case.batch + (case.chunk,)
    needed = sum(-(-n // case.page_size) for n in lens)
    pool = pool_pages(needed)
    table = random_page_table(lens, case.page_size, pool, gen_host)
    k = random_tensor((pool, case.page_size, hk, d), dt, device, gen)
    v = random_tensor((pool, case.page_size, hk, d), dt, device, gen)
    pages = table.pages(case.batch).long().to(device)
    k_p = k[pages].reshape(-1, hk, d)[: case.chunk].contiguous()
    v_p = v[pages].reshape(-1, hk, d)[: case.chunk].contiguous()
    q_p = random_tensor((case.chunk, hq, d), dt, device, gen)
    q_d = random_tensor((case.batch, hq, d), dt, device, gen)
    return MixedData(q_p, k_p, v_p, q_d, (k, v), table)


def mixed_reference(case: Mixed, data: MixedData) -> list[torch.Tensor]:
    """The float reference of the checked slices: the first REF_REQUESTS decodes, the last REF_QUERIES chunk queries."""
    from jitattn import reference

    hk, d = case.num_kv_heads, case.head_dim
    refs = []
    for r in range(min(REF_REQUESTS, case.batch)):
        pages = data.table.pages(r).long().to(data.q_d.device)
        keys = data.cache[0][pages].reshape(-1, hk, d)[: case.kv_len]
        values = data.cache[1][pages].reshape(-1, hk, d)[: case.kv_len]
        refs.append(reference.single_attention(data.q_d[r:r + 1], keys, values)[0])
    m = min(REF_QUERIES, case.chunk)
    refs.append(reference.single_attention(data.q_p[-m:], data.k_p, data.v_p, causal=True)[0])
    return refs


def checked(case: Mixed, out_p: torch.Tensor | None, out_d: torch.Tensor | None) -> list[torch.Tensor | None]:
    """The slices of (prefill out, decode out) that ``mixed_reference`` gives (None where a part is absent)."""
    n = min(REF_REQUESTS, case.batch)
    dec = [out_d[r:r + 1] if out_d is not None else None for r in range(n)]
    return [*dec, out_p[-min(REF_QUERIES, case.chunk):] if out_p is not None else None]


def part_error(got: list, refs: list[torch.Tensor]) -> float:
    pairs = [(g, r) for g, r in zip(got, refs) if g is not None]
    return rel_err([g for g, _ in pairs], [r for _, r in pairs])


# --------------------------------------------------------------------------- #
# The calls: each returns (chunk out or None, decode out or None)
# --------------------------------------------------------------------------- #
API = {"pod": "PODWithPagedKVCacheWrapper", "batch_attention": "BatchAttention"}


def mixed_call(lib, case: Mixed, data: MixedData, device: torch.device, on_device: bool = False) -> Callable:
    """Plan ``lib``'s (jitattn's or flashinfer's) mixed wrapper once; the callable runs the whole batch."""
    dt, on = TORCH_DTYPES[case.dtype], (device if on_device else None)
    heads = (case.num_qo_heads, case.num_kv_heads, case.head_dim)
    if case.api == "pod":
        pod = lib.PODWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
        pod.plan(*data.decode_table(case.batch, on), *heads, case.page_size, q_data_type=dt, kv_data_type=dt)
        return lambda: pod.run(data.q_p, data.k_p, data.v_p, data.q_d, data.cache, causal_p=True)
    t = data.table
    qo_indptr = indptr_of([1] * case.batch + [case.chunk])
    kv_lens = torch.tensor([case.kv_len] * case.batch + [case.chunk], dtype=torch.int32)
    index = [x.to(on) if on is not None else x for x in (qo_indptr, t.indptr, t.indices, kv_lens)]
    attn = lib.BatchAttention(kv_layout="NHD", device=device.type)
    attn.plan(*index, case.num_qo_heads, case.num_kv_heads, case.head_dim, case.head_dim, case.page_size,
              causal=True, q_data_type=dt, kv_data_type=dt)
    q = torch.cat([data.q_d, data.q_p])  # the decodes, then the chunk (as the page table)

    def run():
        out, _ = attn.run(q, data.cache)
        return out[case.batch:], out[: case.batch]
    return run


def prefill_call(lib, case: Mixed, data: MixedData, device: torch.device) -> Callable:
    """The chunk alone: ``single_prefill_with_kv_cache`` on its contiguous k/v (POD's own path), or the paged
    prefill wrapper on its pages (BatchAttention's)."""
    if case.api == "pod":
        return lambda: (lib.single_prefill_with_kv_cache(data.q_p, data.k_p, data.v_p, causal=True), None)
    t, dt = data.table, TORCH_DTYPES[case.dtype]
    wrapper = lib.BatchPrefillWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
    pages = t.pages(case.batch)
    wrapper.plan(indptr_of([case.chunk]), indptr_of([pages.numel()]), pages, t.last[case.batch:],
                 case.num_qo_heads, case.num_kv_heads, case.head_dim, case.page_size, causal=True,
                 q_data_type=dt, kv_data_type=dt)
    return lambda: (wrapper.run(data.q_p, data.cache), None)


def decode_call(lib, case: Mixed, data: MixedData, device: torch.device) -> Callable:
    """The decodes alone: ``BatchDecodeWithPagedKVCacheWrapper`` over their pages."""
    dt = TORCH_DTYPES[case.dtype]
    wrapper = lib.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device))
    wrapper.plan(*data.decode_table(case.batch), case.num_qo_heads, case.num_kv_heads, case.head_dim,
                 case.page_size, q_data_type=dt, kv_data_type=dt)
    return lambda: (None, wrapper.run(data.q_d, data.cache))


# --------------------------------------------------------------------------- #
# The rows
# --------------------------------------------------------------------------- #
def separate_baseline(case: Mixed, row: dict, parts: list[dict]) -> dict:
    names = " + ".join(p["name"] for p in parts)
    if any(p.get("time_us") is None for p in parts) or row.get("time_us") is None:
        return {"name": names, "error": "a separate launch did not run"}
    total = sum(p["time_us"] for p in parts)
    return {"name": names, "of": "the separate launches", "time_us": total,
            "rate": case.flops / (total * 1e-6) / 1e12, "rate_unit": "TFLOP/s", "ratio": total / row["time_us"],
            "target": case.target,
            "what": f"the separate launches' summed time / this row's time (target >= {case.target:.3g})"}


def run_mixed(case: Mixed, ctx: Context) -> list[dict]:
    import jitattn

    data = make_mixed_data(case, ctx.device)
    refs = mixed_reference(case, data)
    row = new_row(case)
    rows = [row, *(new_row(p) for p in case.parts())]
    calls = [mixed_call(jitattn, case, data, ctx.device), prefill_call(jitattn, case, data, ctx.device),
             decode_call(jitattn, case, data, ctx.device)]
    first: list[torch.Tensor] = []
    try:
        for r, fn in zip(rows, calls):
            out = fn()
            ctx.sync()
            r["max_rel_err"] = part_error(checked(case, *out), refs)
            first = first or [t.clone() for t in out]
            ctx.check_budget("timing")
            set_time(r, ctx.timer.measure(fn, ctx.measure_s), ctx, fn)
        row["baseline"] = separate_baseline(case, row, rows[1:])
        if "flashinfer" in ctx.peers:
            row["peers"] = {"flashinfer": run_peer(
                case, ctx, lambda fi: mixed_call(fi, case, data, ctx.device, on_device=True), first,
                row["time_us"], needs=(API[case.api],))}
    except BudgetExceeded as exc:
        row["note"] = join_notes(row["note"], str(exc))
    row["sdpa_na"] = "compared with its separate launches"
    for r in rows[1:]:
        r["sdpa_na"] = f"a separate launch of {case.name}"
    return rows

"""Paged prefill on the sm90 tier across page sizes, layouts and gather knobs, beside ragged KV, same run:

    JITATTN_PREFILL_TIER=sm90 python3 tools/bench_paged_sm90.py [--batch 8 --seq 4096]
        [--pages 1,16,64 --layouts NHD,HND] [--tunings '[{}, {"gather_sync": 2}]']

llama8b shapes (32 / 8 heads, head_dim 128, bf16), qo_len = kv_len = seq per request, the pages
of the batch handed out in a random order. ``--tunings``: a JSON list of overrides of
``jitattn.kernels.prefill_sm90.SM90_TUNING`` (each renders its own source, a cache entry of its own);
every one runs on every (layout, page size). Each paged output is compared with the ragged
kernel's on the same tokens (max abs difference; 0 expected at the default KV block: the same
blocks in the same order).
Times: CUDA events around each launch, median of 20 after 3 warm-ups (L2 not flushed; the KV of
one batch is 134 MB, 2.7x the H200's L2). FLOPs: 4 * visible (query, key) pairs * qo heads *
head_dim (causal: s (s + 1) / 2 pairs per request)."""

from __future__ import annotations

import argparse
import json

import torch

import jitattn
import jitattn.jit
from jitattn.kernels import prefill_sm90

from bench_tier import _time as median_ms  # the same CUDA-event median timer (tools/ is on sys.path when run)


def paged_copy(k: torch.Tensor, v: torch.Tensor, batch: int, page: int, layout: str,
               gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(5-d cache, page order) holding ragged ``k``/``v`` of ``batch`` equal requests in shuffled pages."""
    tokens, hkv, d = k.shape
    pages = tokens // page
    order = torch.randperm(pages, generator=gen).to(torch.int32)
    cache = torch.empty(pages, 2, page, hkv, d, dtype=k.dtype, device=k.device)
    where = order.long().to(k.device)
    cache[where, 0] = k.view(pages, page, hkv, d)
    cache[where, 1] = v.view(pages, page, hkv, d)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return cache, order


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--no-causal", action="store_true")
    ap.add_argument("--pages", default="1,16,64")
    ap.add_argument("--layouts", default="NHD,HND")
    ap.add_argument("--tunings", default="[{}]")
    args = ap.parse_args()
    b, s, hq, hkv, d, causal = args.batch, args.seq, 32, 8, 128, not args.no_causal
    dtype = torch.bfloat16
    flops = 4 * b * (s * (s + 1) // 2 if causal else s * s) * hq * d
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b * s, hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(b * s, hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(b * s, hkv, d, generator=gen).to(dtype).cuda()
    indptr = torch.arange(0, b * s + 1, s, dtype=torch.int32)
    ws = torch.empty(1 << 26, dtype=torch.uint8, device="cuda")
    ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(ws)
    ragged.plan(indptr, indptr, hq, hkv, d, causal=causal, q_data_type=dtype)
    ref = ragged.run(q, k, v)
    ms = median_ms(lambda: ragged.run(q, k, v))
    print(f"ragged (TMA)                          {ms:7.3f} ms  {flops / ms / 1e9:6.1f} TFLOP/s")
    defaults = dict(prefill_sm90.SM90_TUNING)
    for tuning in json.loads(args.tunings):
        prefill_sm90.SM90_TUNING.update(tuning)
        jitattn.jit._registry.clear()  # the next load renders (and builds) this tuning's source
        try:
            for layout in args.layouts.split(","):
                for page in map(int, args.pages.split(",")):
                    cache, order = paged_copy(k, v, b, page, layout, gen)
                    w = jitattn.BatchPrefillWithPagedKVCacheWrapper(ws, layout)
                    w.plan(indptr, torch.arange(0, b * s // page + 1, s // page, dtype=torch.int32), order,
                           torch.full((b,), page, dtype=torch.int32), hq, hkv, d, page, causal=causal,
                           q_data_type=dtype)
                    out = w.run(q, cache)
                    err = (out.float() - ref.float()).abs().max().item()
                    ms = median_ms(lambda: w.run(q, cache))  # noqa: B023  (timed before the next iteration)
                    print(f"paged {layout} page {page:3d} {json.dumps(tuning):22s} {ms:7.3f} ms  "
                          f"{flops / ms / 1e9:6.1f} TFLOP/s  max |paged - ragged| {err:.1e}")
        finally:
            prefill_sm90.SM90_TUNING.clear()
            prefill_sm90.SM90_TUNING.update(defaults)
            jitattn.jit._registry.clear()


if __name__ == "__main__":
    main()

"""The paged prefill kernel's cost per query tile against the KV blocks it walks: time = fixed + blocks x per-block.

    python3 tools/prefill_tile_cost.py [--page 64] [--blocks 1,2,4,8,16,32,64]

Llama-3-8B heads (32 / 8, head dim 128, bf16, non-causal), 32-token requests (with the GQA group packed, one
128-row tile per KV head) over n KV blocks each; every request reads the same pages (a short prefix, so
the cache is small; the blocks then come from L2, and the fit measures the kernel's compute path, not DRAM).
The batch gives ~16 tiles per SM. Each point is CUDA-event timed (L2 evicted before each call:
``jitattn.bench.timing.Timer``); the tile's time is the launch's over the tiles per SM. A least-squares
line over the points gives the fixed cost of a tile (the query load, the pipeline's fill and drain, the
epilogue) in KV blocks: what a short tile (block-sparse rows, cascade chunks, a causal diagonal) pays.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

import jitattn
from jitattn.bench.timing import Timer
from jitattn.hardware import num_sms
from jitattn.kernels import prefill_sm90

HQ, HKV, D, TOKENS = 32, 8, 128, 32


def tile_us(timer: Timer, blocks: int, page: int, tiles_per_sm: int, gen: torch.Generator) -> tuple[float, int]:
    """(microseconds per tile, the KV block) for requests of ``blocks`` KV blocks."""
    dev = torch.device("cuda")
    spec_block = prefill_sm90.SM90_PAGED_KV_BLOCK[D]
    kv_len = blocks * spec_block
    pages = -(-kv_len // page)
    batch = tiles_per_sm * num_sms(torch.cuda.current_device()) // HKV
    cache = torch.randn(pages, 2, page, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    q = torch.randn(batch * TOKENS, HQ, D, generator=gen).to(torch.bfloat16).to(dev)
    i32 = dict(dtype=torch.int32)
    qo_indptr = torch.arange(batch + 1, **i32) * TOKENS
    kv_indptr = torch.arange(batch + 1, **i32) * pages
    kv_indices = torch.arange(pages, **i32).repeat(batch)
    last = torch.full((batch,), (kv_len - 1) % page + 1, **i32)
    w = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(qo_indptr, kv_indptr, kv_indices, last, HQ, HKV, D, page, causal=False, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    us = timer.measure(lambda: w.run(q, cache, out=out)).median_us
    return us / (batch * HKV / num_sms(torch.cuda.current_device())), spec_block


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page", type=int, default=64)
    ap.add_argument("--blocks", default="1,2,3,4,6,8,12,16,32,64")
    ap.add_argument("--tiles-per-sm", type=int, default=16)
    args = ap.parse_args()
    timer = Timer(torch.device("cuda"))
    gen = torch.Generator().manual_seed(0)
    ns, ts = [], []
    for n in (int(x) for x in args.blocks.split(",")):
        t, bn = tile_us(timer, n, args.page, args.tiles_per_sm, gen)
        flops = 4 * TOKENS * HQ // HKV * n * bn * D
        print(f"{n:3d} blocks of {bn}: {t:7.2f} us per tile, {flops / t / 1e6 * num_sms(0):6.1f} TFLOP/s", flush=True)
        ns.append(n)
        ts.append(t)
    slope, fixed = np.polyfit(ns, ts, 1)
    print(f"fit: {fixed:.2f} us fixed + {slope:.3f} us per block (the fixed cost = {fixed / slope:.2f} blocks)")


if __name__ == "__main__":
    main()

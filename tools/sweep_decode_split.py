"""Decode split-KV chunk lengths for the single long request and the skewed batch, one process, no rebuilds:

    python3 tools/sweep_decode_split.py [--out FILE] [--device cpu]

The decode rows b1 x 32768 (target <= 40 µs, SDPA 40.6 on the H200) and 1 x 32768 + 63 x 512 (target
<= 70 µs): llama8b shapes (32 / 8 heads, d128, bf16, page 16, pages in random order). Each row is the
planner's own choice (``auto``) and then ``plan(fixed_split_size=N)`` for a range of chunk lengths (pages),
so the best chunk length for these shapes takes one run; the split is host-side (the same kernel:
nothing is rebuilt). Timing: the suite's ``Timer`` (CUDA events per call, L2 evicted before each, launch
hidden), median; the suite's rows are ``python3 -m jitattn.bench --only 'decode/*'``.
"""

from __future__ import annotations

import argparse
import json

import torch

import jitattn
from jitattn.bench.timing import Timer

from profile_ncu import HQ, HKV, D, paged_batch  # the same shapes and cache (tools/ is on sys.path when run)

PAGE = 16
CASES = {"b1_s32768": [32768], "skewed_1x32768_63x512": [32768] + [512] * 63, "b4_s32768": [32768] * 4,
         "b8_s16384": [16384] * 8, "b16_s4096": [4096] * 16, "b2_s8192": [8192] * 2}
SPLITS = [None, 8, 16, 24, 32, 48, 64, 96, 128, 256]  # pages per chunk (None: the planner's choice)
# The few-request rule (one block per SM) against the split before it (blocks_per_sm 2), per case:
# "before" is plan(fixed_split_size=) at the chunk the old rule chose (0: no split).
BEFORE = {"b1_s32768": 63, "skewed_1x32768_63x512": 124, "b4_s32768": 249, "b8_s16384": 249, "b16_s4096": 125,
          "b2_s8192": 32}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cuda (the figures), or cpu (a smoke run of the script)")
    ap.add_argument("--all", action="store_true", help="every chunk length of SPLITS (else auto and BEFORE's)")
    args = ap.parse_args()
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        ap.error("no CUDA device here: run it on a GPU machine, or --device cpu for a smoke run")
    timer = Timer(dev, scrub_bytes=256 << 20)
    gen = torch.Generator().manual_seed(0)
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    results: dict[str, dict[str, float]] = {}
    for name, lens in CASES.items():
        cache, indptr, indices, last = paged_batch(lens, PAGE, gen, dev)
        q = torch.randn(len(lens), HQ, D, generator=gen).to(torch.bfloat16).to(dev)
        out = torch.empty_like(q)
        wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        results[name] = {}
        splits = SPLITS if args.all else [None, BEFORE[name]]
        for split in splits:
            wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, fixed_split_size=split)
            chunks = wrapper._plan.split.num_chunks if wrapper._plan.split.kv_chunk_size else len(lens)
            us = timer.measure(lambda: wrapper.run(q, cache, out=out)).median_us
            key = "auto" if split is None else f"{split} pages"
            results[name][key] = us
            print(f"{name:<24s} {key:>10s}  chunks {chunks:5d}  {us:8.1f} us", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""Where a decode launch's time goes: per-block %globaltimer stamps of the cuda decode kernel (TUNING trace=1).

    python3 tools/trace_decode.py [CASE ...]

Cases (llama8b shapes: 32 / 8 heads, d128, bf16, page 16, pages in random order): b1 (1 x 32768, the planner's
one-wave split), tails (128 x 256: the cascade row's per-request level alone), skewed (1 x 32768 + 63 x 512), b64
(64 x 2048); gptoss1024 (64 / 8 heads, d64, 64 x 1024: the suite's decode/gptoss_b64_s1024, one wave of the
short-items layout); window128 (gpt-oss's sliding-window layers: 64 / 8 heads, d64, 64 x 8192 with a window of 128
keys: the suite's decode/gptoss_window128_b64_s8192). For each: the launch's GPU time by CUDA events (L2 evicted
before it, as the suite does), then per block the phases of its first item -- prologue (page ids, query, row
tables), first tile's wait, main loop, result write, split merge -- as quantiles over the blocks, the spread of the
block starts (launch ramp) and ends (tail), and the main loop's bytes per microsecond.
"""

from __future__ import annotations

import ctypes
import statistics
import sys

import numpy as np
import torch

from jitattn.kernels import decode

decode.TUNING["trace"] = 1

import jitattn  # noqa: E402
from evicted_timing import evicted_event_times  # noqa: E402

PAGE = 16
# case -> (KV lengths, query heads, KV heads, head dim, window_left)
CASES = {"b1": ([32768], 32, 8, 128, -1), "tails": ([256] * 128, 32, 8, 128, -1),
         "skewed": ([32768] + [512] * 63, 32, 8, 128, -1), "b64": ([2048] * 64, 32, 8, 128, -1),
         "window128": ([8192] * 64, 64, 8, 64, 127), "gptoss1024": ([1024] * 64, 64, 8, 64, -1)}
FIELDS = 8


def run_case(name: str, lens: list[int], hq: int, hkv: int, d: int, window: int) -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    pages = [-(-n // PAGE) for n in lens]
    pool = sum(pages)
    cache = torch.randn(pool, 2, PAGE, hkv, d, device=dev, dtype=torch.bfloat16)
    indices = torch.randperm(pool, generator=gen).to(torch.int32)
    indptr = torch.tensor([0] + np.cumsum(pages).tolist(), dtype=torch.int32)
    last = torch.tensor([(n - 1) % PAGE + 1 for n in lens], dtype=torch.int32)
    q = torch.randn(len(lens), hq, d, device=dev, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    w = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=torch.bfloat16, window_left=window)
    times, scrub = evicted_event_times(lambda: w.run(q, cache, out=out), dev)
    spec = w._plan.spec  # the planned kernel's spec: its module (the loader returns the loaded one)
    lib = jitattn.load(spec)._lib
    # the layout the plan launched (the short-items one may have shorter tiles)
    layout = (decode.short_items_layout(spec) if w._plan.split.short_items else None) or decode.cuda_layout(spec)
    tile_bytes = layout["kTileTokens"] * (layout["kDQK"] + layout["kDVO"]) * layout["kElemBytes"]  # K + V read
    torch.cuda.synchronize()
    lib.jitattn_decode_trace_clear()  # the last launch below is the one read back
    scrub.sum()
    w.run(q, cache, out=out)
    torch.cuda.synchronize()
    buf = (ctypes.c_uint64 * (8192 * FIELDS))()
    n = lib.jitattn_decode_trace(ctypes.byref(buf))
    t = np.frombuffer(buf, dtype=np.uint64).reshape(8192, FIELDS)[:n].astype(np.int64)
    t = t[(t[:, 0] > 0) & (t[:, 5] > 0)]  # blocks that ran a work item to its end
    t0 = t[:, 0].min()
    rel = (t[:, :6] - t0) / 1e3  # us from the first block's start
    print(f"== {name}: {len(lens)} requests, {len(t)} blocks, events {statistics.median(times):.1f} us "
          f"(last traced launch: first start -> last end {rel[:, 5].max():.1f} us)")
    q_ = lambda x: " / ".join(f"{v:6.2f}" for v in np.quantile(x, [0.1, 0.5, 0.9]))  # noqa: E731
    print(f"  block start           {q_(rel[:, 0])}   (p10 / p50 / p90, us from the first start)")
    for label, a, b in (("prologue", 0, 1), ("first tile wait", 1, 2), ("main loop", 2, 3), ("write", 3, 4),
                        ("merge", 4, 5)):
        print(f"  {label:20s}  {q_(rel[:, b] - rel[:, a])}")
    print(f"  block end             {q_(rel[:, 5])}")
    tiles = t[:, 6]
    loop = rel[:, 3] - rel[:, 2]
    ok = tiles > 0
    if ok.any():
        per_tile = loop[ok] / tiles[ok]
        print(f"  main loop per tile    {q_(per_tile)} us  -> {tile_bytes / np.median(per_tile) / 1e3:.1f} GB/s per block")
    sms = np.bincount(t[:, 7].astype(np.int64))
    print(f"  blocks per SM: max {sms.max()}, SMs used {np.count_nonzero(sms)}")


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    for name in names:
        run_case(name, *CASES[name])
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

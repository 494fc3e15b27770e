"""Where an sm90 prefill launch's time goes: per-block %globaltimer stamps of its first item (SM90_TUNING trace=1).

    python3 tools/trace_prefill.py [CASE ...] [--page 16] [--warm code|all]

Cases (Llama-3-8B heads: 32 / 8, head dim 128, bf16, paged KV, non-causal, 32-token requests: with the GQA group
packed, one 128-row tile per request and KV head):
  one_wave  16 requests over 2048 keys, four requests on each page list: 128 items of 16 KV blocks, one per SM, four
            tiles reading each KV block (the shape of the b128 cascade's shared level, cut into 4 chunks);
  short     1-block tiles, ~16 per SM (tools/prefill_tile_cost.py's shortest point: a tile's fixed cost);
  long      64-block tiles, one per SM.
For each: the launch's GPU time by CUDA events (L2 evicted before it, as the suite does), then per block the
phases of its first item as quantiles over the blocks (p10 / p50 / p90, microseconds): the producer decoding the
item and issuing the first K block's loads, the consumers waiting for the queries and that block, the first S,
the rest of the blocks (per block), the output's store; the spread of the block starts (launch ramp) and ends
(tail), and for launches of several items per block the time per later item.

``--warm``: what L2 holds when the traced launch starts (by default nothing: evicted as before the timed calls).
``code``: L2 evicted, then the same kernel run once on a one-request problem of its own, so the kernel's code is
in L2 (and the SMs' instruction caches were filled once) while the traced launch's data are not; ``all``: no
eviction after the previous launch of the same problem (code, index arrays, the queries and the last KV in L2).
"""

from __future__ import annotations

import ctypes
import statistics
import sys

import numpy as np
import torch

from jitattn.kernels import prefill_sm90

prefill_sm90.SM90_TUNING["trace"] = 1

import jitattn  # noqa: E402
from evicted_timing import evicted_event_times  # noqa: E402
from jitattn.hardware import num_sms  # noqa: E402

HQ, HKV, D, TOKENS = 32, 8, 128, 32
FIELDS, BLOCKS = 12, 1024
KV_BLOCK = prefill_sm90.SM90_PAGED_KV_BLOCK[D]


def case_shape(name: str, sms: int) -> tuple[int, int, int]:
    """(requests, KV tokens per request, requests per page list) of case ``name``."""
    if name == "one_wave":
        return 16, 2048, 4
    if name == "short":
        return 16 * sms // HKV, KV_BLOCK, 16 * sms // HKV
    if name == "long":
        return sms // HKV, 64 * KV_BLOCK, 1
    raise SystemExit(f"unknown case {name!r}: one_wave, short or long")


def _code_warmer(dev: torch.device, page: int):
    """A launch of the same kernel on a one-request problem of its own (data the traced launch never reads)."""
    i32 = dict(dtype=torch.int32)
    pages = -(-KV_BLOCK // page)
    cache = torch.randn(pages, 2, page, HKV, D, device=dev).to(torch.bfloat16)
    q = torch.randn(TOKENS, HQ, D, device=dev).to(torch.bfloat16)
    w = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(torch.tensor([0, TOKENS], **i32), torch.tensor([0, pages], **i32), torch.arange(pages, **i32),
           torch.tensor([(KV_BLOCK - 1) % page + 1], **i32), HQ, HKV, D, page, causal=False, q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    return lambda: w.run(q, cache, out=out)


def run_case(name: str, page: int, warm: str = "") -> None:
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    batch, kv_len, sharing = case_shape(name, num_sms(torch.cuda.current_device()))
    pages = -(-kv_len // page)
    lists = -(-batch // sharing)  # distinct page lists, each read by `sharing` requests
    cache = torch.randn(lists * pages, 2, page, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    order = torch.randperm(lists * pages, generator=gen).to(torch.int32).view(lists, pages)
    i32 = dict(dtype=torch.int32)
    kv_indices = torch.cat([order[r // sharing] for r in range(batch)])
    q = torch.randn(batch * TOKENS, HQ, D, generator=gen).to(torch.bfloat16).to(dev)
    w = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(torch.arange(batch + 1, **i32) * TOKENS, torch.arange(batch + 1, **i32) * pages, kv_indices,
           torch.full((batch,), (kv_len - 1) % page + 1, **i32), HQ, HKV, D, page, causal=False,
           q_data_type=torch.bfloat16)
    out = torch.empty_like(q)
    times, scrub = evicted_event_times(lambda: w.run(q, cache, out=out), dev)
    lib = ctypes.CDLL(str(jitattn.load(w.current_plan.spec).path))  # the loaded module's library (same handle)
    warmer = _code_warmer(dev, page) if warm == "code" else None
    if warmer is not None:
        warmer()  # planned, loaded and run once before the trace
    if lib.jitattn_prefill_trace_clear() != 0:
        raise SystemExit("jitattn_prefill_trace_clear failed")
    if warm == "all":
        w.run(q, cache, out=out)  # leaves the problem's data and the kernel's code in L2
    else:
        scrub.sum()
        if warmer is not None:
            warmer()  # the kernel's code in L2, no data of the traced launch (its block 0 rewrites these stamps)
    w.run(q, cache, out=out)  # the launch read back
    torch.cuda.synchronize()
    buf = (ctypes.c_uint64 * (BLOCKS * FIELDS))()
    n = lib.jitattn_prefill_trace(ctypes.byref(buf))
    t = np.frombuffer(buf, dtype=np.uint64).reshape(BLOCKS, FIELDS)[:max(n, 0)].astype(np.int64)
    t = t[(t[:, 0] > 0) & (t[:, 7] > 0)]  # blocks that stored a first item with KV blocks
    if not len(t):
        raise SystemExit(f"{name}: no traced block (is the sm90 tier taken? JITATTN_PREFILL_TIER=sm90)")
    t0 = t[:, 0].min()
    rel = (t[:, [0, 1, 2, 3, 4, 5, 6, 7, 10]] - t0) / 1e3  # us from the first block's start
    start, decoded, k_issued, q_in, k_in, s_done, pv_done, stored, end = rel.T
    nblk = t[:, 8]
    ran = t[:, 11]
    print(f"== {name}{' (warm: ' + warm + ')' if warm else ''}: {batch} requests x {kv_len} keys (pages of {page}), "
          f"{len(t)} blocks, items per block "
          f"{ran.min()}-{ran.max()}, KV blocks per first item {nblk.min()}-{nblk.max()}; events "
          f"{statistics.median(times):.1f} us (the traced launch: first start -> last end {end.max():.1f} us)")
    q_ = lambda x: " / ".join(f"{v:6.2f}" for v in np.quantile(x, [0.1, 0.5, 0.9]))  # noqa: E731
    for label, x in (("block start", start), ("item decoded", decoded - start),
                     ("first K loads issued", k_issued - decoded), ("queries landed", q_in - start),
                     ("first K block landed", k_in - start), ("first S done", s_done - k_in),
                     ("per later block", (pv_done - s_done) / np.maximum(nblk - 1, 1)),
                     ("output stored", stored - pv_done), ("block end", end)):
        print(f"  {label:22s} {q_(x)}")
    more = ran > 1
    if more.any():
        print(f"  per later item         {q_((end[more] - stored[more]) / (ran[more] - 1))}")


def main() -> None:
    args = sys.argv[1:]
    page, warm = 16, ""
    for flag in ("--page", "--warm"):
        if flag in args:
            i = args.index(flag)
            value = args[i + 1]
            args = args[:i] + args[i + 2:]
            if flag == "--page":
                page = int(value)
            elif value in ("code", "all"):
                warm = value
            else:
                raise SystemExit(f"--warm {value!r}: code or all")
    for name in args or ["one_wave", "short", "long"]:
        run_case(name, page, warm)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Per-phase timeline of the sm90 MLA kernels (SM cycles, block 0's first item), from clock64() stamps.

Run on an H100/H200: ``python3 dev/mla_trace.py [tma|gather] [shared]``. The kernel source is patched before the
build (jitattn.jit.key.render), so the stamps never reach the real template: thread 0 of each warpgroup of block 0
writes clock64() at the points named in STAMPS into a device array, read back through an exported function.
Case: b64 x 4096, 128 heads, page 64, bf16 (``shared``: every request reads the same pages, KV L2-resident).
Prints, per warpgroup, the median over the steady-state iterations of each stamp's cycles after the iteration's
first stamp, and the iteration period.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import sys

import torch

import jitattn
import jitattn.jit.key as key

SLOTS, ITERS = 16, 64
HEADER = f"""
__device__ long long g_mla_trace[2 * {ITERS} * {SLOTS}];
#define MLA_TRACE(iter, slot) \\
  if (blockIdx.x == 0 && i == blockIdx.x && wt == 0 && (iter) < {ITERS}) \\
    g_mla_trace[(wg * {ITERS} + (iter)) * {SLOTS} + (slot)] = clock64();
JITATTN_EXPORT int jitattn_mla_trace(long long* host) {{
  return int(cudaMemcpyFromSymbol(host, g_mla_trace, sizeof(g_mla_trace)));
}}
"""

# (anchor text in the rendered kernel, stamp name): the stamp goes right after the anchor's first occurrence
# (after its n-th occurrence when the anchor is a (text, n) pair).
STAMPS = {
    "tma": [
        (("        // the rope chunk of K0 was last read by S0: the next block's comes in now\n", 0), "wg0 start", 0, 0),
        (("sm90::named_barrier_arrive(kBarSync, 256);\n", 0), "wg0 softmax0 done", 0, 1),
        (("        pv_local(o, pa, kv0_base);\n        sm90::wg_commit();\n", 0), "wg0 P0V0 issued", 0, 2),
        (("        sm90::named_barrier(kBarScale1, 256);\n", 0), "wg0 scale1 in", 0, 3),
        (("        sm90::named_barrier_arrive(kBarP0, 256);\n", 0), "wg0 sP0 stored", 0, 4),
        (("        sm90::named_barrier(kBarWarpgroup, 128);  // every warp of wg0 is past the GEMM above: K0's left half is "
          "free\n", 0), "wg0 P0V0 done", 0, 5),
        (("        sm90::named_barrier(kBarP1, 256);\n", 0), "wg0 sP1 in", 0, 6),
        (("          pv_shared(o, p1_base, kv1_base);\n          sm90::wg_commit();\n", 0), "wg0 P1V1 issued", 0, 7),
        (("          scores<0, 4>(sc, q_base, kv0_base, bars, parity, rq8, false);\n          sm90::wg_commit();\n", 0),
         "wg0 S' 8,0-3 issued", 0, 8),
        (("          scores<4, kChunks - 1>(sc, q_base, kv0_base, bars, parity, rq8, false);\n          sm90::wg_commit();\n",
          0), "wg0 S' 4-7 issued", 0, 9),
        (("        sm90::reg_fence(sc);\n      } else {", 0), "wg0 S' done", 0, 10),
        (("        sm90::named_barrier(kBarSync, 256);\n", 0), "wg1 softmax0 in", 1, 1),
        (("        sm90::named_barrier_arrive(kBarScale1, 256);\n", 0), "wg1 softmax1 done", 1, 2),
        (("        sm90::named_barrier(kBarP0, 256);\n", 0), "wg1 sP0 in", 1, 3),
        (("        sm90::named_barrier_arrive(kBarP1, 256);\n", 0), "wg1 PVs issued", 1, 4),
        (("          sm90::named_barrier(kBarWarpgroup + 1, 128);\n", 0), "wg1 P0V0 done", 1, 5),
        (("        sm90::named_barrier(kBarWarpgroup + 1, 128);\n", 1), "wg1 P1V1 done", 1, 6),
        (("          scores<0, 4>(sc, q_base, kv1_base, my_bars, parity, rq8, false);\n          sm90::wg_commit();\n", 0),
         "wg1 S' issued", 1, 7),
        (("          sm90::reg_fence(sc);\n          parity ^= 1;\n", 0), "wg1 S' done", 1, 8),
    ],
}
WG1_START = ("        // ---- softmax of block b1 (S1 in sc) against wg0's max after block b0\n", "wg1 start", 1, 0)


def patched(text: str) -> str:
    kernel = text.index("_tma(const __grid_constant__")
    start = text.rindex('extern "C"', 0, kernel)
    text = text[:start] + HEADER + text[start:]
    body = text.index("_tma(const __grid_constant__")
    anchor, name, wg, slot = WG1_START
    at = text.index(anchor, body) + len(anchor)
    text = text[:at] + f"        MLA_TRACE((b0 - it.blk_begin) / 2, {slot})\n" + text[at:]
    for (anchor, nth), name, wg, slot in STAMPS["tma"]:
        at = body
        for _ in range(nth + 1):
            at = text.index(anchor, at) + len(anchor)
        if anchor.endswith("} else {"):
            text = text[:at - len("      } else {")] + f"        MLA_TRACE((b0 - it.blk_begin) / 2, {slot})\n" + \
                text[at - len("      } else {"):]
        else:
            text = text[:at] + f"MLA_TRACE((b0 - it.blk_begin) / 2, {slot})\n" + text[at:]
    return text


def main() -> None:
    shared = "shared" in sys.argv
    original = key.render

    def render(spec):
        sources = dict(original(spec))
        if spec.op == "mla":
            sources["kernel.cu"] = patched(sources["kernel.cu"])
        return sources

    key.render = render
    os.environ["JITATTN_MLA_KERNEL"] = "sm90-tma"
    b, n, page, heads = 64, 4096, 64, 128
    per = n // page
    gen = torch.Generator().manual_seed(0)
    buf = torch.randn(b * per + 1, page, 576, generator=gen).to(torch.bfloat16).cuda()
    indices = torch.randperm(b * per + 1, generator=gen)[: b * per].to(torch.int32)
    if shared:
        indices = indices[:per].repeat(b)
    indptr = (torch.arange(b + 1) * per).to(torch.int32)
    lens = torch.full((b,), n, dtype=torch.int32)
    q_nope = torch.randn(b, heads, 512, generator=gen).to(torch.bfloat16).cuda()
    q_pe = torch.randn(b, heads, 64, generator=gen).to(torch.bfloat16).cuda()
    w = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(torch.arange(b + 1, dtype=torch.int32), indptr, indices, lens, heads, 512, 64, page, False,
           1.0 / math.sqrt(192), torch.bfloat16, torch.bfloat16)
    for _ in range(3):
        w.run(q_nope, q_pe, buf[..., :512], buf[..., 512:])
    torch.cuda.synchronize()
    host = (ctypes.c_longlong * (2 * ITERS * SLOTS))()
    assert w._kernel.module._lib.jitattn_mla_trace(host) == 0
    stamps = torch.tensor(list(host), dtype=torch.int64).view(2, ITERS, SLOTS)
    names = {(wg, slot): name for (_, name, wg, slot) in STAMPS["tma"] + [(None, WG1_START[1], 1, 0)]}
    steady = range(4, 28)
    for wg in (0, 1):
        period = statistics.median(int(stamps[wg, k + 1, 0] - stamps[wg, k, 0]) for k in steady)
        print(f"warpgroup {wg}: iteration period {period:.0f} cycles (median over iterations 4..27)")
        for slot in range(1, SLOTS):
            if (wg, slot) not in names:
                continue
            rel = statistics.median(int(stamps[wg, k, slot] - stamps[wg, k, 0]) for k in steady)
            print(f"  {names[(wg, slot)]:22s} {rel:7.0f}")
    # the two warpgroups' starts against each other (same SM clock)
    off = statistics.median(int(stamps[1, k, 0] - stamps[0, k, 0]) for k in steady)
    print(f"wg1 start - wg0 start: {off:.0f} cycles")


if __name__ == "__main__":
    main()

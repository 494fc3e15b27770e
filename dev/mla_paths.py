"""Times the sm90 MLA kernel's two load paths side by side: cp.async gathers (JITATTN_MLA_KERNEL=sm90-gather, the
serial kernel) and TMA (sm90-tma, the paired-block kernel), through BatchMLAPagedAttentionWrapper.

Run on an H100/H200: ``python3 dev/mla_paths.py``. Shapes: the benchmark's mla/* cases (bf16, page 64), the same
at page 16, and two small batches that split. Timing as dev/mla_tuning.py (CUDA events around 20 back-to-back
run() calls after 3 warm-ups, median of 5 groups; L2 not flushed). Each TMA output is compared with the gather
output on the same inputs (relative L2 difference).
"""

from __future__ import annotations

import math
import os

import torch

import jitattn
from mla_tuning import _time

SHAPES = [  # (name, batch, kv_len, heads, page size); "shared": every request reads the same pages (L2-resident KV)
    ("b64_s4096_h128_p64", 64, 4096, 128, 64),
    ("b64_s4096_h128_p64 shared", 64, 4096, 128, 64),
    ("h16_b128_s4096_p64 shared", 128, 4096, 16, 64),
    ("b128_s8192_h128_p64", 128, 8192, 128, 64),
    ("h16_b128_s4096_p64", 128, 4096, 16, 64),
    ("b64_s4096_h128_p16", 64, 4096, 128, 16),
    ("h16_b128_s4096_p16", 128, 4096, 16, 16),
    ("b4_s8192_h128_p64 (split)", 4, 8192, 128, 64),
    ("b8_s16384_h16_p64 (split)", 8, 16384, 16, 64),
    ("b132_s1000_h128_p64 (odd blocks)", 132, 1000, 128, 64),
]


def _inputs(batch: int, kv_len: int, heads: int, page: int, shared: bool):
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + kv_len + heads + page)
    pages_per = -(-kv_len // page)
    pool = batch * pages_per + 1
    buffer = torch.randn(pool, page, 576, generator=gen, device="cuda").to(torch.bfloat16)
    indices = torch.randperm(pool, device="cpu")[: batch * pages_per].to(torch.int32)
    if shared:
        indices = indices[:pages_per].repeat(batch)
    indptr = (torch.arange(batch + 1) * pages_per).to(torch.int32)
    lens = torch.full((batch,), kv_len, dtype=torch.int32)
    q_nope = torch.randn(batch, heads, 512, generator=gen, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(batch, heads, 64, generator=gen, device="cuda").to(torch.bfloat16)
    return buffer, indices, indptr, lens, q_nope, q_pe


def main() -> None:
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for name, batch, kv_len, heads, page in SHAPES:
        buffer, indices, indptr, lens, q_nope, q_pe = _inputs(batch, kv_len, heads, page, name.endswith("shared"))
        ckv, kpe = buffer[..., :512], buffer[..., 512:]
        qo = torch.arange(batch + 1, dtype=torch.int32)
        args = (qo, indptr, indices, lens, heads, 512, 64, page, False, 1 / math.sqrt(192), torch.bfloat16,
                torch.bfloat16)
        flops = 2 * batch * heads * kv_len * (576 + 512)
        nbytes = batch * kv_len * 576 * 2
        outs = {}
        for loads in ("sm90-gather", "sm90-tma"):
            os.environ["JITATTN_MLA_KERNEL"] = loads
            w = jitattn.BatchMLAPagedAttentionWrapper(workspace)
            w.plan(*args)
            outs[loads] = w.run(q_nope, q_pe, ckv, kpe).float()
            t = _time(lambda: w.run(q_nope, q_pe, ckv, kpe))
            work = w._kernel.work
            diff = ""
            if loads == "sm90-tma":
                ref = outs["sm90-gather"]
                diff = f"rel diff vs gathers {((outs[loads] - ref).norm() / ref.norm()).item():.2e}"
            print(f"{name:34s} {loads:12s} {t:9.1f} us {flops / t / 1e6:7.1f} TFLOP/s {nbytes / t / 1e6:6.2f} TB/s "
                  f"items {work.num_items} merges {work.num_merges} {diff}", flush=True)


if __name__ == "__main__":
    main()

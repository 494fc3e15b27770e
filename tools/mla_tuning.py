"""Times the sm90 MLA kernel (through BatchMLAPagedAttentionWrapper) for tuning choices of jitattn/kernels/mla.py.

Run on an H100/H200: ``python3 tools/mla_tuning.py [--only NAME,...] [choice ...]``, a choice being ``key=value[,key=value]`` of
``family.TUNING`` (default ``load_threads=128 load_threads=256``). Each choice renders distinct sources (its own cache entry).
Shapes: the benchmark's mla/* cases (bf16 queries, page 64; fp8 rows also with f16 queries) and two small
batches that split. Timing: CUDA events around 20 back-to-back run() calls after 3 warm-ups, median of 5
such groups; TFLOP/s = 2 * B * H * L * (576 + 512) / t, TB/s = B * L * 576 * 2 B / t. Each shape is checked
against the prefill kernels' output (JITATTN_MLA_KERNEL=prefill) on the same inputs; fp8 rows count 1 byte
per latent element.
"""

from __future__ import annotations

import math
import os
import statistics
import sys

import torch

import jitattn
import jitattn.jit as jit
from jitattn.kernels import mla as family
from jitattn.runtime.mla_kernel import kernel_spec

E4M3 = torch.float8_e4m3fn
BF16, F16 = torch.bfloat16, torch.float16
SHAPES = [  # (name, batch, kv_len, heads, latent cache dtype, query dtype)
    ("b64_s4096_h128", 64, 4096, 128, BF16, BF16),
    ("b128_s8192_h128", 128, 8192, 128, BF16, BF16),
    ("h16_b128_s4096", 128, 4096, 16, BF16, BF16),
    ("h16_b128_s4096_fp8", 128, 4096, 16, E4M3, BF16),
    ("h16_b128_s4096_fp8_f16q", 128, 4096, 16, E4M3, F16),
    ("b64_s4096_h128_fp8", 64, 4096, 128, E4M3, BF16),
    ("b64_s4096_h128_fp8_f16q", 64, 4096, 128, E4M3, F16),
    ("b4_s8192_h128 (split)", 4, 8192, 128, BF16, BF16),
    ("b8_s16384_h16 (split)", 8, 16384, 16, BF16, BF16),
]


def mla_inputs(batch: int, kv_len: int, heads: int, kv_dtype: torch.dtype, q_dtype: torch.dtype, page: int = 64):
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + kv_len + heads)
    pages_per = kv_len // page
    pool = batch * pages_per + 1
    buffer = torch.randn(pool, page, 576, generator=gen, device="cuda").to(kv_dtype)
    indices = torch.randperm(pool, device="cpu")[: batch * pages_per].to(torch.int32)
    indptr = (torch.arange(batch + 1) * pages_per).to(torch.int32)
    lens = torch.full((batch,), kv_len, dtype=torch.int32)
    q_nope = torch.randn(batch, heads, 512, generator=gen, device="cuda").to(q_dtype)
    q_pe = torch.randn(batch, heads, 64, generator=gen, device="cuda").to(q_dtype)
    return buffer, indices, indptr, lens, q_nope, q_pe


def median_call_us(fn) -> float:
    for _ in range(3):
        fn()
    groups = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        end.synchronize()
        groups.append(start.elapsed_time(end) * 1e3 / 20)
    return statistics.median(groups)


def main(choices: list[str]) -> None:
    # --only A,B: the shapes whose name contains A or B (e.g. h16: the rows the narrow kernel takes)
    only = choices.pop(choices.index("--only") + 1).split(",") if "--only" in choices else None
    if only is not None:
        choices.remove("--only")
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    for name, batch, kv_len, heads, kv_dtype, q_dtype in SHAPES:
        if only is not None and not any(part in name for part in only):
            continue
        buffer, indices, indptr, lens, q_nope, q_pe = mla_inputs(batch, kv_len, heads, kv_dtype, q_dtype)
        ckv, kpe = buffer[..., :512], buffer[..., 512:]
        qo = torch.arange(batch + 1, dtype=torch.int32)
        args = (qo, indptr, indices, lens, heads, 512, 64, 64, False, 1 / math.sqrt(192), q_dtype, kv_dtype)
        os.environ["JITATTN_MLA_KERNEL"] = "prefill"
        ref = jitattn.BatchMLAPagedAttentionWrapper(workspace)
        ref.plan(*args)
        expected = ref.run(q_nope, q_pe, ckv, kpe).float()
        t_ref = median_call_us(lambda: ref.run(q_nope, q_pe, ckv, kpe))
        flops = 2 * batch * heads * kv_len * (576 + 512)
        nbytes = batch * kv_len * 576 * kv_dtype.itemsize
        print(f"{name:24s} prefill kernels  {t_ref:9.1f} us {flops / t_ref / 1e6:7.1f} TFLOP/s "
              f"{nbytes / t_ref / 1e6:6.2f} TB/s", flush=True)
        defaults = dict(family.TUNING)
        for choice in choices:
            family.TUNING.clear()
            family.TUNING.update(defaults)
            family.TUNING.update({k: int(v) for k, v in (kv.split("=") for kv in choice.split(","))})
            jit._registry.pop(kernel_spec(q_dtype, kv_dtype), None)  # the same spec renders other sources now
            os.environ["JITATTN_MLA_KERNEL"] = "sm90"
            w = jitattn.BatchMLAPagedAttentionWrapper(workspace)
            w.plan(*args)
            out = w.run(q_nope, q_pe, ckv, kpe).float()
            err = ((out - expected).norm() / expected.norm()).item()
            t = median_call_us(lambda: w.run(q_nope, q_pe, ckv, kpe))
            work = w._kernel.work
            print(f"{name:24s} sm90 {choice:<14s} {t:9.1f} us {flops / t / 1e6:7.1f} TFLOP/s "
                  f"{nbytes / t / 1e6:6.2f} TB/s  rel err vs prefill {err:.2e}  items {work.num_items} "
                  f"merges {work.num_merges}{' narrow' if w._kernel.narrow else ''}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["load_threads=128", "load_threads=256"])

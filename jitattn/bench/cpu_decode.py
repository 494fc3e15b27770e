"""Decode on the cpu target: jitattn's generic attention kernel vs torch SDPA.

Run: ``python -m jitattn.bench.cpu_decode [--batch 16 --kv-len 1024 ...]``.

One decode step (one query per request) over a paged KV cache (NHD, pages in a
shuffled order, like a live cache) for jitattn, and over the same data as a
contiguous ``[batch, heads, kv_len, dim]`` float32 tensor for
``torch.nn.functional.scaled_dot_product_attention`` (``enable_gqa=True``).
Bytes per call = K + V read + q read + o written, in each kernel's own dtypes.
Each figure is the median of ``--rounds`` calls timed round-robin after
warm-up; ``max |o - sdpa|`` compares against SDPA on the float32 data (for bf16
it is mostly the rounding of the inputs to bf16).

Measured 2026-11-29 on the 2-core AMD EPYC dev VM (shared, so +-5 %), torch
2.13 CPU (its SDPA uses AVX-512), g++ 12 -O3 without -march (SSE2 only);
batch 16, kv_len 1024, 32/8 heads, head_dim 128, page_size 16, 2 threads:

    kernel                          us     GB/s
    jitattn f32 (paged)           8400     16.1
    jitattn bf16 (paged)          9000      7.5
    torch SDPA f32 (enable_gqa)  10200     13.2

The kernel is compute-bound at the SSE2 multiply/add rate (~2 vector
multiply-adds per cycle per core): bf16 halves the bytes but adds a
conversion pass, so it is no faster than f32.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from typing import Callable

import torch

import jitattn
from jitattn.runtime.launch import AttentionScalars, launch_attention
from jitattn.spec import KVLayout, PosEncoding, VariantSpec


def _median_us(kernels: dict[str, Callable[[], object]], rounds: int, warmup: int = 3) -> dict[str, float]:
    """Median microseconds per call of each kernel, timed round-robin so that
    load from other processes on the machine hits every kernel alike."""
    for fn in kernels.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in kernels}
    for _ in range(rounds):
        for name, fn in kernels.items():
            started = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - started)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def bench(batch: int, kv_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
          rounds: int) -> None:
    torch.manual_seed(0)
    pages_per_request = math.ceil(kv_len / page_size)
    num_pages = batch * pages_per_request
    kv_indices = torch.randperm(num_pages, dtype=torch.int32)
    kv_indptr = torch.arange(0, num_pages + 1, pages_per_request, dtype=torch.int32)
    kv_last_page_len = torch.full((batch,), kv_len - (pages_per_request - 1) * page_size, dtype=torch.int32)
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32)
    scalars = AttentionScalars(
        causal=False, pos_encoding=PosEncoding.NONE, window_left=-1, sm_scale=1.0 / math.sqrt(head_dim),
        logits_soft_cap=0.0, rope_scale=1.0, rope_theta=1e4,
    )
    cache_f32 = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim)
    q_f32 = torch.randn(batch, num_qo_heads, head_dim)

    # The same keys/values, contiguous per request, for SDPA: [batch, kv_heads, kv_len, dim].
    gathered = cache_f32[kv_indices.long()].view(batch, pages_per_request, 2, page_size, num_kv_heads, head_dim)
    gathered = gathered.permute(2, 0, 4, 1, 3, 5).reshape(2, batch, num_kv_heads, -1, head_dim)[:, :, :, :kv_len]
    k_sdpa, v_sdpa = gathered[0].contiguous(), gathered[1].contiguous()
    q_sdpa = q_f32.unsqueeze(2)  # [batch, heads, 1, dim]

    def sdpa():
        return torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_sdpa, v_sdpa, enable_gqa=True)

    expected = sdpa().squeeze(2)
    kernels: dict[str, Callable[[], object]] = {}
    num_bytes: dict[str, int] = {}
    errors: dict[str, float] = {}
    qo_elements = 2 * batch * num_qo_heads * head_dim  # q read + o written
    kv_elements = 2 * batch * kv_len * num_kv_heads * head_dim  # K + V read
    for dtype, name in ((torch.float32, "f32"), (torch.bfloat16, "bf16")):
        module = jitattn.load(VariantSpec(op="decode", target="cpu", q_dtype=name, kv_dtype=name, o_dtype=name))
        cache = cache_f32.to(dtype)
        q = q_f32.to(dtype)
        o = torch.empty(batch, num_qo_heads, head_dim, dtype=dtype)

        def run(module=module, cache=cache, q=q, o=o):
            launch_attention(
                module, q=q, k=cache[:, 0], v=cache[:, 1], o=o, lse=None, qo_indptr=qo_indptr,
                kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
                page_size=page_size, kv_layout=KVLayout.NHD, custom_mask=None, mask_indptr=None,
                num_kv_heads=num_kv_heads, scalars=scalars,
            )

        label = f"jitattn {name} (paged)"
        run()
        errors[label] = (o.float() - expected).abs().max().item()
        kernels[label] = run
        num_bytes[label] = (kv_elements + qo_elements) * dtype.itemsize
    kernels["torch SDPA f32 (enable_gqa)"] = sdpa
    num_bytes["torch SDPA f32 (enable_gqa)"] = (kv_elements + qo_elements) * 4

    print(f"decode: batch {batch}, kv_len {kv_len}, heads {num_qo_heads}/{num_kv_heads}, head_dim {head_dim}, "
          f"page_size {page_size}, {torch.get_num_threads()} threads, median of {rounds} round-robin calls")
    print(f"{'kernel':<30}{'us':>10}{'GB/s':>9}  max |o - sdpa|")
    for label, us in _median_us(kernels, rounds).items():
        error = f"{errors[label]:.1e}" if label in errors else "-"
        print(f"{label:<30}{us:>10.0f}{num_bytes[label] / (us * 1e-6) / 1e9:>9.1f}  {error}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--kv-len", type=int, default=1024)
    parser.add_argument("--num-qo-heads", type=int, default=32)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args(argv)
    bench(args.batch, args.kv_len, args.num_qo_heads, args.num_kv_heads, args.head_dim, args.page_size, args.rounds)


if __name__ == "__main__":
    main()

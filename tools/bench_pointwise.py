"""The serving model's row-wise ops at a decode step's size, jitattn's kernels beside torch's forms, in CUDA graphs.

    python3 tools/bench_pointwise.py [--tokens 128] [--hidden 4096] [--intermediate 14336] [--profile]

bf16, Llama-3-8B sizes by default. Two figures per form, microseconds per call, L2 not flushed (a step's own
conditions): **graph**, the form captured 50 times into one CUDA graph (as a decode step replays it), CUDA events
around replays, median of 10; **plain**, 50 eager calls back to back, host wall clock from the first launch to the
synchronisation after the last, median of 10 (host cost included: what a loop without graphs pays).
``--profile`` adds cProfile's busiest functions over 500 plain calls of each jitattn form (where its host time goes). RMSNorm: torch's fused ``rms_norm`` with the weight, Hugging Face's
four-kernel spelling, jitattn's ``rmsnorm``; the residual add and jitattn's ``fused_add_rmsnorm``; the gated MLP
activation on one GEMM output's halves: torch's ``silu(gate) * up`` and jitattn's ``silu_and_mul``.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from typing import Callable

import torch
import torch.nn.functional as F

import jitattn

REPS = 50


def graph_us(fn: Callable[[], object]) -> float:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (loads, allocator) outside the capture
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / REPS)
    return sorted(times)[len(times) // 2]


def plain_us(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        for _ in range(REPS):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e6 / REPS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--profile", action="store_true", help="cProfile of each jitattn form's plain calls")
    args = ap.parse_args()
    m, h, i = args.tokens, args.hidden, args.intermediate
    g = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    x, delta, residual, weight, gate_up = rand(m, h), rand(m, h), rand(m, h), rand(h) + 1, rand(m, 2 * i)
    eps = 1e-5
    rows = [
        ("torch rms_norm (fused, with the weight)", lambda: F.rms_norm(x, (h,), weight, eps)),
        ("torch, Hugging Face's four kernels", lambda: weight * F.rms_norm(x.float(), (h,), eps=eps).to(x.dtype)),
        ("jitattn.rmsnorm", lambda: jitattn.rmsnorm(x, weight, eps)),
        ("torch residual add", lambda: x + delta),
        ("jitattn.fused_add_rmsnorm (add + norm)", lambda: jitattn.fused_add_rmsnorm(delta, residual, weight, eps)),
        ("torch silu(gate) * up", lambda: (lambda a, b: F.silu(a) * b)(*gate_up.chunk(2, dim=-1))),
        ("jitattn.silu_and_mul", lambda: jitattn.silu_and_mul(gate_up)),
    ]
    print(f"{m} tokens, hidden {h}, intermediate {i}, bf16; us per call: in a CUDA graph of {REPS}, then plain")
    for name, fn in rows:
        print(f"  {name:45s} {graph_us(fn):7.2f} {plain_us(fn):7.2f}", flush=True)
    if args.profile:
        for name, fn in rows:
            if name.startswith("jitattn"):
                profile_host(name, fn)


def profile_host(name: str, fn: Callable[[], object]) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(500):
        fn()
    profiler.disable()
    torch.cuda.synchronize()
    print(f"cProfile of 500 plain calls: {name}")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(12)


if __name__ == "__main__":
    main()

"""Kernels of one cascade run() (``SHAPES``), from torch.profiler: name, launches, µs each.

    python3 tools/profile_cascade.py          # on the GPU machine; PROFILE_DEVICE=cpu: a smoke run
    python3 tools/profile_cascade.py --sweep  # each kernel's µs per shared-level chunk size (fixed_split_size)
    python3 tools/profile_cascade.py --run b128:32   # run that shape / chunk pages 30 times (for ncu)
    PROFILE_PAGE=64 python3 tools/profile_cascade.py  # pages of 64 tokens (default 16)
"""

from __future__ import annotations

import os
import sys

import torch

import jitattn

HQ, HKV, D = 32, 8, 128
PAGE = int(os.environ.get("PROFILE_PAGE", "16"))


def cascade(batch: int, shared_len: int, unique_len: int, dev: torch.device, split: int | None = None):
    gen = torch.Generator().manual_seed(0)
    p_shared, p_unique = shared_len // PAGE, -(-unique_len // PAGE)
    needed = p_shared + batch * p_unique
    order = torch.randperm(2 * needed, generator=gen)[:needed].to(torch.int32)
    shared, unique = order[:p_shared], order[p_shared:]
    cache = torch.randn(2 * needed, 2, PAGE, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    q = torch.randn(batch, HQ, D, generator=gen).to(torch.bfloat16).to(dev)
    i32 = dict(dtype=torch.int32)
    w = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(128 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan([torch.tensor([0, batch], **i32), torch.arange(batch + 1, **i32)],
           [torch.tensor([0, p_shared], **i32), torch.arange(0, batch * p_unique + 1, p_unique, **i32)],
           [shared, unique], [torch.tensor([PAGE], **i32), torch.full((batch,), (unique_len - 1) % PAGE + 1, **i32)],
           HQ, HKV, D, PAGE, causal=False, q_data_type=torch.bfloat16, fixed_split_size=split)
    return lambda: w.run(q, cache)


# the suite's two rows, and one layer of the serving engine's system-16k decode step (own tokens: 64 of prompt + ~32
# decoded)
SHAPES = {"b128": (128, 8192, 256), "b32": (32, 32768, 128), "e16k": (128, 16384, 96)}


def kernel_us(fn, dev: torch.device, runs: int = 10) -> dict[str, float]:
    """Device µs per run of each kernel fn launches (torch.profiler), by kernel name."""
    for _ in range(5):
        fn()
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(runs):
            fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
    return {e.key[:40]: e.self_device_time_total / runs for e in prof.key_averages() if e.self_device_time_total > 0}


def sweep(dev: torch.device) -> None:
    for name, shape in SHAPES.items():
        for split in (None, 8, 16, 32, 57, 62, 64, 128, 256):
            try:
                us = kernel_us(cascade(*shape, dev, split), dev)
            except Exception as exc:  # noqa: BLE001  (a sweep point that does not plan: say so, go on)
                print(f"{name} split {split}: {type(exc).__name__}: {str(exc)[:100]}")
                continue
            cells = "  ".join(f"{k.split('(')[0][-28:]} {v:6.1f}" for k, v in sorted(us.items()))
            print(f"{name} split {str(split):>4s} pages: total {sum(us.values()):6.1f} us  {cells}", flush=True)


def main() -> None:
    dev = torch.device(os.environ.get("PROFILE_DEVICE", "cuda"))
    if "--sweep" in sys.argv:
        return sweep(dev)
    if "--run" in sys.argv:
        name, split = sys.argv[sys.argv.index("--run") + 1].split(":")
        fn = cascade(*SHAPES[name], dev, int(split) or None)
        for _ in range(30):
            fn()
        return None
    for shape in SHAPES.values():
        fn = cascade(*shape, dev)
        for _ in range(5):
            fn()
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with torch.profiler.profile(activities=acts) as prof:
            for _ in range(10):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
        print(f"== cascade b{shape[0]} shared {shape[1]} + {shape[2]} each (10 runs)")
        key = "self_device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=70))


if __name__ == "__main__":
    main()

"""Hardware ceilings measured in the same run as the kernels.

- ``copy``: a device-to-device ``copy_`` (on CUDA 2 GiB -> 2 GiB, i.e. 4 GiB of
  bytes read + written); the rate counts bytes read + written.
- ``read_stream``: a reduction over a large float32 tensor (4 GiB read on CUDA);
  the better of ``torch.sum`` and ``torch.amax``; the rate counts bytes read.
  Bandwidth rows (decode, cascade) are compared with this one: decode reads
  far more than it writes.
- ``gemm``: an ``n x n x n`` matmul on random data (8192, bf16 on CUDA);
  rate = 2 n^3 / time. Compute rows (prefill) are compared with it.

On the cpu target the sizes are smaller (256 MiB copy, 512 MiB read, 2048^3)
and the GEMM is float32 (bf16 GEMM throughput on CPUs varies too much with
the ISA to be a ceiling).
"""

from __future__ import annotations

import torch

from .timing import Timer

GIB = 1 << 30


def copy_gbs(timer: Timer, nbytes: int, budget_s: float = 0.3) -> dict:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=timer.device)
    dst = torch.empty_like(src)
    t = timer.measure(lambda: dst.copy_(src), budget_s, scrub=False, max_iters=50)
    return {"gbps": 2 * nbytes / (t.median_us * 1e-6) / 1e9, "bytes": 2 * nbytes, "median_us": t.median_us,
            "method": f"tensor.copy_ of {nbytes / GIB:.3g} GiB (bytes read + written)"}


def read_stream_gbs(timer: Timer, nbytes: int, budget_s: float = 0.3) -> dict:
    x = torch.empty(nbytes // 4, dtype=torch.float32, device=timer.device).normal_()
    best, method = None, ""
    for name, fn in (("torch.sum", lambda: x.sum()), ("torch.amax", lambda: x.amax())):
        t = timer.measure(fn, budget_s, scrub=False, max_iters=50)
        if best is None or t.median_us < best.median_us:
            best, method = t, name
    return {"gbps": nbytes / (best.median_us * 1e-6) / 1e9, "bytes": nbytes, "median_us": best.median_us,
            "method": f"{method} over {nbytes / GIB:.3g} GiB float32 (bytes read; best of sum/amax)"}


def gemm_tflops(timer: Timer, n: int, dtype: torch.dtype, budget_s: float = 0.3) -> dict:
    gen = torch.Generator(device=timer.device).manual_seed(0)
    a = torch.randn(n, n, device=timer.device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=timer.device, dtype=dtype, generator=gen)
    t = timer.measure(lambda: torch.matmul(a, b), budget_s, scrub=False, max_iters=50)
    return {"tflops": 2 * n**3 / (t.median_us * 1e-6) / 1e12, "n": n, "dtype": str(dtype).removeprefix("torch."),
            "median_us": t.median_us, "method": f"torch.matmul {n}^3 {str(dtype).removeprefix('torch.')}, random data"}


def measure(timer: Timer, quick: bool = False) -> dict:
    """All three ceilings for the timer's device."""
    if timer.cuda:
        out = {
            "copy": copy_gbs(timer, 2 * GIB),
            "read_stream": read_stream_gbs(timer, 4 * GIB),
            "gemm": gemm_tflops(timer, 8192, torch.bfloat16),
        }
        torch.cuda.empty_cache()
        return out
    return {
        "copy": copy_gbs(timer, 256 << 20, 0.2),
        "read_stream": read_stream_gbs(timer, 512 << 20, 0.2),
        "gemm": gemm_tflops(timer, 1024 if quick else 2048, torch.float32, 0.2),
    }

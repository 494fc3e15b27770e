"""CUDA-event times of a launch with L2 evicted before each call, as the suite times its rows (the trace tools)."""

from __future__ import annotations

from typing import Callable

import torch


def evicted_event_times(run: Callable[[], object], device: torch.device, calls: int = 10,
                        warmup: int = 3) -> tuple[list[float], torch.Tensor]:
    """``warmup`` calls of ``run``, then ``calls`` timed ones (microseconds), each after a read of 4x L2; returns the
    times and the buffer whose ``sum()`` evicts L2 (for the caller's further launches)."""
    for _ in range(warmup):
        run()
    scrub = torch.ones(4 * torch.cuda.get_device_properties(device).L2_cache_size // 4, device=device)
    times = []
    for _ in range(calls):
        scrub.sum()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times, scrub

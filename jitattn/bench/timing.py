"""Timing helpers shared by the benchmark scripts.

``Timer.measure`` is what the suite uses: warm-up, an estimate, then as many
timed calls as fit a time budget (between ``min_iters`` and ``max_iters``);
the result is the median. On CUDA each call is bracketed by CUDA events, and
before each call read-only passes over a buffer four times the L2 size
("scrub") evict what the previous call left in L2 -- every call starts
from DRAM, as a layer does in a real model -- and keep the GPU busy while
the host enqueues the call: enough passes to outlast the call's host-side
work (measured once per callable), so all of its launches are queued before
the start event and run back to back. The result is device time, as a
CUDA-graph replay would see it; ``plain_launch_us`` measures the same call
launched eagerly back to back (host cost included), and host overhead alone
is ``host_us``. A read (not a write) is used
so that no dirty lines are written back during the timed call. On the cpu
target each call is timed with ``time.perf_counter``.

``events_median_us`` / ``graphed`` are the plain helpers of the per-kernel
scripts (``decode_cuda``, ``prefill_cuda``).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Timing:
    median_us: float
    iters: int
    p20_us: float
    p80_us: float

    def to_dict(self) -> dict:
        return {"median_us": self.median_us, "iters": self.iters, "p20_us": self.p20_us, "p80_us": self.p80_us}


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _summary(times_us: list[float]) -> Timing:
    return Timing(statistics.median(times_us), len(times_us), _quantile(times_us, 0.2), _quantile(times_us, 0.8))


class Timer:
    """Median time of a callable on one device (see the module docstring)."""

    def __init__(self, device: torch.device, scrub_bytes: int = 0) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self._scrub: torch.Tensor | None = None
        self._scrub_us: float | None = None
        if self.cuda and scrub_bytes > 0:
            self._scrub = torch.ones(scrub_bytes // 4, dtype=torch.float32, device=device)

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def scrub(self, passes: int = 1) -> None:
        if self._scrub is not None:
            for _ in range(passes):
                self._scrub.sum()

    def scrub_us(self) -> float:
        """Device time of one scrub pass (measured once)."""
        if self._scrub_us is None:
            self.scrub()
            self.sync()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.scrub(5)
            end.record()
            self.sync()
            self._scrub_us = max(start.elapsed_time(end) * 1e3 / 5, 1.0)
        return self._scrub_us

    def scrub_passes(self, fn: Callable[[], object]) -> int:
        """Scrub passes that keep the GPU busy for longer than ``fn``'s host-side work (launches included)."""
        self.sync()
        started = time.perf_counter()
        fn()
        host_us = (time.perf_counter() - started) * 1e6
        self.sync()
        return int(min(20, max(1, math.ceil((1.5 * host_us + 20.0) / self.scrub_us()))))

    def measure(self, fn: Callable[[], object], budget_s: float = 0.5, *, min_iters: int = 3,
                max_iters: int = 200, warmup: int = 2, scrub: bool = True) -> Timing:
        use_scrub = scrub and self._scrub is not None
        for _ in range(warmup):
            fn()
        passes = self.scrub_passes(fn) if use_scrub else 0
        self.sync()
        started = time.perf_counter()
        self.scrub(passes)
        fn()
        self.sync()
        per_call = max(time.perf_counter() - started, 1e-7)
        iters = int(max(min_iters, min(max_iters, budget_s / per_call)))
        if not self.cuda:
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
            return _summary(times)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
        for i in range(iters):
            self.scrub(passes)
            starts[i].record()
            fn()
            ends[i].record()
        self.sync()
        return _summary([s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends)])

    def plain_launch_us(self, fn: Callable[[], object], calls: int = 50, rounds: int = 5) -> float:
        """Wall time per call of ``calls`` back-to-back calls, synchronised only at the end (median of rounds).

        No scrub and no CUDA graph: the per-call cost of a serving loop that launches eagerly, host
        work included (the larger of host and device time per call; L2 stays warm between calls).
        """
        for _ in range(3):
            fn()
        self.sync()
        samples = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            self.sync()
            samples.append((time.perf_counter() - t0) / calls * 1e6)
        return statistics.median(samples)

    def host_us(self, fn: Callable[[], object], budget_s: float = 0.3, max_iters: int = 5000) -> Timing:
        """Host (wall) time per call without synchronising in between: the call's host-side cost."""
        for _ in range(20):
            fn()
        self.sync()
        times: list[float] = []
        deadline = time.perf_counter() + budget_s
        while len(times) < max_iters and (len(times) < 20 or time.perf_counter() < deadline):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
        self.sync()
        return _summary(times)


def events_median_us(fn: Callable[[], object], iters: int = 100, warmup: int = 10, sync_each: bool = False) -> float:
    """Median microseconds of ``fn`` by CUDA events around each call (no L2 scrub).

    Calls run back to back, or one at a time when ``sync_each`` (each then includes its launch latency).
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn()
        ends[i].record()
        if sync_each:
            ends[i].synchronize()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1e3


def graphed(fn: Callable[[], object]) -> Callable[[], None]:
    """``fn`` captured in a CUDA graph; returns the replay callable (the first call builds/loads)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return graph.replay

"""The ops suite's mixed cases (POD, BatchAttention) against the prefill part's grid cap
(``jitattn.runtime.side_by_side``): each case's parts alone, then the one call with the cap the estimate picks
and with fixed caps. Timed as the suite times (``jitattn.bench.timing.Timer``: CUDA events, L2 evicted).

    python3 tools/sweep_side_by_side.py OUT.json
    python3 tools/sweep_side_by_side.py --trace [CALLS]

``--trace`` instead launches each case's one call CALLS times back to back (default 4; no scrub, no sync in
between: a plain launch loop) under torch.profiler (with Python stacks) and prints every kernel's stream, start
and end (us from the first kernel's start), each call's host time and the host events of the second call:
whether the two parts overlap on the GPU, whether the host keeps ahead of it, and where the host time goes;
then cProfile's table of 200 more calls.
"""

from __future__ import annotations

import json
import sys

import torch

import jitattn
from jitattn.bench import ops_mixed
from jitattn.bench.ops_cases import MIXED_CASES
from jitattn.bench.timing import Timer
from jitattn.runtime import side_by_side as sbs

CAPS = [132, 116, 100, 88, 76, 66, 56, 48, 40, 32, 24]


def main(out: str) -> None:
    device = torch.device("cuda")
    timer = Timer(device)
    estimate = sbs.prefill_sms
    results = {}
    for case in MIXED_CASES:
        data = ops_mixed.make_mixed_data(case, device)
        prefill = timer.measure(ops_mixed.prefill_call(jitattn, case, data, device)).median_us
        decode = timer.measure(ops_mixed.decode_call(jitattn, case, data, device)).median_us
        print(f"{case.name} prefill alone {prefill:.1f} decode alone {decode:.1f} sum {prefill + decode:.1f}",
              flush=True)
        row = {"prefill": prefill, "decode": decode}
        for cap in [None, *CAPS]:
            picked: list[int] = []
            sbs.prefill_sms = ((lambda f, b, s: picked.append(estimate(f, b, s)) or picked[-1]) if cap is None
                               else (lambda f, b, s, cap=cap: cap))
            t = timer.measure(ops_mixed.mixed_call(jitattn, case, data, device)).median_us
            name = f"estimate ({', '.join(map(str, sorted(set(picked))))})" if cap is None else str(cap)
            print(f"  cap {name}: {t:.1f} us ({(prefill + decode) / t:.3f}x the sum)", flush=True)
            row[name] = t
        sbs.prefill_sms = estimate
        results[case.name] = row
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


def trace(calls: int) -> None:
    from torch.profiler import ProfilerActivity, profile, record_function

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for case in MIXED_CASES:
        case = case if device.type == "cuda" else case.small()
        data = ops_mixed.make_mixed_data(case, device)
        fn = ops_mixed.mixed_call(jitattn, case, data, device)
        for _ in range(3):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        with profile(activities=activities, with_stack=True) as prof:
            for i in range(calls):
                with record_function(f"call {i}"):
                    fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
        events = prof.events()
        on_cpu = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
        calls_cpu = sorted((e for e in on_cpu if e.name.startswith("call ")), key=lambda e: e.time_range.start)
        kernels = sorted((e for e in events if e.device_type != torch.autograd.DeviceType.CPU
                          and not e.name.startswith("call ") and e.time_range.elapsed_us() > 0),
                         key=lambda e: e.time_range.start)
        t0 = kernels[0].time_range.start if kernels else 0
        print(f"{case.name}: {calls} calls back to back; host us per call "
              f"{[round(e.time_range.elapsed_us(), 1) for e in calls_cpu]}; GPU span "
              f"{(kernels[-1].time_range.end - t0) if kernels else 0:.1f} us", flush=True)
        for e in kernels:
            print(f"  stream {getattr(e, 'device_resource_id', '?'):>4} {e.time_range.start - t0:9.1f} "
                  f"{e.time_range.end - t0:9.1f} ({e.time_range.elapsed_us():7.1f})  {e.name[:70]}", flush=True)
        if len(calls_cpu) > 1:  # the host's calls inside the second call: where its time goes
            last = calls_cpu[1].time_range
            print("  host events of the second call (us from its start, duration; Python functions and runtime calls):",
                  flush=True)
            for e in sorted(on_cpu, key=lambda e: e.time_range.start):
                r = e.time_range
                if e.name.startswith("call ") or r.start < last.start or r.end > last.end or r.elapsed_us() < 3:
                    continue
                print(f"    {r.start - last.start:8.1f} {r.elapsed_us():8.1f}  {e.name[-80:]}", flush=True)
        host_profile(fn, device)


def host_profile(fn, device: torch.device, calls: int = 200) -> None:
    """cProfile of ``calls`` back-to-back calls (synchronised at the end only): the host functions by
    cumulative time."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"  cProfile of {calls} calls (seconds in all):", flush=True)
    pstats.Stats(profiler, stream=sys.stdout).sort_stats("cumulative").print_stats(30)


if __name__ == "__main__":
    if sys.argv[1] == "--trace":
        trace(int(sys.argv[2]) if len(sys.argv) > 2 else 4)
    else:
        main(sys.argv[1])

"""Where a serving engine's decode step spends its time: host planning against the whole step, cascade against flat.

    python3 tools/profile_serving.py [--device cuda] [--model llama-3-8b-shapes] [--prefix 16384] [--requests 128]
        [--steps 8] [--branches N --branch-len L] [--own 64] [--graphs] [--no-profile] [--profile-prefill]

Builds ``jitattn.serving.Engine`` on random weights, admits ``--requests`` requests over one shared prefix of
``--prefix`` tokens (then, with ``--branches``, one of N branch blocks; ``--own`` tokens of their own each), runs
every prefill, then for each path (the engine's decode-path
choice forced to ``cascade``, then ``flat``; CUDA graphs off unless ``--graphs``) times ``--steps`` decode steps (each synchronised,
wall time) and the planner's ``decode_step`` inside them (host time), then ``--steps`` more back to back (the
engine's steady state: with overlap, each step's host work under the GPU work of the one before), and on cuda prints torch.profiler's tables
of one more step (sorted by CUDA time, then by CPU time): the GPU work against the host work.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import serve  # noqa: E402

from jitattn.serving import Engine, LlamaModel, preset  # noqa: E402


def _engine(model, work, requests: int, path: str, graphs: bool, profile_prefill: bool = False) -> Engine:
    longest = max(len(p) + n for _, p, n in work)
    pages = -(-longest // 16)
    engine = Engine(model, num_pages=pages * 4 + requests * 8 + 64, page_size=16, max_batch_size=requests,
                    cascade=True, cuda_graphs=graphs, max_seq_len=longest + 64)
    engine.decode_paths.choose = lambda bucket, estimate=None: path  # forced: the path under test on every step
    for _, prompt, n in work:
        engine.add_request(prompt, n + 64)
    prefill_s, profiled = [], not profile_prefill
    while engine.waiting or engine.prefilling:
        if not profiled and len(engine.prefilling) > 1:  # the first step prefilling several requests' own tokens
            profiled = True
            _profile_step(engine)
            continue
        t = time.perf_counter()
        engine.step()
        _sync(engine)
        prefill_s.append(time.perf_counter() - t)
    if profile_prefill:
        print(f"prefill phase: {len(prefill_s)} steps, ms {[round(s * 1e3, 1) for s in prefill_s]}", flush=True)
    return engine


def _sync(engine: Engine) -> None:
    if engine.model.device.type == "cuda":
        torch.cuda.synchronize()


def _profile_step(engine: Engine) -> None:
    """torch.profiler's tables of one engine step (by CUDA time, then by CPU time); cuda only."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        engine.step()
        _sync(engine)
    for key in ("cuda_time_total", "cpu_time_total"):
        print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=70), flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--model", help="a serving preset (default: llama-3-8b-shapes on cuda, tiny on the cpu, where the "
                    "8B shapes' float32 weights need ~32 GB)")
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--requests", type=int, default=128)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--branches", type=int, default=0, help="a prefix tree: the prefix, then one of N branch blocks")
    ap.add_argument("--branch-len", type=int, default=0, help="tokens of each branch block")
    ap.add_argument("--own", type=int, default=64, help="each request's own prompt tokens")
    ap.add_argument("--graphs", action="store_true", help="replay captured decode steps (cuda)")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--profile-prefill", action="store_true", help="time the prefill phase's steps and profile the "
                    "first step that prefills several requests (cascade path only)")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.requests < 1 or args.prefix < 0:
        ap.error("--steps and --requests must be >= 1, --prefix >= 0")
    cuda = args.device == "cuda"
    args.model = args.model or ("llama-3-8b-shapes" if cuda else "tiny")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    config = preset(args.model)
    model = LlamaModel.random(config, seed=0, dtype=torch.bfloat16 if cuda else torch.float32, device=args.device)
    work = serve.workload(serve.parse_args([
        "--num-requests", str(args.requests), "--system-prompt-len", str(args.prefix), "--prompt-len-range",
        str(args.own), str(args.own), "--output-len", "64", "--max-batch-size", str(args.requests),
        "--branches", str(args.branches), "--branch-len", str(args.branch_len)]), config.vocab_size)
    for path in ("cascade", "flat"):
        engine = _engine(model, work, args.requests, path, args.graphs,
                         args.profile_prefill and cuda and path == "cascade")
        plan_s, real = [], engine.planner.decode_step

        def timed(*a, **k):
            sync()
            t = time.perf_counter()
            result = real(*a, **k)
            sync()
            plan_s.append(time.perf_counter() - t)
            return result

        engine.planner.decode_step = timed
        step_s = []
        for _ in range(args.steps):
            sync()
            t = time.perf_counter()
            engine.step()
            sync()
            step_s.append(time.perf_counter() - t)
        engine.planner.decode_step = real
        t = time.perf_counter()  # back to back: with overlap, a step's host work runs under the step before it
        for _ in range(args.steps):
            engine.step()
        sync()
        back_to_back = (time.perf_counter() - t) / args.steps
        tree = f" + {args.branches} branches of {args.branch_len}" if args.branches else ""
        print(f"{args.model} {args.requests} x ({args.prefix}{tree} + {args.own}), {path}: step ms (each synchronised) "
              f"{[round(s * 1e3, 2) for s in step_s]}; of which decode_step (host) ms "
              f"{[round(s * 1e3, 2) for s in plan_s]}; back to back {back_to_back * 1e3:.2f} ms per step "
              f"(overlap {engine.overlap}); levels {engine.planner.last_decode_levels}", flush=True)
        if cuda and not args.no_profile:
            _profile_step(engine)
        del engine


if __name__ == "__main__":
    main()

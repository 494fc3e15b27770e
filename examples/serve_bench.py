"""Run examples/serve.py's workloads with cascade on/off and CUDA graphs on/off; write one markdown table.

    python3 examples/serve_bench.py --device cuda --model llama-3-8b-shapes --preset all \\
        --out docs/benchmarks/serving_h200.md
    python3 examples/serve_bench.py --device cuda --model llama-3-8b-shapes --num-requests 64 \\
        --system-prompt-len 2048 --output-len 64 --out serving.md       # one workload of your own

Presets (the workloads a user of prefix caching has): ``system-2k`` (64 requests over a 2,048-token system
prompt), ``system-16k`` (128 requests over 16,384 shared tokens + 64 own, 32 out: the prefix no longer fits
in L2), ``agent-fork`` (128 requests in a three-level tree: an 8,192-token root shared by all, 4 branches of
2,048 shared by 32 each, own tails of 64-256), ``no-sharing`` (64 random prompts of 512-4,096: cascade has
nothing to share); ``all`` runs the four. Every other flag goes to serve.py unchanged. Each workload first
runs twice untimed (cascade on, then off) to load the kernels.

The roofline column: the decode steps' time cannot be below max(bytes / read-stream bandwidth, FLOPs / GEMM
rate) over the run's decode steps, where bytes = the weights once per step + the KV the chosen path read
(a cascade reads a shared node's pages once, flat decode every request's whole history) and FLOPs = 2 x
weights' parameters per decoded token; both ceilings are measured in the same run (``jitattn.bench``).
The column is that bound over the measured decode time (1.0 = at the roofline).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402

PRESETS = {
    "system-2k": ["--num-requests", "64", "--system-prompt-len", "2048", "--prompt-len", "64", "--output-len", "64"],
    "system-16k": ["--num-requests", "128", "--max-batch-size", "128", "--system-prompt-len", "16384",
                   "--prompt-len-range", "64", "64", "--output-len", "32"],
    "agent-fork": ["--num-requests", "128", "--max-batch-size", "128", "--system-prompt-len", "8192", "--branches", "4",
                   "--branch-len", "2048", "--prompt-len-range", "64", "256", "--output-len", "32"],
    "no-sharing": ["--num-requests", "64", "--system-prompt-len", "0", "--prompt-len-range", "512", "4096",
                   "--output-len", "64"],
}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"  # no request produced a second token: no TPOT


def ceilings(device: str) -> dict | None:
    """Read-stream GB/s and GEMM TFLOP/s measured now on ``device`` (cuda only; None on the cpu)."""
    if not device.startswith("cuda"):
        return None
    import torch

    from jitattn.bench.ceilings import GIB, gemm_tflops, read_stream_gbs
    from jitattn.bench.timing import Timer

    timer = Timer(torch.device(device))
    return {"read_gbps": read_stream_gbs(timer, 4 * GIB)["gbps"],
            "gemm_tflops": gemm_tflops(timer, 8192, torch.bfloat16)["tflops"]}


def roofline_fraction(row: dict, peaks: dict | None) -> float | None:
    """The decode steps' roofline time over their measured time (see the module docstring)."""
    if peaks is None or not row["decode_s"]:
        return None
    element = 2 if row["dtype"] in ("bfloat16", "float16") else 4
    nbytes = row["decode_steps"] * row["weight_bytes"] + row["decode_kv_tokens"] * row["kv_bytes_per_token"]
    flops = 2 * (row["weight_bytes"] // element) * row["decode_tokens"]
    ideal = max(nbytes / (peaks["read_gbps"] * 1e9), flops / (peaks["gemm_tflops"] * 1e12))
    return ideal / row["decode_s"]


def run_workload(rest: list[str], on_cuda: bool) -> list[dict]:
    variants = [("--cascade",), ("--no-cascade",)]
    if on_cuda:
        variants += [("--cascade", "--graphs"), ("--no-cascade", "--graphs")]
    # Warm-up over the whole workload, cascade on and off: every kernel loaded and every GEMM shape of the
    # run seen once (a short warm-up left the first timed row paying for both), nothing recorded.
    warm = serve.main(rest + ["--cascade"])
    serve.main(rest + ["--no-cascade"])
    if warm["device"].startswith("cuda") and not on_cuda:  # --device auto found a GPU: time the graphs too
        variants += [("--cascade", "--graphs"), ("--no-cascade", "--graphs")]
    return [serve.main(rest + list(flags)) for flags in variants]


def table(workloads: list[tuple[str, list[dict]]], peaks: dict | None, command: str) -> list[str]:
    first = workloads[0][1][0]
    lines = [
        f"# Serving engine: {first['model']} ({first['layers']} layers, {first['dtype']}) on {first['device']}",
        "",
        f"`python3 examples/serve_bench.py {command}` (each workload: two untimed warm-up runs, cascade on and off).",
        "Tokens/s counts output tokens over the wall time of the whole run (prefill included); the ratio beside it "
        "is cascade on / off with the same graphs setting.",
        "Timing: host wall clock (time.perf_counter) around the whole run, synchronised at its end; every step "
        "reads its greedy tokens back to the host (int(argmax)), so host cost is in every figure. Graphs off: "
        "every step launches eagerly (a cascade step has a level per level of the batch's prefix tree). Graphs "
        "on: a decode step replays the CUDA graph of its batch-size bucket (flat, or a cascade of the tree's "
        "levels padded to fixed node counts: any shape is captured), prefill chunks launch eagerly, and with cascade "
        "on a step of shared prefixes takes whichever path (flat, cascade) the engine has timed faster for its "
        "bucket. Roofline: the decode steps' byte / FLOP floor over their measured time"
        + (f" (read-stream {peaks['read_gbps']:.0f} GB/s, bf16 GEMM {peaks['gemm_tflops']:.0f} TFLOP/s, measured in "
           "this run)." if peaks else " (cuda only)."),
        "",
        "| workload | cascade | graphs | output tok/s | on / off | TTFT mean ms | TPOT mean ms | decode steps "
        "(cascade / graph) | deepest cascade | decode roofline | KV pool pages | KV saved at peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rows in workloads:
        off = {r["graphs"]: r["output_tokens_per_s"] for r in rows if not r["cascade"]}
        for r in rows:
            ratio = f"{r['output_tokens_per_s'] / off[r['graphs']]:.2f}x" if r["cascade"] and off.get(r["graphs"]) else ""
            roof = roofline_fraction(r, peaks)
            lines.append(
                f"| {name} | {'on' if r['cascade'] else 'off'} | {'on' if r['graphs'] else 'off'} "
                f"| {r['output_tokens_per_s']:.1f} | {ratio} | {r['ttft_mean_ms']:.1f} | {_ms(r['tpot_mean_ms'])} "
                f"| {r['decode_steps']} ({r['cascade_steps']} / {r['graph_steps']}) | {r['max_cascade_levels']} "
                f"| {'n/a' if roof is None else f'{roof:.2f}'} | {r['kv_pool_pages']} "
                f"| {r['kv_bytes_saved_peak'] / 2**20:.1f} MiB |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="markdown file to write")
    parser.add_argument("--preset", choices=[*PRESETS, "all"], help="a workload (its serve.py flags come first; "
                        "flags given here override them)")
    args, rest = parser.parse_known_args(argv)
    names = list(PRESETS) if args.preset == "all" else [args.preset] if args.preset else [None]
    on_cuda = "cuda" in " ".join(rest)
    workloads = [(name or "custom", run_workload(PRESETS.get(name, []) + rest, on_cuda)) for name in names]
    peaks = ceilings(workloads[0][1][0]["device"])
    command = " ".join((["--preset", args.preset] if args.preset else []) + rest)
    lines = table(workloads, peaks, command)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

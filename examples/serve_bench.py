"""Run examples/serve.py's workload with cascade on/off and CUDA graphs on/off; write a markdown table.

    python3 examples/serve_bench.py --device cuda --model llama-3-8b-shapes --num-requests 64 \\
        --system-prompt-len 2048 --output-len 64 --out docs/benchmarks/serving_h200.md

Every other flag goes to serve.py unchanged. Two untimed warm-up runs of the same workload (cascade on,
then off) first load the kernels.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import serve  # noqa: E402


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"  # no request produced a second token: no TPOT


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="markdown file to write")
    args, rest = parser.parse_known_args()
    on_cuda = "cuda" in " ".join(rest)
    variants = [("--cascade",), ("--no-cascade",)]
    if on_cuda:
        variants += [("--cascade", "--graphs"), ("--no-cascade", "--graphs")]
    # Warm-up over the whole workload, cascade on and off: every kernel loaded and every GEMM shape of the
    # run seen once (a short warm-up left the first timed row paying for both), nothing recorded.
    warm = serve.main(rest + ["--cascade"])
    serve.main(rest + ["--no-cascade"])
    if warm["device"].startswith("cuda") and not on_cuda:  # --device auto found a GPU: time the graphs too
        variants += [("--cascade", "--graphs"), ("--no-cascade", "--graphs")]
    rows = [serve.main(rest + list(flags)) for flags in variants]
    first = rows[0]
    lines = [
        f"# Serving engine: {first['model']} ({first['layers']} layers, {first['dtype']}) on {first['device']}",
        "",
        f"`python3 examples/serve_bench.py {' '.join(rest)}` ({first['requests']} requests; two untimed warm-up runs "
        "of the same workload, cascade on and off).",
        "Tokens/s counts output tokens over the wall time of the whole run (prefill included).",
        "Timing: host wall clock (time.perf_counter) around the whole run, synchronised at its end; every step "
        "reads its greedy tokens back to the host (int(argmax)), so host cost is in every figure. Graphs off: "
        "every step launches eagerly. Graphs on: a decode step replays the CUDA graph of its batch-size bucket "
        "(flat, or cascade up to 8 prefix groups; more groups launch eagerly), prefill chunks launch eagerly, and "
        "with cascade on a step of shared prefixes takes whichever path (flat, cascade) the engine has timed "
        "faster for its bucket (each is tried after a capture and a warm-up step). Each step plans once from "
        "host page-table arrays.",
        "",
        "| cascade | graphs | output tok/s | TTFT mean ms | TTFT p99 ms | TPOT mean ms | decode steps (cascade / graph) "
        "| prompt tokens reused | KV saved at peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {'on' if r['cascade'] else 'off'} | {'on' if r['graphs'] else 'off'} | {r['output_tokens_per_s']:.1f} "
            f"| {r['ttft_mean_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {_ms(r['tpot_mean_ms'])} "
            f"| {r['decode_steps']} ({r['cascade_steps']} / {r['graph_steps']}) | {r['prompt_tokens_reused']} "
            f"| {r['kv_bytes_saved_peak'] / 2**20:.1f} MiB |")
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

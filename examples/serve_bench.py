"""Run examples/serve.py's workloads with cascade on/off and CUDA graphs on/off; write one markdown table.

    python3 examples/serve_bench.py --device cuda --model llama-3-8b-shapes --preset all \\
        --out docs/benchmarks/serving_h200.md
    python3 examples/serve_bench.py --device cuda --model llama-3-8b-shapes --num-requests 64 \\
        --system-prompt-len 2048 --output-len 64 --out serving.md       # one workload of your own

Presets (the workloads a user of prefix caching has): ``system-2k`` (64 requests over a 2,048-token system
prompt), ``system-16k`` (128 requests over 16,384 shared tokens + 64 own, 32 out: the prefix no longer fits
in L2), ``agent-fork`` (128 requests in a three-level tree: an 8,192-token root shared by all, 4 branches of
2,048 shared by 32 each, own tails of 64-256), ``no-sharing`` (64 random prompts of 512-4,096: cascade has
nothing to share), ``agent-fork-wide`` (128 requests under a 32,768-token root and 32 branches of 512 shared by 4
each, own tails of 64-256: the tree whose levels save the root's re-reads); ``all`` runs the five. Every other
flag goes to serve.py unchanged. Each workload first runs twice untimed (cascade on, then off) to load the kernels.

``--sweep-prefix 1024,2048,...`` (with ``--sweep-requests 64,128``) instead times one workload per shared-prefix
length and request count (64 own tokens, 32 out), cascade on and off, and writes the decode step time against the
prefix length (and, with ``--plot FILE.png`` and matplotlib, the plot, roofline dashed).

``--repeat N`` makes every row the median of N runs, made interleaved, with their min-max beside it: one run's
decode step varies by up to a quarter between identical runs on a shared machine, more than the cascade on / off
differences a short-prefix workload is judged by.

The roofline column: the decode steps' time cannot be below max(bytes / read-stream bandwidth, FLOPs / GEMM
rate) over the run's decode steps, where bytes = the weights once per step + the KV the chosen path read
(a cascade reads a shared node's pages once, flat decode every request's whole history) and FLOPs = 2 x
weights' parameters per decoded token + the attention's 4 x query heads x head_dim x layers per (query, key) pair
(each decoded token against its whole context, either path); both ceilings are measured in the same run
(``jitattn.bench``).
The column is that bound over the measured decode time (1.0 = at the roofline).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Callable

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
    "agent-fork-wide": ["--num-requests", "128", "--max-batch-size", "128", "--system-prompt-len", "32768",
                        "--branches", "32", "--branch-len", "512", "--prompt-len-range", "64", "256",
                        "--output-len", "32"],
}


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"  # no request produced a second token: no TPOT


def _spread(bounds: tuple[float, float] | None, digits: int) -> str:
    """The runs' min-max of a repeated row, in brackets; nothing for a single run."""
    return "" if bounds is None or bounds[0] == bounds[1] else f" ({bounds[0]:.{digits}f}-{bounds[1]:.{digits}f})"


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
    flops += row.get("decode_pairs", 0) * row.get("attention_flops_per_pair", 0)  # rows of older runs lack them
    ideal = max(nbytes / (peaks["read_gbps"] * 1e9), flops / (peaks["gemm_tflops"] * 1e12))
    return ideal / row["decode_s"]


# Runs a preset adds to the cascade on / off pair (whose cascade takes the tree's cheapest cut on cuda): the forks'
# trees as a two-level cascade (one node per branch, the root read once per branch), agent-fork's as every level too.
PRESET_VARIANTS = {"agent-fork": [("--cascade", "--cascade-depth", "1"), ("--cascade", "--cascade-depth", "6")],
                   "agent-fork-wide": [("--cascade", "--cascade-depth", "1")]}


# flags of serve.py that set the same thing: a preset's one gives way to the other given on the command line
ALTERNATIVES = {"--prompt-len": "--prompt-len-range", "--prompt-len-range": "--prompt-len"}


def with_overrides(preset: list[str], rest: list[str]) -> list[str]:
    """A preset's flags (options each followed by their values) less those ``rest`` gives, or their alternative
    (``--prompt-len`` for ``--prompt-len-range``), then ``rest``."""
    given = {flag.split("=", 1)[0] for flag in rest if flag.startswith("--")}
    given |= {ALTERNATIVES[flag] for flag in given if flag in ALTERNATIVES}
    kept, keep = [], True
    for token in preset:
        if token.startswith("--"):
            keep = token not in given
        if keep:
            kept.append(token)
    return kept + rest


def run_workload(rest: list[str], on_cuda: bool, graphs_only: bool = False,
                 extra: list[tuple[str, ...]] = (), repeat: int = 1) -> list[dict]:
    """The workload's runs, cascade on and off, graphs off and (on cuda) on; ``graphs_only``: graphs on only,
    after one warm-up run each side (the kernels come from a pre-warmed cache: loading them is cheap). With
    ``repeat`` > 1 every run is made that many times, interleaved (on, off, on, off, ...: drift of the machine
    falls on both sides alike), and each row is their median (``median_run``)."""
    graph_rows = [("--cascade", "--graphs"), *[(*v, "--graphs") for v in extra], ("--no-cascade", "--graphs")]
    if graphs_only:  # a warm-up run each side: a first graph replay of the process costs more than the rest
        serve.main(rest + ["--cascade", "--graphs"])
        serve.main(rest + ["--no-cascade", "--graphs"])
        variants = graph_rows
    else:
        variants = [("--cascade",), *extra, ("--no-cascade",)]
        if on_cuda:
            variants += graph_rows
        # Warm-up over the whole workload, cascade on and off (and with graphs, when graphs rows are timed): every
        # kernel loaded, every GEMM shape of the run seen once and the process's first graph replays made, nothing
        # recorded. (A short warm-up left the first timed row paying for loads. Without the graphs warm-up, the
        # first graphs row of system-2k, cascade on, ran at 0.89x the cascade-off row with no cascade step at all,
        # while the sweep, warmed up with graphs, measured 1.00x where both sides ran the same flat graphs.)
        warm = serve.main(rest + ["--cascade"])
        serve.main(rest + ["--no-cascade"])
        if warm["device"].startswith("cuda") and not on_cuda:  # --device auto found a GPU: time the graphs too
            variants += graph_rows
        if graph_rows[0] in variants:
            serve.main(rest + ["--cascade", "--graphs"])
            serve.main(rest + ["--no-cascade", "--graphs"])
    runs: list[list[dict]] = [[] for _ in variants]
    for _ in range(repeat):
        for i, flags in enumerate(variants):
            runs[i].append(serve.main(rest + list(flags)))
    return [median_run(r) for r in runs]


def _step_s(row: dict) -> float:
    return row["decode_s"] / row["decode_steps"] if row["decode_steps"] else float("inf")


def median_run(runs: list[dict]) -> dict:
    """One row for repeated runs of one configuration: the run of the median decode step time (the lower middle
    one of an even count), its tokens/s replaced by their median over the runs (the two may come from different
    runs), with ``repeats`` and the decode step's and the tokens/s' (min, max) over the runs (``step_ms_range``,
    ``tok_s_range``)."""
    by_step = sorted(runs, key=_step_s)
    row = dict(by_step[(len(runs) - 1) // 2])
    rates = sorted(r["output_tokens_per_s"] for r in runs)
    row["output_tokens_per_s"] = rates[(len(rates) - 1) // 2]
    steps = [1e3 * _step_s(r) for r in by_step if r["decode_steps"]]
    row.update(repeats=len(runs), tok_s_range=(rates[0], rates[-1]),
               step_ms_range=(steps[0], steps[-1]) if steps else None)
    return row


def table(workloads: list[tuple[str, list[dict]]], peaks: dict | None, command: str) -> list[str]:
    first = workloads[0][1][0]
    repeats = first.get("repeats", 1)
    lines = [
        f"# Serving engine: {first['model']} ({first['layers']} layers, {first['dtype']}) on {first['device']}",
        "",
        f"`python3 examples/serve_bench.py {command}` (each workload: untimed warm-up runs, cascade on and off, "
        "and with graphs too when graphs rows are timed).",
        "Tokens/s counts output tokens over the wall time of the whole run (prefill included); the ratio beside it "
        "is cascade on / off with the same graphs setting.",
        "Timing: host wall clock (time.perf_counter) around the whole run, synchronised at its end; every decode "
        "step's greedy tokens reach the host (on cuda one step late: the engine launches the next step first, "
        "so a step's host work overlaps the GPU work of the one before), so host cost is in every figure. Graphs "
        "off: every step launches eagerly (a cascade step has a level per level of the batch's prefix tree). "
        "Graphs on: every bucket's flat and one- and two-level cascade graphs are captured before the timed run "
        "(Engine.capture_graphs, as at a server's startup; other shapes capture on first use); a decode step "
        "replays the graph of its batch-size bucket (flat, or a cascade of the tree's levels padded to fixed node "
        "counts), prefill chunks launch eagerly. With cascade on, a step of shared prefixes takes the cascade "
        "path when its bytes (and the shared levels' FLOPs) say it does under half the flat step's work, the flat "
        "path (on cuda) when they say cascade saves at most a tenth (re-reads L2 serves counted at a fraction of "
        "a DRAM byte), else whichever path the engine has timed faster for its bucket. Roofline: the decode "
        "steps' byte / FLOP floor over their measured time"
        + (f" (read-stream {peaks['read_gbps']:.0f} GB/s, bf16 GEMM {peaks['gemm_tflops']:.0f} TFLOP/s, measured in "
           "this run)." if peaks else " (cuda only)."),
        "",
        "Decode step ms: the decode steps' wall time over their count (a step's time runs from its launch, or "
        "from the step before's tokens on the host when it was launched under that step, to its own tokens on "
        "the host); its on / off ratio is the decode speed-up cascade gives, "
        "which the whole-run tokens/s dilutes with prefill time."
        + (f" Each row: the median of {repeats} runs made interleaved (every row's first run, then every row's "
           "second, ...), the runs' min-max in brackets; the ratios are of medians." if repeats > 1 else
           " Each row: one run (`--repeat N` makes every row the median of N)."),
        "",
        "| workload | cascade | graphs | output tok/s | on / off | TTFT mean ms | TPOT mean ms | decode step ms "
        "| decode on / off | decode steps (cascade / graph) | deepest cascade | decode roofline | KV pool pages "
        "| KV saved at peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, rows in workloads:
        off = {r["graphs"]: r["output_tokens_per_s"] for r in rows if not r["cascade"]}
        off_step = {r["graphs"]: step_ms(r, peaks)[0] for r in rows if not r["cascade"]}
        for r in rows:
            ratio = f"{r['output_tokens_per_s'] / off[r['graphs']]:.2f}x" if r["cascade"] and off.get(r["graphs"]) else ""
            step = step_ms(r, peaks)[0]
            speedup = f"{off_step[r['graphs']] / step:.2f}x" if r["cascade"] and step and off_step.get(r["graphs"]) else ""
            roof = roofline_fraction(r, peaks)
            cascade = "off" if not r["cascade"] else ("on" if not r.get("cascade_depth") else
                                                       f"on, {r['cascade_depth'] + 1} levels at most")
            lines.append(
                f"| {name} | {cascade} | {'on' if r['graphs'] else 'off'} "
                f"| {r['output_tokens_per_s']:.1f}{_spread(r.get('tok_s_range'), 1)} | {ratio} "
                f"| {r['ttft_mean_ms']:.1f} | {_ms(r['tpot_mean_ms'])} "
                f"| {_ms(step)}{_spread(r.get('step_ms_range'), 2)} | {speedup} "
                f"| {r['decode_steps']} ({r['cascade_steps']} / {r['graph_steps']}) | {r['max_cascade_levels']} "
                f"| {'n/a' if roof is None else f'{roof:.2f}'} | {r['kv_pool_pages']} "
                f"| {r['kv_bytes_saved_peak'] / 2**20:.1f} MiB |")
    return lines


def step_ms(row: dict, peaks: dict | None) -> tuple[float | None, float | None]:
    """(measured, roofline) milliseconds per decode step of a run (None where there is none)."""
    if not row["decode_steps"]:
        return None, None
    measured = 1e3 * row["decode_s"] / row["decode_steps"]
    fraction = roofline_fraction(row, peaks)
    return measured, (None if fraction is None else measured * fraction)


def sweep(prefixes: list[int], request_counts: list[int], rest: list[str], on_cuda: bool,
          plot_path: str | None, graphs_only: bool = False, repeat: int = 1,
          on_row: Callable[[list[str]], None] = lambda lines: None) -> list[str]:
    """Decode step time against the shared prefix's length, cascade on and off (see the module docstring).
    ``on_row`` gets the table so far after each point (a long sweep that is cut short keeps its rows)."""
    lines = ["| requests | shared prefix | cascade | graphs | decode step ms | roofline ms | on / off |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    points: dict[tuple[int, bool, bool], list[tuple[int, float, float | None]]] = {}
    peaks = None
    for requests in request_counts:
        for prefix in prefixes:
            flags = ["--num-requests", str(requests), "--max-batch-size", str(requests), "--system-prompt-len",
                     str(prefix), "--prompt-len-range", "64", "64", "--output-len", "32"]
            rows = run_workload(flags + rest, on_cuda, graphs_only, repeat=repeat)
            peaks = peaks or ceilings(rows[0]["device"])
            off = {r["graphs"]: step_ms(r, peaks)[0] for r in rows if not r["cascade"]}
            for r in rows:
                measured, ideal = step_ms(r, peaks)
                if measured is None:
                    continue
                ratio = f"{off[r['graphs']] / measured:.2f}x" if r["cascade"] and off.get(r["graphs"]) else ""
                lines.append(f"| {requests} | {prefix} | {'on' if r['cascade'] else 'off'} "
                             f"| {'on' if r['graphs'] else 'off'} | {measured:.2f}{_spread(r.get('step_ms_range'), 2)} "
                             f"| {'n/a' if ideal is None else f'{ideal:.2f}'} | {ratio} |")
                points.setdefault((requests, r["cascade"], r["graphs"]), []).append((prefix, measured, ideal))
            on_row(lines)
    if plot_path:
        _plot(points, plot_path)
    return lines


def _plot(points: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install -e '.[plot]'); no plot written")
        return
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (requests, cascade, graphs), series in sorted(points.items()):
        series.sort()
        label = f"{requests} requests, cascade {'on' if cascade else 'off'}{', graphs' if graphs else ''}"
        line, = ax.plot([p for p, _, _ in series], [m for _, m, _ in series], marker="o", label=label)
        ideal = [(p, i) for p, _, i in series if i is not None]
        if ideal:
            ax.plot([p for p, _ in ideal], [i for _, i in ideal], linestyle="--", color=line.get_color(), alpha=0.6)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("shared prefix (tokens)")
    ax.set_ylabel("decode step (ms); dashed: roofline")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


# serve.py flags that each sweep point sets itself (a value passed through would override it, mislabelling the row)
SWEEP_SETS = ("--num-requests", "--max-batch-size", "--system-prompt-len", "--prompt-len-range", "--prompt-len",
              "--output-len")


def check_sweep_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, rest: list[str]) -> None:
    """Refuse, before any run, what the sweep would ignore or mislabel, and a plot it could not write."""
    if not args.sweep_prefix:
        for flag, value in (("--plot", args.plot), ("--sweep-requests", args.sweep_requests)):
            if value is not None:
                parser.error(f"{flag} belongs to the sweep: give --sweep-prefix too (or leave {flag} out)")
        return
    clash = [flag for flag in rest if flag.split("=", 1)[0] in SWEEP_SETS]
    if clash:
        parser.error(f"{clash[0]}: each sweep point sets the request count, batch size, shared prefix, prompt and "
                     "output lengths itself; leave it out")
    if args.plot is not None:
        if problem := serve.unwritable("--plot", args.plot):
            parser.error(problem)
        if importlib.util.find_spec("matplotlib") is None:
            parser.error(f"--plot {args.plot}: matplotlib is not installed (pip install -e '.[plot]')")


def main(argv: list[str] | None = None) -> None:
    # no abbreviations: serve.py's flags pass through, and --graphs must not be read as --graphs-only
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--out", required=True, help="markdown file to write")
    parser.add_argument("--preset", choices=[*PRESETS, "all"], help="a workload (its serve.py flags come first; "
                        "flags given here override them)")
    parser.add_argument("--sweep-prefix", type=serve.ints(1),
                        help="comma-separated shared-prefix lengths: time the decode step against them")
    parser.add_argument("--sweep-requests", type=serve.ints(1),
                        help="request counts of the sweep (default 64,128)")
    parser.add_argument("--plot", help="the sweep's PNG (needs matplotlib)")
    parser.add_argument("--repeat", type=int, default=1, help="runs per row, made interleaved; a row is their "
                        "median with the min-max beside it (default 1)")
    parser.add_argument("--graphs-only", "--sweep-graphs-only", dest="graphs_only", action="store_true",
                        help="time CUDA-graph runs only, after a warm-up run each side (cuda; "
                        "--sweep-graphs-only is the same flag)")
    args, rest = parser.parse_known_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: give at least 1 run per row")
    if problem := serve.unwritable("--out", args.out):  # before the runs, not after them
        parser.error(problem)
    if "--json" in rest or any(flag.startswith("--json=") for flag in rest):
        parser.error("--json is serve.py's file of one run, rewritten by each of the bench's runs; the bench's "
                     "table goes to --out")
    own = [flag for flag in rest if flag.split("=", 1)[0] in ("--cascade", "--no-cascade", "--graphs")]
    if own:  # the bench gives these to each run itself (its rows are cascade on / off, graphs off / on)
        parser.error(f"{own[0]}: the bench sets cascade and graphs per row itself (--graphs-only for graph rows "
                     "alone); leave it out")
    check_sweep_flags(parser, args, rest)
    device = argparse.ArgumentParser(add_help=False)
    device.add_argument("--device", default="auto")
    on_cuda = device.parse_known_args(rest)[0].device == "cuda"  # auto: run_workload asks the first run
    if args.sweep_prefix:
        prefixes, counts = args.sweep_prefix, args.sweep_requests or [64, 128]
        flags = " --graphs-only" if args.graphs_only else ""
        listed = lambda values: ",".join(map(str, values))  # noqa: E731
        lines = [f"# Decode step time against the shared prefix (`python3 examples/serve_bench.py "
                 f"--sweep-prefix {listed(prefixes)} --sweep-requests {listed(counts)}{flags} {' '.join(rest)}`)",
                 "", ("Each row: one run" if args.repeat == 1 else f"Each row: the median of {args.repeat} runs "
                       "(made interleaved, min-max in brackets)") + " of the workload (its decode steps' wall time "
                 "over their count, as in the presets' table), after "
                 + ("two untimed warm-up runs (cascade on and off, graphs on)" if args.graphs_only
                    else "the presets' untimed warm-up runs") + "; roofline as in the presets' table.", ""]
        write = lambda table: Path(args.out).write_text("\n".join(lines + table) + "\n")  # noqa: E731
        lines += sweep(prefixes, counts, rest, on_cuda, args.plot, args.graphs_only, args.repeat, on_row=write)
        Path(args.out).write_text("\n".join(lines) + "\n")
        print("\n".join(lines))
        return
    names = list(PRESETS) if args.preset == "all" else [args.preset] if args.preset else [None]
    workloads = [(name or "custom", run_workload(with_overrides(PRESETS.get(name, []), rest), on_cuda,
                                                 args.graphs_only, PRESET_VARIANTS.get(name, []), args.repeat))
                 for name in names]
    peaks = ceilings(workloads[0][1][0]["device"])
    command = " ".join((["--preset", args.preset] if args.preset else []) +
                       (["--repeat", str(args.repeat)] if args.repeat > 1 else []) +
                       (["--graphs-only"] if args.graphs_only else []) + rest)
    lines = table(workloads, peaks, command)
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    except ValueError as exc:  # a serve.py flag the library refuses: the message, not a traceback
        sys.exit(f"serve_bench.py: {exc}")

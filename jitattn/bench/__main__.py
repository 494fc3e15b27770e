"""``python -m jitattn.bench``: jitattn beside torch SDPA and the hardware ceilings, every config defined.

Examples::

    python -m jitattn.bench                                  # every suite
    python -m jitattn.bench --suite decode --json d.json
    python -m jitattn.bench --only 'decode/llama8b_*,prefill/llama8b_causal_b8_s4096'
    python -m jitattn.bench --quick --json out.json --plot out.png
    python -m jitattn.bench --list
    python -m jitattn.bench --suite decode --baseline docs/benchmarks/h200-2026-12-02-b.json

Without a CUDA device the cpu target runs at small sizes (the JSON says so).
How numbers are produced: ``jitattn/bench/suite.py`` (with ``rows``, ``inputs``, ``sdpa``, ``host``) and ``docs/benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from .configs import SUITES

    ap = argparse.ArgumentParser(prog="python -m jitattn.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", default="all", choices=("all", *SUITES))
    ap.add_argument("--only", default=None, help="comma-separated case names, suites or globs (overrides --quick's "
                                                "selection; a variant brings its plain case)")
    ap.add_argument("--quick", action="store_true", help="a subset with shorter timing (under 2 minutes)")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the results (rewritten after every case)")
    ap.add_argument("--plot", default=None, metavar="FILE.png", help="fraction of ceiling per case (matplotlib)")
    ap.add_argument("--target", default="auto", choices=("auto", "cuda", "cpu"),
                    help="auto: cuda when a GPU is visible, else the cpu target at small sizes")
    ap.add_argument("--jobs", type=int, default=0, help="parallel builds in the pre-build (default min(16, CPUs))")
    ap.add_argument("--no-prebuild", action="store_true", help="skip the parallel pre-build (builds happen lazily)")
    ap.add_argument("--measure-s", type=float, default=0.0,
                    help="timing budget per measurement in seconds (default 0.5 cuda / 0.3 cpu; --quick 0.3 / 0.1)")
    ap.add_argument("--case-budget", type=float, default=0.0,
                    help="seconds per case; a case past it skips its remaining stages (default 45)")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="seconds for the whole run; cases after it are listed as skipped (default 210, --quick 100)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--peer", action="append", choices=("flashinfer",), default=[],
                    help="also time a peer library on the same data (skipped per row when it is not installed)")
    ap.add_argument("--no-sdpa", action="store_true",
                    help="skip torch SDPA's timings (runs that compare two trees or tunings: tools/bench_settings.py)")
    ap.add_argument("--baseline", default=None, metavar="FILE.json",
                    help="an earlier run's --json: list the rows whose fraction of the ceiling moved by over 5%%")
    ap.add_argument("--ceilings-json", default=None, help=argparse.SUPPRESS)  # a resumed child reuses the ceilings
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    opts = ap.parse_args(argv)
    for name in ("jobs", "measure_s", "case_budget", "deadline"):
        value = getattr(opts, name)
        if not 0 <= value < float("inf"):  # (NaN fails too) 0: the default
            ap.error(f"--{name.replace('_', '-')}={value} must be a finite number >= 0 (0: the default)")
    opts.case_budget = opts.case_budget or 45.0  # 0 is the default, as for the other numbers (not zero seconds)
    opts.only = None if opts.only is None else [s for s in opts.only.split(",") if s.strip()]
    return opts


def _has_matplotlib() -> bool:
    try:
        return importlib.util.find_spec("matplotlib") is not None
    except (ImportError, ValueError):  # a None entry in sys.modules (a blocked import)
        return False


def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    from . import configs

    try:
        cases = configs.select(opts.suite, opts.only, opts.quick)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if opts.list:
        for case in cases:
            names = configs.row_names(case)
            extra = f"  -> rows {', '.join(names)}" if names != (case.name,) else ""
            print(f"{case.name}{extra}")
        return 0
    from . import compare, report, suite

    problem = report.check_json_path(opts.json)
    if problem is None and opts.plot is not None and not opts.child:  # before the run, not after it
        if not opts.plot.strip():
            problem = "--plot: the path is empty; name a file"
        elif not _has_matplotlib():
            problem = f"--plot {opts.plot}: matplotlib is not installed (pip install matplotlib)"
        else:
            problem = report.check_json_path(opts.plot, flag="--plot")
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2

    baseline = None
    if opts.baseline and not opts.child:
        try:
            baseline = compare.load(opts.baseline)  # before the run: a wrong path fails at once
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    doc = suite.run(opts)
    if not opts.child:
        report.print_final(doc)
        if baseline is not None:
            print(compare.report(doc, baseline), flush=True)
        if opts.plot:
            try:
                report.plot(doc, opts.plot)
            except Exception as exc:  # a plotting problem never loses the results
                print(f"--plot {opts.plot}: failed ({type(exc).__name__}: {exc})", flush=True)
        if opts.json:
            print(f"results written to {opts.json}", flush=True)
    # a run whose rows failed is not a success (a script that checks the exit code must see it); skipped rows are
    # not failures, but a run that timed nothing at all (every case past --deadline or its budget) is not a success
    rows = doc.get("rows", [])
    if any(row.get("status") == "error" for row in rows):
        return 1
    if rows and not any(row.get("status") == "ok" and row.get("time_us") is not None for row in rows):
        print("error: no case was timed (every row was skipped or ran out of its budget: see the notes above)",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # the reader went away (``| head``): stop without a traceback, as other tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the interpreter's final flush stays quiet
        sys.exit(1)

"""Suite rows under several settings of the environment, one subprocess each, alternated, printed side by side.

    python3 tools/bench_settings.py OUT.json --only 'variants/plain_prefill*,variants/prefill_softcap*' \\
        '' 'JITATTN_DEV_SM90_TUNING={"kv_block": 176}'
    python3 tools/bench_settings.py OUT.json --only 'prefill/llama8b_causal_paged*' \\
        JITATTN_PREFILL_FP8_UPCAST=off JITATTN_PREFILL_FP8_UPCAST=on --rounds 3

A setting is a space-separated list of NAME=VALUE assignments ('' for none), applied on top of this process's
environment (``TREE=DIR`` instead runs the bench in another checkout of the repository, DIR, with
``PYTHONPATH=DIR/.pysite:DIR``: a copy with one template or module changed, alternated with this one): the knobs and tunings read at import (``JITATTN_DEV_SM90_TUNING``) or at ``plan()``
(``JITATTN_PREFILL_FP8_UPCAST``, ``JITATTN_PREFILL_TIER``), each a distinct rendered source where it changes one.
Each row is the suite's own timing (``python -m jitattn.bench``: events, L2 evicted); every round runs every
setting once, in order, so drift shows as a trend within a column rather than as a difference between columns.
OUT.json holds every round's bench document per setting (rows, environment with the knobs set, method).
``--fast``: SDPA is timed and the ceilings measured by the first run only (the others take its ceilings and
``--no-sdpa``): the later runs time only jitattn.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile


def parse_setting(text: str) -> dict[str, str]:
    """'A=1 B={"x": 2}' -> {"A": "1", "B": '{"x": 2}'} ('' is no change). A value runs to the next ' NAME=' (or the
    end), so JSON values keep their quotes and spaces."""
    if not text.strip():
        return {}
    parts = re.split(r"\s+(?=[A-Za-z_][A-Za-z0-9_]*=)", text.strip())
    out = {}
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise SystemExit(f"setting {text!r}: {part!r} is not NAME=VALUE")
        out[name] = value
    return out


def run_once(command: list[str], env: dict[str, str]) -> dict:
    """One run of ``command`` (the bench's arguments but --json) under ``env`` (``TREE``: in that checkout): the
    bench's JSON document (its rows, environment and method), or {} when the run failed before writing it."""
    env = dict(env)
    tree = env.pop("TREE", None)
    if tree is not None:
        env["PYTHONPATH"] = f"{tree}/.pysite:{tree}"
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        done = subprocess.run([*command, "--json", f.name], env={**os.environ, **env}, check=False, cwd=tree,
                              stdout=subprocess.DEVNULL)
        try:
            return json.load(open(f.name))
        except json.JSONDecodeError:  # keep the other settings' runs
            print(f"setting {env}: no rows (exit {done.returncode})", file=sys.stderr)
            return {}


def compare(out: str, labels: list[str], commands: list[list[str]], envs: list[dict[str, str]], rounds: int,
            fast: bool = False) -> int:
    """Run every (command, env) once per round, print a row per case and a column per setting (microseconds,
    one figure per round: the events figure, host cost hidden, then in brackets the plain-launch one, host cost
    included), and write every round's bench document to ``out`` (by setting). ``fast``: only the first run
    times SDPA and measures the ceilings; the others take its ceilings and skip SDPA (``--no-sdpa``).
    -> the number of (case, setting) cells with at least one timed run."""
    # two settings alike (a noise check) keep a column each
    labels = [label if labels.index(label) == i else f"{label} #{i + 1}" for i, label in enumerate(labels)]
    docs: dict[str, list[dict]] = {label: [] for label in labels}
    first: dict = {}
    for _ in range(rounds):
        for label, command, env in zip(labels, commands, envs):
            extra = ["--no-sdpa", "--ceilings-json", json.dumps(first["ceilings"])] if fast and first else []
            docs[label].append(run_once(command + extra, env))
            json.dump(docs, open(out, "w"), indent=1)  # what ran so far survives a timeout
            if fast and not first and "ceilings" in docs[label][-1]:
                first = docs[label][-1]
    rows = {label: [{r["name"]: r for r in doc.get("rows", [])} for doc in runs] for label, runs in docs.items()}
    names = list(dict.fromkeys(n for runs in rows.values() for r in runs for n in r))
    width = max(24, *(len(label) for label in labels))
    print(f"{'case':46s} {'sdpa':>8s} " + " ".join(f"{label[:width]:>{width}s}" for label in labels))
    for n in names:
        first = next((r[n] for r in rows[labels[0]] if n in r), {})
        timed = [b["time_us"] for b in (first.get("sdpa") or {}).values() if isinstance(b, dict) and b.get("time_us")]
        sdpa = min(timed, default=None)  # SDPA's fastest backend (prefill rows time flash and cuDNN, not "default")
        cells = []
        for label in labels:
            runs = [r[n] for r in rows[label] if n in r and r[n].get("time_us")]
            events = " / ".join(f"{r['time_us']:.1f}" for r in runs)
            plain = " / ".join(f"{r['plain_launch_us']:.1f}" for r in runs if r.get("plain_launch_us"))
            cells.append(f"{events} [{plain}]" if plain else events)
        print(f"{n:46s} {f'{sdpa:.1f}' if sdpa else '-':>8s} " + " ".join(f"{c:>{width}s}" for c in cells))
    json.dump(docs, open(out, "w"), indent=1)
    return sum(any(n in r and r[n].get("time_us") for r in rows[label]) for n in names for label in labels)


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="JSON of every round's rows per setting")
    ap.add_argument("settings", nargs="+", help="NAME=VALUE ... per setting ('' for the environment as it is)")
    ap.add_argument("--only", required=True, help="the bench's --only (rows, suites or globs)")
    ap.add_argument("--rounds", type=int, default=2, help="times every setting runs (alternated; default 2)")
    ap.add_argument("--measure-s", default="0.3", help="the bench's --measure-s per case (default 0.3)")
    ap.add_argument("--fast", action="store_true", help="SDPA and the ceilings measured by the first run only (every "
                    "TREE must be a checkout whose bench takes --no-sdpa)")
    opts = ap.parse_args(argv)
    command = [sys.executable, "-m", "jitattn.bench", "--only", opts.only, "--measure-s", opts.measure_s]
    labels = [s or "(as is)" for s in opts.settings]
    timed = compare(opts.out, labels, [command] * len(labels), [parse_setting(s) for s in opts.settings],
                    opts.rounds, opts.fast)
    if not timed:  # a script that checks the exit code must not take an empty table for results
        raise SystemExit(f"no setting timed any row of --only {opts.only!r} (see the runs' messages above)")


if __name__ == "__main__":
    main(sys.argv[1:])

"""Warp-stall samples of a warp-specialized kernel by role, from Nsight Compute's source page (no GPU needed).

    ncu -i REPORT.ncu-rep --page source --csv --print-source sass > OUT.csv   # gpu_ncu (gpu_env.sh) writes it
    python3 tools/ncu_stalls.py OUT.csv [OTHER.csv ...] [--reason wait] [--top 20]

The sm90 prefill and MLA kernels split their warps by role with setmaxnreg: the instructions after the
``USETMAXREG.TRY_ALLOC`` are the consumer warpgroups', those after ``USETMAXREG.DEALLOC`` the producer's, the
rest the common start. Printed per file: each role's sampled warp states (all samples, by stall reason), then the
instructions with the most samples (``--reason NAME``: of that stall reason, with its count by opcode). Two files
side by side (two tunings of one kernel) show where the samples moved.
"""

from __future__ import annotations

import argparse
import collections
import csv
from pathlib import Path

ROLES = (("USETMAXREG.TRY_ALLOC", "consumer"), ("USETMAXREG.DEALLOC", "producer"))


def rows(path: Path) -> list[dict[str, str]]:
    """The source page's instruction rows (the CSV's first line names the kernel, the second the columns)."""
    try:
        with open(path, newline="") as f:
            lines = list(csv.reader(f))
    except OSError as exc:
        raise SystemExit(f"{path}: {exc.strerror}") from None
    if len(lines) < 2 or "Source" not in lines[1]:
        raise SystemExit(f"{path}: not an ncu source-page CSV (its second line names the columns, Source among them: "
                         "ncu -i REPORT --page source --csv --print-source sass)")
    header = lines[1]
    return [dict(zip(header, line)) for line in lines[2:] if len(line) == len(header)]


def by_role(instructions: list[dict[str, str]]) -> list[tuple[str, dict[str, str]]]:
    """(role, row) for every instruction, the role switching at the setmaxnreg of each warp role."""
    role, out = "start", []
    for row in instructions:
        for marker, name in ROLES:
            if marker in row["Source"]:
                role = name
        out.append((role, row))
    return out


def summary(path: Path, reason: str | None, top: int) -> None:
    labelled = by_role(rows(path))
    reasons = [k for k in labelled[0][1] if k.startswith("stall_") and "Not Issued" not in k] if labelled else []
    samples = collections.Counter()
    stalls: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for role, row in labelled:
        samples[role] += int(row.get("Warp Stall Sampling (All Samples)") or 0)
        for k in reasons:
            stalls[role][k[6:]] += int(row[k] or 0)
    print(f"== {path}: samples by role {dict(samples)}")
    for role, counts in stalls.items():
        print(f"   {role:9s} " + ", ".join(f"{k} {v}" for k, v in counts.most_common(8)))
    column = f"stall_{reason}" if reason else "Warp Stall Sampling (All Samples)"
    ranked = sorted(((int(row.get(column) or 0), role, row["Source"].strip()) for role, row in labelled), reverse=True)
    if reason:
        ops = collections.Counter()
        for n, _, source in ranked:
            words = source.split()
            ops[(words[1] if words[0].startswith("@") else words[0]).split(".")[0]] += n
        print(f"   {reason} by opcode: " + ", ".join(f"{k} {v}" for k, v in ops.most_common(10)))
    for n, role, source in ranked[:top]:
        print(f"   {n:7d} {role:9s} {source[:80]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path, help="CSVs of ncu --page source --csv --print-source sass")
    parser.add_argument("--reason", help="rank instructions by this stall reason (e.g. wait, barrier, mio)")
    parser.add_argument("--top", type=int, default=20)
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top {args.top}: give at least 1")
    for path in args.files:
        summary(path, args.reason, args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A run beside an earlier one (``python -m jitattn.bench --baseline FILE.json``).

Rows are matched by name and compared by their fraction of the ceiling measured in the
same run (``fraction``), not by time: lent machines of one kind differ by a few percent
in bandwidth, and the ceiling is measured on the machine that ran the row. A row whose
fraction fell by more than ``threshold`` is a regression (gemma-2's d256 decode once
drifted from 593 to 800 us over six recorded runs, 2026-11-29 to 2026-12-02, because no
run was compared with the one before).
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class RowChange:
    name: str
    before: float  # fraction of the ceiling in the baseline run
    after: float   # ... in this run
    time_before_us: float
    time_after_us: float

    @property
    def ratio(self) -> float:
        """This run's fraction over the baseline's (above 1: faster)."""
        return self.after / self.before


def load(path: str) -> dict:
    """A results document written by ``--json``; a clear error when the file is not one."""
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--baseline {path}: cannot read a results JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise ValueError(f"--baseline {path}: not a results document of python -m jitattn.bench --json "
                         "(no 'rows' list)")
    return doc


def positive_number(value) -> bool:
    """Whether a run file's figure is a positive finite number (not a bool, a string or NaN)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < float("inf")


def _comparable(rows: list) -> dict[str, dict]:
    """The rows with a name, status ok and a positive fraction and time (a hand-edited file's others are left out)."""
    return {row["name"]: row for row in rows
            if isinstance(row, dict) and isinstance(row.get("name"), str) and row.get("status") == "ok"
            and positive_number(row.get("fraction")) and positive_number(row.get("time_us"))}


def _setup(doc: dict) -> tuple:
    """What makes two runs' rows comparable: the target, the device and --quick (its smaller shapes and ceilings)."""
    environment = doc.get("environment") if isinstance(doc.get("environment"), dict) else {}
    args = doc.get("args") if isinstance(doc.get("args"), dict) else {}
    return doc.get("target"), environment.get("device"), bool(args.get("quick"))


def mismatch(doc: dict, baseline: dict) -> str | None:
    """Why the two runs' rows do not compare (another target: other sizes), or None."""
    (target, _, quick), (old_target, _, old_quick) = _setup(doc), _setup(baseline)
    if target != old_target:
        return f"this run's target is {target}, the baseline's {old_target} (other shapes and units)"
    if quick != old_quick:
        return "one run is --quick (smaller cpu shapes and ceilings), the other not" if target == "cpu" else None
    return None


def changes(doc: dict, baseline: dict) -> list[RowChange]:
    """Every row both runs measured, in this run's order."""
    before = _comparable(baseline.get("rows", []))
    out = []
    for name, row in _comparable(doc.get("rows", [])).items():
        old = before.get(name)
        if old is not None:
            out.append(RowChange(name, float(old["fraction"]), float(row["fraction"]), float(old["time_us"]),
                                 float(row["time_us"])))
    return out


def report(doc: dict, baseline: dict, threshold: float = 0.05) -> str:
    """The rows that moved by more than ``threshold`` (of their fraction of the ceiling), slower first."""
    problem = mismatch(doc, baseline)
    if problem:
        return f"beside the baseline ({baseline.get('created', 'undated')}): not compared: {problem}"
    rows = changes(doc, baseline)
    slower = sorted((c for c in rows if c.ratio < 1 - threshold), key=lambda c: c.ratio)
    faster = sorted((c for c in rows if c.ratio > 1 + threshold), key=lambda c: -c.ratio)
    lines = [f"beside the baseline ({baseline.get('created', 'undated')}): {len(rows)} rows in both, "
             f"{len(slower)} slower and {len(faster)} faster by over {threshold:.0%} of their fraction of the ceiling"]
    if _setup(doc)[1] != _setup(baseline)[1]:
        lines.append(f"  (the baseline ran on {_setup(baseline)[1]}, this run on {_setup(doc)[1]}: fractions of each "
                     "machine's own ceilings)")
    for label, group in (("SLOWER", slower), ("faster", faster)):
        for c in group:
            lines.append(f"  {label:6s} {c.name:48s} {c.before:.2f} -> {c.after:.2f} of ceiling ({c.ratio:.2f}x; "
                         f"{c.time_before_us:.1f} -> {c.time_after_us:.1f} us)")
    return "\n".join(lines)

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


def _comparable(rows: list) -> dict[str, dict]:
    return {row["name"]: row for row in rows
            if isinstance(row, dict) and row.get("status") == "ok" and row.get("fraction") and row.get("time_us")}


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
    rows = changes(doc, baseline)
    slower = sorted((c for c in rows if c.ratio < 1 - threshold), key=lambda c: c.ratio)
    faster = sorted((c for c in rows if c.ratio > 1 + threshold), key=lambda c: -c.ratio)
    lines = [f"beside the baseline ({baseline.get('created', 'undated')}): {len(rows)} rows in both, "
             f"{len(slower)} slower and {len(faster)} faster by over {threshold:.0%} of their fraction of the ceiling"]
    for label, group in (("SLOWER", slower), ("faster", faster)):
        for c in group:
            lines.append(f"  {label:6s} {c.name:48s} {c.before:.2f} -> {c.after:.2f} of ceiling ({c.ratio:.2f}x; "
                         f"{c.time_before_us:.1f} -> {c.time_after_us:.1f} us)")
    return "\n".join(lines)

"""Output of the suite: streamed row lines, the final table, the JSON file and the PNG plot."""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import tempfile
from typing import Callable


def printer(opts) -> Callable[[str], None]:
    def log(line: str) -> None:
        print(line, flush=True)

    return log


def fmt_time(us: float | None) -> str:
    if us is None or (isinstance(us, float) and math.isnan(us)):
        return "-"
    if us < 1e3:
        return f"{us:.1f} us"
    if us < 1e6:
        return f"{us / 1e3:.2f} ms"
    return f"{us / 1e6:.2f} s"


def fmt_rate(rate: float | None, unit: str | None) -> str:
    if rate is None:
        return "-"
    if unit == "GB/s":
        return f"{rate:.0f} GB/s" if rate >= 10 else f"{rate:.2f} GB/s"
    if unit == "TFLOP/s":
        return f"{rate:.1f} TF/s" if rate >= 1 else f"{rate * 1e3:.1f} GF/s"
    return f"{rate:.3g} {unit}"


def fmt_frac(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction:.2f}"


def fmt_err(err: float | None) -> str:
    if err is None:
        return "-"
    if math.isinf(err) or math.isnan(err):
        return "NaN/inf"
    return f"{err:.1e}"


def ceilings_line(ceilings: dict | None) -> str:
    if not ceilings:
        return "ceilings: -"
    if "error" in ceilings:
        return f"ceilings: failed ({ceilings['error']})"
    parts = []
    if "copy" in ceilings:
        parts.append(f"copy {ceilings['copy']['gbps']:.0f} GB/s (read + write)")
    if "read_stream" in ceilings:
        parts.append(f"read-stream {ceilings['read_stream']['gbps']:.0f} GB/s")
    if "gemm" in ceilings:
        g = ceilings["gemm"]
        parts.append(f"{g['dtype']} GEMM {g['n']}^3 {g['tflops']:.1f} TFLOP/s")
    return "ceilings: " + ", ".join(parts)


def _sdpa_cells(row: dict) -> list[tuple[str, str]]:
    """(SDPA or peer cell, speedup cell) lines for a row: SDPA's backends, then the peers'."""
    cells = []
    sdpa = row.get("sdpa")
    if row.get("sdpa_na"):
        cells.append(("n/a", ""))
    elif not sdpa:
        cells.append(("-", ""))
    for name, res in list((sdpa or {}).items()) + list((row.get("peers") or {}).items()):
        if "n/a" in res:
            cells.append((f"{name}: n/a", ""))
        elif "error" in res:
            cells.append((f"{name}: error", ""))
        else:
            speed = f"{res['speedup']:.2f}x" if res.get("speedup") else "-"
            cells.append((f"{name} {fmt_time(res['time_us'])}", speed))
    return cells


def _notes(row: dict) -> str:
    parts = []
    if row.get("error"):
        if row.get("status") == "skipped":  # its reason reads "skipped: ..." (suite.skipped_rows)
            parts.append("SKIPPED: " + row["error"].removeprefix("skipped: "))
        else:
            parts.append("ERROR: " + row["error"])
    if row.get("plain_launch_us"):  # first: the notes column is cut, and this is what an eager loop pays
        parts.append(f"plain launches {fmt_time(row['plain_launch_us'])}/call")
    base = row.get("baseline")
    if base:
        if "error" in base:
            parts.append(f"baseline: {base['error']}")
        elif base.get("speedup") is not None:
            speedup, than = base["speedup"], base.get("than", "flat decode")
            if "than" not in base and base.get("what", "").startswith("two-level time / tree"):  # runs before it
                speedup, than = 1 / speedup, "the tree cascade"
            faster = f"{speedup:.2f}x faster" if speedup >= 1 else f"{1 / speedup:.2f}x slower"
            parts.append(f"{faster} than {than} ({fmt_time(base['time_us'])})")
        elif base.get("ratio") is not None:
            of = base.get("of", "the plain kernel")
            possessive = "'" if of.endswith("s") else "'s"  # "the separate launches' rate"
            parts.append(f"{base['ratio']:.2f}x {of}{possessive} rate")
    if row.get("sdpa_na"):
        parts.append(f"SDPA n/a: {row['sdpa_na']}")
    for name, res in (row.get("sdpa") or {}).items():
        if "error" in res:
            parts.append(f"SDPA {name}: {res['error'][:90]}")
        elif "n/a" in res:
            parts.append(f"SDPA {name}: {res['n/a']}")
        elif res.get("note"):
            parts.append(f"SDPA {name}: {res['note'][:60]}")
    for name, res in (row.get("peers") or {}).items():
        if "error" in res or "n/a" in res:
            parts.append(f"{name}: {(res.get('error') or res.get('n/a'))[:90]}")
        elif (res.get("max_rel_err_vs_jitattn") or 0) > 0.05:
            parts.append(f"{name} differs from jitattn by {res['max_rel_err_vs_jitattn']:.2g}")
    if row.get("note"):
        parts.append(row["note"])
    return "; ".join(parts)


def row_line(row: dict, index: int) -> str:
    sdpa = ", ".join(f"{a} {b}".strip() for a, b in _sdpa_cells(row))
    head = f"[{index:3d}] {row['name']:<46s}"
    if row["status"] != "ok":
        return f"{head} {row['status'].upper()}: {row.get('error')}"
    return (f"{head} {fmt_time(row['time_us']):>10s} {fmt_rate(row['rate'], row['rate_unit']):>11s} "
            f"ceil {fmt_frac(row['fraction']):>5s}  sdpa {sdpa}  err {fmt_err(row['max_rel_err'])}  "
            f"({row['seconds']:.1f} s)")


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def table(doc: dict, notes_width: int = 110) -> str:
    """The final table (notes cut to ``notes_width``; the JSON has them whole)."""
    head = ("case", "jitattn", "rate", "ceil", "SDPA", "speedup", "rel err", "notes")
    lines = [f"{head[0]:<46s} {head[1]:>10s} {head[2]:>11s} {head[3]:>5s}  {head[4]:<20s} {head[5]:>7s} "
             f"{head[6]:>8s}  {head[7]}"]
    lines.append("-" * 130)
    for row in doc["rows"]:
        cells = _sdpa_cells(row) if row["status"] == "ok" else [("", "")]
        first = cells[0]
        lines.append(
            f"{row['name']:<46s} {fmt_time(row['time_us']):>10s} {fmt_rate(row['rate'], row['rate_unit']):>11s} "
            f"{fmt_frac(row['fraction']):>5s}  {first[0]:<20s} {first[1]:>7s} {fmt_err(row['max_rel_err']):>8s}  "
            f"{_short(_notes(row), notes_width)}")
        for cell in cells[1:]:
            lines.append(f"{'':<46s} {'':>10s} {'':>11s} {'':>5s}  {cell[0]:<20s} {cell[1]:>7s}")
    return "\n".join(lines)


def summary(doc: dict) -> str:
    rows = doc["rows"]
    counts = {s: sum(r["status"] == s for r in rows) for s in ("ok", "error", "skipped")}
    env = doc.get("environment", {})
    head = (f"jitattn bench ({doc['target']}, {env.get('device')}, torch {env.get('torch')}, "
            f"git {env.get('git', '?')}): {counts['ok']} ok, {counts['error']} errors, {counts['skipped']} skipped "
            f"in {doc.get('elapsed_s', 0):.0f} s")
    timing = (doc.get("method") or {}).get("timing")
    return head + "\n" + ceilings_line(doc.get("ceilings")) + "\n" + doc["note"] + (
        f"\ntiming: {timing}" if timing else "")


def _clean(value):
    """JSON without NaN/inf (they become null)."""
    if isinstance(value, float) and (math.isnan(value) or math.isinf(value)):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def write_json(doc: dict, path: str | None) -> None:
    """Write ``doc`` atomically (a partial run still leaves valid JSON)."""
    if not path:
        return
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".bench-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(_clean(doc), f, indent=1, allow_nan=False)
            f.write("\n")
        os.chmod(tmp, 0o644)  # a results file, readable as any other (mkstemp makes it 0600)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def check_json_path(path: str | None, flag: str = "--json") -> str | None:
    """Why ``--json path`` (or another output ``flag``'s) cannot be written (None: it can), checked before a run rather
    than after its first case."""
    if path is None:
        return None
    if not path.strip():
        return f"{flag}: the path is empty; name a file"
    if os.path.isdir(path):
        example = "bench.png" if flag == "--plot" else "bench.json"
        return f"{flag} {path} is a directory; name a file (e.g. {os.path.join(path, example)})"
    if os.path.lexists(path) and not os.path.isfile(path):  # write_json replaces the path: a device, FIFO or socket
        return f"{flag} {path} is not a regular file (the results replace what is there); name a file"
    directory = parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{flag} {path}: {parent} is a file, not a directory"
    if not os.access(parent, os.W_OK):
        return f"{flag} {path}: {parent} is not writable"
    try:
        name_max = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    if len(os.fsencode(os.path.basename(path))) > name_max:
        return f"{flag} {path}: the file name is longer than {name_max} bytes; give a shorter one"
    try:  # the run would make the directory at its first write: made now, a refusal comes before the run
        os.makedirs(directory, exist_ok=True)
    except OSError as exc:
        return f"{flag} {path}: cannot make {directory} ({exc.strerror})"
    try:  # the directory exists: try it (root passes os.access where /proc and /sys refuse)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".bench-", suffix=".json")
        os.close(fd)
        os.unlink(tmp)
    except OSError as exc:
        return f"{flag} {path}: cannot write in {directory} ({exc.strerror})"
    return None


def plot(doc: dict, path: str, log: Callable[[str], None] = print) -> bool:
    """Fraction of its ceiling per case, jitattn beside each SDPA backend; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log(f"--plot {path}: matplotlib is not installed; no plot written (pip install matplotlib)")
        return False
    rows = [r for r in doc["rows"] if r.get("fraction") is not None]
    if not rows:
        log(f"--plot {path}: no row has a fraction of a ceiling; no plot written")
        return False
    backends: list[str] = []
    for r in rows:
        for name, res in (r.get("sdpa") or {}).items():
            if res.get("fraction") is not None and name not in backends:
                backends.append(name)
    series = [("jitattn", [r["fraction"] for r in rows])]
    for name in backends:
        series.append((f"SDPA {name}", [((r.get("sdpa") or {}).get(name) or {}).get("fraction") for r in rows]))
    colors = {label: f"C{k}" for k, (label, _) in enumerate(series)}
    fig, ax = plt.subplots(figsize=(11, 1.5 + 0.3 * sum(
        max(1, sum(values[i] is not None for _, values in series)) for i in range(len(rows)))))
    labelled: set[str] = set()
    for i in range(len(rows)):
        present = [(label, values[i]) for label, values in series if values[i] is not None]
        height = 0.8 / len(present)
        for k, (label, value) in enumerate(present):
            ax.barh(i + (k - (len(present) - 1) / 2) * height, value, height=height, color=colors[label],
                    label=None if label in labelled else label)
            labelled.add(label)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{r['name']} ({'GB/s' if r['rate_unit'] == 'GB/s' else 'TFLOP/s'})" for r in rows],
                       fontsize=8)
    ax.invert_yaxis()
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("fraction of ceiling (bandwidth rows: read-stream, RoPE: copy; compute rows: GEMM)")
    env = doc.get("environment", {})
    ax.set_title(f"jitattn vs torch SDPA, {env.get('device')} ({doc['target']}, {doc.get('created', '')})\n"
                 + ceilings_line(doc.get("ceilings")), fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    log(f"plot written to {path}")
    return True


def print_final(doc: dict, out=None) -> None:
    out = out or sys.stdout
    print("\n" + table(doc), file=out)
    print("\n" + summary(doc), file=out, flush=True)

"""The innermost loop of a kernel around an anchor instruction, as basic blocks with their opcode counts: what one
iteration of a hot loop issues (per thread), read from SASS without a GPU.

    python3 tools/sass_loop.py CUBIN [--anchor REGEX] [--nth N] [--kernel SUBSTRING]

CUBIN is a ``k.cubin`` that ``tools/sass_stats.py`` wrote (``OUT_DIR/NAME/k.cubin``). The anchor is the Nth match
(default: the last) of REGEX among the instructions (default ``HGMMA|HMMA``: the sm90 prefill's and MLA's wgmmas, the
decode kernel's mmas); ``--kernel`` keeps only the kernel whose name contains SUBSTRING (a module holding several,
as decode's two layouts). Printed: the loop's line range, then each basic block (its lines, instruction count, most
frequent opcodes, and the branch that ends it with its target), and the loop's total. Which blocks an iteration
takes (a mask, a rescale, a tail) is the reader's call: sum those; every instruction is counted once per thread.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
from pathlib import Path

_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_INSTR = re.compile(r"^\s+/\*[0-9a-f]{4,6}\*/\s+(.*?)\s*;")
_KERNEL = re.compile(r"^\.text\.(\S+):")


def listing(cubin: Path, kernel: str | None) -> list[tuple[str, str]]:
    """(kind, text) rows of the disassembly: ("label", name), ("instr", text); one kernel's when ``kernel``."""
    try:
        sass = subprocess.run(["nvdisasm", "-c", str(cubin)], capture_output=True, text=True, check=True).stdout
    except FileNotFoundError:
        raise SystemExit("nvdisasm not found: put the CUDA toolkit's bin directory on PATH") from None
    except subprocess.CalledProcessError as exc:
        raise SystemExit(f"nvdisasm -c {cubin} failed: {exc.stderr.strip() or exc}") from None
    rows, keep = [], kernel is None
    for line in sass.splitlines():
        m = _KERNEL.match(line)
        if m:
            keep = kernel is None or kernel in m.group(1)
        elif keep and _LABEL.match(line):
            rows.append(("label", _LABEL.match(line).group(1)))
        elif keep and _INSTR.match(line):
            rows.append(("instr", _INSTR.match(line).group(1)))
    return rows


def opcode(text: str) -> str:
    words = text.split()
    return (words[1] if words[0].startswith("@") and len(words) > 1 else words[0]).split(".")[0]


def innermost_loop(rows: list[tuple[str, str]], anchor: int) -> tuple[int, int]:
    """(first, last) row of the innermost loop holding row ``anchor``: the shortest back edge around it (the
    out-of-line retry stubs of barrier waits jump back from the kernel's end: longer, so not taken)."""
    labels = {text: i for i, (kind, text) in enumerate(rows) if kind == "label"}
    loops = [(labels[m.group(1)], i) for i, (kind, text) in enumerate(rows)
             if kind == "instr" and (m := _BRANCH.search(text)) and labels[m.group(1)] <= anchor < i]
    if not loops:
        raise SystemExit("no loop holds the anchor")
    return min(loops, key=lambda span: span[1] - span[0])


def blocks(rows: list[tuple[str, str]], first: int, last: int) -> list[list[int]]:
    """The rows [first, last] cut into basic blocks (at labels, and after branches), instruction rows only."""
    out, cur = [], []
    for i in range(first, last + 1):
        kind, text = rows[i]
        if kind == "label" and cur:
            out.append(cur)
            cur = []
        if kind == "instr":
            cur.append(i)
            if _BRANCH.search(text) or opcode(text) in ("EXIT", "RET"):
                out.append(cur)
                cur = []
    return out + ([cur] if cur else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cubin", type=Path)
    parser.add_argument("--anchor", default=r"HGMMA|HMMA", help="regex of the anchor instruction")
    parser.add_argument("--nth", type=int, default=-1, help="which match (0 the first, -1 the last)")
    parser.add_argument("--kernel", help="only the kernel whose mangled name contains this")
    args = parser.parse_args(argv)
    rows = listing(args.cubin, args.kernel)
    matches = [i for i, (kind, text) in enumerate(rows) if kind == "instr" and re.search(args.anchor, text)]
    if not matches:
        raise SystemExit(f"no instruction matches {args.anchor!r}")
    first, last = innermost_loop(rows, matches[args.nth])
    labels = {i: text for i, (kind, text) in enumerate(rows) if kind == "label"}
    print(f"loop: rows {first}-{last} (anchor row {matches[args.nth]}: {rows[matches[args.nth]][1]})")
    total = collections.Counter()
    for block in blocks(rows, first, last):
        counts = collections.Counter(opcode(rows[i][1]) for i in block)
        total.update(counts)
        end = rows[block[-1]][1]
        m = _BRANCH.search(end)
        jump = f"  -> {m.group(1)} (row {next(i for i, t in labels.items() if t == m.group(1))}): {end}" if m else ""
        top = ", ".join(f"{op} {n}" for op, n in counts.most_common(6))
        print(f"  rows {block[0]}-{block[-1]}: {len(block)} ({top}){jump}")
    print(f"loop total: {sum(total.values())} ({', '.join(f'{op} {n}' for op, n in total.most_common(12))})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

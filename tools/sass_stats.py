"""ptxas statistics and SASS opcode counts of representative decode, sm90 prefill and MLA specs, to compare a
kernel before and after a change that should not change its work (a refactor, a new axis behind
``if constexpr``). No GPU needed: nvcc and nvdisasm (or cuobjdump) on the machine.

    python3 tools/sass_stats.py OUT_DIR [--family decode|prefill|mla|all] [--against EARLIER_DIR] [NAME ...]

Each spec is rendered from the checkout on ``sys.path`` (run it with ``PYTHONPATH=<other tree>`` for the
other side), compiled for sm_90a with jitattn's flags into ``OUT_DIR/NAME/k.cubin``; printed per spec:
instructions, registers, spill bytes, and with ``--against`` the opcodes whose counts changed. nvdisasm comes
with the CUDA toolkit or ``pip install nvidia-cuda-nvdisasm``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("JITATTN_CUDA_ARCH_LIST", "9.0a")  # the sm90 prefill tier is chosen by the arch list

from jitattn.jit.render import render  # noqa: E402
from jitattn.jit.templates import include_dir  # noqa: E402
from jitattn.jit.toolchain import CUDA_FLAGS  # noqa: E402
from jitattn.spec import VariantSpec  # noqa: E402

_ADDRESS = re.compile(r"^\s+/\*[0-9a-f]{4,6}\*/\s+(.*?)\s*;")


_PLAIN = {"pos_encoding": "none", "use_sliding_window": False, "use_logits_soft_cap": False}


def _decode(hd: int, g: int = 4, **kw) -> VariantSpec:
    kw = {**_PLAIN, **kw}
    q = kw.pop("q", "bf16")
    return VariantSpec(op="decode", target="cuda", q_dtype=q, kv_dtype=kw.pop("kv", q), o_dtype=q, head_dim_qk=hd,
                       head_dim_vo=hd, group_size=g, kv_layout="nhd", kv_storage="paged", **kw)


def _prefill(hd: int, g: int = 4, **kw) -> VariantSpec:
    kw = {**_PLAIN, **kw}
    q = kw.pop("q", "bf16")
    dvo, o = kw.pop("dvo", hd), kw.pop("o", q)
    return VariantSpec(op="prefill", target="cuda", q_dtype=q, kv_dtype=q, o_dtype=o, head_dim_qk=hd, head_dim_vo=dvo,
                       group_size=g, kv_layout="nhd", mask_mode=kw.pop("mask", "causal"),
                       kv_storage=kw.pop("storage", "ragged"), **kw)


def _mla(q: str, kv: str | None = None) -> VariantSpec:
    return VariantSpec(op="mla", target="cuda", q_dtype=q, kv_dtype=kv or q, o_dtype=q, head_dim_qk=576,
                       head_dim_vo=512)


SPECS = {
    "decode": {"d128g4": _decode(128), "d128g1": _decode(128, 1), "d64g8": _decode(64, 8), "d96g1": _decode(96, 1),
               "d256g2cap": _decode(256, 2, use_logits_soft_cap=True), "d128e4m3": _decode(128, kv="e4m3"),
               "d128rope": _decode(128, pos_encoding="rope"), "d128win": _decode(128, use_sliding_window=True),
               "d256rope": _decode(256, 2, pos_encoding="rope"), "d128sinks": _decode(128, use_sinks=True)},
    "prefill": {"p128c": _prefill(128), "p128n": _prefill(128, mask="none"), "p64c": _prefill(64),
                "p256c": _prefill(256), "p128paged": _prefill(128, storage="paged"),
                "p256paged": _prefill(256, 2, storage="paged"),
                "p128maskpaged": _prefill(128, mask="custom", storage="paged"),
                "p128cap": _prefill(128, use_logits_soft_cap=True), "p128win": _prefill(128, use_sliding_window=True),
                "p64win": _prefill(64, 8, use_sliding_window=True),
                "p256win": _prefill(256, 1, use_sliding_window=True),
                "p128sinks": _prefill(128, use_sinks=True), "p128alibi": _prefill(128, pos_encoding="alibi"),
                "p64alibi": _prefill(64, pos_encoding="alibi"), "p128mask": _prefill(128, mask="custom"),
                "p64maskpaged": _prefill(64, mask="custom", storage="paged"), "p192x128c": _prefill(192, 1, dvo=128),
                "p128fp8c": _prefill(128, q="e4m3", o="bf16"),
                "p128fp8n": _prefill(128, 1, q="e4m3", o="bf16", mask="none"),
                "p128fp8paged": _prefill(128, q="e4m3", o="bf16", storage="paged")},
    "mla": {"mla_bf16": _mla("bf16"), "mla_e4m3": _mla("bf16", "e4m3")},
}


def _disassembler() -> list[str]:
    cuda_bin = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin"
    for name, args in (("nvdisasm", ["-c"]), ("cuobjdump", ["-sass"])):
        found = shutil.which(name) or (str(cuda_bin / name) if (cuda_bin / name).exists() else None)
        if found:
            return [found, *args]
    raise SystemExit("neither nvdisasm nor cuobjdump found: install the CUDA toolkit's, or pip install "
                     "nvidia-cuda-nvdisasm and put its bin/ on PATH")


def compile_one(name: str, spec: VariantSpec, out: Path, disasm: list[str]) -> dict:
    work = out / name
    work.mkdir(parents=True, exist_ok=True)
    sources = render(spec)
    for file, text in sources.items():
        (work / file).write_text(text)
    cu = next(f for f in sources if f.endswith(".cu"))
    flags = [f for f in CUDA_FLAGS if not f.startswith("-Xcompiler")]
    done = subprocess.run(["nvcc", *flags, "-arch=sm_90a", "-cubin", "-Xptxas", "-v", f"-I{work}",
                           f"-I{include_dir('cuda')}", "-o", str(work / "k.cubin"), str(work / cu)],
                          capture_output=True, text=True)
    if done.returncode:
        return {"name": name, "error": done.stderr[-2000:]}
    ptxas = " | ".join(line.split("info    : ")[-1].strip() for line in done.stderr.splitlines()
                       if "Used" in line or "spill" in line)
    sass = subprocess.run([*disasm, str(work / "k.cubin")], capture_output=True, text=True, check=True).stdout
    ops = [m.group(1) for m in map(_ADDRESS.match, sass.splitlines()) if m]
    (work / "sass.txt").write_text("\n".join(ops) + "\n")
    return {"name": name, "instructions": len(ops), "ptxas": ptxas}


def opcode_counts(sass_file: Path) -> collections.Counter:
    counts = collections.Counter()
    for line in sass_file.read_text().splitlines():
        words = line.split()
        if words:
            counts[words[1] if words[0].startswith("@") and len(words) > 1 else words[0]] += 1
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("names", nargs="*", help="spec names (default: every spec of --family)")
    parser.add_argument("--family", choices=["decode", "prefill", "mla", "all"], default="all")
    parser.add_argument("--against", type=Path, help="an earlier OUT_DIR: print the opcodes whose counts changed")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_intermixed_args(argv)  # names before or after the options
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1")
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"{args.out}: a file; name a directory for the SASS")
    if args.against is not None and not args.against.is_dir():
        parser.error(f"--against {args.against}: no such directory (an earlier OUT)")
    args.names = list(dict.fromkeys(args.names))  # one compile a name (two would write one folder at once)
    table = {n: s for fam, specs in SPECS.items() if args.family in (fam, "all") for n, s in specs.items()}
    unknown = [n for n in args.names if n not in table]
    if unknown:
        raise SystemExit(f"unknown spec names {unknown}; known: {', '.join(table)}")
    disasm = _disassembler()
    with cf.ThreadPoolExecutor(args.jobs) as pool:
        results = pool.map(lambda n: compile_one(n, table[n], args.out, disasm), args.names or list(table))
        for r in results:
            if "error" in r:
                print(f"{r['name']}: FAILED\n{r['error']}")
                continue
            print(f"{r['name']}: {r['instructions']} instructions | {r['ptxas']}")
            earlier = args.against / r["name"] / "sass.txt" if args.against else None
            if earlier and earlier.exists():
                before, after = opcode_counts(earlier), opcode_counts(args.out / r["name"] / "sass.txt")
                moved = [f"{op} {before[op]}->{after[op]}" for op in sorted(before | after) if before[op] != after[op]]
                print("    " + (", ".join(moved) if moved else "same opcode counts"))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``jitattn-cache`` command line.

Exit codes: 0 ok, 1 some builds (or checks) failed, 2 usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    pass


def _specs_from_args(args: argparse.Namespace):
    import torch  # noqa: F401  (dtype parsing)

    from jitattn.attention.options import parse_dtype
    from jitattn.attention.specs import model_specs
    from jitattn.spec import Target, parse_spec_text

    from .presets import PRESETS, from_hf_config

    target = Target.parse(args.target, "--target")
    specs = []
    shapes = []
    for name in args.preset or []:
        if name not in PRESETS:
            raise UsageError(f"unknown preset {name!r}; available: {', '.join(sorted(PRESETS))}")
        shapes.append(PRESETS[name])
    for path in args.config or []:
        shapes.append(from_hf_config(path))
    dtype = parse_dtype(args.dtype, "--dtype")
    kv_dtype = parse_dtype(args.kv_dtype, "--kv-dtype") if args.kv_dtype else dtype
    if target is Target.CUDA and dtype == torch.float32:
        raise UsageError("--dtype float32 is supported on the cpu target only; use bfloat16 or float16")
    for shape in shapes:
        shape = shape.with_tensor_parallel(args.tp)
        specs += model_specs(
            target, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
            dtype=dtype, kv_dtype=kv_dtype, sliding_window=shape.sliding_window,
            full_attention_too=shape.full_attention_too, logits_soft_cap=shape.logits_soft_cap,
        )
    for text in args.spec or []:
        specs.append(parse_spec_text(text))
    if not specs:
        raise UsageError("nothing to warm: give --preset NAME, --config config.json or --spec TEXT")
    return list(dict.fromkeys(specs))


def _default_target(arch: str | None) -> str:
    if arch:
        return "cuda"
    try:
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
    except Exception:
        return "cpu"


def cmd_warm(args: argparse.Namespace) -> int:
    if args.arch:
        os.environ["JITATTN_CUDA_ARCH_LIST"] = args.arch
    args.target = args.target or _default_target(args.arch)
    specs = _specs_from_args(args)
    import jitattn.jit as jit
    from jitattn.jit.cache import find_entry, plan_build

    if args.dry_run:
        for spec in specs:
            try:
                status = "cached" if find_entry(plan_build(spec)) else "cold"
            except (NotImplementedError, RuntimeError) as exc:
                status = f"error: {exc}"
            print(f"{spec.uri:60s} {status}")
        return EXIT_OK
    from tqdm import tqdm

    started = time.perf_counter()
    bar = tqdm(total=len(specs), unit="spec", desc="jitattn warm", disable=args.quiet)

    def on_done(result) -> None:
        bar.set_postfix_str(f"{result.status}: {result.spec.uri}", refresh=False)
        bar.update(1)

    try:
        results = jit.build_many(specs, jobs=args.jobs, on_done=on_done)
    finally:
        bar.close()
    built = [r for r in results if r.status == "built"]
    cached = [r for r in results if r.status == "cached"]
    failed = [r for r in results if r.status == "failed"]
    print(f"jitattn-cache warm: {len(built)} built, {len(cached)} already cached, {len(failed)} failed "
          f"({len(specs)} specs, target {args.target}, {time.perf_counter() - started:.1f} s)")
    for r in failed:
        print(f"FAILED {r.spec.uri}:\n{r.error}", file=sys.stderr)
    return EXIT_FAILED if failed else EXIT_OK


def _entries():
    from jitattn.jit.cache import layers, read_manifest

    for base in layers():
        if not base.is_dir():
            continue
        for entry in sorted(base.iterdir()):
            manifest = read_manifest(entry)
            if manifest is not None:
                yield base, entry, manifest


def cmd_ls(args: argparse.Namespace) -> int:
    rows = list(_entries())
    for base, entry, m in rows:
        size = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file())
        arch = ",".join(m.get("archs") or []) or "host"
        print(f"{m['uri']:60s} {m['target']:4s} {arch:8s} {size / 1e6:7.2f} MB  {m.get('built_at', '?')}  {entry}")
    print(f"{len(rows)} entries")
    return EXIT_OK


def cmd_info(args: argparse.Namespace) -> int:
    found = [(entry, m) for _, entry, m in _entries() if m["uri"] == args.uri or entry.name.startswith(args.uri)]
    if not found:
        print(f"no cache entry matches {args.uri!r} (see `jitattn-cache ls`)", file=sys.stderr)
        return EXIT_FAILED
    for entry, m in found:
        print(f"# {entry}")
        print(json.dumps(m, indent=2, sort_keys=True))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from jitattn.jit.cache import entry_problem, layers

    bad = 0
    writable = layers()[-1]
    for base, entry, _ in _entries():
        problem = entry_problem(entry)
        if problem is None:
            continue
        bad += 1
        print(f"BAD {entry}: {problem}")
        if args.fix and base == writable:
            shutil.rmtree(entry, ignore_errors=True)
            print(f"  removed {entry}")
    print(f"verify: {bad} bad entries")
    return EXIT_FAILED if bad and not args.fix else EXIT_OK


def cmd_clear(args: argparse.Namespace) -> int:
    from jitattn import env
    from jitattn.jit.cache import SCHEMA

    root = env.cache_dir() / SCHEMA
    if root.exists():
        shutil.rmtree(root)
    print(f"cleared {root}")
    return EXIT_OK


def cmd_show_config(args: argparse.Namespace) -> int:
    from jitattn import env

    for name, value, source in env.describe():
        print(f"{name:26s} {value}   [{source}]")
    print(f"{'(cache root in use)':26s} {env.cache_dir()}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jitattn-cache", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    warm = sub.add_parser("warm", help="pre-build every kernel a model (or spec) needs")
    warm.add_argument("--preset", action="append", help="model preset (llama-3-8b, mistral-7b, gemma-2-9b, ...)")
    warm.add_argument("--config", action="append", help="path to a Hugging Face config.json")
    warm.add_argument("--spec", action="append", help="one spec: a uri or key=value,... (see README)")
    warm.add_argument("--target", choices=["cuda", "cpu"], help="default: cuda when a GPU is visible or --arch given")
    warm.add_argument("--arch", help="CUDA archs, e.g. '9.0a' or '8.0;9.0a' (build without a GPU)")
    warm.add_argument("--dtype", default="bfloat16", help="q/o dtype (default bfloat16)")
    warm.add_argument("--kv-dtype", help="kv cache dtype (default: --dtype; e.g. float8_e4m3fn)")
    warm.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (splits heads)")
    warm.add_argument("-j", "--jobs", type=int, help="parallel compiles (default: memory-aware)")
    warm.add_argument("--dry-run", action="store_true", help="list the specs and whether they are cached")
    warm.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    warm.set_defaults(func=cmd_warm)
    ls = sub.add_parser("ls", help="list cache entries")
    ls.set_defaults(func=cmd_ls)
    info = sub.add_parser("info", help="show one entry's manifest")
    info.add_argument("uri")
    info.set_defaults(func=cmd_info)
    verify = sub.add_parser("verify", help="re-checksum every entry")
    verify.add_argument("--fix", action="store_true", help="remove bad entries from the writable cache")
    verify.set_defaults(func=cmd_verify)
    clear = sub.add_parser("clear", help="remove every entry of the writable cache")
    clear.set_defaults(func=cmd_clear)
    show = sub.add_parser("show-config", help="print every JITATTN_* knob and its source")
    show.set_defaults(func=cmd_show_config)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        return EXIT_USAGE if exc.code not in (0, None) else EXIT_OK
    try:
        return args.func(args)
    except UsageError as exc:
        print(f"jitattn-cache: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except ValueError as exc:
        print(f"jitattn-cache: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("jitattn-cache: interrupted; the cache is consistent (unfinished builds were not published)",
              file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())

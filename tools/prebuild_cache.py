"""Build, on a machine without a GPU, the kernels that GPU test files pre-build (their ``GPU_SPECS``), for an arch
list, and pack the cache for a GPU machine: the machine then starts with them built (tools/gpu_env.sh unpacks
``.whl/prebuilt.tar.xz`` into its cache) instead of spending its first seconds of each test run on nvcc.

    JITATTN_CUDA_ARCH_LIST=9.0a python3 tools/prebuild_cache.py OUT.tar.xz tests/test_a.py ... \
        [--bench 'ops/fp8_*,prefill/llama8b_*'] [--manifests manifests.tgz] \
        [--env 'JITATTN_DEV_SM90_TUNING={"wg_skip": 0}'] [--jobs N]

A test file's ``GPU_SPECS`` are what its session pre-builds in parallel; the kernels its tests meet beyond them
(other tiers, tunings set by a test, a wrapper's own choices) are built one at a time as the tests reach them.
``--manifests`` adds the specs of every ``manifest.json`` in a cache directory or in an archive of one: what a GPU
run really built (``gpu_manifests`` in tools/gpu_env.sh packs its cache's manifests into the results).

Entries are content-keyed (the spec, the rendered sources, the flags and the arch list), so the archive helps only
a machine running the same tree with the same toolkit flags; any other tree or arch just misses and builds. The
modules link the static CUDA runtime, so the archive compresses well (xz over the whole tar: ~0.1 MB a module).
Each ``--env`` setting is one more build of the same specs in a child process with that variable set (a
development knob renders other sources).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def manifest_specs(path: Path) -> list:
    """The cuda specs of the cache entries' ``manifest.json`` files under ``path`` (a directory, or a tar archive of
    one, compressed or not)."""
    from jitattn.spec import Target, VariantSpec

    if path.is_dir():
        texts = [m.read_text() for m in sorted(path.rglob("manifest.json"))]
    else:
        with tarfile.open(path) as tar:
            texts = [tar.extractfile(m).read().decode() for m in tar.getmembers()
                     if m.isfile() and Path(m.name).name == "manifest.json"]
    specs = [VariantSpec.from_dict(json.loads(text)["spec"]) for text in texts]
    return [s for s in specs if s.target is Target.CUDA]


def gpu_specs(paths: list[str], bench: str | None, manifests: list[str] = ()) -> list:
    """The GPU_SPECS of the test files at ``paths`` (tests/ on sys.path, as pytest has it), the kernels of the
    benchmark rows ``bench`` selects (``--only``'s syntax) and the specs of the cache manifests ``manifests``."""
    sys.path.insert(0, str(ROOT / "tests"))
    specs = [s for m in manifests for s in manifest_specs(Path(m))]
    if bench:
        from jitattn.bench.configs import select
        from jitattn.bench.inputs import specs_of

        specs += [s for case in select("all", bench.split(",")) for s in specs_of(case, "cuda")]
    for path in paths:
        loader = importlib.util.spec_from_file_location(Path(path).stem, path)
        module = importlib.util.module_from_spec(loader)
        sys.modules[loader.name] = module  # (a dataclass in the module looks itself up there)
        loader.loader.exec_module(module)
        specs += list(getattr(module, "GPU_SPECS", []))
    return specs


def build(paths: list[str], bench: str | None, manifests: list[str], jobs: int) -> int:
    """Build the specs into JITATTN_CACHE_DIR; the number that failed."""
    import jitattn.jit

    started = time.perf_counter()
    results = jitattn.jit.build_many(list(dict.fromkeys(gpu_specs(paths, bench, manifests))), jobs=jobs)
    failed = [r for r in results if r.status == "failed"]
    counts = {s: sum(r.status == s for r in results) for s in sorted({r.status for r in results})}
    print(f"{len(results)} specs {counts} in {time.perf_counter() - started:.0f} s "
          f"({os.environ.get('JITATTN_DEV_SM90_TUNING', 'default knobs')})")
    for r in failed:
        print(f"  FAILED {r.spec.uri}: {(r.error or '').splitlines()[:1]}")
    return len(failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the archive to write (.tar.xz)")
    parser.add_argument("tests", nargs="*", help="test files whose GPU_SPECS to build")
    parser.add_argument("--bench", help="benchmark rows whose kernels to build too (python -m jitattn.bench's --only)")
    parser.add_argument("--manifests", action="append", default=[],
                        help="a cache directory, or an archive of one, whose manifests' specs to build too")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE: one more build with it set")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not os.environ.get("JITATTN_CUDA_ARCH_LIST"):
        raise SystemExit("set JITATTN_CUDA_ARCH_LIST to the GPU machine's arch list (e.g. 9.0a for an H200)")
    if args.child:
        return build(args.tests, args.bench, args.manifests, args.jobs)  # (the parent passes absolute paths)
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: give at least 1")
    if args.out.is_dir() or not args.out.resolve().parent.is_dir():
        parser.error(f"{args.out}: name an archive in an existing directory")
    # paths from the working directory, else from the repository root (the child runs there): absolute from here on
    args.tests, args.manifests = ([str(Path(t).resolve() if Path(t).exists() else ROOT / t) for t in paths]
                                  for paths in (args.tests, args.manifests))
    missing = [t for t in [*args.tests, *args.manifests] if not Path(t).exists()]
    if missing:
        parser.error(f"{os.path.relpath(missing[0], ROOT)}: no such file (from here or from the repository root)")
    bad = [e for e in args.env if not e.partition("=")[0] or not e.partition("=")[1]]
    if bad:
        parser.error(f"--env {bad[0]!r}: give NAME=VALUE")
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "JITATTN_CACHE_DIR": cache, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        failed = 0
        for setting in ["", *args.env]:
            child_env = dict(env)
            if setting:
                name, _, value = setting.partition("=")
                child_env[name] = value
            command = [sys.executable, __file__, str(args.out), *args.tests, "--jobs", str(args.jobs), "--child",
                       *(["--bench", args.bench] if args.bench else []),
                       *(a for m in args.manifests for a in ("--manifests", m))]
            failed += subprocess.run(command, env=child_env, cwd=ROOT).returncode
        if not any(Path(cache).rglob("manifest.json")):  # nothing built: keep the archive there is
            print(f"no kernel built; {args.out} left as it was", file=sys.stderr)
            return 1
        partial = args.out.with_name(args.out.name + ".partial")
        with tarfile.open(partial, "w:xz", preset=9) as tar:
            tar.add(cache, arcname=".")
        if failed:  # an archive missing kernels would stand in for a whole one: the caller decides
            print(f"some builds failed (above); {args.out} left as it was, the kernels that built are in {partial}",
                  file=sys.stderr)
            return 1
        partial.replace(args.out)  # whole or not at all
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

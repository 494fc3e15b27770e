"""The pipeline: spec -> render -> build (ninja, locked, cached) -> load.

``load(spec)`` is the one entry point the wrappers use; ``build_many`` builds
many cold specs in parallel under one job budget (the CLI and the GPU test
pre-build use it).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from .. import env
from ..log import get_logger
from ..kernels import family
from ..spec import Op, Target, VariantSpec
from .build import LIBRARY_NAME, compile_count
from .build_and_publish import build_entry, build_or_find_entry
from .cache import MANIFEST, entry_problem, find_entry, layers, writable_root
from .key import BuildInputs, build_inputs
from .errors import BuildError, CacheError, CompileDisabledError, JitError, KernelError
from .loader import LOAD_ERRORS, Module, library_problem
from .render import render
from .toolchain import ToolchainError, default_jobs

__all__ = [
    "BuildError", "BuildResult", "CacheError", "CompileDisabledError", "JitError", "KernelError", "Module",
    "ToolchainError", "build_many", "compile_count", "has_short_items_layout", "load", "render", "resident_blocks",
    "short_items_blocks", "warm_command",
]

# Loaded modules by (spec, _settings(spec)): the settings a module's source and flags depend on are read on every load
# of a spec they change, so changing one between calls loads that build.
_Key = tuple[VariantSpec, tuple]
_registry: dict[_Key, Module] = {}
_registry_lock = threading.Lock()  # guards _spec_locks; never held during a build
_spec_locks: dict[_Key, threading.Lock] = {}
# The last build of a key that failed in this process, and when (time.monotonic): threads that waited for that
# build get its error instead of each compiling again (a later call, after the wait, does try again).
_failed_builds: dict[_Key, tuple[BuildError, float]] = {}


def resident_blocks(spec: VariantSpec) -> int:
    """Blocks per SM the cuda kernel of ``spec`` is sized for (what split-KV planning balances over); 2 by default."""
    facts = getattr(family(spec.op), "resident_blocks", None)
    return facts(spec) if facts is not None else 2


def short_items_blocks(spec: VariantSpec) -> int:
    """Resident blocks per SM of the cuda module's second layout for plans of many short requests (the decode
    kernel's, ``kernels.decode.short_items_layout``); 0: the module has none."""
    facts = getattr(family(spec.op), "short_items_layout", None)
    layout = facts(spec) if spec.target is Target.CUDA and facts is not None else None
    return layout["kMinBlocks"] if layout is not None else 0


def has_short_items_layout(spec: VariantSpec) -> bool:
    """Whether the cuda module of ``spec`` has a second layout for plans of many short requests."""
    return short_items_blocks(spec) > 0


def warm_command(spec: VariantSpec) -> str:
    """A ``jitattn-cache warm`` command line that builds exactly ``spec`` (safe to paste into a shell).

    A spec whose uri the CLI can parse back is named by its uri; one with a
    custom variant (its uri holds only a hash of the snippets) by its JSON form.
    """
    import json
    import shlex

    from ..spec_text import parse_spec_text

    # a variant built under JITATTN_DEBUG=1 is another cache entry: the command must build that one
    command = ("JITATTN_DEBUG=1 " if spec.variant is not None and env.debug() else "") + "jitattn-cache warm --spec"
    try:
        if parse_spec_text(spec.uri) == spec:
            return f"{command} {shlex.quote(spec.uri)}"
    except (ValueError, TypeError, KeyError, IndexError):
        pass
    text = json.dumps(spec.to_dict(), sort_keys=True, separators=(",", ":"))
    return f"{command} {shlex.quote(text)}"


def _refuse_compile_if_asked(plan: BuildInputs, unloadable: str | None = None) -> None:
    """Raise under JITATTN_ASSERT_NO_COMPILE=1, saying why the spec is not loadable from the cache: ``unloadable``
    (an entry that does not load here), a damaged entry, or none at all."""
    if not env.assert_no_compile():
        return
    spec = plan.spec
    damaged = [(entry, problem) for entry in (base / plan.name for base in layers())
               if (entry / MANIFEST).exists() and (problem := entry_problem(entry, plan.key)) is not None]
    where = (unloadable if unloadable is not None else
             f"its cache entry {damaged[0][0]} is damaged ({damaged[0][1]})" if damaged else "it is not in the cache")
    raise CompileDisabledError(
        f"{spec.uri}: {where} and JITATTN_ASSERT_NO_COMPILE=1 forbids compiling it; "
        f"pre-build it in a process without that setting ({warm_command(spec)}), or unset JITATTN_ASSERT_NO_COMPILE"
    )


def _does_not_load(entry_dir: Path, why: object) -> CacheError:
    return CacheError(
        f"the cache entry {entry_dir} passes its checksum but does not load here: {why}. It was built "
        "against other libraries or toolchain (a cache shared between machines, or imported) or changed "
        "after it was built; `jitattn-cache verify --fix` removes it, and the next load rebuilds it")


def _ensure_built(plan: BuildInputs, jobs: int) -> tuple[str, float]:
    """(status, seconds) after making sure ``plan`` has an entry that loads here.

    status: 'cached' (there before), 'built' (this process compiled it) or
    'built-by-other' (another process published it while this one waited for its lock). An entry of a read-only
    layer that does not load here is built in the writable cache, as ``load`` would; one of the writable cache
    raises (``load`` would).
    """
    entry_dir = find_entry(plan)
    problem = None if entry_dir is None else library_problem(entry_dir / LIBRARY_NAME, plan.spec.uri)
    if entry_dir is not None and problem is None:
        return "cached", 0.0
    if problem is not None:
        if entry_dir.parent == writable_root():
            raise _does_not_load(entry_dir, problem)
        problem = f"its cache entry {entry_dir} (a read-only layer) does not load here ({problem})"
        get_logger().warning("%s: %s; building it in the writable cache", plan.spec.uri, problem)
    _refuse_compile_if_asked(plan, problem)
    started = time.perf_counter()
    _, built = build_or_find_entry(plan, jobs=jobs)
    status = "built" if built else "cached" if problem is not None else "built-by-other"
    return status, time.perf_counter() - started


def _settings(spec: VariantSpec) -> tuple:
    """The settings beyond ``spec`` that its module depends on and a process may change between loads: JITATTN_DEBUG
    (custom variants' checks), the prefill tier and arch list (prefill kernels). Other specs take none: their
    per-call loads (the per-layer ops) stay a dict lookup, and their arch list is the one of their first load."""
    if spec.variant is None and spec.op is not Op.PREFILL:
        return ()
    return env.build_settings()


def _check_spec(where: str, spec) -> None:
    if not isinstance(spec, VariantSpec):
        raise TypeError(f"{where}() takes VariantSpec objects, not {type(spec).__name__} {spec!r}; make one with "
                        "jitattn.VariantSpec(...), or jitattn.spec_text.parse_spec_text(uri) from a uri")


def _load_built(key: _Key, plan: BuildInputs, again: bool = True) -> Module:
    """``plan``'s module from its cache entry, built first when there is none. An entry removed between its lookup
    and its load (a concurrent `jitattn-cache clear` or prune) is looked up (or built) ``again`` once."""
    entry_dir = find_entry(plan)
    if entry_dir is None:
        _refuse_compile_if_asked(plan)
        try:
            entry_dir = build_entry(plan, jobs=default_jobs())
        except BuildError as exc:
            _failed_builds[key] = (exc, time.monotonic())
            raise
    try:
        return Module(plan.spec, entry_dir / LIBRARY_NAME, plan.entries)
    except LOAD_ERRORS as exc:  # its checksum matched: not a torn write
        if again and not (entry_dir / LIBRARY_NAME).exists():
            return _load_built(key, plan, again=False)
        if again and entry_dir.parent != writable_root():  # a read-only layer's, built elsewhere: build this one's
            get_logger().warning("the cache entry %s (a read-only layer) does not load here (%s); building the "
                                 "kernel in the writable cache", entry_dir, exc)
            _refuse_compile_if_asked(plan, f"its cache entry {entry_dir} (a read-only layer) does not load here "
                                           f"({exc})")
            return Module(plan.spec, build_entry(plan, jobs=default_jobs()) / LIBRARY_NAME, plan.entries)
        raise _does_not_load(entry_dir, exc) from exc


def load(spec: VariantSpec) -> Module:
    """The loaded module for ``spec``: a dict hit after the first call in a process.

    On a cache miss this renders, builds (one INFO log line) and publishes the
    module first; with JITATTN_ASSERT_NO_COMPILE=1 a miss raises instead.
    """
    _check_spec("load", spec)
    key = (spec, _settings(spec))
    module = _registry.get(key)
    if module is not None:
        return module
    with _registry_lock:
        spec_lock = _spec_locks.setdefault(key, threading.Lock())
    asked = time.monotonic()
    with spec_lock:  # one thread builds a given spec; loads of other specs proceed
        module = _registry.get(key)
        if module is None:
            failed = _failed_builds.get(key)
            if failed is not None and failed[1] >= asked:  # the build this call waited for failed
                raise BuildError(str(failed[0]))
            module = _load_built(key, build_inputs(spec))
            _registry[key] = module
    return module


@dataclass(frozen=True)
class BuildResult:
    spec: VariantSpec
    status: str  # "cached", "built", "built-by-other" (published by another process meanwhile) or "failed"
    seconds: float
    error: str | None = None


def build_many(
    specs: Iterable[VariantSpec],
    jobs: int | None = None,
    on_done: Callable[[BuildResult], None] | None = None,
    raise_on_error: bool = False,
) -> list[BuildResult]:
    """Make sure every spec has a cache entry, building cold ones in parallel.

    ``jobs`` (default: the memory-aware ``default_jobs()``) bounds the
    compiler processes running at once across all specs. ``on_done`` is
    called once per spec as it finishes (the CLI's progress bar).
    """
    if isinstance(specs, (str, VariantSpec)):
        parsed = " parsed by jitattn.spec_text.parse_spec_text" if isinstance(specs, str) else ""
        raise TypeError(f"build_many() takes an iterable of VariantSpecs, not one {type(specs).__name__}: pass "
                        f"[{specs!r}]{parsed}")
    specs = list(specs)
    for spec in specs:
        _check_spec("build_many", spec)
    unique = list(dict.fromkeys(specs))
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"build_many(jobs={jobs!r}): jobs is a positive int (compiler processes at once), or None "
                         "for the memory-aware default")
    jobs = jobs or default_jobs()
    results: list[BuildResult] = []

    def one(spec: VariantSpec) -> BuildResult:
        started = time.perf_counter()
        try:
            status, _ = _ensure_built(build_inputs(spec), jobs=1)
            return BuildResult(spec, status, time.perf_counter() - started)
        except (JitError, ToolchainError, ValueError, NotImplementedError, OSError) as exc:
            return BuildResult(spec, "failed", time.perf_counter() - started, str(exc))

    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(unique) or 1))) as pool:
        futures = [pool.submit(one, spec) for spec in unique]
        for future in as_completed(futures):
            result = future.result()
            results.append(result)
            if on_done is not None:
                on_done(result)
    order = {spec: i for i, spec in enumerate(unique)}
    results.sort(key=lambda r: order[r.spec])
    failed = [r for r in results if r.status == "failed"]
    if raise_on_error and failed:
        details = "\n\n".join(f"{r.spec.uri}: {r.error}" for r in failed)
        raise BuildError(f"{len(failed)} of {len(results)} builds failed:\n{details}")
    return results

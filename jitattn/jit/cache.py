"""The content-keyed kernel cache and its publish protocol.

Layout: ``<layer>/<SCHEMA>/<uri>-<key16>/{sources/, build.ninja, lib.so, manifest.json}``.
Read-only layers (``JITATTN_CACHE_PATH``) are searched first and never written;
the writable root (``JITATTN_CACHE_DIR`` or the platform cache dir) last.

An entry exists once its ``manifest.json`` exists and the library's sha256
matches it. Builds happen in a private temp dir under a per-key file lock
(released by the OS if the holder dies) and are published by one atomic
rename, so a killed build, a half-written file or a corrupted library never
becomes something that loads.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import platform
import re
import shutil
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import filelock

from .. import __version__, env
from ..abi import ABI_VERSION, Entry
from ..families import family
from ..log import get_logger
from ..spec import Target, VariantSpec
from . import toolchain as tc
from . import trust
from .build import LIBRARY_NAME, build_cancelled, raise_if_cancelled, run_ninja, write_ninja
from .errors import BuildError, CacheError
from .loader import check_library
from ..families.variant import explain_build_error
from .render import included_headers, render
from .templates import include_dir

SCHEMA = "v1"
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class BuildPlan:
    """Everything that determines one binary, and the key derived from it."""

    spec: VariantSpec
    sources: dict[str, str]
    headers: dict[str, str]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    archs: tuple[str, ...]
    key: str

    @property
    def name(self) -> str:
        return f"{self.spec.uri}-{self.key[:16]}"

    @property
    def entries(self) -> tuple[Entry, ...]:
        return family(self.spec.op).entries(self.spec)


def compute_key(
    spec: VariantSpec, sources: dict[str, str], headers: dict[str, str],
    cflags: tuple[str, ...], ldflags: tuple[str, ...], archs: tuple[str, ...],
) -> str:
    """sha256 over every keyed input; paths, mtimes and compiler locations are not among them."""
    material = {
        "schema": SCHEMA,
        "abi": ABI_VERSION,
        "spec": spec.to_dict(),
        "sources": sources,
        "headers": headers,
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "archs": list(archs),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def plan_build(spec: VariantSpec) -> BuildPlan:
    """Render ``spec`` and compute its key (pure apart from reading templates and the arch)."""
    sources = render(spec)
    headers = included_headers(sources, spec.target)
    archs = tc.cuda_arch_list() if spec.target is Target.CUDA else ()
    cflags = tc.compile_flags(spec.target) + tc.gencode_flags(archs)
    ldflags = tc.link_flags(spec.target) + tc.gencode_flags(archs)
    key = compute_key(spec, sources, headers, cflags, ldflags, archs)
    return BuildPlan(spec, sources, headers, cflags, ldflags, archs, key)


# -- locations and safety ------------------------------------------------------


def _unsafe_reason(path: Path) -> str | None:
    """Why loading code from ``path`` would be unsafe (with the fix), or None."""
    found = trust.violations(path, follow_links=True)
    return "; ".join(str(v) for v in found) if found else None


def writable_root() -> Path:
    """The writable cache root's schema dir, created private (0700) if missing.

    Raises CacheError when it cannot be created, is not writable, or breaks the
    trust rule anywhere from the root to ``locks/`` and ``tmp/`` (checked before
    every build and every write).
    """
    root = env.cache_dir()
    base = root / SCHEMA
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in (base, base / "locks", base / "tmp"):
            sub.mkdir(mode=0o700, exist_ok=True)
    except OSError as exc:
        raise CacheError(
            f"cannot create the jitattn cache at {root} ({exc.strerror}); set JITATTN_CACHE_DIR to a "
            "writable directory"
        ) from None
    if not os.access(root, os.W_OK | os.X_OK) or not os.access(base, os.W_OK | os.X_OK):
        raise CacheError(f"the jitattn cache at {root} is not writable; set JITATTN_CACHE_DIR to a writable directory")
    trust.require_trusted(root, base / "locks", base / "tmp", action="build in")
    return base


def layers() -> list[Path]:
    """Schema dirs to search for entries, read-only layers first (they need not exist)."""
    found = [layer / SCHEMA for layer in env.cache_path()]
    found.append(env.cache_dir() / SCHEMA)
    return found


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(entry_dir: Path) -> dict | None:
    try:
        return json.loads((entry_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def entry_problem(entry_dir: Path, key: str | None = None) -> str | None:
    """Why ``entry_dir`` is not a usable entry (missing, corrupt, wrong key), or None."""
    manifest = read_manifest(entry_dir)
    if manifest is None:
        return "no readable manifest"
    if key is not None and manifest.get("key") != key:
        return "manifest key does not match"
    library = entry_dir / manifest.get("library", LIBRARY_NAME)
    try:
        actual = sha256_file(library)
    except OSError:
        return "library missing"
    if actual != manifest.get("sha256"):
        return "library checksum does not match its manifest (corrupted)"
    return None


def find_entry(plan: BuildPlan) -> Path | None:
    """The first valid entry for ``plan`` in the read-only layers, then the writable root."""
    log = get_logger()
    for base in layers():
        entry_dir = base / plan.name
        if not (entry_dir / MANIFEST).exists():
            continue
        # Whoever can write a directory on the way can swap entries in and out of it; the writable
        # cache's locks/ and tmp/ are held to the same rule as on the build path.
        extra = (base / "locks", base / "tmp") if base == layers()[-1] else ()
        trust.require_trusted(base.parent, entry_dir, *extra, action="load a kernel from")
        problem = entry_problem(entry_dir, plan.key)
        if problem is None:
            trust.require_trusted(base.parent, entry_dir / LIBRARY_NAME, action="load a kernel from")
            return entry_dir
        log.warning("ignoring cache entry %s: %s", entry_dir, problem)
    return None


# -- building and publishing ---------------------------------------------------


def build_entry(plan: BuildPlan, jobs: int = 1) -> Path:
    """Build and publish ``plan`` into the writable root; returns the entry dir.

    Exactly one process builds a given key at a time; the others wait on the
    lock, then find the published entry.
    """
    return build_or_find_entry(plan, jobs)[0]


def build_or_find_entry(plan: BuildPlan, jobs: int = 1) -> tuple[Path, bool]:
    """(entry dir, True if this call built it) -- False: another process published it while we waited."""
    base = writable_root()
    root = base.parent
    entry_dir = base / plan.name
    lock = filelock.FileLock(str(base / "locks" / (plan.name + ".lock")))
    log = get_logger()
    try:
        lock.acquire(timeout=2)
    except filelock.Timeout:
        log.info("waiting for another process building %s", plan.spec.uri)
        while True:  # poll so that a cancelled build (Ctrl-C in `jitattn-cache warm`) stops waiting
            raise_if_cancelled(plan.spec.uri)
            try:
                lock.acquire(timeout=0.2)
                break
            except filelock.Timeout:
                continue
    try:
        if (entry_dir / MANIFEST).exists() and entry_problem(entry_dir, plan.key) is None:
            trust.require_trusted(root, entry_dir / LIBRARY_NAME, action="load a kernel from")
            _forget_failure(base, plan.name)
            return entry_dir, False
        _remove_stale_temps(base, plan.name)
        started = time.perf_counter()
        work_dir = _build_in_temp(base, plan, jobs)
        try:
            seconds = time.perf_counter() - started
            _write_manifest(work_dir, plan, seconds)
            _point_build_file_at(work_dir, entry_dir)
            raise_if_cancelled(plan.spec.uri)
            # The last check before the rename: nobody else can have changed the path in the meantime.
            trust.require_trusted(root, work_dir, entry_dir.parent, action="publish into")
            if entry_dir.exists():  # a corrupted or stale entry: move it out of the way first
                trash = base / "tmp" / f"{plan.name}.trash-{uuid.uuid4().hex[:8]}"
                os.replace(entry_dir, trash)
                shutil.rmtree(trash, ignore_errors=True)
            os.replace(work_dir, entry_dir)
        except OSError as exc:
            raise write_error(exc, f"the cache entry of {plan.spec.uri}", work_dir) from None
        finally:
            if work_dir.exists():  # not published: leave no partial entry behind
                shutil.rmtree(work_dir, ignore_errors=True)
        _forget_failure(base, plan.name)
        log.info("built %s in %.1f s -> %s", plan.spec.uri, seconds, entry_dir)
        return entry_dir, True
    finally:
        lock.release()


def write_error(exc: OSError, what: str, where: Path) -> CacheError:
    """One readable CacheError for a failed write: what, where, the free space and what to do."""
    import errno

    target = Path(getattr(exc, "filename", None) or where)
    probe = target
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        free = shutil.disk_usage(probe).free
        free_text = (f"{free / (1 << 20):.1f} MiB" if free >= 1 << 20 else f"{free // 1024} KiB") + \
            " free on that filesystem"
    except OSError:
        free_text = "free space unknown"
    reason = exc.strerror or str(exc)
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = ("free some space (`jitattn-cache prune --max-size 1G` removes old kernels) or set "
                  "JITATTN_CACHE_DIR to a disk with room")
    elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        advice = "the cache is not writable there: fix its permissions or set JITATTN_CACHE_DIR to a writable directory"
    else:
        advice = "check the disk, then try again (or set JITATTN_CACHE_DIR to another directory)"
    return CacheError(
        f"could not write {what} to {target}: {reason} ({free_text}). Nothing was published and the cache is "
        f"still usable; {advice}"
    )


def _forget_failure(base: Path, name: str) -> None:
    # Once the entry exists, a failure kept from an earlier attempt only misleads.
    shutil.rmtree(base / "failed" / name, ignore_errors=True)


def _remove_stale_temps(base: Path, name: str) -> None:
    # We hold the key's lock, so any temp dir of this key is left over from a killed build.
    for leftover in (base / "tmp").glob(name + ".*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _build_in_temp(base: Path, plan: BuildPlan, jobs: int) -> Path:
    toolchain = tc.probe(plan.spec.target)
    raise_if_cancelled(plan.spec.uri)
    try:
        work_dir = Path(tempfile.mkdtemp(prefix=plan.name + ".", dir=base / "tmp"))
    except OSError as exc:
        raise write_error(exc, f"the build directory of {plan.spec.uri}", base / "tmp") from None
    done = False
    try:
        trust.require_trusted(base.parent, work_dir, action="build in")
        try:
            (work_dir / "sources").mkdir()
            (work_dir / "obj").mkdir()
            for name, text in plan.sources.items():
                (work_dir / "sources" / name).write_text(text)
            main_sources = [n for n in plan.sources if not n.endswith(".h")]
            write_ninja(work_dir, main_sources, plan.spec.target, toolchain, plan.cflags, plan.ldflags,
                        include_dir(plan.spec.target.value))
        except OSError as exc:
            raise write_error(exc, f"the sources of {plan.spec.uri}", work_dir) from None
        try:
            run_ninja(work_dir, jobs, work_dir / "sources" / main_sources[0])
        except BuildError as exc:
            if build_cancelled():
                raise
            if "No space left on device" in str(exc):
                raise write_error(OSError(28, "No space left on device", str(work_dir)),
                                  f"the compiler's output for {plan.spec.uri}", work_dir) from None
            kept = _keep_failed(base, plan, work_dir)
            if isinstance(kept, Path):
                text = str(exc).replace(str(work_dir), str(kept))
            else:  # the files named in the message are removed with the temp dir: say so
                text = f"{exc}\n(the failed build could not be kept for inspection: {kept}; it was removed)"
            raise BuildError(explain_build_error(plan.spec, text, plan.sources.get("variant.h"))) from None
        try:
            check_library(work_dir / LIBRARY_NAME, plan.spec.uri, plan.entries)
        except (OSError, RuntimeError, AttributeError) as exc:
            raise BuildError(f"{plan.spec.uri}: the built library does not load or lacks a symbol: {exc}") from None
        shutil.rmtree(work_dir / "obj", ignore_errors=True)
        _drop_shared_write_bits(work_dir)
        done = True
        return work_dir
    except OSError as exc:
        raise write_error(exc, f"the build of {plan.spec.uri}", work_dir) from None
    finally:
        if not done:  # failed, cancelled or interrupted: nothing of it stays in tmp/
            shutil.rmtree(work_dir, ignore_errors=True)


def _point_build_file_at(work_dir: Path, final_dir: Path) -> None:
    # build.ninja names absolute paths; make it name the published entry so it can be re-run there.
    ninja_file = work_dir / "build.ninja"
    ninja_file.write_text(ninja_file.read_text().replace(str(work_dir), str(final_dir)))


def _drop_shared_write_bits(work_dir: Path) -> None:
    # A permissive umask (002) must not make our own entries fail the safety check.
    for path in [work_dir, *work_dir.rglob("*")]:
        mode = path.stat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(path, mode & ~(stat.S_IWGRP | stat.S_IWOTH))


def _keep_failed(base: Path, plan: BuildPlan, work_dir: Path) -> Path | str:
    """Move a failed build where the user can read it; returns its new path, or why it could not.

    A rename, not a copy: it needs no disk space, and the full compiler log
    (``build.log``) goes with it.
    """
    failed = base / "failed" / plan.name
    try:
        failed.parent.mkdir(mode=0o700, exist_ok=True)
        shutil.rmtree(failed, ignore_errors=True)
        _point_build_file_at(work_dir, failed)
        os.replace(work_dir, failed)
    except OSError as exc:
        return exc.strerror or str(exc)
    return failed


def _write_manifest(work_dir: Path, plan: BuildPlan, seconds: float) -> None:
    toolchain = tc.probe(plan.spec.target)
    library = work_dir / LIBRARY_NAME
    manifest = {
        "schema": SCHEMA,
        "uri": plan.spec.uri,
        "key": plan.key,
        "spec": plan.spec.to_dict(),
        "target": plan.spec.target.value,
        "archs": list(plan.archs),
        "cflags": list(plan.cflags),
        "ldflags": list(plan.ldflags),
        "toolchain": {"compiler": os.path.basename(toolchain.compiler), "version": toolchain.version},
        "machine": platform.machine(),  # host architecture; `jitattn-cache import` checks it
        "library": LIBRARY_NAME,
        "sha256": sha256_file(library),
        "size": library.stat().st_size,
        "exports": [e.symbol for e in plan.entries],
        "built_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "build_seconds": round(seconds, 3),
        "jitattn_version": __version__,
    }
    partial = work_dir / (MANIFEST + ".partial")
    with open(partial, "w") as f:
        json.dump(manifest, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(partial, work_dir / MANIFEST)


# -- maintenance (the jitattn-cache CLI) -----------------------------------------

# An entry dir is named "<uri>-<key16>"; the schema dir also holds locks/, tmp/ and failed/.
ENTRY_NAME_RE = re.compile(r"^[a-z0-9_]+-[0-9a-f]{16}$")


def entry_lock(base: Path, name: str) -> filelock.FileLock:
    """The per-key lock of entry ``name`` in schema dir ``base`` (the lock ``build_entry`` takes)."""
    for sub in ("locks", "tmp"):
        (base / sub).mkdir(mode=0o700, exist_ok=True)
    return filelock.FileLock(str(base / "locks" / (name + ".lock")))


def entry_dirs(base: Path) -> list[Path]:
    """Every entry-named dir of schema dir ``base`` (valid or not), sorted by name."""
    try:
        return sorted(p for p in base.iterdir() if p.is_dir() and ENTRY_NAME_RE.match(p.name))
    except OSError:
        return []


def foreign_entry_problem(entry_dir: Path) -> str | None:
    """Why ``entry_dir`` (possibly from another machine) is not a consistent entry, or None.

    Beyond ``entry_problem``: the manifest's schema, uri and key must match the
    dir's name, and its spec must be valid and have that uri.
    """
    problem = entry_problem(entry_dir)
    if problem is not None:
        return problem
    manifest = read_manifest(entry_dir)
    if manifest.get("schema") != SCHEMA or manifest.get("library", LIBRARY_NAME) != LIBRARY_NAME:
        return f"manifest schema {manifest.get('schema')!r} / library {manifest.get('library')!r} is not ours"
    key = str(manifest.get("key", ""))
    if f"{manifest.get('uri')}-{key[:16]}" != entry_dir.name or not re.fullmatch(r"[0-9a-f]{64}", key):
        return "manifest uri/key do not match the entry's name"
    try:
        spec = VariantSpec.from_dict(manifest.get("spec") or {})
    except (TypeError, ValueError) as exc:
        return f"manifest spec is invalid: {exc}"
    if spec.uri != manifest.get("uri"):
        return f"manifest spec has uri {spec.uri!r}, not {manifest.get('uri')!r}"
    return None


def remove_entry(base: Path, entry_dir: Path, timeout: float = 10.0) -> bool:
    """Remove an entry of the writable schema dir ``base`` under its per-key lock.

    The entry is first renamed into ``tmp/`` (one atomic step: a loader sees it
    or not), then deleted. Returns False if the lock stayed busy (a build of
    that key is running).
    """
    lock = entry_lock(base, entry_dir.name)
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        return False
    try:
        if entry_dir.exists():
            trash = base / "tmp" / f"{entry_dir.name}.trash-{uuid.uuid4().hex[:8]}"
            os.replace(entry_dir, trash)
            shutil.rmtree(trash, ignore_errors=True)
        return True
    finally:
        lock.release()


def publish_entry(base: Path, staged: Path, timeout: float | None = None) -> str:
    """Move a complete, verified entry dir ``staged`` (on ``base``'s filesystem) into ``base``.

    Under the per-key lock: a valid entry already there is kept ('present');
    an invalid one is replaced ('replaced'); else the entry is published by one
    atomic rename ('published'). ``staged`` is consumed either way.
    """
    entry_dir = base / staged.name
    lock = entry_lock(base, staged.name)
    lock.acquire(timeout=-1 if timeout is None else timeout)
    try:
        trust.require_trusted(base.parent, base / "locks", base / "tmp", staged, action="publish into")
        if entry_dir.exists() and entry_problem(entry_dir) is None:
            shutil.rmtree(staged, ignore_errors=True)
            return "present"
        status = "published"
        if entry_dir.exists():
            trash = base / "tmp" / f"{staged.name}.trash-{uuid.uuid4().hex[:8]}"
            os.replace(entry_dir, trash)
            shutil.rmtree(trash, ignore_errors=True)
            status = "replaced"
        os.replace(staged, entry_dir)
        return status
    finally:
        lock.release()

"""Building and publishing one cache entry: the sequence behind a cache miss.

Under the key's lock: look again; render the sources into a private temp dir, run ninja, check
the library loads and exports its entries, write the manifest last, then ``cache.install_entry``
(one atomic rename). A failure leaves no partial entry: the build moves to ``failed/`` for
inspection and the error is explained in the snippet's own terms when a variant caused it.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import stat
import tempfile
import time
from pathlib import Path

import filelock

from ..kernels import family
from ..log import get_logger
from ..version import __version__
from . import toolchain as tc
from . import trust
from .build import LIBRARY_NAME, BuildKilled, build_cancelled, raise_if_cancelled, run_ninja, write_ninja
from .cache import (
    MANIFEST, entry_lock, entry_problem, install_entry, remove_stale_temps, sha256_file, write_error, writable_root,
)
from .errors import BuildError, CacheError
from .key import SCHEMA, BuildInputs
from .loader import check_library
from .templates import include_dir


def explain_build_error(spec, message: str, sources: dict[str, str]) -> str:
    """The family's reading of a compiler error (a custom variant's snippets mapped back), else the message."""
    explain = getattr(family(spec.op), "explain_build_error", None)
    return explain(spec, message, sources) if explain is not None else message


def build_entry(plan: BuildInputs, jobs: int = 1) -> Path:
    """Build and publish ``plan`` into the writable root; returns the entry dir.

    Exactly one process builds a given key at a time; the others wait on the
    lock, then find the published entry.
    """
    return build_or_find_entry(plan, jobs)[0]


# A build that holds its entry's lock this long is worth a warning to whoever waits for it (a cuda build of a
# large spec takes a minute or two; the next warnings come at 4x the wait).
LOCK_WARN_SECONDS = 120


def build_or_find_entry(plan: BuildInputs, jobs: int = 1) -> tuple[Path, bool]:
    """(entry dir, True if this call built it) -- False: another process published it while we waited."""
    base = writable_root()
    root = base.parent
    entry_dir = base / plan.name
    lock = entry_lock(base, plan.name)
    log = get_logger()
    try:
        lock.acquire(timeout=2)
    except filelock.Timeout:
        log.info("waiting for another process building %s", plan.spec.uri)
        waited, warn_at = time.perf_counter(), LOCK_WARN_SECONDS
        while True:  # poll so that a cancelled build (Ctrl-C in `jitattn-cache warm`) stops waiting
            raise_if_cancelled(plan.spec.uri)
            try:
                lock.acquire(timeout=0.2)
                break
            except filelock.Timeout:
                if time.perf_counter() - waited >= warn_at:  # a stopped or hung holder keeps it for good
                    log.warning("still waiting after %d s for the process that holds %s (building %s); if none is "
                                "building it (a stopped or hung process), end that process", warn_at,
                                lock.lock_file, plan.spec.uri)
                    warn_at *= 4
    except OSError as exc:  # (after Timeout, one too) a directory, a link loop or an unwritable file in its place
        locks = Path(lock.lock_file).parent
        what = f"cannot take the build lock {lock.lock_file} ({exc.strerror or exc})"
        in_place = os.path.lexists(lock.lock_file)  # (something is there that is not a file this user can write)
        if not os.access(locks, os.W_OK | os.X_OK):  # the lock cannot be made there, nor what is there removed
            then = f", remove it (rm -rf {lock.lock_file})" if in_place else ""
            raise CacheError(f"{what}: its directory {locks} is not writable for you; fix it (chmod u+rwx {locks})"
                             f"{then} and retry") from None
        raise CacheError(f"{what}; it must be a file you can write: remove it (rm -rf {lock.lock_file}) and "
                         "retry") from None
    try:
        if (entry_dir / MANIFEST).exists() and entry_problem(entry_dir, plan.key) is None:
            trust.require_trusted(root, entry_dir / LIBRARY_NAME, action="load a kernel from")
            _forget_failure(base, plan.name)
            return entry_dir, False
        remove_stale_temps(base, plan.name)
        started = time.perf_counter()
        work_dir = _build_in_temp(base, plan, jobs)
        try:
            seconds = time.perf_counter() - started
            _write_manifest(work_dir, plan, seconds)
            _point_build_file_at(work_dir, entry_dir)
            raise_if_cancelled(plan.spec.uri)
            # The last check before the rename: nobody else can have changed the path in the meantime.
            trust.require_trusted(root, work_dir, entry_dir.parent, action="publish into")
            install_entry(base, work_dir, plan.name)  # a corrupted or stale entry there is discarded first
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


def _forget_failure(base: Path, name: str) -> None:
    # Once the entry exists, a failure kept from an earlier attempt only misleads.
    shutil.rmtree(base / "failed" / name, ignore_errors=True)


def _build_in_temp(base: Path, plan: BuildInputs, jobs: int) -> Path:
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
            if build_cancelled() or isinstance(exc, BuildKilled):
                raise
            if "No space left on device" in str(exc):
                raise write_error(OSError(28, "No space left on device", str(work_dir)),
                                  f"the compiler's output for {plan.spec.uri}", work_dir) from None
            kept = _keep_failed(base, plan, work_dir)
            if isinstance(kept, Path):
                text = str(exc).replace(str(work_dir), str(kept))
            else:  # the files named in the message are removed with the temp dir: say so
                text = f"{exc}\n(the failed build could not be kept for inspection: {kept}; it was removed)"
            raise BuildError(explain_build_error(plan.spec, text, plan.sources)) from None
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


def _keep_failed(base: Path, plan: BuildInputs, work_dir: Path) -> Path | str:
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


def _write_manifest(work_dir: Path, plan: BuildInputs, seconds: float) -> None:
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

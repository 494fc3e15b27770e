"""The content-keyed kernel cache on disk: layers, trust checks, lookup, locks, publishing, removal.

Layout: ``<layer>/<SCHEMA>/<uri>-<key16>/{sources/, build.ninja, lib.so, manifest.json}``.
Read-only layers (``JITATTN_CACHE_PATH``) are searched first and never written;
the writable root (``JITATTN_CACHE_DIR`` or the platform cache dir) last.

An entry exists once its ``manifest.json`` exists and the library's sha256
matches it. Builds happen in a private temp dir under a per-key file lock
(released by the OS if the holder dies) and are published by one atomic
rename, so a killed build, a half-written file or a corrupted library never
becomes something that loads. The key is computed in ``key.py``; the build that
ends in ``install_entry`` is ``build_and_publish.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import uuid
from pathlib import Path

import filelock

from .. import env
from ..log import get_logger
from ..spec import VariantSpec
from . import trust
from .build import LIBRARY_NAME
from .errors import CacheError
from .key import SCHEMA, BuildInputs

MANIFEST = "manifest.json"


# -- locations and safety ------------------------------------------------------


def unsafe_reason(path: Path) -> str | None:
    """Why loading code from ``path`` would be unsafe (with the fix), or None."""
    found = trust.violations(path, follow_links=True)
    return "; ".join(str(v) for v in found) if found else None


def writable_root() -> Path:
    """The writable cache root's schema dir, created private (0700) if missing.

    Raises CacheError when it cannot be created, is not writable, or breaks the
    trust rule anywhere from the root to ``locks/`` and ``tmp/`` (checked before
    every build and every write).
    """
    root = _cache_dir()
    base = root / SCHEMA
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        for sub in (base, base / "locks", base / "tmp"):
            sub.mkdir(mode=0o700, exist_ok=True)
    except FileExistsError as exc:  # a file or a dangling link where one of its directories belongs
        raise CacheError(f"{exc.filename} is in the jitattn cache's way: it exists but is not a directory; remove "
                         f"it (rm {exc.filename}) or set JITATTN_CACHE_DIR to another directory") from None
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
    writable = _cache_dir() / SCHEMA
    # each folder once, however it is spelt (a/../b, a link to it); the writable cache listed as a layer too: once,
    # writable
    seen = {os.path.realpath(writable)}
    found = []
    for base in (layer / SCHEMA for layer in env.cache_path()):
        real = os.path.realpath(base)
        if real not in seen:
            seen.add(real)
            found.append(base)
    found.append(writable)
    return found


def _cache_dir() -> Path:
    """``env.cache_dir()``, refused as a CacheError when the setting cannot be a directory (it or a parent of it is a
    regular file; a ~user that names no user): every load and every command then says so, not 'Not a directory'."""
    problem = env.CACHE_DIR.problem()  # (one stat where the directory exists)
    if problem is not None:
        raise CacheError(problem)
    return env.cache_dir()


def _regular(path: Path) -> Path:
    """``path``, when it is a regular file: opening a FIFO (or a device) put there would block its reader for good
    (an OSError otherwise, read as a missing or unreadable file)."""
    if not stat.S_ISREG(os.lstat(path).st_mode):
        raise OSError(f"{path} is not a regular file")
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(_regular(path), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_manifest(entry_dir: Path) -> dict | None:
    """The entry's manifest, or None when it is missing or not a JSON object (``[1, 2]`` or ``42`` is as unreadable
    as a truncated file: every reader expects an object)."""
    try:
        manifest = json.loads(_regular(entry_dir / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def entry_problem(entry_dir: Path, key: str | None = None) -> str | None:
    """Why ``entry_dir`` is not a usable entry (missing, corrupt, wrong key), or None."""
    manifest = read_manifest(entry_dir)
    if manifest is None:
        return "no readable manifest"
    if key is not None and manifest.get("key") != key:
        return "manifest key does not match"
    if manifest.get("schema") != SCHEMA:  # loads and verify read the same fields: a hand-edited one fails both
        return f"manifest schema {manifest.get('schema')!r} is not {SCHEMA!r}"
    if manifest.get("library", LIBRARY_NAME) != LIBRARY_NAME:  # the loader opens LIBRARY_NAME: check that file
        return f"manifest names library {manifest.get('library')!r}, not {LIBRARY_NAME!r}"
    library = entry_dir / LIBRARY_NAME
    try:
        actual = sha256_file(library)
    except OSError:
        return "library missing"
    if actual != manifest.get("sha256"):
        return "library checksum does not match its manifest (corrupted)"
    return None


def find_entry(plan: BuildInputs) -> Path | None:
    """The first valid entry for ``plan`` in the read-only layers, then the writable root."""
    log = get_logger()
    for base in layers():
        entry_dir = base / plan.name
        try:
            if not (entry_dir / MANIFEST).exists():
                continue
        except OSError as exc:  # (a missing path is False; one it cannot search raises)
            raise unreadable(entry_dir, exc) from None
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


# -- maintenance (the jitattn-cache CLI) -----------------------------------------

# An entry dir is named "<uri>-<key16>", where a custom variant's uri ends in "_v<name>-<hash8>" (its name may hold
# capitals); the schema dir also holds locks/, tmp/ and failed/.
ENTRY_NAME_RE = re.compile(r"^[a-z0-9_]+(?:_v[A-Za-z][A-Za-z0-9_]*-[0-9a-f]{8})?-[0-9a-f]{16}\Z")


def entry_lock(base: Path, name: str) -> filelock.FileLock:
    """The per-key lock of entry ``name`` in schema dir ``base`` (the lock ``build_entry`` takes)."""
    for sub in ("locks", "tmp"):
        try:
            (base / sub).mkdir(mode=0o700, exist_ok=True)
        except FileExistsError:  # a file (or a dangling link) where the cache's own directory belongs
            raise CacheError(f"{base / sub} is in the cache's way: it exists but is not a directory; remove it "
                             f"(rm {base / sub}) and retry") from None
    return filelock.FileLock(str(base / "locks" / (name + ".lock")))


def entry_dirs(base: Path) -> list[Path]:
    """Every entry-named dir of schema dir ``base`` (valid or not), sorted by name; none where it does not exist.
    A ``base`` this process cannot read raises a CacheError (its entries would be missed, silently)."""
    try:
        return sorted(p for p in base.iterdir() if p.is_dir() and ENTRY_NAME_RE.match(p.name))
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise unreadable(base, exc) from None


def unreadable(path: Path, exc: OSError) -> CacheError:
    """The error for a cache directory (a layer's, an entry's) that this process cannot read."""
    return CacheError(f"cannot read {path} ({exc.strerror or exc}): give yourself read and search access to it "
                      f"(chmod -R u+rX {path}); a read-only layer may instead be taken out of JITATTN_CACHE_PATH")


def foreign_entry_problem(entry_dir: Path) -> str | None:
    """Why ``entry_dir`` (possibly from another machine) is not a consistent entry, or None.

    Beyond ``entry_problem``: the manifest's uri and key must match the
    dir's name, and its spec must be valid and have that uri.
    """
    problem = entry_problem(entry_dir)
    if problem is not None:
        return problem
    manifest = read_manifest(entry_dir)
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


def _check_entry_of(base: Path, entry_dir: Path) -> None:
    if entry_dir.parent != base or not ENTRY_NAME_RE.match(entry_dir.name):
        raise ValueError(f"{entry_dir} is not a cache entry of {base}; nothing removed")


def discard_entry(base: Path, entry_dir: Path) -> None:
    """Move ``entry_dir`` into ``tmp/`` (one atomic step: a loader sees it whole or not at all), then delete it.

    Call with the entry's lock held. ``entry_dir`` must be an entry's name in ``base`` (nothing else is removed).
    """
    _check_entry_of(base, entry_dir)
    if os.path.lexists(entry_dir):  # (a link in an entry's place, dangling or not, goes too)
        trash = base / "tmp" / f"{entry_dir.name}.trash-{uuid.uuid4().hex[:8]}"
        os.replace(entry_dir, trash)
        if trash.is_symlink():
            trash.unlink()
        else:
            shutil.rmtree(trash, ignore_errors=True)


def install_entry(base: Path, staged: Path, name: str) -> str:
    """The one publish step: ``staged`` (complete, verified, on ``base``'s filesystem) becomes entry ``name``.

    Call with the entry's lock held; an entry already there is discarded first. Returns
    'replaced' or 'published'.
    """
    entry_dir = base / name
    status = "replaced" if entry_dir.exists() else "published"
    discard_entry(base, entry_dir)
    os.replace(staged, entry_dir)
    return status


def remove_stale_builds(base: Path) -> int:
    """Delete what builds of schema dir ``base`` left in ``tmp/`` when their process was killed (``<entry>.<id>``
    build and trash directories), each only while its entry's lock is free (no build of it is running); returns
    how many were deleted. A killed build's compiler may still finish into its directory: the lock is its owner's."""
    try:
        names = {p.name.split(".", 1)[0] for p in (base / "tmp").iterdir() if p.is_dir()}
    except OSError:
        return 0
    removed = 0
    for name in sorted(n for n in names if ENTRY_NAME_RE.match(n)):
        lock = entry_lock(base, name)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            continue
        try:
            removed += remove_stale_temps(base, name)
        finally:
            lock.release()
    return removed


def remove_stale_temps(base: Path, name: str) -> int:
    """Delete ``tmp/``'s directories of entry ``name`` (the caller holds its lock, so they are left over from a killed
    build or removal); returns how many went."""
    removed = 0
    for leftover in (base / "tmp").glob(name + ".*"):
        shutil.rmtree(leftover, ignore_errors=True)
        removed += not leftover.exists()
    return removed


def remove_entry(base: Path, entry_dir: Path, timeout: float = 10.0) -> bool:
    """Remove an entry of the writable schema dir ``base`` under its per-key lock.

    The entry is first renamed into ``tmp/`` (one atomic step: a loader sees it
    or not), then deleted. Returns False if the lock stayed busy (a build of
    that key is running).
    """
    _check_entry_of(base, entry_dir)
    lock = entry_lock(base, entry_dir.name)
    try:
        lock.acquire(timeout=timeout)
    except filelock.Timeout:
        return False
    try:
        discard_entry(base, entry_dir)
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
        return install_entry(base, staged, staged.name)
    finally:
        lock.release()

"""``export`` and ``import``: cache bundles (tar archives of entries) for other machines.

A bundle holds ``v1/<uri>-<key16>/{manifest.json, build.ninja, lib.so, sources/...}``
and nothing else: extracted (or imported with ``--to DIR``) into a folder, that
folder is a cache layer usable read-only through ``JITATTN_CACHE_PATH``.

Import trusts nothing in the archive: every member is checked before anything
is written (relative paths under ``v1/<entry>/`` only; no ``..``, absolute
paths, links, devices or duplicates), entries are unpacked into a private
staging dir and checked (manifest consistent with the entry's name, library
checksum), and each is published by one atomic rename under its per-key lock.
"""

from __future__ import annotations

import argparse
import os
import platform
import posixpath
import re
import shlex
import shutil
import stat
import sys
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

from .selection import UsageError, arch_env, has_selection, resolve_specs
from .store import entries, entry_violations, human_size

EXIT_OK, EXIT_FAILED = 0, 1
_EXPORTED_FILES = ("manifest.json", "build.ninja", "lib.so")  # an entry's files a bundle carries (and sources/)
_ENTRY_FILES = _EXPORTED_FILES + ("build.log", ".ninja_log")  # what a build writes: a hand-made tar of a cache has them


def _write_mode(path: Path) -> str:
    """tarfile's write mode for ``path``'s suffix (gzip unless it says otherwise); reading detects it."""
    name = path.name.lower()
    for suffix, mode in ((".tar.xz", "w:xz"), (".tar.bz2", "w:bz2"), (".tar", "w")):
        if name.endswith(suffix):
            return mode
    return "w:gz"


# -- export --------------------------------------------------------------------


def _selected_entries(args: argparse.Namespace) -> tuple[list[Path], list[str]]:
    """(entry dirs to export, problems) for the selection in ``args`` (default: every entry)."""
    from jitattn.jit import JitError, ToolchainError
    from jitattn.jit.admin import find_entry, foreign_entry_problem
    from jitattn.jit.admin import build_inputs

    chosen: list[Path] = []
    problems: list[str] = []
    if has_selection(args):
        with arch_env(args.arch):
            for spec in resolve_specs(args):
                try:
                    entry = find_entry(build_inputs(spec))
                except (NotImplementedError, ValueError, ToolchainError, JitError) as exc:
                    problems.append(f"{spec.uri}: {str(exc).splitlines()[0]}")
                    continue
                if entry is None:
                    problems.append(f"{spec.uri}: not in the cache (build it with `jitattn-cache warm`)")
                else:
                    chosen.append(entry)
    else:
        seen: set[str] = set()
        for entry in entries():
            if entry.name in seen:
                continue
            seen.add(entry.name)
            unsafe = entry_violations(entry)  # (as a --spec selection refuses it: an import would trust it)
            if unsafe:
                problems.append(f"{entry.path}: on an unsafe path ({unsafe[0].path}: {unsafe[0].reason}); not "
                                "exported (see `jitattn-cache verify`)")
            else:
                chosen.append(entry.path)
    good = []
    for path in dict.fromkeys(chosen):
        problem = foreign_entry_problem(path)
        if problem is None:
            good.append(path)
        else:
            problems.append(f"{path}: {problem} (run `jitattn-cache verify --fix`)")
    return good, problems


def _add(tar: tarfile.TarFile, arcname: str, path: Path | None, *, mode: int) -> None:
    info = tarfile.TarInfo(arcname)
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = mode
    if path is None:
        info.type = tarfile.DIRTYPE
        info.mtime = int(time.time())
        tar.addfile(info)
        return
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        info.size = st.st_size
        info.mtime = int(st.st_mtime)
        tar.addfile(info, f)


def cmd_export(args: argparse.Namespace) -> int:
    from jitattn.jit.admin import SCHEMA

    out = Path(args.file)
    if not out.parent.is_dir():
        raise UsageError(f"cannot write {out}: {out.parent} is not a directory")
    if out.is_dir():
        raise UsageError(f"cannot write {out}: it is a directory; name the bundle file, e.g. {out / 'jitattn.tar.gz'}")
    if out.exists() and not out.is_file():  # a pipe or device: the bundle is written aside, then renamed over it
        raise UsageError(f"cannot write {out}: it is not a regular file (a pipe or a device, which the bundle would "
                         "replace); name a file path, and copy the file where it should go")
    if out.suffix.lower() in (".zip", ".7z", ".rar"):
        raise UsageError(f"cannot write {out}: bundles are tar archives; name it .tar.gz (or .tar.xz, .tar.bz2, .tar)")
    chosen, problems = _selected_entries(args)
    if problems:
        for p in problems:
            print(f"jitattn-cache export: {p}", file=sys.stderr)
        if not args.allow_missing:
            print(f"jitattn-cache export: {len(problems)} problem(s); nothing written "
                  "(--allow-missing exports the rest)", file=sys.stderr)
            return EXIT_FAILED
    if not chosen:
        print("jitattn-cache export: no cache entries to export; nothing written", file=sys.stderr)
        return EXIT_FAILED
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    total = 0
    try:
        with tarfile.open(partial, _write_mode(out)) as tar:
            _add(tar, SCHEMA, None, mode=0o755)
            for entry in sorted(chosen, key=lambda p: p.name):
                prefix = f"{SCHEMA}/{entry.name}"
                _add(tar, prefix, None, mode=0o755)
                for name in _EXPORTED_FILES:
                    if (entry / name).is_file() and not (entry / name).is_symlink():
                        _add(tar, f"{prefix}/{name}", entry / name, mode=0o755 if name == "lib.so" else 0o644)
                        total += (entry / name).stat().st_size
                sources = entry / "sources"
                if sources.is_dir() and not sources.is_symlink():
                    _add(tar, f"{prefix}/sources", None, mode=0o755)
                    for path in sorted(sources.rglob("*")):
                        rel = path.relative_to(entry).as_posix()
                        if path.is_symlink():
                            continue
                        if path.is_dir():
                            _add(tar, f"{prefix}/{rel}", None, mode=0o755)
                        elif path.is_file():
                            _add(tar, f"{prefix}/{rel}", path, mode=0o644)
                            total += path.stat().st_size
        os.replace(partial, out)
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename in (str(partial), str(out)):  # not the hidden partial's name
            raise OSError(f"cannot write {out} ({exc.strerror}); write the bundle into a directory you can write "
                          "to") from None
        raise
    print(f"exported {len(chosen)} entries ({human_size(total)} uncompressed) to {out} "
          f"({human_size(out.stat().st_size)})")
    print(f"  use it elsewhere: jitattn-cache import {out.name} [--to DIR]; "
          "then JITATTN_CACHE_PATH=DIR for a read-only layer")
    return EXIT_FAILED if problems else EXIT_OK


# -- import --------------------------------------------------------------------


class UnsafeArchive(Exception):
    pass


def _member_problem(member: tarfile.TarInfo, name: str) -> str | None:
    from jitattn.jit.admin import ENTRY_NAME_RE
    from jitattn.jit.admin import SCHEMA

    if not (member.isreg() or member.isdir()):
        kind = ("a symlink" if member.issym() else "a hard link" if member.islnk() else
                "a device file" if member.ischr() or member.isblk() else "a fifo" if member.isfifo() else
                f"type {member.type!r}")
        return f"is {kind}; bundles hold regular files and directories only"
    if not name or name.startswith("/") or "\\" in name or (len(name) > 1 and name[1] == ":"):
        return "has an absolute path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has a '..', '.' or empty path component"
    if parts[0] != SCHEMA:
        if re.fullmatch(r"v\d+", parts[0]):
            return f"is of cache layout {parts[0]} (this jitattn reads {SCHEMA}); export it with this version"
        return f"is outside {SCHEMA}/"
    if len(parts) == 1:
        return None if member.isdir() else f"{SCHEMA} must be a directory"
    if parts[1] in ("locks", "tmp", "failed"):
        return "is the cache's working state, not an entry; make bundles with `jitattn-cache export`"
    if not ENTRY_NAME_RE.match(parts[1]):
        return f"{parts[1]!r} is not a cache entry name (<uri>-<key16>)"
    if len(parts) == 2:
        return None if member.isdir() else "an entry must be a directory"
    if len(parts) == 3 and parts[2] in _ENTRY_FILES:
        return None if member.isreg() else f"{parts[2]} must be a regular file"
    if parts[2] == "sources":
        return None if len(parts) > 3 or member.isdir() else "sources must be a directory"
    return f"{parts[2]!r} is not part of a cache entry ({', '.join(_ENTRY_FILES)}, sources/)"


def _check_members(tar: tarfile.TarFile) -> list[tuple[tarfile.TarInfo, str]]:
    """The archive's members with normalised names; UnsafeArchive listing every bad one."""
    bad, seen, members = [], set(), []
    for member in tar.getmembers():
        name = member.name
        while name.startswith("./"):
            name = name[2:]
        name = name.rstrip("/") if member.isdir() else name
        if name in ("", "."):
            if member.isdir():
                continue
        problem = _member_problem(member, name)
        if problem is None and name in seen:
            problem = "appears twice"
        if problem is not None:
            bad.append(f"  {member.name!r}: {problem}")
        seen.add(name)
        members.append((member, name))
    if bad:
        shown = bad[:20] + ([f"  ... and {len(bad) - 20} more"] if len(bad) > 20 else [])
        raise UnsafeArchive("\n".join(shown))
    return members


def _extract(tar: tarfile.TarFile, members: list[tuple[tarfile.TarInfo, str]], staging: Path) -> None:
    """Write the checked members under ``staging`` (never following links; modes are ours)."""
    root = os.path.realpath(staging)
    for member, name in sorted(members, key=lambda m: (not m[0].isdir(), m[1])):
        target = os.path.realpath(os.path.join(root, *name.split("/")))
        if os.path.commonpath([root, target]) != root:  # cannot happen after _check_members
            raise UnsafeArchive(f"  {member.name!r}: escapes the destination")
        if member.isdir():
            os.makedirs(target, mode=0o755, exist_ok=True)
            continue
        os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
        mode = 0o755 if posixpath.basename(name) == "lib.so" and name.count("/") == 2 else 0o644
        source = tar.extractfile(member)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), mode)
        with os.fdopen(fd, "wb") as f, source:
            shutil.copyfileobj(source, f, 1 << 20)
        os.chmod(target, mode)


def local_cuda_archs() -> tuple[tuple[str, ...] | None, str]:
    """(the arch list this machine builds and loads cuda entries for, where it comes from); None: unknown."""
    from jitattn import env
    from jitattn.jit.admin import ToolchainError, cuda_arch_list

    if env.cuda_arch_list():
        try:
            return cuda_arch_list(), "JITATTN_CUDA_ARCH_LIST"
        except ToolchainError:
            return None, "an invalid JITATTN_CUDA_ARCH_LIST"
    from .selection import gpu_visible

    if gpu_visible():
        import torch

        try:
            return cuda_arch_list(), f"the visible GPU ({torch.cuda.get_device_name()})"
        except Exception:  # noqa: BLE001
            return None, "the visible GPU"
    return None, "no visible GPU and no JITATTN_CUDA_ARCH_LIST"


def compat_problem(manifest: dict, cuda_archs: tuple[tuple[str, ...] | None, str]) -> str | None:
    """Why an entry built elsewhere cannot be used on this machine, when that can be told; else None."""
    machine = manifest.get("machine")
    if machine and machine != platform.machine():
        return (f"built on a {machine} machine, this one is {platform.machine()}: its library cannot load here; "
                f"build the bundle on a {platform.machine()} machine")
    if manifest.get("target") == "cuda":
        archs, source = cuda_archs
        built = tuple(manifest.get("archs") or ())
        if archs is not None and built != archs:
            want = ";".join(archs)
            return (f"built for CUDA arch {';'.join(built) or '?'}, but this machine uses {want} (from {source}), "
                    f"so it would never be loaded here; build the bundle with `jitattn-cache warm --arch '{want}'` "
                    f"or set JITATTN_CUDA_ARCH_LIST to match (--force imports it anyway)")
    return None


def _stale_note(manifest: dict) -> str | None:
    """A note when this jitattn install would compute another key for the entry's spec (never used here)."""
    from jitattn.jit.admin import build_inputs
    from jitattn.spec import VariantSpec

    try:
        spec = VariantSpec.from_dict(manifest["spec"])
        with arch_env(";".join(manifest.get("archs") or ()) or None):
            key = build_inputs(spec).key
    except Exception:  # noqa: BLE001 - a note only
        return None
    if key != manifest.get("key"):
        return "built by a different jitattn version (its sources or flags differ from this install's), " \
               "so this install will not use it"
    return None


def _prepare_destination(to: str | None) -> Path:
    """The schema dir to import into, with locks/ and tmp/."""
    from jitattn.jit.admin import SCHEMA
    from jitattn.jit.admin import writable_root

    if to is None:
        return writable_root()
    if not to.strip():
        raise UsageError(f"--to {to!r} is blank; give the cache root to import into, or leave --to out for the "
                         "writable cache")
    root = Path(to).expanduser()
    try:
        root.mkdir(mode=0o755, parents=True, exist_ok=True)
        base = root / SCHEMA
        for sub in (base, base / "locks", base / "tmp"):
            sub.mkdir(mode=0o755, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--to {to}: cannot create it: {exc.strerror}") from None
    from jitattn.jit.admin import chain_violations

    found = chain_violations(root, base / "locks", base / "tmp")
    if found:
        details = "; ".join(f"{v.reason} (fix: {v.fix})" for v in found)
        raise UsageError(f"--to {to}: {details}; jitattn refuses to load kernels from such a layer. "
                         "Fix it or choose another directory")
    return base


def remove_stale_imports(base: Path) -> int:
    """Delete the staging directories of imports into schema dir ``base`` whose process is gone (``import-PID-*``;
    one of another name older than a day); returns how many went. A running import's own is kept."""
    removed = 0
    for old in (base / "tmp").glob("import-*"):
        pid = old.name.split("-")[1]
        try:
            stale = not _alive(int(pid)) if pid.isdigit() else old.stat().st_mtime < time.time() - 86400
        except OSError:
            continue
        if stale:
            shutil.rmtree(old, ignore_errors=True)
            removed += not old.exists()
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _truncated_plain_tar(archive: Path, tar: tarfile.TarFile) -> bool:
    """Whether ``archive`` (its members read) is an uncompressed tar cut short at a member boundary: tarfile then
    stops quietly at the last whole member. A complete tar ends with two zero blocks; a compressed one's own
    checksum catches a cut."""
    with open(archive, "rb") as f:
        magic = f.read(6)
    if magic.startswith((b"\x1f\x8b", b"BZh", b"\xfd7zXZ")):
        return False
    return archive.stat().st_size - tar.offset < 2 * tarfile.BLOCKSIZE


def cmd_import(args: argparse.Namespace) -> int:
    archive = Path(args.file)
    if archive.is_dir():
        raise UsageError(f"{archive} is a directory; import takes a bundle file (`jitattn-cache export` writes one). "
                         "An extracted bundle is used as it is: add it to JITATTN_CACHE_PATH")
    if not archive.is_file():
        raise UsageError(f"{archive}: no such file")
    try:
        tar = tarfile.open(archive, "r:*")
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        print(f"jitattn-cache import: {archive} is not a readable tar archive: {exc}", file=sys.stderr)
        return EXIT_FAILED
    with tar:
        try:
            members = _check_members(tar)
        except UnsafeArchive as exc:
            print(f"jitattn-cache import: refusing {archive}: unsafe archive; nothing was imported:\n{exc}",
                  file=sys.stderr)
            return EXIT_FAILED
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
            print(f"jitattn-cache import: {archive} is damaged: {exc}; nothing was imported", file=sys.stderr)
            return EXIT_FAILED
        if _truncated_plain_tar(archive, tar):
            print(f"jitattn-cache import: {archive} ends without a tar end-of-archive marker (cut short in a copy?); "
                  "nothing was imported: copy the bundle again", file=sys.stderr)
            return EXIT_FAILED
        base = _prepare_destination(args.to)
        needed = sum(m.size for m, _ in members if m.isreg())
        free = shutil.disk_usage(base).free
        if needed > free:
            print(f"jitattn-cache import: {archive} needs {human_size(needed)} but {base} has only "
                  f"{human_size(free)} free; nothing was imported", file=sys.stderr)
            return EXIT_FAILED
        remove_stale_imports(base)
        staging = Path(tempfile.mkdtemp(prefix=f"import-{os.getpid()}-", dir=base / "tmp"))
        try:
            try:
                _extract(tar, members, staging)
            except UnsafeArchive as exc:
                print(f"jitattn-cache import: refusing {archive}: unsafe archive; nothing was imported:\n{exc}",
                      file=sys.stderr)
                return EXIT_FAILED
            except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
                print(f"jitattn-cache import: cannot unpack {archive}: {exc}; nothing was imported",
                      file=sys.stderr)
                return EXIT_FAILED
            return _publish_staged(archive, staging, base, args)
        finally:
            shutil.rmtree(staging, ignore_errors=True)


def _publish_staged(archive: Path, staging: Path, base: Path, args: argparse.Namespace) -> int:
    from jitattn.jit.admin import SCHEMA
    from jitattn.jit.admin import foreign_entry_problem, publish_entry, read_manifest

    staged = sorted(p for p in (staging / SCHEMA).iterdir()) if (staging / SCHEMA).is_dir() else []
    if not staged:
        print(f"jitattn-cache import: {archive} holds no cache entries; nothing was imported", file=sys.stderr)
        return EXIT_FAILED
    bad = [(p.name, foreign_entry_problem(p)) for p in staged]
    bad = [(n, problem) for n, problem in bad if problem is not None]
    if bad:
        print(f"jitattn-cache import: refusing {archive}: {len(bad)} entr{'y' if len(bad) == 1 else 'ies'} "
              "fail their own manifest (tampered or damaged); nothing was imported:", file=sys.stderr)
        for name, problem in bad:
            print(f"  {name}: {problem}", file=sys.stderr)
        return EXIT_FAILED
    archs = local_cuda_archs()
    counts = {"published": 0, "replaced": 0, "present": 0}
    refused = []
    for path in staged:
        manifest = read_manifest(path)
        problem = compat_problem(manifest, archs)
        if problem is not None and not args.force:
            refused.append((path.name, problem))
            continue
        _drop_shared_write_bits(path)
        counts[publish_entry(base, path)] += 1
        note = _stale_note(manifest)
        if note:
            print(f"note: {path.name}: {note}", file=sys.stderr)
    for name, problem in refused:
        print(f"REFUSED {name}: {problem}", file=sys.stderr)
    imported = counts["published"] + counts["replaced"]
    print(f"imported {imported} entries into {base} ({counts['present']} already present"
          f"{', ' + str(counts['replaced']) + ' damaged ones replaced' if counts['replaced'] else ''}"
          f", {len(refused)} refused)")
    if args.to:
        print(f"  use it read-only: JITATTN_CACHE_PATH={shlex.quote(str(base.parent.absolute()))}")  # pasteable
    return EXIT_FAILED if refused else EXIT_OK


def _drop_shared_write_bits(entry: Path) -> None:
    for path in [entry, *entry.rglob("*")]:
        mode = path.lstat().st_mode
        if mode & (stat.S_IWGRP | stat.S_IWOTH):
            os.chmod(path, mode & ~(stat.S_IWGRP | stat.S_IWOTH))

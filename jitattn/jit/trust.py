"""The cache's one trust rule, and the fix for each violation.

A directory or library jitattn builds in, writes to or loads from must be
owned by you (or root, for images baked by root) and not writable by group or
others: whoever can write a directory on the way from the cache root to a
library can swap the library (and its manifest) for their own code. The rule
is applied to every directory from the cache root down to the entry, and to
the private temp dir a build runs in, before a build starts, before a file is
written and before a library is loaded. ``doctor`` and ``verify`` report the
same violations with the ``chmod``/``chown`` that fixes each.
"""

from __future__ import annotations

import os
import pwd
import shlex
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import CacheError


@dataclass(frozen=True)
class Violation:
    """One path that breaks the trust rule: why, and the shell command that fixes it."""

    path: Path
    reason: str
    fix: str

    def __str__(self) -> str:
        return f"{self.reason} (fix: {self.fix})"


def _user_name() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def violations(path: Path, follow_links: bool = False) -> list[Violation]:
    """What is wrong with ``path`` under the trust rule (empty when it is fine or missing).

    ``follow_links``: judge what a symbolic link points to (the cache root may be one) instead of
    refusing the link.
    """
    try:
        st = path.stat() if follow_links else path.lstat()
    except (FileNotFoundError, NotADirectoryError):  # missing (a file above it: chain_violations names that)
        return []
    except PermissionError as exc:  # the directory holding it is not searchable by this process
        return [Violation(path, f"{path} cannot be looked at ({exc.strerror}): {path.parent} is not searchable by "
                                "you", f"chmod u+rx {shlex.quote(str(path.parent))}")]
    quoted = shlex.quote(str(path))
    found = []
    if stat.S_ISLNK(st.st_mode):
        return [Violation(path, f"{path} is a symbolic link (a cache path must be the real directory or file)",
                          f"rm {quoted} (and point JITATTN_CACHE_DIR at the real directory)")]
    if st.st_uid not in (os.getuid(), 0):
        found.append(Violation(path, f"{path} is owned by uid {st.st_uid}, not by you (uid {os.getuid()}) or root",
                               f"chown {shlex.quote(_user_name())} {quoted}"))
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        # A shared sticky directory (/tmp, /dev/shm) is meant to be world-writable: the fix is a private
        # directory under it, not a chmod of it.
        fix = (f"point JITATTN_CACHE_DIR at a private directory of yours under it (mkdir -m 700 "
               f"{shlex.quote(str(path / (_user_name() + '-jitattn')))})" if st.st_mode & stat.S_ISVTX
               else f"chmod go-w {quoted}")
        found.append(Violation(path, f"{path} is writable by other users (mode {stat.filemode(st.st_mode)})", fix))
    return found


def chain(root: Path, leaf: Path) -> list[Path]:
    """``root`` and every path below it down to ``leaf`` (which must be inside ``root``)."""
    rel = leaf.relative_to(root)
    paths = [root]
    for part in rel.parts:
        paths.append(paths[-1] / part)
    return paths


def chain_violations(root: Path, *leaves: Path, directories: tuple[Path, ...] = ()) -> list[Violation]:
    """Every violation on the paths from ``root`` down to each of ``leaves``, each path once; and a path that exists
    but is not a directory where one belongs (above a leaf, or one of ``directories``) is in the cache's way."""
    seen: set[Path] = set()
    as_directory: set[Path] = set()  # paths already looked at as directories (one stat each)
    blocked: set[Path] = set()
    found: list[Violation] = []
    for leaf in leaves or (root,):
        for path in chain(root, leaf):
            if path not in seen:
                seen.add(path)
                found += violations(path, follow_links=path == root)
            if (path != leaf or path in directories) and path not in as_directory:
                as_directory.add(path)
                if _in_the_way(path, follow_links=path == root):
                    blocked.add(path)
                    found.append(Violation(path, f"{path} is in the jitattn cache's way: it exists but is not a "
                                                 "directory", f"rm {shlex.quote(str(path))}"))
            if path in blocked:
                break  # nothing below it can exist
    return found


def _in_the_way(path: Path, follow_links: bool) -> bool:
    """Whether ``path`` exists but is not a directory (a file, or a link where no link may be)."""
    try:
        st = path.stat() if follow_links else path.lstat()
    except OSError:
        return False
    return not stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode)  # (a link: violations names it)


def require_trusted(root: Path, *leaves: Path, action: str) -> None:
    """Raise CacheError naming each violation on the way from ``root`` to ``leaves`` and its fix.

    ``action`` says what was about to happen ("build in", "load a kernel from", ...).
    """
    found = chain_violations(root, *leaves)
    if not found:
        return
    lines = "\n".join(f"  - {v.reason}\n    fix: {v.fix}" for v in found)
    raise CacheError(
        f"refusing to {action} the jitattn cache at {root}: whoever can write a directory on the way to a "
        f"library can replace it with their own code, and\n{lines}\n"
        "Run the fix commands (or `jitattn-cache doctor`), or set JITATTN_CACHE_DIR to a private directory (for a "
        "read-only layer of JITATTN_CACHE_PATH: take it off that list)"
    )

"""Reading the cache for the CLI: entries of every layer, sizes, build times, units."""

from __future__ import annotations

import datetime
import re
from dataclasses import dataclass
from pathlib import Path

from .selection import UsageError


@dataclass
class CacheEntry:
    base: Path  # the layer's schema dir (<layer>/v1)
    path: Path  # <base>/<uri>-<key16>
    manifest: dict | None  # None: unreadable
    writable: bool  # in the writable cache (else a read-only JITATTN_CACHE_PATH layer)

    @property
    def name(self) -> str:
        return self.path.name

    def _text(self, field: str) -> str | None:
        """The manifest's ``field`` when it is a string (a hand-edited or foreign manifest may hold anything;
        `jitattn-cache verify` reports such an entry, listing it must not fail)."""
        value = (self.manifest or {}).get(field)
        return value if isinstance(value, str) and value else None

    @property
    def uri(self) -> str:
        return self._text("uri") or self.name.rsplit("-", 1)[0]

    @property
    def target(self) -> str:
        return self._text("target") or "?"

    @property
    def arch(self) -> str:
        if self._text("target") == "cuda":
            archs = (self.manifest or {}).get("archs")
            ok = isinstance(archs, list) and archs and all(isinstance(a, str) for a in archs)
            return ";".join(archs) if ok else "?"
        return self._text("machine") or "host"

    @property
    def size(self) -> int:
        return tree_size(self.path)

    @property
    def built_at(self) -> datetime.datetime | None:
        return parse_time(self._text("built_at"))


def tree_size(path: Path) -> int:
    total = 0
    for p in path.rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            pass
    return total


def parse_time(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        t = datetime.datetime.fromisoformat(str(value))
    except ValueError:
        return None
    return t if t.tzinfo else t.replace(tzinfo=datetime.timezone.utc)


def writable_base() -> Path:
    from jitattn import env
    from jitattn.jit.admin import SCHEMA

    return env.cache_dir() / SCHEMA


def entries(include_readonly: bool = True) -> list[CacheEntry]:
    """Every entry-named dir of the read-only layers (first) and the writable cache."""
    from jitattn.jit.admin import entry_dirs, layers, read_manifest

    found = []
    all_layers = layers()
    writable = all_layers[-1]
    for base in all_layers:
        if base != writable and not include_readonly:
            continue
        for path in entry_dirs(base):
            found.append(CacheEntry(base, path, read_manifest(path), base == writable))
    return found


def entry_violations(entry: CacheEntry) -> list:
    """Trust-rule violations on the paths from ``entry``'s layer root down to its library: an entry with any is
    never loaded (its library's constructors would run as you), whatever a command reports of it."""
    from jitattn.jit.admin import LIBRARY_NAME, chain_violations

    return chain_violations(entry.base.parent, entry.path, entry.path / LIBRARY_NAME)


def cache_violations(base: Path, entry_paths: list[Path], writable: bool) -> list:
    """Trust-rule violations of one layer (schema dir ``base``): its root, the schema dir, (for the
    writable cache) locks/ and tmp/, then each entry dir and library, each path once; a file where one of those
    directories belongs is named too."""
    from jitattn.jit.admin import LIBRARY_NAME
    from jitattn.jit.admin import chain_violations

    directories = [base] + ([base / "locks", base / "tmp"] if writable else []) + list(entry_paths)
    leaves = directories + [path / LIBRARY_NAME for path in entry_paths]
    return chain_violations(base.parent, *leaves, directories=tuple(directories))


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*$", re.IGNORECASE)
_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(text: str) -> int:
    """'2G', '500M', '1.5GiB', '4096' -> bytes (powers of 1024)."""
    match = _SIZE_RE.match(text)
    if not match:
        raise UsageError(f"size {text!r} is not understood; use e.g. 2G, 500M, 64K or a byte count")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def parse_duration(text: str) -> datetime.timedelta:
    """'30d', '12h', '2w', '90m', '45s' -> timedelta."""
    match = _DURATION_RE.match(text)
    if not match:
        raise UsageError(f"duration {text!r} is not understood; use e.g. 30d, 12h, 2w, 90m or 45s")
    try:
        return datetime.timedelta(seconds=float(match.group(1)) * _DURATION_UNITS[match.group(2).lower()])
    except OverflowError:  # past timedelta's ~2.7 million years
        raise UsageError(f"duration {text!r} is too long; give at most a few thousand years (e.g. 36500d)") from None

"""Every environment knob jitattn reads, in one typed place.

Values are read when used, never at import, so a test or a server can change
them between calls. ``describe()`` lists each knob, its value and where that
value came from (the ``jitattn-cache show-config`` command prints it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Knob:
    name: str
    doc: str
    default: str


KNOBS: tuple[Knob, ...] = (
    Knob("JITATTN_CACHE_DIR", "writable cache root", "platformdirs.user_cache_dir('jitattn')"),
    Knob("JITATTN_CACHE_PATH", "read-only cache layers searched first (os.pathsep list)", ""),
    Knob("JITATTN_MAX_JOBS", "parallel compile jobs (also MAX_JOBS)", "min(CPUs, free memory / 2 GiB)"),
    Knob("JITATTN_CUDA_ARCH_LIST", "CUDA archs to build, e.g. '8.0;9.0a' (also TORCH_CUDA_ARCH_LIST)", "the visible GPU"),
    Knob("JITATTN_ASSERT_NO_COMPILE", "1: any compile is an error (prove a cache is warm)", "0"),
    Knob("JITATTN_LOG_LEVEL", "info|debug: log to stderr (plans, cold builds)", "unset (no handler)"),
    Knob("JITATTN_DEBUG", "1: custom-variant parameters are bounds-checked (a separate cache entry)", "0"),
    Knob("JITATTN_NVCC", "path to nvcc (else CUDA_HOME/CUDA_PATH/bin/nvcc, else PATH)", "search"),
    Knob("JITATTN_CXX", "host C++ compiler for the cpu target (also CXX)", "c++"),
    Knob("CUDA_HOME", "CUDA toolkit root (also CUDA_PATH)", "search"),
    Knob("JITATTN_TEST_CACHE_DIR", "the test suite's shared cache (tests/conftest.py; .ci/run sets it after warming)",
         "unset: each test run builds into a temp dir it removes"),
)


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("info", "debug")


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in _TRUE


def cache_dir() -> Path:
    """The writable cache root."""
    explicit = _get("JITATTN_CACHE_DIR")
    if explicit is not None:
        return Path(explicit).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("jitattn"))


def cache_path() -> list[Path]:
    """Read-only cache layers, searched before the writable root."""
    raw = _get("JITATTN_CACHE_PATH")
    if raw is None:
        return []
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p]


def max_jobs_override() -> int | None:
    """A user-set job count (JITATTN_MAX_JOBS wins over MAX_JOBS), or None."""
    for name in ("JITATTN_MAX_JOBS", "MAX_JOBS"):
        raw = _get(name)
        if raw is not None:
            try:
                value = int(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not an integer; set it to a job count such as 4") from None
            if value < 1:
                raise ValueError(f"{name}={raw!r} must be at least 1")
            return value
    return None


def cuda_arch_list() -> str | None:
    """The arch list the user asked for, e.g. '8.0;9.0a', or None for the visible GPU."""
    return _get("JITATTN_CUDA_ARCH_LIST") or _get("TORCH_CUDA_ARCH_LIST")


def assert_no_compile() -> bool:
    return _truthy(_get("JITATTN_ASSERT_NO_COMPILE"))


def debug() -> bool:
    """JITATTN_DEBUG=1: compile custom-variant parameter accessors with bounds checks.

    The checks are in the rendered source, so a debug build is its own cache
    entry (its key differs) and never replaces the fast one.
    """
    return _truthy(_get("JITATTN_DEBUG"))


def log_level() -> str | None:
    raw = _get("JITATTN_LOG_LEVEL")
    return raw.lower() if raw else None


def nvcc_override() -> str | None:
    return _get("JITATTN_NVCC")


def cuda_home() -> str | None:
    return _get("CUDA_HOME") or _get("CUDA_PATH")


def cxx() -> str:
    return _get("JITATTN_CXX") or _get("CXX") or "c++"


def problems() -> dict[str, str]:
    """{variable: what is wrong with its value and what to set} for every invalid setting."""
    found: dict[str, str] = {}
    for name in ("JITATTN_MAX_JOBS", "MAX_JOBS"):
        raw = _get(name)
        if raw is None:
            continue
        try:
            ok = int(raw) >= 1
        except ValueError:
            ok = False
        if not ok:
            found[name] = f"{name}={raw!r} is not a positive integer; set it to a job count such as 4, or unset it"
    for name in ("JITATTN_ASSERT_NO_COMPILE", "JITATTN_DEBUG"):
        raw = _get(name)
        if raw is not None and raw.strip().lower() not in _TRUE + _FALSE:
            found[name] = f"{name}={raw!r} is neither on nor off; set it to 1 or 0"
    raw = _get("JITATTN_LOG_LEVEL")
    if raw is not None and raw.lower() not in LOG_LEVELS:
        found["JITATTN_LOG_LEVEL"] = (f"JITATTN_LOG_LEVEL={raw!r} is not a level jitattn knows; set it to "
                                      f"{' or '.join(LOG_LEVELS)}, or unset it")
    for name in ("JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST"):
        raw = _get(name)
        if raw is None:
            continue
        import re

        bad = [a for a in re.split(r"[;\s,]+", raw.strip()) if a and not re.match(r"^\d+\.\d+[af]?(\+PTX)?$", a)]
        if bad:
            found[name] = (f"{name}={raw!r}: {', '.join(map(repr, bad))} is not an arch; use e.g. '8.0;9.0a' "
                           "or '9.0a+PTX'")
        if name == "JITATTN_CUDA_ARCH_LIST":
            break  # it wins over TORCH_CUDA_ARCH_LIST, which is then not read
    raw = _get("JITATTN_NVCC")
    if raw is not None and not (os.path.isfile(raw) and os.access(raw, os.X_OK)):
        found["JITATTN_NVCC"] = f"JITATTN_NVCC={raw!r} is not an executable file; point it at nvcc or unset it"
    raw = _get("JITATTN_CACHE_DIR")
    if raw is not None and Path(raw).expanduser().exists() and not Path(raw).expanduser().is_dir():
        found["JITATTN_CACHE_DIR"] = f"JITATTN_CACHE_DIR={raw!r} is not a directory; point it at one (or a new path)"
    return found


def describe() -> list[tuple[str, str, str]]:
    """(name, value, source) for every knob: 'env' when set, else 'default'."""
    rows = []
    for knob in KNOBS:
        value = _get(knob.name)
        rows.append((knob.name, value if value is not None else knob.default, "env" if value is not None else "default"))
    for alias in ("MAX_JOBS", "TORCH_CUDA_ARCH_LIST", "CUDA_PATH", "CXX"):
        value = _get(alias)
        if value is not None:
            rows.append((alias, value, "env"))
    return rows

"""Every environment knob jitattn reads, declared once: name, aliases, kind, default, doc.

Values are read when used, never at import, so a test or a server can change them between calls (a kernel module
already loaded in the process is reloaded for a changed JITATTN_DEBUG, prefill tier or arch list where they change
its source; the arch list of other cuda modules is the one of their first load). ``KNOBS`` is what
``jitattn-cache show-config`` and ``doctor`` list and check; the accessors below are what the library calls. A
knob's aliases are read, in order, when the knob itself is unset (``MAX_JOBS`` for ``JITATTN_MAX_JOBS``, ...).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

ON_WORDS = ("1", "true", "yes", "on")  # what an on / off setting takes (spec_text reads its flags the same)
OFF_WORDS = ("0", "false", "no", "off")
LOG_LEVELS = ("info", "debug")
PREFILL_TIERS = ("auto", "sm80", "sm90")
MLA_KERNELS = ("auto", "sm90", "prefill")
FP8_UPCAST = ("off", "on", "auto")
ROPE_FIRST = ("off", "on", "auto")
# the knobs that take one of a few words: kind -> (what a value is, the words)
_CHOICES = {"tier": ("a prefill tier", PREFILL_TIERS), "mla": ("an MLA kernel choice", MLA_KERNELS),
            "upcast": ("an fp8-upcast choice", FP8_UPCAST), "rope_first": ("a RoPE-first choice", ROPE_FIRST)}
_ARCH = re.compile(r"^\d+\.\d+[af]?(\+PTX)?$")


def arch_list_problem(raw: str) -> str | None:
    """What is wrong with an arch list ('8.0;9.0a'): an entry that is not an arch, or one older than the kernels'
    sm_80; None when nothing is (the check of JITATTN_CUDA_ARCH_LIST's knob and of the archs a build parses)."""
    archs = [a for a in re.split(r"[;\s,]+", raw.strip()) if a]
    if not archs:  # (the build would pass nvcc no -gencode: its default arch, older than the kernels')
        return f"{raw!r} names no arch; use e.g. '9.0a' or '8.0;9.0a'"
    bad = [a for a in archs if not _ARCH.match(a)]
    if bad:
        return f"{', '.join(map(repr, bad))} is not an arch; use e.g. '8.0;9.0a' or '9.0a+PTX'"
    old = [a for a in archs if int(a.split(".")[0]) < 8]
    return f"{old[0]!r} is older than the kernels' sm_80 (Ampere); give 8.0 or newer" if old else None


def _get(name: str) -> str | None:
    value = os.environ.get(name)
    return value if value not in (None, "") else None


@dataclass(frozen=True)
class Knob:
    """One setting: ``kind`` says how its value is read and checked."""

    name: str
    kind: str  # "path" | "paths" | "jobs" | "seconds" | "flag" | "log_level" | "archs" | "executable" | "command", or a
    # _CHOICES kind ("tier", "mla", "upcast", "rope_first")
    default: str  # what applies when unset, as show-config describes it
    doc: str
    aliases: tuple[str, ...] = ()

    def setting(self) -> tuple[str | None, str | None]:
        """(value, the variable that set it): the knob itself, else its first set alias; (None, None) if unset."""
        for variable in (self.name, *self.aliases):
            value = _get(variable)
            if value is not None:
                return value, variable
        return None, None

    def value(self) -> str | None:
        return self.setting()[0]

    def problem(self) -> str | None:
        """What is wrong with the value in effect, and what to set; None when it is fine or unset."""
        raw, variable = self.setting()
        if raw is None:
            return None
        shown = f"{variable}={raw!r}"
        if self.kind == "jobs":
            try:
                ok = int(raw) >= 1
            except ValueError:
                ok = False
            return None if ok else f"{shown} is not a positive integer; set it to a job count such as 4, or unset it"
        if self.kind == "seconds":
            try:
                ok = 0 <= float(raw) < math.inf
            except ValueError:
                ok = False
            return None if ok else f"{shown} is not a number of seconds; set it to one such as 600 (0: no limit)"
        if self.kind == "flag":
            if raw.strip().lower() in ON_WORDS + OFF_WORDS:
                return None
            return f"{shown} is neither on nor off; set it to 1 or 0"
        if self.kind == "log_level":
            if raw.lower() in LOG_LEVELS:
                return None
            return f"{shown} is not a level jitattn knows; set it to {' or '.join(LOG_LEVELS)}, or unset it"
        if self.kind in _CHOICES:
            what, values = _CHOICES[self.kind]
            if raw.strip().lower() in values:
                return None
            return f"{shown} is not {what}; set it to {', '.join(values)}, or unset it"
        if self.kind == "archs":
            problem = arch_list_problem(raw)
            return None if problem is None else f"{shown}: {problem}"
        if self.kind == "executable":
            if os.path.isfile(raw) and os.access(raw, os.X_OK):
                return None
            return f"{shown} is not an executable file; point it at nvcc or unset it"
        if self.kind in ("path", "paths"):
            for part in raw.split(os.pathsep) if self.kind == "paths" else [raw]:
                try:
                    path = Path(part).expanduser()
                except RuntimeError:  # pathlib: "Could not determine home directory"
                    return f"{shown}: {part!r} starts with a ~user that names no user here; give the path in full"
                if self.kind == "path":
                    problem = _directory_problem(part, path)
                    if problem:
                        return f"{shown} {problem}"
        return None


def _directory_problem(part: str, path: Path) -> str | None:
    """What keeps ``path`` (the setting's text ``part``) from being, or becoming, a directory jitattn can use; None
    when nothing does."""
    if not part.strip():
        return "is blank; unset it (the default location) or give a directory"
    if "|" in part or "\n" in part:  # ninja's build files cannot name such paths
        return "holds a '|' or a newline, which the build files cannot name; choose another path"
    try:
        existing = next((p for p in (path, *path.absolute().parents) if os.path.lexists(p)), None)
        longest = max((len(os.fsencode(c)) for c in path.parts), default=0)
        if longest > 255 or len(os.fsencode(str(path.absolute()))) > 4000:  # NAME_MAX / PATH_MAX of common systems
            return "is too long for the file system (a name of more than 255 bytes, or a path of more than 4000); " \
                   "choose a shorter path"
        if existing is not None and os.path.islink(existing) and not existing.exists():
            return f"names {existing}, a symbolic link to nothing (a dangling link or a loop); point it at a directory"
        if existing == path and not path.is_dir():
            return "is not a directory; point it at one (or a new path)"
        if existing is not None and not existing.is_dir():
            return f"names a path under {existing}, which is a file, so no directory can be made there; point " \
                   "it at a directory (or a new path)"
    except OSError as exc:  # a name too long for the file system, a component it cannot search
        return f"cannot be used ({exc.strerror}); choose a shorter or accessible path"
    return None


CACHE_DIR = Knob("JITATTN_CACHE_DIR", "path", "platformdirs.user_cache_dir('jitattn')", "writable cache root")
CACHE_PATH = Knob("JITATTN_CACHE_PATH", "paths", "", "read-only cache layers searched first (os.pathsep list)")
MAX_JOBS = Knob("JITATTN_MAX_JOBS", "jobs", "min(CPUs, free memory / 2 GiB)", "parallel compile jobs",
                aliases=("MAX_JOBS",))
CUDA_ARCH_LIST = Knob("JITATTN_CUDA_ARCH_LIST", "archs", "the visible GPU", "CUDA archs to build, e.g. '8.0;9.0a'",
                      aliases=("TORCH_CUDA_ARCH_LIST",))
BUILD_TIMEOUT = Knob("JITATTN_BUILD_TIMEOUT", "seconds", "1800",
                     "seconds one kernel build may take before its compiler is stopped (0: no limit)")
ASSERT_NO_COMPILE = Knob("JITATTN_ASSERT_NO_COMPILE", "flag", "0", "1: any compile is an error (prove a cache is warm)")
LOG_LEVEL = Knob("JITATTN_LOG_LEVEL", "log_level", "unset (no handler)", "info|debug: log to stderr (plans, cold builds)")
DEBUG = Knob("JITATTN_DEBUG", "flag", "0", "1: custom-variant parameters are bounds-checked (a separate cache entry)")
NVCC = Knob("JITATTN_NVCC", "executable", "search", "path to nvcc (else CUDA_HOME/CUDA_PATH/bin/nvcc, else PATH)")
CXX = Knob("JITATTN_CXX", "command", "c++", "host C++ compiler for the cpu target", aliases=("CXX",))
CUDA_HOME = Knob("CUDA_HOME", "path", "search", "CUDA toolkit root", aliases=("CUDA_PATH",))
BATCH_INVARIANT = Knob("JITATTN_BATCH_INVARIANT", "flag", "0",
                       "1: plan() defaults to batch_invariant=True (each request's bits independent of the batch)")
PREFILL_TIER = Knob("JITATTN_PREFILL_TIER", "tier", "auto",
                    "cuda prefill kernel tier: auto (sm90 on a 9.0a-only arch list where the spec allows), sm80, sm90")
MLA_KERNEL = Knob("JITATTN_MLA_KERNEL", "mla", "auto",
                  "BatchMLAPagedAttentionWrapper's kernel: auto (the sm90 MLA kernel on an H100/H200 for the plans it "
                  "supports, else the paged prefill kernels), sm90 (an error where it cannot run), prefill")
PREFILL_FP8_UPCAST = Knob(
    "JITATTN_PREFILL_FP8_UPCAST", "upcast", "auto",
    "paged prefill plans of fp8 KV: on reads the batch's pages once into a 16-bit ragged K / V per run (memory: 2 x "
    "tokens x kv heads x dim 16-bit values) and runs the 16-bit kernel; auto does so where that kernel takes the "
    "sm90 tier (the default: H200, causal b8 x 4096 d128 paged, 2.46 against 4.83 ms); off keeps the fp8 kernel")
PREFILL_ROPE_FIRST = Knob(
    "JITATTN_PREFILL_ROPE_FIRST", "rope_first", "auto",
    "prefill plans with pos_encoding_mode ROPE_LLAMA: on rotates q and k once per run (an f16 copy of q, k and v: "
    "memory 2 x (qo tokens x qo heads + 2 x kv tokens x kv heads) x dim bytes) and runs the f16 kernel without "
    "RoPE; auto (the default) does so where that kernel takes the sm90 tier; off keeps RoPE in the kernel")
TEST_CACHE_DIR = Knob("JITATTN_TEST_CACHE_DIR", "path", "unset: JITATTN_CACHE_DIR when set, else a temp dir the run "
                      "removes",
                      "the test suite's shared cache (tests/conftest.py; .ci/run sets it after warming)")

# Development knobs: read where they apply (kernel experiments), listed by show-config only when set.
DEV_KNOBS = ("JITATTN_DEV_SM90_TUNING",)

KNOBS: tuple[Knob, ...] = (CACHE_DIR, CACHE_PATH, MAX_JOBS, BUILD_TIMEOUT, CUDA_ARCH_LIST, ASSERT_NO_COMPILE,
                           LOG_LEVEL, DEBUG, NVCC, CXX, CUDA_HOME, BATCH_INVARIANT, PREFILL_TIER, MLA_KERNEL,
                           PREFILL_FP8_UPCAST, PREFILL_ROPE_FIRST, TEST_CACHE_DIR)


def _truthy(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ON_WORDS


def _flag(knob: Knob) -> bool:
    """An on / off knob's value; a value that is neither is an error, not a silent "off"."""
    problem = knob.problem()
    if problem is not None:
        raise ValueError(problem)
    return _truthy(knob.value())


_BUILD_VARIABLES = (DEBUG.name, CUDA_ARCH_LIST.name, *CUDA_ARCH_LIST.aliases, PREFILL_TIER.name)
_build_settings_seen: dict[tuple[str | None, ...], tuple] = {}


def build_settings() -> tuple:
    """The settings a module's rendered source or build flags depend on (JITATTN_DEBUG, the arch list, the prefill
    tier; the development knobs are read at import), as their meaning (``jit.load`` keeps a module per spec and
    these where they change it). The raw values are looked up, their meaning parsed once per distinct set."""
    raw = tuple(map(os.environ.get, _BUILD_VARIABLES))
    settings = _build_settings_seen.get(raw)
    if settings is None:
        settings = (debug(), cuda_arch_list(), prefill_tier())
        _build_settings_seen[raw] = settings
    return settings


def cache_dir() -> Path:
    """The writable cache root."""
    explicit = CACHE_DIR.value()
    if explicit is not None:  # a relative root is taken from the working directory (ninja runs in another)
        return _expanded(explicit, CACHE_DIR)
    import platformdirs

    return Path(platformdirs.user_cache_dir("jitattn"))


def cache_path() -> list[Path]:
    """Read-only cache layers, searched before the writable root."""
    raw = CACHE_PATH.value()
    if raw is None:
        return []
    return [_expanded(p, CACHE_PATH) for p in raw.split(os.pathsep) if p]


def _expanded(raw: str, knob: Knob) -> Path:
    """``raw`` (a path of ``knob``'s setting) with ``~`` expanded, absolute; a ValueError for a ``~user`` that names
    no user (pathlib's RuntimeError said only that it could not find a home directory)."""
    try:
        return Path(raw).expanduser().absolute()
    except RuntimeError:
        raise ValueError(knob.problem() or f"{knob.name}: cannot expand {raw!r}") from None


def max_jobs_override() -> int | None:
    """A user-set job count (JITATTN_MAX_JOBS wins over MAX_JOBS), or None."""
    problem = MAX_JOBS.problem()
    if problem is not None:
        raise ValueError(problem)
    raw = MAX_JOBS.value()
    return int(raw) if raw is not None else None


def build_timeout() -> float | None:
    """Seconds one kernel build may take (JITATTN_BUILD_TIMEOUT, else its default); None: no limit (0)."""
    problem = BUILD_TIMEOUT.problem()
    if problem is not None:
        raise ValueError(problem)
    seconds = float(BUILD_TIMEOUT.value() or BUILD_TIMEOUT.default)
    return seconds if seconds > 0 else None


def cuda_arch_list() -> str | None:
    """The arch list the user asked for, e.g. '8.0;9.0a', or None for the visible GPU."""
    return CUDA_ARCH_LIST.value()


def assert_no_compile() -> bool:
    """JITATTN_ASSERT_NO_COMPILE=1: a cache miss is an error; a value neither on nor off is one too (a deployment
    proving its cache warm must not lose the check to a typo)."""
    return _flag(ASSERT_NO_COMPILE)


def debug() -> bool:
    """JITATTN_DEBUG=1: compile custom-variant parameter accessors with bounds checks.

    The checks are in the rendered source, so a debug build is its own cache
    entry (its key differs) and never replaces the fast one. A value neither on nor off is an error.
    """
    return _flag(DEBUG)


_batch_invariant_seen: tuple[str | None, bool] | None = None  # (the raw value, what it means)


def batch_invariant() -> bool:
    """JITATTN_BATCH_INVARIANT=1: the default of every wrapper's ``plan(batch_invariant=None)``.

    An invalid value is an error rather than a silent "off" (a deployment asking for
    deterministic inference must get it or be told). Read on every call (a serving loop plans
    every step): the raw value is compared with the last one seen before it is parsed again."""
    global _batch_invariant_seen
    raw = os.environ.get(BATCH_INVARIANT.name)
    if _batch_invariant_seen is not None and _batch_invariant_seen[0] == raw:
        return _batch_invariant_seen[1]
    value = _flag(BATCH_INVARIANT)
    _batch_invariant_seen = (raw, value)
    return value


def log_level() -> str | None:
    """JITATTN_LOG_LEVEL: 'info', 'debug' or None (unset); a level jitattn does not know warns once and logs nothing
    (a typo there should not stop a server)."""
    problem = LOG_LEVEL.problem()
    if problem is not None:
        _warn_once(problem + "; jitattn logs nothing")
        return None
    raw = LOG_LEVEL.value()
    return raw.lower() if raw else None


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        import warnings

        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _choice(knob: Knob, default: str) -> str:
    """A one-of-a-few-words knob's value (lower case), ``default`` when unset; a bad value is an error."""
    problem = knob.problem()
    if problem is not None:
        raise ValueError(problem)
    raw = knob.value()
    return raw.strip().lower() if raw else default


def prefill_tier() -> str:
    """JITATTN_PREFILL_TIER: 'auto' (the default), 'sm80' or 'sm90'; a bad value is an error."""
    return _choice(PREFILL_TIER, "auto")


def nvcc_override() -> str | None:
    return NVCC.value()


def cuda_home() -> str | None:
    return CUDA_HOME.value()


def cxx() -> str:
    return CXX.value() or "c++"


def problems() -> dict[str, str]:
    """{variable: what is wrong with its value and what to set} for every invalid setting in effect."""
    found: dict[str, str] = {}
    for knob in KNOBS:
        problem = knob.problem()
        if problem is not None:
            found[knob.setting()[1]] = problem
    return found


def describe() -> list[tuple[str, str, str]]:
    """(name, value, source) for every knob: 'env' or 'env <ALIAS>' when set, else 'default'."""
    rows = []
    for knob in KNOBS:
        value, variable = knob.setting()
        if value is None:
            rows.append((knob.name, knob.default, "default"))
        else:
            rows.append((knob.name, value, "env" if variable == knob.name else f"env {variable}"))
    return rows


def mla_kernel() -> str:
    """JITATTN_MLA_KERNEL: 'auto' (the default), 'sm90' or 'prefill'; a bad value is an error."""
    return _choice(MLA_KERNEL, "auto")


def prefill_fp8_upcast() -> str:
    """JITATTN_PREFILL_FP8_UPCAST: 'auto' (the default), 'on' or 'off'; a bad value is an error."""
    return _choice(PREFILL_FP8_UPCAST, "auto")


def prefill_rope_first() -> str:
    """JITATTN_PREFILL_ROPE_FIRST: 'auto' (the default), 'on' or 'off'; a bad value is an error."""
    return _choice(PREFILL_ROPE_FIRST, "auto")

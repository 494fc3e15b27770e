"""``show-config`` (every knob, its value and where it came from) and ``doctor`` (what is wrong, how to fix it)."""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .store import entries, human_size

EXIT_OK, EXIT_FAILED = 0, 1
MIN_FREE_BYTES = 1 << 30

# -- show-config -----------------------------------------------------------------

def _effective_default(name: str) -> str:
    """What jitattn uses for ``name`` when nothing is set (computed, never fails)."""
    from jitattn import env
    from jitattn.jit import admin
    from jitattn.spec import Target

    try:
        if name == "JITATTN_CACHE_DIR":
            return str(env.cache_dir())
        if name == "JITATTN_MAX_JOBS":
            return f"{admin.default_jobs()}  (min(CPUs, free memory / 2 GiB))"
        if name == "JITATTN_CUDA_ARCH_LIST":
            from .selection import gpu_visible

            if gpu_visible():
                return f"{';'.join(admin.cuda_arch_list())}  (the visible GPU)"
            return "(none: no visible GPU; cuda builds need --arch or this variable)"
        if name == "JITATTN_NVCC":
            try:
                return f"{admin.probe(Target.CUDA).compiler}  (found on the search path)"
            except admin.ToolchainError:
                return "(not found)"
        if name == "JITATTN_CXX":
            try:
                return f"c++  ({admin.probe(Target.CPU).compiler})"
            except admin.ToolchainError:
                return "c++  (not found)"
        if name == "JITATTN_CACHE_PATH":
            return "(none)"
        if name in ("JITATTN_ASSERT_NO_COMPILE", "JITATTN_DEBUG"):
            return "0"
        if name == "JITATTN_LOG_LEVEL":
            return "(unset: the jitattn logger has no handler)"
        if name == "CUDA_HOME":
            return "(unset)"
        if name == "JITATTN_TEST_CACHE_DIR":
            return "(unset: each test run builds into a temp dir it removes)"
    except Exception as exc:  # noqa: BLE001 - show-config must always print
        return f"(error: {exc})"
    return next((knob.default for knob in env.KNOBS if knob.name == name), "")


def config_rows() -> list[tuple[str, str, str]]:
    """(knob, value, source) for every knob jitattn reads, plus unknown JITATTN_* variables."""
    from jitattn import env

    rows = []
    known = set()
    for knob in env.KNOBS:
        known.update((knob.name, *knob.aliases))
        value, variable = knob.setting()
        if value is None:
            value, source = _effective_default(knob.name), "default"
        else:
            source = "env" if variable == knob.name else f"env {variable}"
        rows.append((knob.name, value, source))
    for name in sorted(os.environ):
        if name in env.DEV_KNOBS:
            rows.append((name, os.environ[name], "env (development only)"))
        elif name.startswith("JITATTN_") and name not in known:
            rows.append((name, os.environ[name], "env (unknown to jitattn: a typo?)"))
    return rows


def cmd_show_config(args: argparse.Namespace) -> int:
    """Print every setting; an invalid one is flagged with what to set (exit 1)."""
    from jitattn import env

    problems = env.problems()
    rows = config_rows()
    width = max(len(r[0]) for r in rows) + 2
    for name, value, source in rows:
        read_from = source.removeprefix("env ").strip() if source.startswith("env ") else name
        problem = problems.get(read_from) or problems.get(name)
        flag = f"   INVALID: {problem}" if problem else ""
        print(f"{name:{width}s} {value}   [{source}]{flag}")
    shown = {r[0] for r in rows} | {r[2].removeprefix("env ") for r in rows}
    for name, problem in problems.items():  # e.g. MAX_JOBS=abc while JITATTN_MAX_JOBS wins
        if name not in shown:
            print(f"{name:{width}s} {os.environ.get(name)}   [env, not read]   INVALID: {problem}")
    if problems:
        print(f"show-config: {len(problems)} invalid setting(s): fix or unset them", file=sys.stderr)
    return EXIT_FAILED if problems else EXIT_OK


# -- doctor --------------------------------------------------------------------------


@dataclass
class Check:
    name: str
    level: str  # "ok" | "warn" | "FAIL"
    detail: str
    fix: str = ""


def _executable(path: str) -> bool:
    return os.path.isfile(path) and os.access(path, os.X_OK)


def _release(version: str) -> tuple[int, int] | None:
    match = re.search(r"release (\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _check_config(out: list[Check]) -> None:
    from jitattn import env

    for name, problem in env.problems().items():
        out.append(Check("config", "FAIL", f"invalid setting: {problem}",
                         f"fix {name} (`jitattn-cache show-config` shows every setting) or unset it"))
    for name, value, source in config_rows():
        if source.startswith("env (unknown"):
            out.append(Check("config", "warn", f"{name}={value} is not a jitattn setting",
                             "check the spelling (`jitattn-cache show-config` lists the settings)"))


def _check_nvcc(out: list[Check], gpu: bool) -> str | None:
    """Returns nvcc's version line when found."""
    from jitattn import env
    from jitattn.jit import admin
    from jitattn.spec import Target

    override = env.nvcc_override()
    if override and not _executable(override):
        out.append(Check("nvcc", "FAIL", f"missing: JITATTN_NVCC={override} is not an executable file",
                         "point JITATTN_NVCC at nvcc (e.g. /usr/local/cuda/bin/nvcc) or unset it"))
        return None
    home = env.cuda_home()
    if home and not override and not _executable(str(Path(home) / "bin" / "nvcc")):
        out.append(Check("nvcc", "FAIL", f"missing: CUDA_HOME/CUDA_PATH={home} has no bin/nvcc",
                         "set CUDA_HOME to the CUDA toolkit root (the folder with bin/nvcc) or unset it"))
        return None
    try:
        toolchain = admin.probe(Target.CUDA)
    except admin.ToolchainError as exc:
        needed = gpu and not env.assert_no_compile()
        out.append(Check(
            "nvcc", "FAIL" if needed else "warn", "missing: " + str(exc).split(":")[0],
            "install the CUDA toolkit (12.4+) or set CUDA_HOME / JITATTN_NVCC; only building cuda kernels needs "
            "it (a server can load a pre-built bundle through JITATTN_CACHE_PATH without it)",
        ))
        return None
    out.append(Check("nvcc", "ok", f"{toolchain.compiler} ({toolchain.version})"))
    return toolchain.version


def _compute_name(arch: str) -> str:
    """'9.0a' / '9.0a+PTX' -> 'compute_90' (the name `nvcc --list-gpu-arch` prints)."""
    major, minor = re.match(r"(\d+)\.(\d+)", arch).groups()
    return f"compute_{major}{minor}"


def _check_arch_support(out: list[Check], nvcc_version: str | None, gpu: bool) -> None:
    from jitattn import env
    from jitattn.jit import admin
    from jitattn.spec import Target

    try:
        archs = admin.cuda_arch_list() if (env.cuda_arch_list() or gpu) else ()
    except admin.ToolchainError as exc:
        out.append(Check("arch list", "FAIL", str(exc).split(";")[0],
                         "set JITATTN_CUDA_ARCH_LIST like '9.0a' or '8.0;9.0a', or unset it"))
        return
    if not archs:
        out.append(Check("arch list", "ok", "none to build by default (no GPU, no JITATTN_CUDA_ARCH_LIST); "
                         "`warm --arch 9.0a` builds for a GPU elsewhere"))
        return
    if nvcc_version is None:
        out.append(Check("arch list", "ok", ";".join(archs)))
        return
    try:
        listed = subprocess.run([admin.probe(Target.CUDA).compiler, "--list-gpu-arch"], capture_output=True,
                                text=True, timeout=60).stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        listed = []
    if not listed:
        out.append(Check("arch list", "ok", ";".join(archs)))
        return
    unsupported = [a for a in archs if _compute_name(a) not in listed]
    if unsupported:
        out.append(Check("arch list", "FAIL", f"this nvcc cannot build {', '.join(unsupported)} "
                         f"(it supports {', '.join(x.removeprefix('compute_') for x in listed)})",
                         "use a CUDA toolkit that supports these archs, or change JITATTN_CUDA_ARCH_LIST"))
    else:
        out.append(Check("arch list", "ok", f"{';'.join(archs)} (supported by this nvcc)"))


def _check_host_compiler(out: list[Check]) -> None:
    from jitattn import env
    from jitattn.jit import admin
    from jitattn.spec import Target

    try:
        toolchain = admin.probe(Target.CPU)
    except admin.ToolchainError as exc:
        explicit = os.environ.get("JITATTN_CXX") or os.environ.get("CXX")
        out.append(Check(
            "host compiler", "warn" if env.assert_no_compile() and not explicit else "FAIL", str(exc).split(":")[0],
            f"{'fix JITATTN_CXX/CXX or unset it; ' if explicit else ''}install g++ (or clang++ with OpenMP) or set "
            "JITATTN_CXX to its path; the cpu target and nvcc both need one",
        ))
        return
    with tempfile.TemporaryDirectory(prefix="jitattn-doctor-") as tmp:
        src = Path(tmp) / "t.cpp"
        src.write_text('#include <omp.h>\nextern "C" int f() { return omp_get_max_threads(); }\n')
        proc = subprocess.run([toolchain.compiler, *admin.CPU_FLAGS, "-shared", str(src), "-o", str(Path(tmp) / "t.so")],
                              capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        out.append(Check("host compiler", "FAIL", f"{toolchain.compiler} ({toolchain.version}) cannot build an "
                         f"OpenMP shared library: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}",
                         "install the OpenMP runtime (libgomp for g++, libomp for clang++) or use g++"))
        return
    out.append(Check("host compiler", "ok", f"{toolchain.compiler} ({toolchain.version}; OpenMP works)"))


def _check_ninja(out: list[Check]) -> None:
    from jitattn.jit.admin import ninja_path
    from jitattn.jit.admin import BuildError

    try:
        out.append(Check("ninja", "ok", ninja_path()))
    except BuildError as exc:
        out.append(Check("ninja", "FAIL", str(exc), "pip install ninja"))


def _driver_version() -> int | None:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def _check_gpu(out: list[Check], nvcc_version: str | None) -> bool:
    try:
        import torch
    except Exception as exc:  # noqa: BLE001
        out.append(Check("GPU", "warn", f"torch cannot be imported ({exc})", "pip install torch"))
        return False
    if not torch.cuda.is_available():
        why = "torch is a CPU-only build" if torch.version.cuda is None else "no CUDA device is visible"
        out.append(Check("GPU", "ok", f"none ({why}): the cpu target works; cuda kernels can still be built for "
                         "another machine with `warm --arch 9.0a`"))
        return False
    gpus = []
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        gpus.append(f"cuda:{i} {torch.cuda.get_device_name(i)} (sm_{major}{minor})")
    out.append(Check("GPU", "ok", "; ".join(gpus)))
    driver, release = _driver_version(), _release(nvcc_version or "")
    if driver and release and driver < release[0] * 1000 + release[1] * 10:
        out.append(Check("driver", "FAIL", f"the driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, "
                         f"but nvcc is {release[0]}.{release[1]}: kernels built with it will not run",
                         "update the NVIDIA driver, or point CUDA_HOME at a toolkit the driver supports"))
    elif driver:
        out.append(Check("driver", "ok", f"supports CUDA {driver // 1000}.{driver % 1000 // 10}"))
    return True


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _failed_dir_violations(base: Path) -> list:
    from jitattn.jit.admin import chain_violations

    failed = base / "failed"
    return [v for v in chain_violations(base.parent, failed) if v.path == failed]


def _check_cache_dir(out: list[Check]) -> None:
    from jitattn import env
    from jitattn.jit.admin import SCHEMA

    root = env.cache_dir()
    where = "JITATTN_CACHE_DIR" if os.environ.get("JITATTN_CACHE_DIR") else "the default location"
    existing = _nearest_existing(root)
    if root.is_symlink() and not root.exists():
        out.append(Check("cache dir", "FAIL", f"{root} ({where}) is a symbolic link to nothing (a dangling link or a "
                         "loop)", f"remove it (rm {root}) or point it at a directory you own"))
        return
    if root.exists():
        if not root.is_dir():
            out.append(Check("cache dir", "FAIL", f"{root} ({where}) is not a directory",
                             "set JITATTN_CACHE_DIR to a directory of your own"))
            return
        # the root, then the directories a build writes in (an entry, its lock, its build directory)
        for d in (root, root / SCHEMA, root / SCHEMA / "locks", root / SCHEMA / "tmp"):
            if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
                out.append(Check("cache dir", "FAIL", f"{d} ({where}{', the cache root' if d == root else ''}) is not "
                                 "a writable directory: every cold build fails",
                                 f"fix its permissions (chmod u+rwx {d}) or set JITATTN_CACHE_DIR elsewhere"))
                return
        from .store import cache_violations

        mine = entries(include_readonly=False)
        unsafe = cache_violations(root / SCHEMA, [e.path for e in mine], writable=True)
        unsafe += _failed_dir_violations(root / SCHEMA)
        for v in unsafe:
            out.append(Check("cache dir", "FAIL", f"unsafe: {v.reason}; jitattn refuses to build in or load from "
                             "this cache", v.fix))
        if unsafe:
            return
        n, size = len(mine), sum(e.size for e in mine)
        detail = f"{root} ({where}; {n} entries, {human_size(size)})"
        failed = root / SCHEMA / "failed"
        if failed.is_dir() and any(failed.iterdir()):
            detail += f"; failed builds kept in {failed}"
    elif not os.access(existing, os.W_OK | os.X_OK):
        out.append(Check("cache dir", "FAIL", f"{root} ({where}) does not exist and {existing} is not writable",
                         "set JITATTN_CACHE_DIR to a writable directory"))
        return
    else:
        detail = f"{root} ({where}; not created yet)"
    free = shutil.disk_usage(existing).free
    if free < MIN_FREE_BYTES:
        out.append(Check("cache dir", "FAIL", f"{detail}: only {human_size(free)} free",
                         "free space, `jitattn-cache prune --max-size 1G`, or set JITATTN_CACHE_DIR elsewhere"))
    else:
        out.append(Check("cache dir", "ok", f"{detail}; {human_size(free)} free"))


def _check_layers(out: list[Check]) -> None:
    from jitattn import env
    from jitattn.jit.admin import SCHEMA
    from jitattn.jit import CacheError
    from jitattn.jit.admin import entry_dirs, foreign_entry_problem

    for layer in env.cache_path():
        base = layer / SCHEMA
        if not base.is_dir():
            out.append(Check("read-only layer", "warn", f"{layer} (JITATTN_CACHE_PATH) has no {SCHEMA}/ folder: "
                             "nothing is loaded from it", "point JITATTN_CACHE_PATH at the folder holding v1/"))
            continue
        from .store import cache_violations

        try:
            dirs = entry_dirs(base)
        except CacheError as exc:
            out.append(Check("read-only layer", "FAIL", str(exc), f"chmod -R u+rX {layer}"))
            continue
        violations = cache_violations(base, dirs, writable=False)
        unsafe = [str(v) for v in violations]
        bad = sum(foreign_entry_problem(entry) is not None for entry in dirs)
        if unsafe:
            shown = "; ".join(unsafe[:3]) + (f"; and {len(unsafe) - 3} more" if len(unsafe) > 3 else "")
            fixes = "; ".join(dict.fromkeys(v.fix for v in violations))
            out.append(Check("read-only layer", "FAIL", f"{layer}: unsafe: {shown}; loads from it are refused",
                             f"{fixes} (or at once: chmod -R go-w {layer}, and make it owned by you or root)"))
        elif bad:
            out.append(Check("read-only layer", "FAIL", f"{layer}: {bad} of {len(dirs)} entries fail their checksum",
                             "re-create the bundle (`jitattn-cache export`) and import it again; "
                             "`jitattn-cache verify` lists them"))
        else:
            out.append(Check("read-only layer", "ok", f"{layer} ({len(dirs)} entries, safe)"))


def cmd_doctor(args: argparse.Namespace) -> int:
    import jitattn

    checks: list[Check] = [Check("jitattn", "ok", f"{jitattn.__version__} ({Path(jitattn.__file__).parent}), "
                                 f"Python {sys.version.split()[0]}")]
    _check_config(checks)
    from .selection import gpu_visible

    gpu = gpu_visible()
    nvcc_version = _check_nvcc(checks, gpu)
    _check_host_compiler(checks)
    _check_ninja(checks)
    _check_gpu(checks, nvcc_version)
    _check_arch_support(checks, nvcc_version, gpu)
    _check_cache_dir(checks)
    _check_layers(checks)
    width = max(len(c.name) for c in checks) + 1
    for c in checks:
        print(f"[{c.level:^4s}] {c.name + ':':{width}s} {c.detail}")
        if c.fix:
            print(f"       {'':{width}s} fix: {c.fix}")
    problems = sum(c.level == "FAIL" for c in checks)
    warnings = sum(c.level == "warn" for c in checks)
    print(f"doctor: {problems} problem(s), {warnings} warning(s)")
    return EXIT_FAILED if problems else EXIT_OK

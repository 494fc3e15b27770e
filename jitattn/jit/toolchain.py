"""Compilers, their versions, flags and the CUDA arch list.

The toolchain is probed at most once per process and only when something is
built or validated: the cache-hit path never runs a compiler.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from .. import env, hardware
from ..spec import Target


class ToolchainError(RuntimeError):
    """No usable compiler, or an arch list that cannot be built."""


@dataclass(frozen=True)
class Toolchain:
    target: str
    compiler: str  # absolute path; never part of the cache key
    version: str  # the compiler's own version line; recorded in the manifest


# Flags are part of the cache key (paths are kept out of them).
CPU_FLAGS: tuple[str, ...] = ("-O3", "-std=c++17", "-fPIC", "-fopenmp", "-fvisibility=hidden", "-fno-math-errno")
CPU_LINK_FLAGS: tuple[str, ...] = ("-shared", "-fopenmp")
CUDA_FLAGS: tuple[str, ...] = (
    "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-Xcompiler=-fPIC,-fvisibility=hidden",
    "-DNDEBUG", "-lineinfo",
)
CUDA_LINK_FLAGS: tuple[str, ...] = ("-shared", "-cudart=static")


def compile_flags(target: Target) -> tuple[str, ...]:
    return CPU_FLAGS if target is Target.CPU else CUDA_FLAGS


def link_flags(target: Target) -> tuple[str, ...]:
    return CPU_LINK_FLAGS if target is Target.CPU else CUDA_LINK_FLAGS


def _find_nvcc() -> str:
    explicit = env.nvcc_override()
    if explicit:
        if os.path.isfile(explicit) and os.access(explicit, os.X_OK):
            return os.path.realpath(explicit)
        raise ToolchainError(f"JITATTN_NVCC={explicit!r} is not an executable nvcc; fix or unset it")
    candidates = []
    if env.cuda_home():
        candidates.append(str(Path(env.cuda_home()) / "bin" / "nvcc"))
    candidates.append(shutil.which("nvcc") or "")
    candidates.append("/usr/local/cuda/bin/nvcc")
    for path in candidates:
        if path and os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.realpath(path)
    raise ToolchainError(
        "nvcc not found: install the CUDA toolkit, or set CUDA_HOME (nvcc in $CUDA_HOME/bin) or JITATTN_NVCC. "
        "Building for the cuda target needs nvcc; loading an already-built cache entry does not"
    )


def _find_cxx() -> str:
    name = env.cxx()
    path = name if os.path.isabs(name) else shutil.which(name)
    if not path or not os.access(path, os.X_OK):
        variable = env.CXX.setting()[1] or "JITATTN_CXX"
        if len(name.split()) > 1:  # e.g. CXX="ccache g++", a command line rather than one program
            raise ToolchainError(
                f"{variable}={name!r} is a command line; jitattn runs one program as the host C++ compiler: set "
                "JITATTN_CXX to a compiler's path (a ccache wrapper too: its masquerade link, e.g. "
                "/usr/lib/ccache/g++)"
            )
        raise ToolchainError(
            f"host C++ compiler {name!r} not found: install g++ (or clang++) or set JITATTN_CXX to its path. "
            "The cpu target is built with it"
        )
    return os.path.realpath(path)


@functools.cache
def _probe(target: str, compiler: str) -> Toolchain:
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ToolchainError(f"{compiler} --version failed: {exc}") from None
    lines = [line.strip() for line in out.splitlines() if line.strip()]
    if target == "cuda":
        release = [line for line in lines if "release" in line or line.startswith("Build")]
        version = "; ".join(release) or (lines[-1] if lines else "unknown")
    else:
        version = lines[0] if lines else "unknown"
    return Toolchain(target=target, compiler=compiler, version=version)


def probe(target: Target) -> Toolchain:
    """Find and identify the compiler for ``target`` (cached per process and path)."""
    compiler = _find_cxx() if target is Target.CPU else _find_nvcc()
    return _probe(target.value, compiler)


def cuda_arch_list() -> tuple[str, ...]:
    """The archs to build (``hardware.cuda_arch_list``), its errors as ``ToolchainError``."""
    try:
        return hardware.cuda_arch_list()
    except hardware.ArchListError as exc:
        raise ToolchainError(str(exc)) from None


def gencode_flags(archs: tuple[str, ...]) -> tuple[str, ...]:
    flags = []
    for arch in archs:
        major, minor, variant, ptx = hardware.ARCH_PATTERN.match(arch).groups()
        sm = f"{major}{minor}{variant}"
        flags.append(f"-gencode=arch=compute_{sm},code=sm_{sm}")
        if ptx:
            flags.append(f"-gencode=arch=compute_{sm},code=compute_{sm}")
    return tuple(flags)


def default_jobs() -> int:
    """JITATTN_MAX_JOBS / MAX_JOBS, else min(CPUs, free memory / 2 GiB), at least 1."""
    override = env.max_jobs_override()
    if override is not None:
        return override
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cpus, _free_memory_bytes() // (2 << 30)))


def _free_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30

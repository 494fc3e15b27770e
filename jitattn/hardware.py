"""Facts about the GPU and the CUDA arch list, in one place (base layer: it imports only ``env``).

The arch list is what jitattn builds for: ``JITATTN_CUDA_ARCH_LIST`` (or ``TORCH_CUDA_ARCH_LIST``), else
the visible GPU's capability ('9.0a' on Hopper, whose wgmma / setmaxnreg need the arch-specific 'a'
target). Kernel families choose their tiers from it (``hopper_only``), the planners size their splits by
the SM count.
"""

from __future__ import annotations

import functools
import re

from . import env

# TORCH_CUDA_ARCH_LIST's format: major.minor, an optional arch-specific 'a' / family 'f', an optional +PTX.
ARCH_PATTERN = re.compile(r"^(\d+)\.(\d+)([af]?)(\+PTX)?$")
_HOPPER_ARCH = re.compile(r"^9\.0a(\+PTX)?$")


class ArchListError(RuntimeError):
    """No arch list can be had: a malformed JITATTN_CUDA_ARCH_LIST, or neither one nor a visible GPU."""


def cuda_arch_list() -> tuple[str, ...]:
    """The archs to build, e.g. ('9.0a',): JITATTN_CUDA_ARCH_LIST, else the current GPU."""
    raw = env.cuda_arch_list()
    if raw:
        return _parsed_arch_list(raw)
    import torch

    if not torch.cuda.is_available():
        raise ArchListError(
            "no visible CUDA GPU to build for: set JITATTN_CUDA_ARCH_LIST (e.g. '9.0a' for H100/H200) "
            "to build on a machine without one, or use the cpu target"
        )
    major, minor = capability(torch.cuda.current_device())
    suffix = "a" if (major, minor) == (9, 0) else ""
    return (f"{major}.{minor}{suffix}",)


@functools.cache
def _parsed_arch_list(raw: str) -> tuple[str, ...]:
    """A JITATTN_CUDA_ARCH_LIST value's archs (parsed once per value: plan() asks on every call)."""
    problem = env.arch_list_problem(raw)
    if problem is not None:
        raise ArchListError(f"JITATTN_CUDA_ARCH_LIST: {problem}")
    return tuple(a for a in re.split(r"[;\s,]+", raw.strip()) if a)


@functools.cache
def capability(device_index: int) -> tuple[int, int]:
    """The compute capability of CUDA device ``device_index`` (asked of the driver once per process)."""
    import torch

    return torch.cuda.get_device_capability(device_index)


def known_arch_list() -> tuple[str, ...] | None:
    """``cuda_arch_list()``, or None where there is none (no GPU and no JITATTN_CUDA_ARCH_LIST, or a bad one:
    whatever builds for it reports that)."""
    try:
        return cuda_arch_list()
    except ArchListError:
        return None


def hopper_only(archs: tuple[str, ...] | None) -> bool:
    """Whether ``archs`` build sm_90a alone (the Hopper tiers' wgmma / TMA kernels run on nothing else)."""
    return bool(archs) and all(_HOPPER_ARCH.match(a) for a in archs)


@functools.cache
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of a CUDA device (132 on the H200)."""
    import torch

    return torch.cuda.get_device_properties(device_index).multi_processor_count

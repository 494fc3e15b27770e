"""Kernel families: for each op, which template renders it, its exported
entries (the binary interface) and the context dict the template receives.

A family module defines ``TEMPLATES`` ({target: template path}),
``entries(spec)`` and ``context(spec)``, and optionally
``explain_build_error(spec, message, sources)`` (``jit`` applies it to a failed compile) and
``select(spec, archs) -> (template path, context)`` (a family with kernel tiers: ``archs`` is the
cuda arch list the build targets, None when unknown; render uses it instead of ``TEMPLATES``). Templates get nothing else: every
derived value is computed here in Python.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from ..spec import DType, Op, Target

_C_TYPES: dict[Target, dict[DType, str]] = {
    Target.CPU: {
        DType.F32: "float", DType.F16: "jitattn::half_t", DType.BF16: "jitattn::bf16_t",
        DType.E4M3: "jitattn::e4m3_t", DType.E5M2: "jitattn::e5m2_t",
    },
    Target.CUDA: {
        DType.F32: "float", DType.F16: "__half", DType.BF16: "__nv_bfloat16",
        DType.E4M3: "__nv_fp8_e4m3", DType.E5M2: "__nv_fp8_e5m2",
    },
}


def c_type(dtype: DType, target: Target) -> str:
    """The C++ element type of ``dtype`` in ``target``'s templates."""
    return _C_TYPES[target][dtype]


_LOADED: dict[Op, ModuleType] = {}  # every cuda decode plan asks (resident_blocks): import_module costs ~1 us


def family(op: Op) -> ModuleType:
    """The family module for ``op``: ``jitattn.kernels.<op.value>`` (a new op needs no entry here)."""
    module = _LOADED.get(op)
    if module is not None:
        return module
    try:
        module = _LOADED[op] = importlib.import_module(f"{__name__}.{op.value}")
    except ModuleNotFoundError as exc:
        if exc.name == f"{__name__}.{op.value}":
            raise NotImplementedError(f"op {op.value!r} has no kernel family in this build of jitattn") from None
        raise
    return module

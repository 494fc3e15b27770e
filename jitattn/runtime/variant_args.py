"""The run-time side of a custom variant: ``run(..., **extra)`` -> the VariantParams struct.

``VariantArgs`` owns one ctypes ``VariantParams`` (the mirror of the struct in
``variant.h``, generated from the same field list) per plan; each ``run()``
validates the keyword arguments against the variant's declared parameters and
writes them into it -- no allocation, no device sync.
"""

from __future__ import annotations

import ctypes
import math

import torch

from ..abi import ctypes_struct, variant_params_entry
from ..spec import Op
from ..variant import TENSOR_DTYPES, AttentionVariant

_INT_RANGE = {"i32": (-(2**31), 2**31 - 1), "i64": (-(2**63), 2**63 - 1)}
# plan() arguments a caller may pass to run() by mistake, by the op whose plan() takes them
_SCALARS = frozenset({"pos_encoding_mode", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta"})
_PLAN_ONLY = {Op.PREFILL: _SCALARS | {"custom_mask", "packed_custom_mask", "causal"}, Op.DECODE: _SCALARS}
_MASKS = frozenset({"custom_mask", "packed_custom_mask", "causal"})


def unexpected_run_arguments(wrapper: str, names, op: Op) -> TypeError:
    """The error for ``run()`` keyword arguments ``names`` of a plan (of ``op``) without a custom variant."""
    planned = sorted(set(names) & _PLAN_ONLY.get(op, frozenset()))
    if planned:
        hint = (f"{', '.join(planned)} {'is a' if len(planned) == 1 else 'are'} plan() argument"
                f"{'s' * (len(planned) > 1)}: plan() fixes the mask and the kernel, so re-plan with it")
    elif op is Op.DECODE and set(names) & _MASKS:
        hint = "decode attends to every key of a request's pages and takes no mask (a mask is a prefill's plan())"
    else:
        hint = "extra arguments are the parameters of a custom variant, and this plan has none (plan(..., variant=...))"
    return TypeError(f"{wrapper}.run() got unexpected keyword argument(s) {sorted(names)}; {hint}")


class VariantArgs:
    """The VariantParams struct of one plan and the check that fills it."""

    def __init__(self, variant: AttentionVariant, wrapper: str) -> None:
        self.variant = variant
        self.wrapper = wrapper
        self.struct = ctypes_struct(variant_params_entry(variant))()
        self._declared = {p.name: p for p in variant.params}

    @property
    def address(self) -> int:
        return ctypes.addressof(self.struct)

    def fill(self, args: dict, device: torch.device, rows: int = 1) -> None:
        """Check ``args`` (the extra keyword arguments of run()) and write them into the struct (``rows``: the launch's
        query rows; with none nothing reads a parameter)."""
        where = f"{self.wrapper}.run() (variant {self.variant.name!r})"
        unknown = sorted(set(args) - set(self._declared))
        if unknown:
            declared = ", ".join(self._declared) or "none"
            raise TypeError(f"{where}: unexpected keyword argument(s) {unknown}; the variant declares: {declared}")
        s = self.struct
        for name, param in self._declared.items():
            value = args.get(name)
            if value is None:
                if not param.optional:
                    raise TypeError(
                        f"{where}: missing required argument {name!r} ({_describe(param)}); pass it as "
                        f"run(..., {name}=...)"
                    )
                setattr(s, name, None if param.rank else 0)
                for d in range(param.rank):
                    setattr(s, f"{name}_size{d}", 0)
                continue
            if param.rank == 0:
                setattr(s, name, _scalar(where, param, value))
                continue
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"{where}: {name} must be a torch.Tensor ({_describe(param)}); got "
                                f"{type(value).__name__}")
            expected = getattr(torch, TENSOR_DTYPES[param.dtype][1])
            if value.dtype != expected:
                raise TypeError(f"{where}: {name} has dtype {value.dtype}; the variant declares {expected} "
                                f"({param.dtype}); convert it with .to({expected})")
            if value.dim() != param.rank:
                raise ValueError(f"{where}: {name} has {value.dim()} dimensions (shape {tuple(value.shape)}); the "
                                 f"variant declares rank {param.rank}")
            if value.device != device:
                raise ValueError(f"{where}: {name} is on {value.device}; the launch runs on {device} (move it "
                                 "there once, outside the per-layer loop)")
            if not value.is_contiguous():
                raise ValueError(f"{where}: {name} must be contiguous (snippets index it row-major); pass "
                                 f"{name}.contiguous()")
            if not value.numel() and not param.optional and rows:  # a null pointer its snippets would read
                raise ValueError(f"{where}: {name} is empty (shape {tuple(value.shape)}); a required tensor must hold "
                                 "what the snippets read (declare it optional=True to pass none)")
            setattr(s, name, value.data_ptr() if value.numel() else None)
            for d in range(param.rank):
                setattr(s, f"{name}_size{d}", value.shape[d])


_F32_MAX = 3.4028234663852886e38


def _describe(param) -> str:
    return f"a {param.dtype} scalar" if param.rank == 0 else f"a rank-{param.rank} {param.dtype} tensor"


def _scalar(where: str, param, value):
    if isinstance(value, torch.Tensor):
        raise TypeError(f"{where}: {param.name} is a scalar parameter; pass a Python number (reading a tensor "
                        "would sync the device)")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{where}: {param.name} must be a Python {'float' if param.dtype == 'f32' else 'int'}; "
                        f"got {value!r}")
    if param.dtype == "f32":
        value = float(value)
        if math.isnan(value) or (math.isfinite(value) and abs(value) > _F32_MAX):
            raise ValueError(f"{where}: {param.name}={value} does not fit in f32 (a finite value beyond float32's "
                             "range would become inf in the kernel; an infinity passes as given)")
        return value
    if isinstance(value, float):
        raise TypeError(f"{where}: {param.name} is declared {param.dtype}; got the float {value!r}")
    lo, hi = _INT_RANGE[param.dtype]
    if not lo <= value <= hi:
        raise ValueError(f"{where}: {param.name}={value} does not fit in {param.dtype}")
    return int(value)

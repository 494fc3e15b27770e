"""RMSNorm, mirroring ``flashinfer.norm`` (FlashInfer 0.5.3's names, arguments, defaults and return values).

``input`` is ``[batch, hidden]`` or ``[batch, heads, hidden]`` (any leading dimensions that collapse into rows:
slices of a wider buffer are fine), ``weight`` ``[hidden]``, one dtype for all (float16, bfloat16 or float32),
on one device (the cuda target on a CUDA device, the cpu target on the CPU). Each row becomes
``x / sqrt(mean(x^2) + eps) * weight`` (Gemma: ``* (1 + weight)``), computed in float32 and rounded once.
The ``fused_add`` forms first add ``input`` into ``residual`` (``residual += input``, rounded) and normalise
that sum (from its float32 value, as FlashInfer does) into ``input``; both are written in place and nothing
is returned. ``enable_pdl`` is accepted and ignored (no programmatic dependent launch). Under torch.compile
each call is one custom op (``runtime/compiled_ops.py``): a model calling them compiles with ``fullgraph=True``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime import compiled_ops
from ..runtime.grad import no_backward
from ..runtime.options import check_flag
from ..runtime.pointwise import rms_norm

__all__ = ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "rmsnorm"]


def _launch():
    """The launch: under torch.compile one custom op of the graph (its checks run when the graph does)."""
    return compiled_ops.rms_norm if torch.compiler.is_compiling() else rms_norm


def _normed(what: str, input: torch.Tensor, weight: torch.Tensor, eps, out: Optional[torch.Tensor],
            weight_offset: float) -> torch.Tensor:
    if out is None:
        if not isinstance(input, torch.Tensor):
            raise TypeError(f"{what}: input must be a torch.Tensor, got {type(input).__name__}")
        out = torch.empty_like(input)
    _launch()(what, input, weight, eps, out, weight_offset=weight_offset)
    return out


@no_backward
def rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None,
            enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``input / RMS(input) * weight`` per row; into ``out`` when given (it may be ``input``), else a new tensor."""
    check_flag(enable_pdl, "enable_pdl")
    return _normed("rmsnorm", input, weight, eps, out, 0.0)


def _fused(what: str, input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps,
           weight_offset: float) -> None:
    if not isinstance(residual, torch.Tensor):  # None would make it a plain rmsnorm, silently
        raise TypeError(f"{what}: residual must be a torch.Tensor (written in place: residual += input), got "
                        f"{type(residual).__name__}; without a residual call rmsnorm")
    _launch()(what, input, weight, eps, input, residual=residual, weight_offset=weight_offset)


def fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                      enable_pdl: Optional[bool] = None) -> None:
    """``residual += input``, then ``input = residual / RMS(residual) * weight``; both in place."""
    check_flag(enable_pdl, "enable_pdl")
    _fused("fused_add_rmsnorm", input, residual, weight, eps, 0.0)


@no_backward
def gemma_rmsnorm(input: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, out: Optional[torch.Tensor] = None,
                  enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """:func:`rmsnorm` with Gemma's ``(1 + weight)``."""
    check_flag(enable_pdl, "enable_pdl")
    return _normed("gemma_rmsnorm", input, weight, eps, out, 1.0)


def gemma_fused_add_rmsnorm(input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6,
                            enable_pdl: Optional[bool] = None) -> None:
    """:func:`fused_add_rmsnorm` with Gemma's ``(1 + weight)``."""
    check_flag(enable_pdl, "enable_pdl")
    _fused("gemma_fused_add_rmsnorm", input, residual, weight, eps, 1.0)

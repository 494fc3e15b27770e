"""Gated activations, mirroring ``flashinfer.activation`` (FlashInfer 0.5.3's names, arguments, defaults).

``input`` is ``[..., 2 * d]`` (float16, bfloat16 or float32; 1-D included; its leading dimensions collapse into
rows, so a slice of a wider buffer is fine); the result ``[..., d]`` is ``act(input[..., :d]) * input[..., d:]``,
computed in float32 and rounded once, into ``out`` when given. ``act``: SiLU (``x * sigmoid(x)``), GeLU
(``erf`` form) or GeLU's tanh approximation. ``enable_pdl`` is accepted and ignored. Under torch.compile each
call is one custom op (``runtime/compiled_ops.py``): a model calling them compiles with ``fullgraph=True``.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime import compiled_ops
from ..runtime.grad import no_backward
from ..runtime.options import check_flag
from ..runtime.pointwise import act_and_mul as launch_act_and_mul

__all__ = ["gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul"]


def _act_and_mul(what: str, act: str, input: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``act_and_mul`` over ``[..., 2 * d]``: a 1-D input (and its 1-D ``out``) runs as one row, which the
    row-wise kernels need; an ``out`` of the wrong shape is named with the shape it must have. Under
    torch.compile the launch is one custom op of the graph (its checks run when the graph does)."""
    act_and_mul = compiled_ops.act_and_mul if torch.compiler.is_compiling() else launch_act_and_mul
    if not isinstance(input, torch.Tensor) or input.dim() == 0:
        if isinstance(input, torch.Tensor):
            raise ValueError(f"{what}: input is 0-d; expected [..., 2 * d] (at least 1 dimension)")
        return act_and_mul(what, act, input, out)  # refuses what is not a tensor
    if isinstance(out, torch.Tensor) and input.shape[-1] % 2 == 0:
        shape = (*input.shape[:-1], input.shape[-1] // 2)
        if tuple(out.shape) != shape:
            raise ValueError(f"{what}: out has shape {tuple(out.shape)}; expected {shape} (the input's, its last "
                             "dimension halved)")
    if input.dim() > 1:
        return act_and_mul(what, act, input, out)
    if input.shape[0] % 2:
        raise ValueError(f"{what}: input has shape {tuple(input.shape)}; its last dimension must be even (the "
                         "activation's half, then the half it multiplies)")
    row_out = out.unsqueeze(0) if isinstance(out, torch.Tensor) else out
    result = act_and_mul(what, act, input.unsqueeze(0), row_out)
    return result[0] if out is None else out


@no_backward
def silu_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``silu(input[..., :d]) * input[..., d:]``."""
    check_flag(enable_pdl, "enable_pdl")
    return _act_and_mul("silu_and_mul", "silu", input, out)


@no_backward
def gelu_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``gelu(input[..., :d]) * input[..., d:]`` (the ``erf`` GeLU)."""
    check_flag(enable_pdl, "enable_pdl")
    return _act_and_mul("gelu_and_mul", "gelu", input, out)


@no_backward
def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor = None,
                      enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``gelu_tanh(input[..., :d]) * input[..., d:]`` (GeLU's tanh approximation)."""
    check_flag(enable_pdl, "enable_pdl")
    return _act_and_mul("gelu_tanh_and_mul", "gelu_tanh", input, out)

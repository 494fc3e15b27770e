"""Gated activations, mirroring ``flashinfer.activation`` (FlashInfer 0.5.3's names, arguments, defaults).

``input`` is ``[..., 2 * d]`` (float16, bfloat16 or float32; its leading dimensions collapse into rows, so a
slice of a wider buffer is fine); the result ``[..., d]`` is ``act(input[..., :d]) * input[..., d:]``,
computed in float32 and rounded once, into ``out`` when given. ``act``: SiLU (``x * sigmoid(x)``), GeLU
(``erf`` form) or GeLU's tanh approximation. ``enable_pdl`` is accepted and ignored.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..runtime.pointwise import act_and_mul

__all__ = ["gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul"]


def silu_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``silu(input[..., :d]) * input[..., d:]``."""
    return act_and_mul("silu_and_mul", "silu", input, out)


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor = None, enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``gelu(input[..., :d]) * input[..., d:]`` (the ``erf`` GeLU)."""
    return act_and_mul("gelu_and_mul", "gelu", input, out)


def gelu_tanh_and_mul(input: torch.Tensor, out: torch.Tensor = None,
                      enable_pdl: Optional[bool] = None) -> torch.Tensor:
    """``gelu_tanh(input[..., :d]) * input[..., d:]`` (GeLU's tanh approximation)."""
    return act_and_mul("gelu_tanh_and_mul", "gelu_tanh", input, out)

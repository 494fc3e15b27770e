"""``flashinfer.activation``: the gated activations (no LSE: the native functions themselves)."""

from __future__ import annotations

from ..ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul

__all__ = ["gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul"]

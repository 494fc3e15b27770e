"""Parsing and defaulting of the options every attention wrapper accepts.

Accepts FlashInfer's spellings ("NONE", "ROPE_LLAMA", "ALIBI", their integer
codes 0/1/2, torch dtypes or their names) and turns them into our enums and
an ``AttentionScalars`` with every default applied.
"""

from __future__ import annotations

import math

import torch

from ..spec import DType, KVLayout, PosEncoding
from .launch import AttentionScalars

_POS_CODES = {0: PosEncoding.NONE, 1: PosEncoding.ROPE_LLAMA, 2: PosEncoding.ALIBI}


def parse_pos_encoding(value: str | int | PosEncoding) -> PosEncoding:
    if isinstance(value, int) and not isinstance(value, bool):
        if value in _POS_CODES:
            return _POS_CODES[value]
        raise ValueError(f"pos_encoding_mode={value} is not supported; use 'NONE', 'ROPE_LLAMA' or 'ALIBI'")
    try:
        return PosEncoding.parse(value, "pos_encoding_mode")
    except ValueError:
        raise ValueError(f"pos_encoding_mode={value!r} is not supported; use 'NONE', 'ROPE_LLAMA' or 'ALIBI'") from None


def parse_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    return DType.parse(value, name).torch_dtype


def parse_kv_layout(value: str | KVLayout) -> KVLayout:
    return KVLayout.parse(value, "kv_layout")


def resolve_scalars(
    *, head_dim_qk: int, causal: bool, pos_encoding: PosEncoding, window_left: int | None,
    logits_soft_cap: float | None, sm_scale: float | None, rope_scale: float | None, rope_theta: float | None,
) -> AttentionScalars:
    """Validate run-time scalars and apply FlashInfer's defaults."""
    window_left = -1 if window_left is None else int(window_left)
    if window_left < -1:
        raise ValueError(f"window_left={window_left} must be -1 (no window) or >= 0")
    cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)
    if cap < 0 or not math.isfinite(cap):
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be None, 0 (off) or a positive number")
    scale = 1.0 / math.sqrt(head_dim_qk) if sm_scale is None else float(sm_scale)
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"sm_scale={sm_scale} must be a positive finite number")
    rope_scale = 1.0 if rope_scale is None else float(rope_scale)
    rope_theta = 1e4 if rope_theta is None else float(rope_theta)
    if rope_scale <= 0 or rope_theta <= 0:
        raise ValueError(f"rope_scale={rope_scale} and rope_theta={rope_theta} must be positive")
    return AttentionScalars(
        causal=bool(causal), pos_encoding=pos_encoding, window_left=window_left, sm_scale=scale,
        logits_soft_cap=cap, rope_scale=rope_scale, rope_theta=rope_theta,
    )


def fp8_scale(value: float | torch.Tensor | None, name: str) -> float:
    """A per-tensor fp8 dequantization scale as a float (None means 1)."""
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float or a one-element tensor (per-tensor scale)")
        if value.device.type != "cpu":
            raise ValueError(f"{name} on {value.device} would need a device sync; pass a Python float")
        value = value.item()
    return float(value)

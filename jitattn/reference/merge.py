"""Reference merges of attention states by natural-log LSE."""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .common import F64, NEG_INF


def merge_states(v: Tensor, s: Tensor) -> Tuple[Tensor, Tensor]:
    """Merge ``num_states`` partial attention states per (token, head).

    Args:
        v: ``[seq, num_states, H, D]`` partial outputs.
        s: ``[seq, num_states, H]`` natural-log LSEs.

    Returns:
        ``(v, s)`` float32 ``[seq, H, D]`` and ``[seq, H]`` with
        ``v = sum_i e^{s_i} v_i / sum_i e^{s_i}`` and ``s = log sum_i e^{s_i}``,
        computed with max subtraction.  If every state is ``-inf`` (or
        ``num_states == 0``) the result is ``v = 0``, ``s = -inf``; a NaN
        LSE makes the result NaN (it is not an empty state).
    """
    if v.dim() != 4 or s.dim() != 3 or tuple(v.shape[:3]) != tuple(s.shape):
        raise ValueError(f"bad shapes v={tuple(v.shape)} s={tuple(s.shape)}")
    seq, n, h, d = v.shape
    if n == 0:
        return (
            torch.zeros(seq, h, d, dtype=torch.float32, device=v.device),
            torch.full((seq, h), NEG_INF, dtype=torch.float32, device=v.device),
        )
    vd = v.to(F64)
    sd = s.to(F64).to(v.device)
    s_max = sd.amax(dim=1, keepdim=True)  # [seq, 1, H]
    s_max = torch.where(torch.isfinite(s_max), s_max, torch.zeros_like(s_max))
    w = torch.exp(sd - s_max)  # [seq, n, H]; 0 for -inf states
    total = w.sum(dim=1)  # [seq, H]
    contrib = torch.where(w[..., None] > 0, w[..., None] * vd, torch.zeros_like(vd))
    num = contrib.sum(dim=1)  # [seq, H, D]
    has = total != 0  # NaN (a NaN state) is not empty: it propagates
    safe_total = torch.where(has, total, torch.ones_like(total))
    v_out = torch.where(has[..., None], num / safe_total[..., None], torch.zeros_like(num))
    s_out = torch.where(
        has, s_max.squeeze(1) + torch.log(safe_total), torch.full_like(total, NEG_INF)
    )
    return v_out.to(torch.float32), s_out.to(torch.float32)


def merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Merge two attention states (``[seq, H, D]`` outputs, ``[seq, H]`` LSEs).

    ``v = (e^{s_a} v_a + e^{s_b} v_b) / (e^{s_a} + e^{s_b})`` and
    ``s = log(e^{s_a} + e^{s_b})``, computed stably; both ``-inf`` gives
    ``v = 0``, ``s = -inf``.

    Returns:
        ``(v, s)`` as float32.
    """
    if v_a.shape != v_b.shape or s_a.shape != s_b.shape:
        raise ValueError("the two states must have identical shapes")
    v = torch.stack([v_a.to(F64), v_b.to(F64).to(v_a.device)], dim=1)
    s = torch.stack([s_a.to(F64), s_b.to(F64).to(s_a.device)], dim=1)
    return merge_states(v, s)

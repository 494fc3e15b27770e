"""Attention sinks on top of any reference attention (float64).

A sink logit ``s_h`` per query head joins the softmax denominator without a value:
``o = sum_j e^{x_j} v_j / (sum_j e^{x_j} + e^{s_h})``. With ``o_keys`` and ``lse`` the
output and natural-log LSE of the keys alone, that is ``o_keys * e^lse / (e^lse + e^s_h)``
(0 when no key is visible, ``lse = -inf``); the LSE the kernels return stays ``lse``.
"""

from __future__ import annotations

import torch
from torch import Tensor


def apply_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """``out`` ``[tokens, H, D]`` and ``lse`` ``[tokens, H]`` of the keys alone -> the output with sinks ``[H]``.

    Computed in float64 as ``out * sigmoid(lse - s)``, which is ``e^lse / (e^lse + e^s)`` without
    overflow and exactly 0 for ``lse = -inf``. Returns float32, like the other references.
    """
    weight = torch.sigmoid(lse.to(torch.float64) - sinks.to(device=lse.device, dtype=torch.float64))
    return (out.to(torch.float64) * weight.unsqueeze(-1)).to(torch.float32)

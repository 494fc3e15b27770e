"""Gated activations of rows (FlashInfer's ``silu_and_mul``, ``gelu_and_mul``, ``gelu_tanh_and_mul``).

One module per element dtype (``q_dtype``: input and output share it; f32, f16 and bf16 on both targets).
A row of ``2 d`` elements at ``input + r * in_stride`` (elements; the row itself is contiguous) gives

    out[r, i] = act(x[r, i]) * x[r, d + i],   i < d

in float32, rounded once to the dtype; ``act`` (``abi.ACT_CODES``) is SiLU ``x / (1 + e^-x)``, GeLU
``x / 2 * (1 + erf(x / sqrt 2))`` or its tanh form ``x / 2 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 x^3)))``.
"""

from __future__ import annotations

from typing import Any

from ..abi import ACT_CODES, Entry, fields
from ..spec import VariantSpec
from . import c_type

TEMPLATES = {"cpu": "cpu/act.cpp.jinja", "cuda": "cuda/act.cu.jinja"}

ACT_AND_MUL = Entry("act_and_mul", fields("input:ptr out:ptr rows:i64 d:i64 in_stride:i64 out_stride:i64 "
                                          "act:i32 num_threads:i32"))


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    return (ACT_AND_MUL,)


def context(spec: VariantSpec) -> dict[str, Any]:
    return {"scalar_ctype": c_type(spec.q_dtype, spec.target), "act_codes": ACT_CODES}

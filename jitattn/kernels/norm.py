"""RMSNorm of rows (FlashInfer's ``rmsnorm``, ``fused_add_rmsnorm`` and their Gemma forms).

One module per element dtype (``q_dtype``: input, residual, weight and output share it; f32, f16 and bf16
on both targets). A row of ``hidden`` elements at ``input + r * in_stride`` (elements; the row itself is
contiguous) becomes

    out[r, i] = x[r, i] * rsqrt(mean_i(x[r, i]^2) + eps) * (weight_offset + weight[i])

in float32, rounded once to the dtype. Without a residual, ``x`` is the input row. With one
(``residual`` set: ``fused_add_rmsnorm``), ``x = input + residual`` in float32; the residual row takes ``x``
(rounded) and the output (the input row itself, in place) the normalised ``x``, from the unrounded sum as
FlashInfer's kernel does. ``weight_offset`` is 0, or 1 for Gemma's ``(1 + weight)``.
"""

from __future__ import annotations

from typing import Any

from ..abi import Entry, fields
from ..spec import VariantSpec
from . import c_type

TEMPLATES = {"cpu": "cpu/norm.cpp.jinja", "cuda": "cuda/norm.cu.jinja"}

# cuda: a block per row, a float32 copy of the row kept in shared memory between the sum of squares and the
# scaling (so the input is read once: 128 KiB at this many elements, past the 48 KiB a launch gets without
# opting in); longer rows are refused (cpu: no limit).
CUDA_MAX_HIDDEN = 32768

RMSNORM = Entry("rmsnorm", fields(
    "input:ptr residual:ptr weight:ptr out:ptr rows:i64 hidden:i64 in_stride:i64 res_stride:i64 out_stride:i64 "
    "eps:f32 weight_offset:f32 num_threads:i32"
))


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    return (RMSNORM,)


def context(spec: VariantSpec) -> dict[str, Any]:
    return {"scalar_ctype": c_type(spec.q_dtype, spec.target), "max_hidden": CUDA_MAX_HIDDEN}

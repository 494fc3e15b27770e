"""RoPE: rotate queries and keys by their token's position (FlashInfer's ``apply_rope*`` functions).

One module per element dtype (``q_dtype``: q, k and their outputs share it; f32, f16 and bf16 on both targets),
or per pair of 16-bit dtypes (``o_dtype`` set: the outputs in the other one, e.g. bf16 rows rotated straight into
f16). Everything else is a run-time field of ``RopeParams``:

- **positions** (``pos_source``, ``abi.ROPE_POSITION_CODES``): ``indptr`` -- token ``t`` of request
  ``r`` (``indptr[r] <= t < indptr[r+1]``) sits at ``offsets[r] + t - indptr[r]``; ``pos_ids`` -- token
  ``t`` sits at ``pos_ids[t]``. Index arrays are int32 or int64 (``index_bytes`` 4 or 8).
- **angles**: pair ``i`` (of ``rotary_dim / 2``) at position ``p`` turns by ``p * freq_i``, with
  ``freq_i = theta^(-2i / rotary_dim)`` scaled by Llama 3.1's rule written as one clamp:
  ``s = clamp(freq_i * smooth_a + smooth_b, 0, 1)``, ``freq_i <- (1 - s) * freq_i * rope_rcp_scale + s * freq_i``
  (plain RoPE: ``smooth_a = smooth_b = 0``, so every frequency is divided by ``rope_scale``). When
  ``cos_sin_cache`` is set (float32 ``[cache_rows, rotary_dim]``, row ``p`` at ``p * cache_stride``:
  cos of each pair in the first half, sin in the second) the angles are read from it instead.
- **pairs**: ``interleave`` 1 rotates ``(2i, 2i+1)``; 0 rotates ``(i, i + rotary_dim/2)`` (NeoX halves).
  Dimensions from ``rotary_dim`` to ``head_dim`` are copied when ``copy_unrotated`` is 1 (out of place)
  and left alone otherwise (in place: the outputs are the inputs).

Every element goes through float32 and is rounded to the output dtype (round to nearest even). A row
(token, head) of q lives at ``t*q_stride_n + h*q_stride_h`` (elements; the last dimension is contiguous),
likewise k and both outputs. The cpu kernel checks every position before writing anything and reports
a bad one; the cuda kernel cannot report without a sync, so a token whose position is invalid (outside
every request of ``indptr``, or outside the cos/sin cache) gets NaN in its rotated dimensions.
"""

from __future__ import annotations

from typing import Any

from ..abi import ROPE_POSITION_CODES, Entry, fields
from ..spec import VariantSpec
from . import c_type

TEMPLATES = {"cpu": "cpu/rope.cpp.jinja", "cuda": "cuda/rope.cu.jinja"}

# The largest rotary_dim the cuda kernel stages (cos and sin of each pair in shared memory: 32 KiB, under the
# 48 KiB a launch gets without opting in; real models rotate at most a few hundred dimensions).
CUDA_MAX_ROTARY_DIM = 8192

ROPE = Entry("rope", fields(
    "q:ptr k:ptr q_out:ptr k_out:ptr indptr:ptr offsets:ptr pos_ids:ptr cos_sin_cache:ptr "
    "nnz:i64 batch_size:i64 num_q_heads:i64 num_k_heads:i64 head_dim:i64 rotary_dim:i64 "
    "q_stride_n:i64 q_stride_h:i64 k_stride_n:i64 k_stride_h:i64 "
    "q_out_stride_n:i64 q_out_stride_h:i64 k_out_stride_n:i64 k_out_stride_h:i64 "
    "cache_rows:i64 cache_stride:i64 "
    "rope_rcp_scale:f32 rope_theta:f32 smooth_a:f32 smooth_b:f32 "
    "pos_source:i32 index_bytes:i32 interleave:i32 copy_unrotated:i32 num_threads:i32"
))


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    return (ROPE,)


def context(spec: VariantSpec) -> dict[str, Any]:
    return {
        "scalar_ctype": c_type(spec.q_dtype, spec.target),
        "out_ctype": c_type(spec.o_dtype or spec.q_dtype, spec.target),
        "pos_codes": ROPE_POSITION_CODES,
        "max_rotary_dim": CUDA_MAX_ROTARY_DIM,
    }

"""Plain-torch float64 reference implementations for jitattn.

Every kernel test compares against the functions in this module.  They are
deliberately simple, loop-per-request implementations with no global state:

* all arithmetic is done in ``torch.float64`` (inputs, including fp8 tensors,
  are upcast with ``.to(torch.float64)``);
* attention outputs and LSEs are returned as ``torch.float32``;
* the LSE is always the *natural* log of the sum of exponentiated logits;
* results live on the device of the query tensor (CPU or CUDA both work).

Semantics (shared by every attention entry point)
-------------------------------------------------
For one request with ``qo_len`` queries and ``kv_len`` keys:

* query ``i`` sits at absolute position ``p_i = kv_len - qo_len + i``; key ``j``
  sits at position ``j``;
* GQA: query head ``h`` reads kv head ``h // (H_qo // H_kv)``;
* ``logits = sm_scale * (q . k)`` with ``sm_scale`` defaulting to
  ``1 / sqrt(D_qk)``;
* ``pos_encoding_mode="ROPE_LLAMA"`` rotates q (at ``p_i``) and k (at ``j``)
  with rotate-half (non-interleaved) RoPE before the dot product;
* ``pos_encoding_mode="ALIBI"`` adds ``slope[h] * (j - p_i)`` to the scaled
  logits;
* ``logits_soft_cap=c`` (``c > 0``) then maps ``logits -> c * tanh(logits / c)``;
* masks (all ANDed): causal (bottom-right) keeps ``j <= p_i``; ``window_left=w``
  (``w >= 0``) keeps ``j >= p_i - w`` only -- the upper bound ``j <= p_i`` comes
  from ``causal`` alone, so a non-causal windowed query also sees every key to
  its right; ``custom_mask`` (True = attend) is ANDed in as well;
* masked logits are ``-inf``; a query whose keys are all masked (or
  ``kv_len == 0``) yields output 0 and LSE ``-inf`` -- never NaN.  A NaN
  query that sees a key yields a NaN output row and a NaN LSE;
* attention sinks (``apply_sinks``) scale the keys' output by
  ``e^lse / (e^lse + e^sink[h])``; the LSE stays that of the keys.

The standalone RoPE functions (``jitattn.ops.rope``) have theirs in ``jitattn.reference.rope``
(``apply_rope``, ``apply_rope_cos_sin_cache``, ``rope_frequencies`` with Llama 3.1's rule).
"""

from __future__ import annotations

from .common import PagedKVCache
from .attention import alibi_slopes, apply_rope_llama, batch_ragged_attention, single_attention
from .block_sparse import block_sparse_attention, bsr_dense_mask, variable_block_sparse_attention
from .masks import pack_custom_mask, unpack_custom_mask
from .paged import (
    append_paged_kv_cache, batch_decode_paged, batch_prefill_paged, get_batch_indices_positions, get_seq_lens,
    paged_kv_to_ragged, to_cache_dtype,
)
from .merge import merge_state, merge_states
from .variant import variant_attention
from .sinks import apply_sinks
from . import rope

__all__ = [
    "alibi_slopes",
    "apply_rope_llama",
    "single_attention",
    "batch_ragged_attention",
    "unpack_custom_mask",
    "pack_custom_mask",
    "paged_kv_to_ragged",
    "batch_decode_paged",
    "batch_prefill_paged",
    "merge_state",
    "merge_states",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "to_cache_dtype",
    "variant_attention",
    "apply_sinks",
    "rope",
    "PagedKVCache",
    "block_sparse_attention",
    "bsr_dense_mask",
    "variable_block_sparse_attention",
]

"""jitattn: a JIT kernel-template engine for LLM attention.

Importing this package initialises no CUDA context, creates no directory and
compiles nothing; all of that happens on first use of a kernel.
"""

from __future__ import annotations

import sys

from .version import __version__  # noqa: E402,F401

from .variant import AttentionVariant, VariantParam  # noqa: E402
from .spec import DType, KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec  # noqa: E402
from .jit import build_many, load  # noqa: E402
from .runtime.specs import mla_model_specs, model_specs  # noqa: E402
from .runtime.merge import merge_state, merge_state_in_place, merge_states  # noqa: E402
from .ops.decode import (  # noqa: E402
    BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper, fast_decode_plan,
    single_decode_with_kv_cache,
)
from .ops.prefill import (  # noqa: E402
    BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper, single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .ops.cascade import (  # noqa: E402
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper, BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
)
from .ops.page import (  # noqa: E402
    append_paged_kv_cache, append_paged_mla_kv_cache, get_batch_indices_positions, get_seq_lens,
)
from .ops.rope import (  # noqa: E402
    apply_llama31_rope, apply_llama31_rope_inplace, apply_llama31_rope_pos_ids, apply_llama31_rope_pos_ids_inplace,
    apply_rope, apply_rope_inplace, apply_rope_pos_ids, apply_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache,
    apply_rope_with_cos_sin_cache_inplace,
)
from .ops.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm  # noqa: E402
from .ops.activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul  # noqa: E402
from .ops.mla import BatchMLAPagedAttentionWrapper  # noqa: E402
from .ops.attention_sink import BatchAttentionWithAttentionSinkWrapper  # noqa: E402
from .ops.batch_attention import BatchAttention  # noqa: E402
from .ops.pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper  # noqa: E402
from .ops.sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper  # noqa: E402
from . import ops as _ops  # noqa: E402
from .ops import (  # noqa: E402,F401  (the short paths below)
    activation, attention, attention_sink, batch_attention, cascade, decode, mla, norm, page, pod, prefill, rope,
    shared_prefix, sparse,
)

# The ops live in jitattn.ops; their modules keep their short paths (``import jitattn.decode``,
# ``from jitattn.cascade import ...``): registered here, so importing one imports nothing twice.
for _name in ("activation", "attention", "attention_sink", "batch_attention", "cascade", "decode", "mla", "norm", "page",
              "pod", "prefill", "rope", "shared_prefix", "sparse"):
    sys.modules[f"{__name__}.{_name}"] = getattr(_ops, _name)
del _name, _ops

__all__ = [
    "AttentionVariant", "VariantParam", "BatchMLAPagedAttentionWrapper", "BatchAttentionWithAttentionSinkWrapper", "append_paged_mla_kv_cache", "BatchDecodeWithPagedKVCacheWrapper", "BatchPrefillWithPagedKVCacheWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan", "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithRaggedKVCacheWrapper", "DType", "KVLayout", "KVStorage", "MaskMode",
    "MultiLevelCascadeAttentionWrapper", "Op", "append_paged_kv_cache", "get_batch_indices_positions",
    "get_seq_lens", "mla_model_specs", "model_specs", "PosEncoding", "Target", "VariantSpec", "build_many", "load",
    "merge_state", "merge_state_in_place", "merge_states", "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache", "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
    "BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "BatchAttention",
    "BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper", "rmsnorm", "fused_add_rmsnorm", "gemma_rmsnorm",
    "gemma_fused_add_rmsnorm", "silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul",
]

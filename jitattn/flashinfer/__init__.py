"""jitattn under FlashInfer's conventions: a drop-in for ``import flashinfer``.

jitattn's own API (``jitattn``, ``jitattn.ops.decode``, ...) returns and takes the **natural-log** LSE.
This namespace has FlashInfer 0.5.3's module layout (``decode``, ``prefill``, ``cascade``, ``mla``,
``page``, ``rope``, ``norm``, ``activation``, ``attention``, ``sparse``, ``pod``, ``quantization``) and names, and
FlashInfer's **base-2** LSE wherever one is returned (``run(..., return_lse=True)``, ``*_return_lse``, an ``lse=``
buffer) or taken (``merge_state``, ``merge_state_in_place``, ``merge_states``); MLA's ``run`` returns base 2 unless
``return_lse_base_on_e=True``, as FlashInfer's. Everything else -- arguments, defaults, the older
``begin_forward``/``forward`` spellings -- is the native API's, which already follows FlashInfer.

Use it where code written for FlashInfer runs::

    import jitattn.flashinfer
    jitattn.flashinfer.install()     # sys.modules["flashinfer"] and its submodules -> this namespace
    import sglang ...                # its `import flashinfer` now gets jitattn

or name it directly: ``from jitattn.flashinfer import BatchDecodeWithPagedKVCacheWrapper``.
"""

from __future__ import annotations

import sys
import types

from . import activation, attention, cascade, decode, mla, norm, page, pod, prefill, quantization, rope, sparse
from .activation import gelu_and_mul, gelu_tanh_and_mul, silu_and_mul
from .attention import BatchAttention, BatchAttentionWithAttentionSinkWrapper
from .cascade import (BatchDecodeWithSharedPrefixPagedKVCacheWrapper, BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
                      MultiLevelCascadeAttentionWrapper, merge_state, merge_state_in_place, merge_states)
from .decode import (BatchDecodeWithPagedKVCacheWrapper, CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
                     fast_decode_plan, single_decode_with_kv_cache)
from .mla import BatchMLAPagedAttentionWrapper
from .norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm
from .pod import BatchPODWithPagedKVCacheWrapper, PODWithPagedKVCacheWrapper
from .page import append_paged_kv_cache, append_paged_mla_kv_cache, get_batch_indices_positions, get_seq_lens
from .quantization import packbits, segment_packbits
from .prefill import (BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper,
                      single_prefill_with_kv_cache, single_prefill_with_kv_cache_return_lse)
from .rope import (apply_llama31_rope, apply_llama31_rope_inplace, apply_llama31_rope_pos_ids,
                   apply_llama31_rope_pos_ids_inplace, apply_rope, apply_rope_inplace, apply_rope_pos_ids,
                   apply_rope_pos_ids_inplace, apply_rope_with_cos_sin_cache, apply_rope_with_cos_sin_cache_inplace)
from .sparse import BlockSparseAttentionWrapper, VariableBlockSparseAttentionWrapper

__all__ = [
    "BatchAttention", "BatchAttentionWithAttentionSinkWrapper", "BatchPODWithPagedKVCacheWrapper",
    "PODWithPagedKVCacheWrapper", "BatchDecodeWithPagedKVCacheWrapper", "BlockSparseAttentionWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchMLAPagedAttentionWrapper",
    "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper", "__version__", "append_paged_kv_cache", "append_paged_mla_kv_cache",
    "apply_llama31_rope", "apply_llama31_rope_inplace", "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace", "apply_rope", "apply_rope_inplace", "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace", "apply_rope_with_cos_sin_cache", "apply_rope_with_cos_sin_cache_inplace",
    "fast_decode_plan", "get_batch_indices_positions", "get_seq_lens", "install", "merge_state",
    "merge_state_in_place", "merge_states", "packbits", "segment_packbits", "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse", "VariableBlockSparseAttentionWrapper",
    "fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "rmsnorm", "gelu_and_mul", "gelu_tanh_and_mul",
    "silu_and_mul",
]

# The FlashInfer release whose API this namespace follows (names, arguments, defaults, LSE convention):
# engines compare flashinfer.__version__ to pick code paths. jitattn's own version is jitattn.__version__.
__version__ = "0.5.3"

SUBMODULES = {"activation": activation, "attention": attention, "cascade": cascade, "decode": decode, "mla": mla,
              "norm": norm, "page": page, "pod": pod, "prefill": prefill, "quantization": quantization, "rope": rope,
              "sparse": sparse}


def install(name: str = "flashinfer") -> types.ModuleType:
    """Make ``import flashinfer`` (and ``flashinfer.decode``, ``.prefill``, ``.cascade``, ``.mla``, ``.page``,
    ``.rope``, ``.norm``, ``.activation``, ``.attention``, ``.sparse``, ``.pod``, ``.quantization``) give this
    namespace; returns it.

    Call it before anything imports FlashInfer: a module that already holds the real package keeps it,
    so installing over an imported FlashInfer is refused. Installing twice is a no-op.
    """
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise TypeError(f"install(name={name!r}): name must be the module name to import this namespace as, such "
                        "as 'flashinfer'")
    this = sys.modules[__name__]
    present = sys.modules.get(name)
    if present is not None and present is not this:
        raise RuntimeError(
            f"{name!r} is already imported (from {getattr(present, '__file__', None) or present!r}); modules that "
            f"imported it keep that one. Call jitattn.flashinfer.install() before anything imports {name}"
        )
    sys.modules[name] = this
    for sub, module in SUBMODULES.items():
        sys.modules[f"{name}.{sub}"] = module
    return this

"""``flashinfer.prefill`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations

import functools

from ..ops import prefill as native
from ..runtime.wrapper import returning_lse
from .convention import returns_base2

__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse"]

single_prefill_with_kv_cache = returns_base2(native.single_prefill_with_kv_cache)
single_prefill_with_kv_cache.__module__ = __name__  # pickled by reference as this module's (the native one is another)
single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)


class BatchPrefillWithPagedKVCacheWrapper(native.BatchPrefillWithPagedKVCacheWrapper):
    __doc__ = native.BatchPrefillWithPagedKVCacheWrapper.__doc__
    run = returns_base2(native.BatchPrefillWithPagedKVCacheWrapper.run)
    run_return_lse = returning_lse(run)


class BatchPrefillWithRaggedKVCacheWrapper(native.BatchPrefillWithRaggedKVCacheWrapper):
    __doc__ = native.BatchPrefillWithRaggedKVCacheWrapper.__doc__
    run = returns_base2(native.BatchPrefillWithRaggedKVCacheWrapper.run)
    run_return_lse = returning_lse(run)

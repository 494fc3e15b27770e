"""``flashinfer.decode`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations

import functools

from ..ops import decode as native
from ..ops.decode import fast_decode_plan
from .convention import returns_base2

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan",
           "single_decode_with_kv_cache"]

single_decode_with_kv_cache = returns_base2(native.single_decode_with_kv_cache)


class BatchDecodeWithPagedKVCacheWrapper(native.BatchDecodeWithPagedKVCacheWrapper):
    __doc__ = native.BatchDecodeWithPagedKVCacheWrapper.__doc__
    run = returns_base2(native.BatchDecodeWithPagedKVCacheWrapper.run)
    run_return_lse = functools.partialmethod(run, return_lse=True)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper,
                                                  native.CUDAGraphBatchDecodeWithPagedKVCacheWrapper):
    __doc__ = native.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__doc__

"""``flashinfer.decode`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations


import torch

from ..ops import decode as native
from ..ops.decode import fast_decode_plan
from ..runtime.wrapper import returning_lse
from .convention import returns_base2
from .page import get_seq_lens

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan",
           "get_seq_lens", "single_decode_with_kv_cache"]

# FlashInfer's flashinfer.decode also holds these; SGLang's and vLLM's FlashInfer backends import them from there.
_RANGES: dict[tuple[int, torch.device], torch.Tensor] = {}


def _get_range_buf(seq_len: int, device: torch.device) -> torch.Tensor:
    """``arange(seq_len)`` in int32 on ``device``, a view of one cached buffer per power of two (FlashInfer's)."""
    size = 1 << max(int(seq_len) - 1, 0).bit_length()
    key = (size, torch.device(device))
    buf = _RANGES.get(key)
    if buf is None:
        buf = _RANGES[key] = torch.arange(size, dtype=torch.int32, device=device)
    return buf[:seq_len]


single_decode_with_kv_cache = returns_base2(native.single_decode_with_kv_cache)
single_decode_with_kv_cache.__module__ = __name__  # pickled by reference as this module's (the native one is another)


class BatchDecodeWithPagedKVCacheWrapper(native.BatchDecodeWithPagedKVCacheWrapper):
    __doc__ = native.BatchDecodeWithPagedKVCacheWrapper.__doc__
    run = returns_base2(native.BatchDecodeWithPagedKVCacheWrapper.run)
    run_return_lse = returning_lse(run)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper,
                                                  native.CUDAGraphBatchDecodeWithPagedKVCacheWrapper):
    __doc__ = native.CUDAGraphBatchDecodeWithPagedKVCacheWrapper.__doc__

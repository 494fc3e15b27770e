"""``flashinfer.attention`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations

import functools

from ..ops import attention_sink as native
from ..ops import batch_attention as native_batch
from .convention import returns_base2, returns_base2_bound

__all__ = ["BatchAttention", "BatchAttentionWithAttentionSinkWrapper"]


class BatchAttention(native_batch.BatchAttention):
    __doc__ = native_batch.BatchAttention.__doc__
    run = returns_base2_bound(native_batch.BatchAttention.run)


class BatchAttentionWithAttentionSinkWrapper(native.BatchAttentionWithAttentionSinkWrapper):
    __doc__ = native.BatchAttentionWithAttentionSinkWrapper.__doc__
    run = returns_base2(native.BatchAttentionWithAttentionSinkWrapper.run)
    run_return_lse = functools.partialmethod(run, return_lse=True)

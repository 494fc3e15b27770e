"""``flashinfer.attention`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations

import functools

import torch

from ..ops import attention_sink as native
from ..ops import batch_attention as native_batch
from ..runtime.wrapper import returning_lse
from .convention import LOG2E, lse_to_base2, returns_base2_bound

__all__ = ["BatchAttention", "BatchAttentionWithAttentionSinkWrapper"]


class BatchAttention(native_batch.BatchAttention):
    __doc__ = native_batch.BatchAttention.__doc__
    run = returns_base2_bound(native_batch.BatchAttention.run)


class BatchAttentionWithAttentionSinkWrapper(native.BatchAttentionWithAttentionSinkWrapper):
    __doc__ = native.BatchAttentionWithAttentionSinkWrapper.__doc__

    @functools.wraps(native.BatchAttentionWithAttentionSinkWrapper.run)
    def run(self, q, paged_kv_cache, *args, **kwargs):
        # FlashInfer's sink variant counts the sink in the normaliser its LSE is taken of:
        # log2(sum_j 2^(s_j log2 e) + 2^(sink log2 e)); jitattn's native LSE is of the keys alone.
        result = lse_to_base2(super().run(q, paged_kv_cache, *args, **kwargs), kwargs.get("lse"))
        lse = result[1] if isinstance(result, tuple) else kwargs.get("lse")
        if lse is not None:
            sinks = args[0] if args else kwargs["sinks"]
            torch.logaddexp2(lse, (sinks * LOG2E).to(lse.device), out=lse)
        return result

    run_return_lse = returning_lse(run)

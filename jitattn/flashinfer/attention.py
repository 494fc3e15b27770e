"""``flashinfer.attention`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations

import functools

from .. import attention_sink as native
from .convention import returns_base2

__all__ = ["BatchAttentionWithAttentionSinkWrapper"]


class BatchAttentionWithAttentionSinkWrapper(native.BatchAttentionWithAttentionSinkWrapper):
    __doc__ = native.BatchAttentionWithAttentionSinkWrapper.__doc__
    run = returns_base2(native.BatchAttentionWithAttentionSinkWrapper.run)
    run_return_lse = functools.partialmethod(run, return_lse=True)

"""FlashInfer's ``flashinfer.attention`` layout: the attention-sink wrapper and ``BatchAttention``."""

from __future__ import annotations

from .attention_sink import BatchAttentionWithAttentionSinkWrapper
from .batch_attention import BatchAttention

__all__ = ["BatchAttention", "BatchAttentionWithAttentionSinkWrapper"]

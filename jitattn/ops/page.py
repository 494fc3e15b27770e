"""Paged KV cache utilities, mirroring ``flashinfer.page``.

``append_paged_kv_cache`` writes new tokens into a paged cache;
``get_batch_indices_positions`` and ``get_seq_lens`` compute its index inputs.
See :mod:`jitattn.runtime.page` for the cache formats and semantics.
"""

from __future__ import annotations

from ..runtime.page import (
    append_paged_kv_cache, append_paged_mla_kv_cache, get_batch_indices_positions, get_seq_lens,
)

__all__ = ["append_paged_kv_cache", "append_paged_mla_kv_cache", "get_batch_indices_positions", "get_seq_lens"]

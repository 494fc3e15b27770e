"""``flashinfer.page``: the paged-cache utilities (no LSE: the native functions themselves)."""

from __future__ import annotations

from ..ops.page import append_paged_kv_cache, append_paged_mla_kv_cache, get_batch_indices_positions, get_seq_lens

__all__ = ["append_paged_kv_cache", "append_paged_mla_kv_cache", "get_batch_indices_positions", "get_seq_lens"]

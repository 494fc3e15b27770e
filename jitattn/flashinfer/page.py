"""``flashinfer.page``: the paged-cache utilities (no LSE: the native functions, but ``get_seq_lens``'s arithmetic
is FlashInfer's own)."""

from __future__ import annotations

import torch

from ..ops.page import append_paged_kv_cache, append_paged_mla_kv_cache, get_batch_indices_positions
from ..ops import page as native

__all__ = ["append_paged_kv_cache", "append_paged_mla_kv_cache", "get_batch_indices_positions", "get_seq_lens"]


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """FlashInfer's ``get_seq_lens``: ``clamp(num_pages - 1, min=0) * page_size + kv_last_page_len`` per request, in
    the inputs' promoted dtype (a request without pages gets its ``kv_last_page_len``; ``jitattn.get_seq_lens``
    gives it 0, int32). Checked as ``jitattn.get_seq_lens`` checks its arguments."""
    return native.get_seq_lens(kv_indptr, kv_last_page_len, page_size, as_flashinfer=True)

"""Paged KV cache utilities, mirroring ``flashinfer.page``.

``append_paged_kv_cache`` writes new tokens into a paged cache;
``get_batch_indices_positions`` and ``get_seq_lens`` compute its index inputs.
See :mod:`jitattn.runtime.page` for the cache formats and semantics. Under torch.compile the two writes are
custom ops (``runtime/compiled_ops.py``): a model calling them compiles with ``fullgraph=True``.
"""

from __future__ import annotations

import torch

from ..runtime import compiled_ops, page
from ..runtime.page import PagedKVCache, get_batch_indices_positions, get_seq_lens

__all__ = ["append_paged_kv_cache", "append_paged_mla_kv_cache", "get_batch_indices_positions", "get_seq_lens"]


def append_paged_kv_cache(
    append_key: torch.Tensor, append_value: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
    paged_kv_cache: PagedKVCache, kv_indices: torch.Tensor, kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    write = compiled_ops.append_paged_kv_cache if torch.compiler.is_compiling() else page.append_paged_kv_cache
    write(append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
          kv_last_page_len, kv_layout)


def append_paged_mla_kv_cache(
    append_ckv: torch.Tensor, append_kpe: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
    ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    write = compiled_ops.append_paged_mla_kv_cache if torch.compiler.is_compiling() else page.append_paged_mla_kv_cache
    write(append_ckv, append_kpe, batch_indices, positions, ckv_cache, kpe_cache, kv_indices, kv_indptr,
          kv_last_page_len)


append_paged_kv_cache.__doc__ = page.append_paged_kv_cache.__doc__
append_paged_mla_kv_cache.__doc__ = page.append_paged_mla_kv_cache.__doc__

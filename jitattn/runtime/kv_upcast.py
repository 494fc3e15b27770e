"""An fp8 paged KV cache read once into a 16-bit ragged K / V, for a prefill plan of 16-bit KV (and any paged cache
into f16 rows for RoPE before the kernel, ``rope_first.py``).

A prefill kernel that converts fp8 KV inside reconverts each KV block for every query tile that reads it (about
64 times per element at causal b x 4096 with the GQA group packed); converting the batch's keys once costs one
read of the fp8 pages and one write of 16-bit rows (docs/kernels/sm90_prefill.md, "fp8 KV on this tier"). fp8
e4m3 / e5m2 to f16 / bf16 is exact, and ``k_scale`` / ``v_scale`` stay the kernel's, so the 16-bit plan computes
the same attention. The price is memory: ``2 x kv tokens x kv heads x head_dim`` 16-bit values per call.

``JITATTN_PREFILL_FP8_UPCAST`` decides when a paged prefill plan takes this route (``env.prefill_fp8_upcast``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..page_table import PagedIndex, check_page_pool
from ..spec import KVLayout
from .batch import upload
from .kv import check_kv_pair, split_paged_kv_cache


def token_rows(index: PagedIndex) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, slot) of every KV token of the batch, request after request (int64, host)."""
    ps = index.page_size
    lens = index.kv_len_array
    starts = index.indptr[:-1].numpy().astype(np.int64)
    total = int(lens.sum())
    request = np.repeat(np.arange(lens.size), lens)
    token = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lens) - lens, lens)
    pages = index.indices.numpy().astype(np.int64)[starts[request] + token // ps] if total else np.zeros(0, np.int64)
    return torch.from_numpy(pages), torch.from_numpy(token % ps)


def ragged_indptr(index: PagedIndex) -> torch.Tensor:
    """The kv_indptr (int32, host) of the batch's keys as ragged rows, request after request."""
    return torch.from_numpy(np.concatenate([[0], np.cumsum(index.kv_len_array)]).astype(np.int32))


class KVUpcast:
    """The gather of one plan: ``upcast(paged_kv_cache) -> (k, v)``, ragged ``[kv tokens, kv heads, dim]`` in
    ``out_dtype``, after the checks the paged plan would have made of the cache."""

    def __init__(self, index: PagedIndex, kv_layout: KVLayout, *, num_kv_heads: int, head_dim_qk: int,
                 head_dim_vo: int, kv_dtype: torch.dtype, out_dtype: torch.dtype, device: torch.device) -> None:
        self.index, self.kv_layout, self.kv_dtype, self.out_dtype = index, kv_layout, kv_dtype, out_dtype
        self.dims = (num_kv_heads, head_dim_qk, head_dim_vo)
        pages, slots = token_rows(index)
        self.pages, self.slots = upload(pages, device), upload(slots, device)

    @property
    def kv_indptr(self) -> torch.Tensor:
        """The ragged plan's kv_indptr (int32, host)."""
        return ragged_indptr(self.index)

    def __call__(self, paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = split_paged_kv_cache(paged_kv_cache, self.kv_layout)
        heads, dqk, dvo = self.dims
        pages = check_kv_pair(k, v, self.kv_layout, num_kv_heads=heads, head_dim_qk=dqk, head_dim_vo=dvo,
                              page_size=self.index.page_size, dtype=self.kv_dtype)
        check_page_pool(self.index, pages)
        if k.device != self.pages.device:
            raise ValueError(f"paged_kv_cache is on {k.device} but the plan is on {self.pages.device}; pass the "
                             "cache on the plan's device")
        return self._rows(k), self._rows(v)

    def _rows(self, cache: torch.Tensor) -> torch.Tensor:
        raw = cache.view(torch.uint8)  # gathered as bytes: indexing is defined for every dtype there
        if self.kv_layout is KVLayout.NHD:  # [pages, page_size, heads, dim]
            rows = raw[self.pages, self.slots]
        else:  # [pages, heads, page_size, dim]: the indexed dims go first, so [tokens, heads, dim] too
            rows = raw[self.pages, :, self.slots]
        return rows.view(self.kv_dtype).to(self.out_dtype)

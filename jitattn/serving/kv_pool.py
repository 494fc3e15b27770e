"""The paged KV pool: one 5-D cache tensor per layer, pages handed out and reference-counted.

Page ``p`` of layer ``l`` is ``caches[l][p]``, shaped ``[2, page_size, num_kv_heads, head_dim]``
(keys at index 0, values at 1: jitattn's one-tensor NHD format). A page is free when no one
holds a reference: requests hold their pages, the radix tree holds the pages it caches, and a
page shared by both is freed only when both let go. Page 0 is never handed out: it is the
scratch page that padded CUDA-graph rows point at.
"""

from __future__ import annotations

import numbers

import torch


def pages_in_budget(budget_bytes: int, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                    dtype: torch.dtype) -> int:
    """How many pages (scratch page included) a pool of these shapes can have in ``budget_bytes`` of memory."""
    if min(num_layers, page_size, num_kv_heads, head_dim) < 1:
        raise ValueError(f"a KV page of num_layers={num_layers}, page_size={page_size}, num_kv_heads={num_kv_heads}, "
                         f"head_dim={head_dim} holds nothing: each must be >= 1")
    page_bytes = num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()
    return max(0, int(budget_bytes) // page_bytes)


class KVPool:
    """Pages of KV memory for every layer, with allocation, reference counts and freeing."""

    SCRATCH_PAGE = 0

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: str | torch.device) -> None:
        for name, value in (("num_pages", num_pages), ("page_size", page_size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name}={value!r} must be an int")
        if num_pages < 2:
            raise ValueError(f"num_pages={num_pages} must be at least 2 (page 0 is the scratch page)")
        if page_size < 1:
            raise ValueError(f"page_size={page_size} must be positive")
        self.num_pages, self.page_size = num_pages, page_size
        self.caches = [torch.zeros(num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
                       for _ in range(num_layers)]
        self._refs = [0] * num_pages
        self._free = list(range(num_pages - 1, self.SCRATCH_PAGE, -1))  # pop() hands out low pages first

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - 1 - len(self._free)

    @property
    def bytes_per_page(self) -> int:
        """KV bytes of one page over every layer."""
        return sum(c[0].numel() * c.element_size() for c in self.caches)

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens."""
        return -(-tokens // self.page_size)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def alloc(self, count: int) -> list[int] | None:
        """``count`` fresh pages, each with one reference; None (nothing taken) when fewer are free."""
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise RuntimeError(f"page {p} is free; only a held page can gain a reference")
            self._refs[p] += 1

    def decref(self, pages: list[int]) -> int:
        """Drop one reference to each page; returns how many became free."""
        freed = 0
        for p in pages:
            if self._refs[p] < 1:
                raise RuntimeError(f"page {p} is already free (a double release)")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

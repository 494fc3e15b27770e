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
    return max(0, int(budget_bytes) // _page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype))


def _page_bytes(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one page's keys and values over every layer."""
    return num_layers * 2 * page_size * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


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
        try:
            self.caches = [torch.zeros(num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device)
                           for _ in range(num_layers)]
        except (RuntimeError, MemoryError) as exc:  # (torch.OutOfMemoryError, raised here too, is a RuntimeError)
            wanted = num_pages * _page_bytes(num_layers, page_size, num_kv_heads, head_dim, dtype)
            raise torch.OutOfMemoryError(
                f"the KV pool of num_pages={num_pages} x page_size={page_size} tokens over {num_layers} layers needs "
                f"{wanted / 2**30:.1f} GiB on {device}, more than can be allocated there; give fewer num_pages "
                "(pages_in_budget gives how many fit in a memory budget)") from exc
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

    def _held(self, pages: list[int], what: str) -> None:
        """Refuse, before anything changes, a page that is not one this pool hands out (1 to num_pages - 1: a
        negative id would index from the end) or that holds no reference (``pages`` may repeat one: each use needs
        a reference of its own only for ``decref``, which checks that itself)."""
        n = self.num_pages
        for p in pages:
            if type(p) is not int and (isinstance(p, bool) or not isinstance(p, numbers.Integral)):
                raise TypeError(f"{what}: page {p!r} must be an int")
            if not 0 < p < n:
                raise ValueError(f"{what}: page {p} is not one this pool hands out (1 to {n - 1}; page 0 is the "
                                 "scratch page)")
            if self._refs[p] < 1:
                raise RuntimeError(f"incref: page {p} is free; only a held page can gain a reference"
                                   if what == "incref" else f"{what}: page {p} is already free (a double release)")

    def alloc(self, count: int) -> list[int] | None:
        """``count`` fresh pages, each with one reference; None (nothing taken) when fewer are free."""
        if isinstance(count, bool) or not isinstance(count, numbers.Integral) or count < 0:
            raise ValueError(f"alloc({count!r}): the page count must be an int >= 0")
        if count > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def incref(self, pages: list[int]) -> None:
        self._held(pages, "incref")
        for p in pages:
            self._refs[p] += 1

    def decref(self, pages: list[int]) -> int:
        """Drop one reference to each page; returns how many became free. Every page is checked first, so a
        refused call changes nothing."""
        self._held(pages, "decref")
        if len(set(pages)) != len(pages):  # a page listed twice needs two references
            for p in set(pages):
                if pages.count(p) > self._refs[p]:
                    raise RuntimeError(f"decref: page {p} is listed {pages.count(p)} times but holds "
                                       f"{self._refs[p]} reference(s) (a double release)")
        freed = 0
        for p in pages:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
                freed += 1
        return freed

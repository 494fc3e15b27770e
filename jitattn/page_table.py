"""Page tables on the host: one rule set for every op, each request's KV length, the pool bound.

Pure functions over host tensors (device arrays are copied to the host once, in one transfer),
unit-tested on their own; ``plan()`` calls them once per batch, ``append_paged_kv_cache`` on the
arrays it holds on the host.
"""

from __future__ import annotations

import functools
import numbers
from dataclasses import dataclass

import numpy as np
import torch

_INT32_MAX = 2**31 - 1  # the largest valid page index (np.iinfo costs microseconds per plan())


@dataclass(frozen=True)
class PagedIndex:
    """A validated page table, on the host."""

    indptr: torch.Tensor  # int32 [batch + 1]
    indices: torch.Tensor  # int32 [>= indptr[-1]]
    last_page_len: torch.Tensor  # int32 [batch]
    page_size: int
    kv_len_array: np.ndarray  # int64 [batch]: each request's KV length
    max_page_index: int  # -1 when no page is referenced
    indices_name: str = "indices"  # what the caller called the indices (errors name it)

    @functools.cached_property
    def kv_lens(self) -> tuple[int, ...]:
        """Each request's KV length as Python ints (made on first use; decode's planner reads the array)."""
        return tuple(self.kv_len_array.tolist())

    @property
    def batch_size(self) -> int:
        return len(self.kv_len_array)


def to_host_int32(name: str, tensor: torch.Tensor, ndim: int = 1) -> torch.Tensor:
    """A host copy of an int32 index tensor (one device->host copy if it is on a GPU)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(tensor).__name__}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {tensor.dtype}; index arrays must be int32 (use .int())")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if tensor.is_cpu:  # is_cpu / is_cuda: a fraction of the cost of building tensor.device
        return tensor if tensor.is_contiguous() and not tensor.requires_grad else tensor.detach().contiguous()
    if not tensor.is_cuda:
        raise ValueError(f"{name} is on the {tensor.device} device, which holds no data; pass index arrays "
                         "on the host (fast path) or on the CUDA device")
    return tensor.detach().to("cpu").contiguous()


def to_host_int32_many(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Host copies of several 1-D int32 index tensors; those on one GPU come back in a single copy.

    Serving engines pass page tables on the device: one device->host transfer (one
    synchronisation) per ``plan()`` instead of one per array.
    """
    on_device = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda]
    if len(on_device) > 1 and len({t.device for t in on_device}) == 1 and all(
        t.dtype == torch.int32 and t.dim() == 1 for t in tensors
    ):
        return joined_to_host([t.detach().to(on_device[0].device) for t in tensors])
    return [to_host_int32(name, t) for name, t in zip(names, tensors)]


def joined_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of same-device 1-D tensors through one concatenated transfer.

    From a GPU the copy lands in page-locked memory (DMA, no bounce through a pageable buffer)."""
    joined = torch.cat(tensors)
    if joined.is_cuda:
        host = torch.empty(joined.shape, dtype=joined.dtype, pin_memory=True)
        host.copy_(joined)  # synchronous: the values are on the host on return
    else:
        host = joined
    return [part.contiguous() for part in host.split([t.numel() for t in tensors])]


def check_indptr(name: str, indptr: torch.Tensor) -> torch.Tensor:
    """A host copy of an int32 indptr: at least one entry, starting at 0, non-decreasing."""
    host = to_host_int32(name, indptr)
    _check_indptr_values(name, host)
    return host


def _check_indptr_values(name: str, host) -> np.ndarray:
    """``host``: a 1-D int32 host tensor or numpy array. Returns its steps (each request's count, int64)."""
    host = host.numpy() if isinstance(host, torch.Tensor) else host
    if host.size < 1:
        raise ValueError(f"{name} must have batch_size + 1 >= 1 entries")
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(host[0])}")
    wide = host.astype(np.int64)  # an int32 difference of a negative and a positive entry can wrap around
    steps = wide[1:] - wide[:-1]  # np.diff costs three times as much on a batch of hundreds
    if steps.size and steps.min() < 0:
        r = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"{name} must be non-decreasing; {name}[{r + 1}] < {name}[{r}]")
    return steps


def check_page_table(
    indptr: torch.Tensor | None, indices: torch.Tensor | None, last_page_len: torch.Tensor | None, page_size: int,
    *, num_pages: int | None = None, names: tuple[str, str, str] = ("indptr", "indices", "last_page_len"),
) -> int:
    """The page-table rules, checked on the arrays given (host int32 tensors; None: not known here).

    One rule set for attention plans, appends and cascade levels: ``indptr`` starts at 0 and
    never decreases; its last entry is at most ``len(indices)``; the referenced page indices
    are ``>= 0`` (and ``< num_pages`` when the pool size is given); ``last_page_len`` has one
    entry per request and lies in ``[1, page_size]`` for a request with pages (it is not read
    for a request without). Returns the highest referenced page (-1 when none or unknown).
    """
    return _check_page_table(indptr, indices, last_page_len, page_size, num_pages, names)[0]


def _int32_values(name: str, values: np.ndarray) -> np.ndarray:
    """``values`` as int32 for the one-pass unsigned bounds checks: int32 as is; another integer array
    (the public callers convert to int32 first; a direct call may not) only when every value fits."""
    if values.dtype == np.int32:
        return values
    if values.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {values.dtype}; index arrays must be int32 (use .int())")
    if values.size and (int(values.min()) < -_INT32_MAX - 1 or int(values.max()) > _INT32_MAX):
        i = int(np.flatnonzero((values < -_INT32_MAX - 1) | (values > _INT32_MAX))[0])
        raise ValueError(f"{name}[{i}] = {int(values[i])} does not fit an int32 index array")
    return values.astype(np.int32)


def _unsigned_max(values: np.ndarray) -> int:
    """The largest of int32 ``values`` read as unsigned, in one pass: above ``_INT32_MAX`` when one is negative.
    Under torch.compile, whose tracing of numpy has no unsigned max on the cpu, from their min and max (the same
    value when none is negative; still above ``_INT32_MAX`` when one is)."""
    if torch.compiler.is_compiling():
        low = int(values.min())
        return low + 2**32 if low < 0 else int(values.max())
    return int(values.view(np.uint32).max())


def positive_int(value, name: str) -> int:
    """``value`` as an int >= 1: Python's and numpy's ints are taken, a bool, a float or a string is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive int")
    return int(value)


def _check_page_table(indptr, indices, last_page_len, page_size: int, num_pages: int | None,
                      names: tuple[str, str, str]) -> tuple[int, np.ndarray | None]:
    """``check_page_table``, also returning each request's page count (None without ``indptr``)."""
    page_size = positive_int(page_size, "page_size")
    highest = -1
    if indptr is None:
        return highest, None
    # numpy views of the host tensors: reductions over a 64k-page table take ~10 us there, while
    # torch's parallel int reductions cost 100s of us on some hosts.
    indptr_np = indptr.numpy()
    pages = _check_indptr_values(names[0], indptr_np)
    batch = indptr_np.size - 1
    if last_page_len is not None and last_page_len.numel() != batch:
        raise ValueError(f"{names[2]} has {last_page_len.numel()} entries; expected batch_size = {batch} "
                         f"(len({names[0]}) - 1)")
    total_pages = int(indptr_np[-1])
    if indices is not None:
        if total_pages > indices.numel():
            raise ValueError(f"{names[0]}[-1] = {total_pages} exceeds len({names[1]}) = {indices.numel()}")
        used = _int32_values(names[1], indices.numpy()[:total_pages])
        # One pass for both bounds: as unsigned, a negative index is larger than every valid one.
        highest = _unsigned_max(used) if total_pages else -1
        if highest > _INT32_MAX:
            i = int(np.flatnonzero(used < 0)[0])
            raise ValueError(f"{names[1]}[{i}] = {int(used[i])} is a negative page index")
        if num_pages is not None and highest >= num_pages:
            i = int(np.flatnonzero(used >= num_pages)[0])
            raise IndexError(f"{names[1]}[{i}] = {int(used[i])} references a page past the end of the kv cache "
                             f"(it has {num_pages} pages)")
    if last_page_len is not None and batch:
        _check_last_page_lens(pages, _int32_values(names[2], last_page_len.numpy()), page_size, names[2])
    return highest, pages


def _check_last_page_lens(pages: np.ndarray, last: np.ndarray, page_size: int, name: str) -> None:
    # As unsigned, last - 1 < page_size is 1 <= last <= page_size (an int32 is at most _INT32_MAX): one
    # pass when every entry is in range, the usual case; otherwise only requests with pages must be.
    if last.size and _unsigned_max(last - 1) >= min(page_size, _INT32_MAX):
        bad = (pages > 0) & ((last < 1) | (last > page_size))
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{name}[{r}] = {int(last[r])} is out of range: a request with pages needs 1 <= "
                             f"last_page_len <= page_size ({page_size})")


def check_host_last_page_lens(indptr: torch.Tensor, last_page_len: torch.Tensor, page_size: int) -> None:
    """``last_page_len``'s rule (``check_page_table``'s), when it is on the host: no device sync (``indptr``: host
    int32, one entry more; a device ``last_page_len`` is not checked)."""
    if last_page_len.is_cpu:
        last = last_page_len.numpy()
        if last.size and _unsigned_max(last - 1) >= min(page_size, _INT32_MAX):  # else all in range
            _check_last_page_lens(np.diff(indptr.numpy()), last, page_size, "last_page_len")


def check_paged_index(
    indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int,
    *, names: tuple[str, str, str] = ("indptr", "indices", "last_page_len"),
) -> PagedIndex:
    """Validate a page table (``check_page_table``'s rules) and compute each request's KV length.

    kv_len = (num_pages - 1) * page_size + last_page_len, and 0 for a request with no pages.
    The arrays may be on the host or the device (copied to the host once).
    """
    page_size = positive_int(page_size, "page_size")
    indptr_h, indices_h, last_h = to_host_int32_many(names, (indptr, indices, last_page_len))
    highest, pages = _check_page_table(indptr_h, indices_h, last_h, page_size, None, names)
    kv_lens = (pages - 1) * page_size + last_h.numpy()  # pages: int64
    if pages.size and pages.min() == 0:
        kv_lens = np.where(pages > 0, kv_lens, 0)
    return PagedIndex(
        indptr=indptr_h, indices=indices_h, last_page_len=last_h, page_size=page_size,
        kv_len_array=kv_lens, max_page_index=highest, indices_name=names[1],
    )


def check_cache_pool(index: PagedIndex, paged_kv_cache) -> None:
    """``check_page_pool`` against a paged cache: one tensor or a ``(k, v)`` pair, pages first in every layout (a
    cache of another kind is left to the launch's checks). Not under torch.compile: traced, the plan's highest page
    would become a guard (a recompile at nearly every plan); the launch's op checks the pool when the graph runs."""
    if torch.compiler.is_compiling():
        return
    k = paged_kv_cache[0] if isinstance(paged_kv_cache, (tuple, list)) and paged_kv_cache else paged_kv_cache
    if isinstance(k, torch.Tensor) and k.dim() > 0:
        check_page_pool(index, k.shape[0])


def check_page_pool(index: PagedIndex, num_pages_in_cache: int) -> None:
    """Refuse page indices past the end of the KV pool."""
    if index.max_page_index >= num_pages_in_cache:
        raise ValueError(
            f"{index.indices_name} references page {index.max_page_index} but the kv cache has only "
            f"{num_pages_in_cache} pages"
        )

"""Paged KV cache maintenance: appending tokens and the index math around it.

FlashInfer-compatible (``flashinfer.page``): same names, same argument order.

Cache formats accepted by ``append_paged_kv_cache`` (``kv_layout`` "NHD" / "HND"):

- one 5-D tensor ``[pages, 2, page_size, H_kv, D]`` (NHD) or ``[pages, 2, H_kv, page_size, D]`` (HND),
  index 0 of dim 1 the keys, 1 the values;
- a ``(k_cache, v_cache)`` tuple of 4-D tensors ``[pages, page_size, H_kv, D]`` (NHD) or
  ``[pages, H_kv, page_size, D]`` (HND);
- a ``(k_cache, v_cache)`` tuple of 3-D tensors ``[tokens, H_kv, D]``: page_size 1 (layout irrelevant).

Request ``r`` owns pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]`` in order; position ``pos``
of it lives in page ``kv_indices[kv_indptr[r] + pos // page_size]``, slot ``pos % page_size``.
"""

from __future__ import annotations

import numbers
from typing import Sequence, Union

import torch

from ..abi import APPEND_SOURCE_CODES
from ..jit import load
from ..page_table import check_page_table
from ..spec import KVLayout, Target
from .checks import (check_no_overlap, check_tensor, cpu_threads, dense_overlap, launch_on, shares_element,
                     spans_overlap, target_of, views_overlap)
from .grad import check_writable, mark_written
from .specs import append_spec
from .kv import cache_geometry, check_kv_tensors, kv_strides, split_paged_kv_cache

__all__ = ["append_paged_kv_cache", "append_paged_mla_kv_cache", "get_batch_indices_positions", "get_seq_lens"]

PagedKVCache = Union[torch.Tensor, Sequence[torch.Tensor]]

_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
_SRC_CODES = {torch.float32: APPEND_SOURCE_CODES["f32"], torch.float16: APPEND_SOURCE_CODES["f16"],
              torch.bfloat16: APPEND_SOURCE_CODES["bf16"]}


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _CacheView:
    """A paged cache as the append kernel sees it: k/v views, geometry, (page, slot, head) strides."""

    def __init__(self, paged_kv_cache: PagedKVCache, layout: KVLayout) -> None:
        self.layout = layout
        self.k, self.v = split_paged_kv_cache(paged_kv_cache, layout)
        check_kv_tensors(self.k, self.v, _CACHE_DTYPES)
        check_no_overlap("the k cache", self.k)  # written in place
        check_no_overlap("the v cache", self.v)
        self.num_pages, self.page_size, self.num_heads, self.head_dim = cache_geometry(self.k, layout)
        if self.page_size < 1:
            raise ValueError(f"paged_kv_cache has page_size {self.page_size}; it must be at least 1")
        self.k_strides = kv_strides(self.k, True, layout)
        self.v_strides = kv_strides(self.v, True, layout)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def device(self) -> torch.device:
        return self.k.device


def _check_index(name: str, tensor: torch.Tensor, cache_device: torch.device, cache: str = "paged_kv_cache") -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (int32 or int64), got {type(tensor).__name__}")
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {_name(tensor.dtype)}; index arrays must be int32 or int64 (use .int())")
    if tensor.device.type != "cpu" and tensor.device != cache_device:
        raise ValueError(
            f"{name} is on {tensor.device} but {cache} is on {cache_device}; index arrays must be on "
            "the cache's device or on the host (cpu)"
        )


def _validate_host_indices(
    batch_indices: torch.Tensor, positions: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor, num_pages: int, page_size: int,
) -> None:
    """Range checks on whichever index arrays are on the host (no device sync is ever needed).

    The page table follows ``plan.check_page_table``'s rules, the same as attention plans'.
    """
    batch_size = kv_indptr.shape[0] - 1
    host = lambda t: t.device.type == "cpu"  # noqa: E731
    check_page_table(kv_indptr if host(kv_indptr) else None, kv_indices if host(kv_indices) else None,
                     kv_last_page_len if host(kv_last_page_len) else None, page_size, num_pages=num_pages,
                     names=("kv_indptr", "kv_indices", "kv_last_page_len"))
    if host(batch_indices) and batch_indices.numel():
        bi = batch_indices.to(torch.int64)
        bad = (bi < 0) | (bi >= batch_size)
        if bool(bad.any()):
            t = int(torch.nonzero(bad)[0])
            raise IndexError(f"batch_indices[{t}]={int(bi[t])} is outside [0, batch_size={batch_size})")
    if host(positions) and positions.numel():
        pos = positions.to(torch.int64)
        if bool((pos < 0).any()):
            t = int(torch.nonzero(pos < 0)[0])
            raise IndexError(f"positions[{t}]={int(pos[t])} is negative")
        if host(batch_indices) and host(kv_indptr):
            indptr = kv_indptr.to(torch.int64)
            capacity = (indptr[1:] - indptr[:-1]) * page_size
            cap = capacity[batch_indices.to(torch.int64)]
            bad = pos >= cap
            if bool(bad.any()):
                t = int(torch.nonzero(bad)[0])
                r = int(batch_indices[t])
                raise IndexError(
                    f"positions[{t}]={int(pos[t])} is beyond request {r}'s pages: it holds "
                    f"{int(capacity[r]) // page_size} pages of {page_size} tokens (capacity {int(capacity[r])}); "
                    "allocate the pages (kv_indices/kv_indptr) before appending"
                )
            if host(kv_last_page_len):  # the request's length: what attention reads of its pages
                length = torch.where(capacity > 0, capacity - page_size + kv_last_page_len.to(torch.int64), 0)
                bad = pos >= length[batch_indices.to(torch.int64)]
                if bool(bad.any()):
                    t = int(torch.nonzero(bad)[0])
                    r = int(batch_indices[t])
                    raise IndexError(f"positions[{t}]={int(pos[t])} is past request {r}'s length {int(length[r])} "
                                     "(kv_indptr and kv_last_page_len, which count the appended tokens too): "
                                     "attention would never read it")


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` contiguous on ``device`` without a host sync.

    A pageable host tensor is staged by the copy itself, so the caller may reuse it right after;
    a pinned one would be read asynchronously, so it is first cloned into pageable memory.
    """
    if tensor.device == device:
        return tensor.contiguous()
    if tensor.is_pinned():
        tensor = tensor.clone()
    return tensor.to(device, non_blocking=True).contiguous()


def _refuse_sources_in_cache(sources, caches) -> None:
    """The appended tokens (``sources``: (name, tensor) pairs) must not live in a cache's own bytes (``caches``:
    (name, tensor) pairs; a slice of a page): the launch would read slots it is writing. Dense tensors (a cache, the
    step's new K / V) by a pointer compare, as this runs on every call; others by their spans."""
    for name, source in sources:
        for cache_name, cache in caches:
            dense = source.is_contiguous() and cache.is_contiguous()
            if dense_overlap(source, cache) if dense else spans_overlap(source, cache):
                raise ValueError(f"{name} lies in {cache_name}'s memory, which the append writes (it would read "
                                 f"slots as they are overwritten); pass {name}.clone()")


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """Write new tokens' keys and values into a paged KV cache, in place.

    Args:
        append_key, append_value: ``[nnz, num_kv_heads, head_dim]``, float32/float16/bfloat16 or the
            cache's own dtype; strided views (e.g. slices of a fused qkv tensor) are read in place, but
            the last dimension must be contiguous.
        batch_indices, positions: int32 ``[nnz]`` (int64 index arrays are converted to int32, as FlashInfer
            does): token ``t`` is position ``positions[t]`` of request
            ``batch_indices[t]`` (see :func:`get_batch_indices_positions`).
        paged_kv_cache: see the module docstring; float32/float16/bfloat16/float8_e4m3fn/float8_e5m2.
        kv_indices, kv_indptr, kv_last_page_len: int32 page table of the cache *after* the append
            (``kv_last_page_len`` is only checked, the write does not need it).
        kv_layout: ``"NHD"`` or ``"HND"``.

    Values are rounded to the cache dtype as torch's ``.to()`` does (round to nearest even). An fp8
    cache saturates: a value beyond its range, inf included, is stored as the largest finite value of
    that sign (e4m3 +-448, e5m2 +-57344; torch's ``.to(float8_e5m2)`` would give inf), the same on the
    cpu and cuda targets; NaN stays NaN. Index arrays may live on the host or
    on the cache's device; host-side ones are range-checked before the launch (a position beyond the
    request's pages raises ``IndexError``). On a CUDA device the kernel runs on the current stream;
    out-of-range entries of device-side index arrays are skipped, never written out of bounds. Two tokens bound for
    one cache slot (a repeated (batch index, position), a page listed twice, two requests appending into a page they
    share) are not detected: which of them lands varies from run to run.
    """
    layout = KVLayout.parse(kv_layout, "kv_layout")
    cache = _CacheView(paged_kv_cache, layout)
    empty = cache.k.numel() == 0 or cache.v.numel() == 0  # (an empty tensor's data_ptr is 0: no memory to share)
    if append_key is not append_value and not empty and (cache.k.data_ptr() == cache.v.data_ptr()
                                                         or views_overlap(cache.k, cache.v)):
        raise ValueError("paged_kv_cache's k and v share memory, so the appended values would overwrite keys: pass "
                         "two caches that do not overlap (or one [pages, 2, ...] tensor)")
    nnz = _check_appended(append_key, append_value, cache)
    caches = paged_kv_cache if isinstance(paged_kv_cache, (tuple, list)) else (paged_kv_cache,)
    _refuse_sources_in_cache((("append_key", append_key), ("append_value", append_value)),
                             [("paged_kv_cache", c) for c in caches])
    check_writable("append_paged_kv_cache", paged_kv_cache=cache.k, **{"paged_kv_cache's v": cache.v})  # (views)
    target, device = target_of("append_paged_kv_cache", (append_key, append_value, cache.k, cache.v))
    if target is Target.CUDA and cache.dtype == torch.float32:
        raise TypeError("float32 paged caches are supported on the cpu target only; on a CUDA device use a float16, "
                        "bfloat16 or fp8 cache")
    index_arrays = _as_int32({
        "batch_indices": batch_indices, "positions": positions, "kv_indices": kv_indices,
        "kv_indptr": kv_indptr, "kv_last_page_len": kv_last_page_len,
    })
    batch_size = _check_append_indices(index_arrays, nnz, device)
    ix = index_arrays
    _validate_host_indices(ix["batch_indices"], ix["positions"], ix["kv_indices"], ix["kv_indptr"],
                           ix["kv_last_page_len"], cache.num_pages, cache.page_size)
    if nnz == 0 or cache.num_heads == 0 or cache.head_dim == 0:
        return
    src_code = APPEND_SOURCE_CODES["same"] if append_key.dtype == cache.dtype else _SRC_CODES[append_key.dtype]
    module = load(append_spec(target, cache.dtype))
    to_dev = {name: _to_device(t, device) for name, t in index_arrays.items() if name != "kv_last_page_len"}
    params = dict(
        append_key=append_key.data_ptr(), append_value=append_value.data_ptr(),
        batch_indices=to_dev["batch_indices"].data_ptr(), positions=to_dev["positions"].data_ptr(),
        k_cache=cache.k.data_ptr(), v_cache=cache.v.data_ptr(),
        kv_indices=to_dev["kv_indices"].data_ptr(), kv_indptr=to_dev["kv_indptr"].data_ptr(),
        nnz=nnz, batch_size=batch_size, num_pages=cache.num_pages, num_heads=cache.num_heads,
        head_dim=cache.head_dim, page_size=cache.page_size,
        key_stride_n=append_key.stride(0), key_stride_h=append_key.stride(1),
        value_stride_n=append_value.stride(0), value_stride_h=append_value.stride(1),
        k_stride_page=cache.k_strides[0], k_stride_n=cache.k_strides[1], k_stride_h=cache.k_strides[2],
        v_stride_page=cache.v_strides[0], v_stride_n=cache.v_strides[1], v_stride_h=cache.v_strides[2],
        src_dtype=src_code, num_threads=cpu_threads(),
    )
    launch_on(module, "append", device, **params)
    mark_written(*caches)


def _check_appended(append_key: torch.Tensor, append_value: torch.Tensor, cache: _CacheView) -> int:
    """The appended keys' and values' dtypes and shapes against the cache; returns nnz (their row count)."""
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        check_tensor(name, t, ndim=3)
        if t.dtype not in _SRC_CODES and t.dtype != cache.dtype:
            raise TypeError(
                f"{name} has dtype {_name(t.dtype)}; use float32, float16, bfloat16 or the cache's dtype "
                f"({_name(cache.dtype)})"
            )
    if append_value.dtype != append_key.dtype:
        raise TypeError(f"append_key is {_name(append_key.dtype)} but append_value is {_name(append_value.dtype)}")
    nnz = append_key.shape[0]
    expected = (nnz, cache.num_heads, cache.head_dim)
    for name, t in (("append_key", append_key), ("append_value", append_value)):
        if tuple(t.shape) != expected:
            hint = ""
            if t.shape[1:] == (cache.page_size, cache.head_dim) and cache.page_size != cache.num_heads:
                other = "NHD" if cache.layout is KVLayout.HND else "HND"
                hint = (f"; read as kv_layout={cache.layout.name} the cache has {cache.num_heads} heads and pages of "
                        f"{cache.page_size}: if its heads are the other dimension, pass kv_layout='{other}'")
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [nnz, num_kv_heads, head_dim] = {expected} "
                             f"to match paged_kv_cache{hint}")
    return nnz


def _as_int32(index_arrays: dict[str, object]) -> dict[str, object]:
    """The index arrays with int64 ones as int32, as FlashInfer's append converts them (engines keep positions in
    int64); a host array whose values int32 cannot hold is refused (a device one is not read: that would sync)."""
    converted = dict(index_arrays)
    for name, t in index_arrays.items():
        if isinstance(t, torch.Tensor) and t.dtype == torch.int64:
            low, high = (int(t.min()), int(t.max())) if t.device.type == "cpu" and t.numel() else (0, 0)
            if not -2**31 <= low <= high < 2**31:
                raise ValueError(f"{name} holds {high if high >= 2**31 else low}, outside int32, the append's index "
                                 "type (page ids, positions and lengths all fit it)")
            converted[name] = t.to(torch.int32)
    return converted


def _check_append_indices(index_arrays: dict[str, torch.Tensor], nnz: int, device, rows: str = "append_key",
                          cache: str = "paged_kv_cache") -> int:
    """The index arrays' dtypes, devices and lengths (``rows``: the appended tensor whose rows they index, ``cache``
    the cache they write); returns the batch size (len(kv_indptr) - 1)."""
    for name, t in index_arrays.items():
        _check_index(name, t, device, cache)
    for name in ("batch_indices", "positions"):
        if index_arrays[name].shape[0] != nnz:
            raise ValueError(f"{name} has {index_arrays[name].shape[0]} entries; expected nnz={nnz} ({rows}'s rows)")
    kv_indptr, kv_last_page_len = index_arrays["kv_indptr"], index_arrays["kv_last_page_len"]
    if kv_indptr.shape[0] < 1:
        raise ValueError("kv_indptr must have batch_size + 1 entries; it is empty")
    entries, requests = kv_indptr.shape[0], kv_last_page_len.shape[0]
    if entries - 1 != requests:  # neither array is known to be the wrong one: both named
        raise ValueError(
            f"kv_indptr has {entries} entries ({entries - 1} request{'s' * (entries != 2)}) but kv_last_page_len "
            f"has {requests} entries ({requests} request{'s' * (requests != 1)}): kv_indptr needs batch_size + 1 "
            "entries and kv_last_page_len batch_size; pass the page table of one batch"
        )
    return entries - 1


def get_batch_indices_positions(
    append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batch index and position of every appended token (FlashInfer semantics).

    Request ``r`` appends ``a_r = append_indptr[r+1] - append_indptr[r]`` tokens, the last ones of
    its sequence: they get batch index ``r`` and positions ``seq_lens[r] - a_r, ..., seq_lens[r] - 1``
    (``seq_lens`` counts tokens *after* the append, e.g. :func:`get_seq_lens` of the new page table).

    Args:
        append_indptr: ``[batch_size + 1]`` integer tensor.
        seq_lens: ``[batch_size]`` integer tensor (host or ``append_indptr``'s device); a longer one (a buffer
            sized for the largest batch, as under CUDA graphs) is read up to ``batch_size``, as FlashInfer does.
        nnz: ``append_indptr[-1]``, the number of appended tokens; passed in so that a CUDA
            ``append_indptr`` is never read back to the host.

    Returns:
        ``(batch_indices, positions)``: int32 ``[nnz]`` on ``append_indptr``'s device. Runs as a few
        torch ops on that device, with no host synchronisation.
    """
    for name, t in (("append_indptr", append_indptr), ("seq_lens", seq_lens)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {_name(t.dtype)} of shape {tuple(t.shape)}")
    if isinstance(nnz, bool) or not isinstance(nnz, numbers.Integral):
        hint = "; for a 0-d tensor such as append_indptr[-1] pass .item()" if isinstance(nnz, torch.Tensor) else ""
        raise TypeError(f"nnz={nnz!r} must be an int (the number of appended tokens){hint}")
    nnz = int(nnz)
    device = append_indptr.device
    batch_size = append_indptr.shape[0] - 1
    if batch_size < 0:
        raise ValueError("append_indptr must have batch_size + 1 entries; it is empty")
    if seq_lens.shape[0] < batch_size:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries; expected batch_size={batch_size}")
    if nnz < 0:
        raise ValueError(f"nnz={nnz} must be >= 0")
    indptr = append_indptr.to(torch.int64)
    lens = seq_lens[:batch_size].to(device=device, dtype=torch.int64, non_blocking=True)
    if device.type == "cpu" and seq_lens.device.type == "cpu":
        if int(indptr[0]) != 0:
            raise ValueError(f"append_indptr[0]={int(indptr[0])} must be 0 (offsets of each request's appended tokens)")
        if int(indptr[-1]) != nnz:
            raise ValueError(f"nnz={nnz} must equal append_indptr[-1]={int(indptr[-1])}")
        counts = indptr[1:] - indptr[:-1]
        if bool((counts < 0).any()):
            r = int(torch.nonzero(counts < 0)[0])
            raise ValueError(f"append_indptr must never decrease: append_indptr[{r + 1}]={int(indptr[r + 1])} < "
                             f"append_indptr[{r}]={int(indptr[r])}")
        bad = counts > lens
        if bool(bad.any()):
            r = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"request {r} appends {int(counts[r])} tokens but seq_lens[{r}]={int(lens[r])}; "
                "seq_lens must count the tokens after the append"
            )
        _fits("seq_lens", lens)
    tokens = torch.arange(nnz, dtype=torch.int64, device=device)
    if batch_size == 0:
        empty = torch.zeros(nnz, dtype=torch.int32, device=device)
        return empty, empty.clone()
    # Request of token t: the number of requests whose end is <= t.
    batch = torch.searchsorted(indptr[1:].contiguous(), tokens, right=True).clamp_(max=batch_size - 1)
    positions = lens[batch] - (indptr[batch + 1] - tokens)
    return batch.to(torch.int32), positions.to(torch.int32)


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int, *,
                 as_flashinfer: bool = False) -> torch.Tensor:
    """Per-request KV lengths of a paged cache: int32 ``[batch_size]`` on ``kv_indptr``'s device.

    ``len[r] = (num_pages[r] - 1) * page_size + kv_last_page_len[r]`` when request ``r`` has pages,
    else 0. No host synchronisation. A ``kv_last_page_len`` longer than the batch (a buffer sized for the
    largest one) is read up to ``batch_size``, as FlashInfer does.

    Arrays on the host are checked with the page-table rules ``plan()`` and ``append_paged_kv_cache``
    apply (``kv_indptr`` starts at 0 and never decreases; ``1 <= kv_last_page_len <= page_size`` for a
    request with pages), with the same messages. Arrays on a CUDA device are **not** checked: that would
    need a host synchronisation (``plan()`` checks them later).

    ``as_flashinfer``: FlashInfer's Python arithmetic (``flashinfer.get_seq_lens``), ``clamp(num_pages - 1, min=0) *
    page_size + kv_last_page_len`` in the inputs' promoted dtype: a request without pages gets its
    ``kv_last_page_len`` (engines pad graph batches with such rows), where the kernels read 0 tokens.
    """
    for name, t in (("kv_indptr", kv_indptr), ("kv_last_page_len", kv_last_page_len)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 1 or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"{name} must be a 1-D integer tensor, got {_name(t.dtype)} of shape {tuple(t.shape)}")
    if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral):
        raise TypeError(f"page_size={page_size!r} must be an int" + (" (pass .item() of a 0-d tensor)"
                                                                    if isinstance(page_size, torch.Tensor) else ""))
    page_size = int(page_size)
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be >= 1")
    batch_size = kv_indptr.shape[0] - 1
    if batch_size < 0:
        raise ValueError("kv_indptr must have batch_size + 1 entries; it is empty")
    if kv_last_page_len.shape[0] < batch_size:
        raise ValueError(f"kv_last_page_len has {kv_last_page_len.shape[0]} entries; expected batch_size={batch_size}")
    if kv_indptr.device.type == "cpu" and kv_last_page_len.device.type == "cpu":
        check_page_table(kv_indptr, None, kv_last_page_len[:batch_size], page_size,
                         names=("kv_indptr", "kv_indices", "kv_last_page_len"))
    device = kv_indptr.device
    num_pages = kv_indptr[1:].to(torch.int64) - kv_indptr[:-1].to(torch.int64)
    last = kv_last_page_len[:batch_size].to(device=device, dtype=torch.int64, non_blocking=True)
    if as_flashinfer:
        lens = (num_pages - 1).clamp_(min=0) * page_size + last
        dtype = torch.promote_types(kv_indptr.dtype, kv_last_page_len.dtype)
        if device.type == "cpu":  # (a request without pages gets its kv_last_page_len, which nothing else checks)
            _fits("the lengths (kv_indptr's pages x page_size + kv_last_page_len)", lens, dtype)
        return lens.to(dtype)
    lens = torch.where(num_pages > 0, (num_pages - 1) * page_size + last, torch.zeros_like(last))
    if device.type == "cpu":
        _fits("the lengths (kv_indptr's pages x page_size)", lens)
    return lens.to(torch.int32)


def _fits(what: str, values: torch.Tensor, dtype: torch.dtype = torch.int32) -> None:
    """Refuse int64 host values that a ``dtype`` result would not hold (no check on a GPU: it would sync)."""
    if values.numel() and not 0 <= int(values.min()) <= int(values.max()) <= torch.iinfo(dtype).max:
        raise ValueError(f"{what} span [{int(values.min())}, {int(values.max())}], which the {_name(dtype)} results "
                         "cannot hold: a request longer than that, a negative kv_last_page_len, or an index array "
                         "that is not one")


def append_paged_mla_kv_cache(
    append_ckv: torch.Tensor, append_kpe: torch.Tensor, batch_indices: torch.Tensor, positions: torch.Tensor,
    ckv_cache: torch.Tensor, kpe_cache: torch.Tensor, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
) -> None:
    """Write new tokens' compressed KV ``[nnz, ckv]`` and rope keys ``[nnz, kpe]`` into an MLA latent cache.

    ``ckv_cache`` ``[pages, page_size, ckv]`` and ``kpe_cache`` ``[pages, page_size, kpe]`` (they may be
    slices of one buffer); everything else as in :func:`append_paged_kv_cache`, with the same checks
    and rounding rules. Both halves are checked before either cache is written: a refused call leaves
    both unchanged.
    """
    _check_mla_half("append_ckv", append_ckv, "ckv_cache", ckv_cache)
    _check_mla_half("append_kpe", append_kpe, "kpe_cache", kpe_cache)
    nnz = _check_mla_shapes(append_ckv, append_kpe, ckv_cache, kpe_cache)
    shared = spans_overlap(ckv_cache, kpe_cache) and shares_element(ckv_cache, kpe_cache)
    if shared is not False:
        what = "share memory" if shared else "overlap in a layout whose bytes this check cannot tell apart"
        raise ValueError(f"ckv_cache and kpe_cache {what}, so the kpe writes could overwrite latent values: cut "
                         "them from disjoint columns of one buffer (buf[..., :512] and buf[..., 512:]) or pass two "
                         "tensors")
    # either source in either cache: the first half's write would change what the second half reads
    _refuse_sources_in_cache((("append_ckv", append_ckv), ("append_kpe", append_kpe)),
                             (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)))
    target, device = target_of("append_paged_mla_kv_cache", (append_ckv, append_kpe, ckv_cache, kpe_cache))
    for name, cache in (("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)):
        if target is Target.CUDA and cache.dtype == torch.float32:
            raise TypeError(f"{name} is float32, which the cpu target alone supports; on a CUDA device use a "
                            "float16, bfloat16 or fp8 cache")
    index_arrays = _as_int32({"batch_indices": batch_indices, "positions": positions, "kv_indices": kv_indices,
                              "kv_indptr": kv_indptr, "kv_last_page_len": kv_last_page_len})
    _check_append_indices(index_arrays, nnz, device, rows="append_ckv", cache="ckv_cache")
    # Everything that differs between the halves is checked above; they share the index arrays, the page size
    # and the page count, so the first write's own checks of the index values refuse both halves or neither.
    ix = index_arrays
    check_writable("append_paged_mla_kv_cache", ckv_cache=ckv_cache, kpe_cache=kpe_cache)
    for appended, cache in ((append_ckv, ckv_cache), (append_kpe, kpe_cache)):
        rows, views = appended.unsqueeze(1), cache.unsqueeze(2)  # one latent head
        append_paged_kv_cache(rows, rows, ix["batch_indices"], ix["positions"], (views, views), ix["kv_indices"],
                              ix["kv_indptr"], ix["kv_last_page_len"], kv_layout="NHD")


def _check_mla_half(append_name: str, appended, cache_name: str, cache) -> None:
    """One half of an MLA append (``append_ckv`` into ``ckv_cache`` or the kpe pair): ranks, dtypes, strides."""
    check_tensor(append_name, appended, ndim=2)
    check_tensor(cache_name, cache, ndim=3, dtypes=_CACHE_DTYPES)
    if appended.dtype not in _SRC_CODES and appended.dtype != cache.dtype:
        raise TypeError(f"{append_name} has dtype {_name(appended.dtype)}; use float32, float16, bfloat16 or "
                        f"{cache_name}'s dtype ({_name(cache.dtype)})")
    check_no_overlap(cache_name, cache)  # written in place
    if cache.shape[1] < 1:
        raise ValueError(f"{cache_name} has shape {tuple(cache.shape)}: page_size 0; it must be at least 1")


def _check_mla_shapes(append_ckv, append_kpe, ckv_cache, kpe_cache) -> int:
    """The two halves' shapes against each other and their caches; returns nnz."""
    if tuple(ckv_cache.shape[:2]) != tuple(kpe_cache.shape[:2]):
        what = "page_size" if ckv_cache.shape[1] != kpe_cache.shape[1] else "page count"
        raise ValueError(f"ckv_cache and kpe_cache differ in {what}: shapes {tuple(ckv_cache.shape)} and "
                         f"{tuple(kpe_cache.shape)}; the two caches share one page table, so give them the same "
                         "[pages, page_size]")
    nnz = append_ckv.shape[0]
    if append_kpe.shape[0] != nnz:
        raise ValueError(f"append_kpe has {append_kpe.shape[0]} rows but append_ckv has {nnz}; give both one row "
                         "per appended token")
    swapped = (append_ckv.shape[1], append_kpe.shape[1]) == (kpe_cache.shape[2], ckv_cache.shape[2])
    for name, appended, cache_name, cache in (("append_ckv", append_ckv, "ckv_cache", ckv_cache),
                                              ("append_kpe", append_kpe, "kpe_cache", kpe_cache)):
        if appended.shape[1] != cache.shape[2]:
            hint = " (are ckv_cache and kpe_cache swapped?)" if swapped else ""
            raise ValueError(f"{name} has shape {tuple(appended.shape)}; expected [nnz, {cache_name}'s last dim] = "
                             f"{(nnz, cache.shape[2])} to match {cache_name} (shape {tuple(cache.shape)}){hint}")
    return nnz

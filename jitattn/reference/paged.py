"""Reference paged-KV operations: lengths, views, batch decode/prefill over pages, append."""

from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .common import PagedKVCache, to_list
from .attention import batch_ragged_attention


def _paged_views(paged_kv_cache: PagedKVCache, kv_layout: str) -> Tuple[Tensor, Tensor, int]:
    """Return ``(k_pages, v_pages, page_size)`` as NHD *views* of the cache.

    The views are ``[pages, page_size, H_kv, D]`` and alias the cache storage,
    so writing into them writes into the cache.
    """
    layout = str(kv_layout).upper()
    if layout not in ("NHD", "HND"):
        raise ValueError(f"kv_layout must be 'NHD' or 'HND', got {kv_layout!r}")
    if isinstance(paged_kv_cache, Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                "a single-tensor paged cache must be [pages, 2, page_size, H, D] "
                f"(NHD) or [pages, 2, H, page_size, D] (HND); got "
                f"{tuple(paged_kv_cache.shape)}"
            )
        k_c, v_c = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    else:
        if len(paged_kv_cache) != 2:
            raise ValueError("a tuple paged cache must be (k_cache, v_cache)")
        k_c, v_c = paged_kv_cache[0], paged_kv_cache[1]
        if k_c.dim() == 3 and v_c.dim() == 3:
            # [tokens, H, D]: page_size 1, layout irrelevant.
            return k_c.unsqueeze(1), v_c.unsqueeze(1), 1
        if k_c.dim() != 4 or v_c.dim() != 4:
            raise ValueError(
                "tuple paged caches must hold two 4-D or two 3-D tensors; got "
                f"{tuple(k_c.shape)}, {tuple(v_c.shape)}"
            )
    if layout == "HND":
        k_c, v_c = k_c.transpose(1, 2), v_c.transpose(1, 2)
    if k_c.shape[:3] != v_c.shape[:3]:
        raise ValueError(f"k/v caches disagree: {tuple(k_c.shape)} vs {tuple(v_c.shape)}")
    return k_c, v_c, int(k_c.shape[1])


def _request_lengths(
    kv_indptr: Tensor, kv_last_page_len: Tensor, page_size: int
) -> Tuple[list, list, list]:
    """Return (indptr list, last_page_len list, seq_len list) with validation."""
    indptr = to_list(kv_indptr)
    last = to_list(kv_last_page_len)
    batch = len(indptr) - 1
    if batch < 0 or len(last) < batch:
        raise ValueError("kv_last_page_len must have one entry per request")
    lens = []
    for r in range(batch):
        npages = indptr[r + 1] - indptr[r]
        if npages < 0:
            raise ValueError("kv_indptr must be non-decreasing")
        if npages == 0:
            lens.append(0)
            continue
        if not 0 <= last[r] <= page_size:
            raise ValueError(
                f"kv_last_page_len[{r}]={last[r]} outside [0, page_size={page_size}]"
            )
        lens.append((npages - 1) * page_size + last[r])
    return indptr, last, lens


def get_seq_lens(kv_indptr: Tensor, kv_last_page_len: Tensor, page_size: int) -> Tensor:
    """Per-request KV lengths of a paged cache, int32.

    ``len[r] = (num_pages[r] - 1) * page_size + kv_last_page_len[r]`` when
    ``num_pages[r] > 0``, else 0.
    """
    num_pages = kv_indptr[1:].to(torch.int64) - kv_indptr[:-1].to(torch.int64)
    last = kv_last_page_len.to(torch.int64).to(num_pages.device)[: num_pages.numel()]
    lens = (num_pages - 1) * int(page_size) + last
    return torch.where(num_pages > 0, lens, torch.zeros_like(lens)).to(torch.int32)


def paged_kv_to_ragged(
    paged_kv_cache: PagedKVCache,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "NHD",
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gather a paged KV cache into contiguous (ragged) k and v.

    Accepted cache formats: one tensor ``[pages, 2, page_size, H, D]`` (NHD) /
    ``[pages, 2, H, page_size, D]`` (HND); a tuple ``(k_cache, v_cache)`` of
    ``[pages, page_size, H, D]`` (NHD) / ``[pages, H, page_size, D]`` (HND); or
    a tuple of 3-D ``[tokens, H, D]`` tensors (page_size 1).  Request ``r`` owns
    pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]`` in that order.

    Returns:
        ``(k, v, kv_seq_indptr)``: ``[total_kv, H_kv, D]`` tensors in the
        cache's dtype/device, and the int64 indptr of the request lengths
        (on ``kv_indptr``'s device).
    """
    k_pages, v_pages, page_size = _paged_views(paged_kv_cache, kv_layout)
    indptr, _, lens = _request_lengths(kv_indptr, kv_last_page_len, page_size)
    indices = torch.as_tensor(kv_indices).to(device=k_pages.device, dtype=torch.int64).reshape(-1)
    ks, vs = [], []
    for r, n in enumerate(lens):
        if n == 0:
            continue
        pages = indices[indptr[r]:indptr[r + 1]]
        ks.append(k_pages[pages].reshape(-1, *k_pages.shape[2:])[:n])
        vs.append(v_pages[pages].reshape(-1, *v_pages.shape[2:])[:n])
    if ks:
        k_out, v_out = torch.cat(ks, dim=0), torch.cat(vs, dim=0)
    else:
        k_out = k_pages.new_empty((0, *k_pages.shape[2:]))
        v_out = v_pages.new_empty((0, *v_pages.shape[2:]))
    seq_indptr = torch.zeros(len(lens) + 1, dtype=torch.int64)
    if lens:
        seq_indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), dim=0)
    dev = kv_indptr.device if isinstance(kv_indptr, Tensor) else torch.device("cpu")
    return k_out, v_out, seq_indptr.to(dev)


def batch_decode_paged(
    q: Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    *,
    kv_layout: str = "NHD",
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    pos_encoding_mode: Union[str, int] = "NONE",
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Reference batched decode over a paged KV cache.

    ``q`` is ``[batch, H_qo, D]``: one query per request, at position
    ``kv_len - 1`` (so it sees every key; ``window_left`` still applies).  A
    request with ``kv_len == 0`` yields output 0 and LSE ``-inf``.

    Returns:
        ``(o, lse)``: float32 ``[batch, H_qo, D_vo]`` and ``[batch, H_qo]``.
    """
    k, v, seq_indptr = paged_kv_to_ragged(
        paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
    )
    batch = seq_indptr.numel() - 1
    if q.shape[0] != batch:
        raise ValueError(f"q has {q.shape[0]} rows but there are {batch} requests")
    qo_indptr = torch.arange(batch + 1, dtype=torch.int64)
    return batch_ragged_attention(
        q, k, v, qo_indptr, seq_indptr,
        causal=False, sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale, rope_theta=rope_theta,
        k_scale=k_scale, v_scale=v_scale,
    )


def batch_prefill_paged(
    q: Tensor,
    paged_kv_cache: PagedKVCache,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    kv_indices: Tensor,
    kv_last_page_len: Tensor,
    *,
    kv_layout: str = "NHD",
    custom_mask: Optional[Tensor] = None,
    causal: bool = False,
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    pos_encoding_mode: Union[str, int] = "NONE",
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Reference batched prefill over a paged KV cache.

    The cache is gathered with :func:`paged_kv_to_ragged` and attention is
    computed with :func:`batch_ragged_attention` (same flat bool
    ``custom_mask`` convention, same keyword semantics).

    Returns:
        ``(o, lse)``: float32 ``[total_qo, H_qo, D_vo]`` and ``[total_qo, H_qo]``.
    """
    k, v, seq_indptr = paged_kv_to_ragged(
        paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len, kv_layout
    )
    return batch_ragged_attention(
        q, k, v, qo_indptr, seq_indptr,
        custom_mask=custom_mask, causal=causal, sm_scale=sm_scale,
        window_left=window_left, logits_soft_cap=logits_soft_cap,
        pos_encoding_mode=pos_encoding_mode, rope_scale=rope_scale,
        rope_theta=rope_theta, k_scale=k_scale, v_scale=v_scale,
    )


def append_paged_kv_cache(
    append_key: Tensor,
    append_value: Tensor,
    batch_indices: Tensor,
    positions: Tensor,
    paged_kv_cache: PagedKVCache,
    kv_indices: Tensor,
    kv_indptr: Tensor,
    kv_last_page_len: Tensor,
    kv_layout: str = "NHD",
) -> None:
    """In-place reference scatter of new tokens into a paged KV cache.

    Token ``t`` (``append_key[t]``: ``[H_kv, D]``) belongs to request
    ``r = batch_indices[t]`` at position ``pos = positions[t]`` and is written
    to page ``kv_indices[kv_indptr[r] + pos // page_size]``, slot
    ``pos % page_size``.  Values are cast to the cache dtype (fp8 saturates
    to its largest finite value, see ``to_cache_dtype``).  The cache
    formats are those of :func:`paged_kv_to_ragged`.  ``kv_last_page_len``
    describes the cache *after* the append (FlashInfer semantics); a position
    at or beyond the resulting sequence length raises ``IndexError``.
    """
    k_pages, v_pages, page_size = _paged_views(paged_kv_cache, kv_layout)
    indptr, _, lens = _request_lengths(kv_indptr, kv_last_page_len, page_size)
    bi = to_list(batch_indices)
    pos = to_list(positions)
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz or len(bi) < nnz or len(pos) < nnz:
        raise ValueError("append_key/value, batch_indices and positions disagree on nnz")
    indices = to_list(kv_indices)
    pages, slots = [], []
    for t in range(nnz):
        r, p = bi[t], pos[t]
        if not 0 <= r < len(lens):
            raise IndexError(f"token {t}: batch index {r} out of range")
        if not 0 <= p < lens[r]:
            raise IndexError(
                f"token {t}: position {p} outside request {r} of length {lens[r]}"
            )
        pages.append(indices[indptr[r] + p // page_size])
        slots.append(p % page_size)
    page_t = torch.tensor(pages, dtype=torch.int64, device=k_pages.device)
    slot_t = torch.tensor(slots, dtype=torch.int64, device=k_pages.device)
    k_pages[page_t, slot_t] = to_cache_dtype(append_key.to(k_pages.device), k_pages.dtype)
    v_pages[page_t, slot_t] = to_cache_dtype(append_value.to(v_pages.device), v_pages.dtype)


def to_cache_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
    """``x.to(dtype)``, except that fp8 saturates: values beyond the range (inf too) become the
    largest finite value of their sign (e4m3 +-448, e5m2 +-57344); NaN stays NaN."""
    if x.dtype == dtype or dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return x.to(dtype)
    fmax = torch.finfo(dtype).max
    return x.float().clamp(-fmax, fmax).to(dtype)  # clamp keeps NaN


def get_batch_indices_positions(
    append_indptr: Tensor, seq_lens: Tensor, nnz: int
) -> Tuple[Tensor, Tensor]:
    """FlashInfer ``get_batch_indices_positions`` reference.

    Request ``r`` appends ``a_r = append_indptr[r+1] - append_indptr[r]``
    tokens, which get batch index ``r`` and positions
    ``seq_lens[r] - a_r + (0 .. a_r - 1)``.  ``nnz`` must equal
    ``append_indptr[-1]``.

    Returns:
        ``(batch_indices, positions)``, both int32 ``[nnz]`` on
        ``append_indptr``'s device.
    """
    indptr = to_list(append_indptr)
    lens = to_list(seq_lens)
    nnz = int(nnz)
    if not indptr or indptr[-1] != nnz:
        raise ValueError(f"nnz={nnz} must equal append_indptr[-1]")
    bis, poss = [], []
    for r in range(len(indptr) - 1):
        a = indptr[r + 1] - indptr[r]
        if a < 0 or a > lens[r]:
            raise ValueError(f"request {r}: append length {a} vs seq_len {lens[r]}")
        bis += [r] * a
        poss += list(range(lens[r] - a, lens[r]))
    dev = append_indptr.device if isinstance(append_indptr, Tensor) else torch.device("cpu")
    return (
        torch.tensor(bis, dtype=torch.int32, device=dev),
        torch.tensor(poss, dtype=torch.int32, device=dev),
    )

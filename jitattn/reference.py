"""Plain-torch float64 reference implementations for jitattn.

Every kernel test compares against the functions in this module.  They are
deliberately simple, loop-per-request implementations with no global state:

* all arithmetic is done in ``torch.float64`` (inputs, including fp8 tensors,
  are upcast with ``.to(torch.float64)``);
* attention outputs and LSEs are returned as ``torch.float32``;
* the LSE is always the *natural* log of the sum of exponentiated logits;
* results live on the device of the query tensor (CPU or CUDA both work).

Semantics (shared by every attention entry point)
-------------------------------------------------
For one request with ``qo_len`` queries and ``kv_len`` keys:

* query ``i`` sits at absolute position ``p_i = kv_len - qo_len + i``; key ``j``
  sits at position ``j``;
* GQA: query head ``h`` reads kv head ``h // (H_qo // H_kv)``;
* ``logits = sm_scale * (q . k)`` with ``sm_scale`` defaulting to
  ``1 / sqrt(D_qk)``;
* ``pos_encoding_mode="ROPE_LLAMA"`` rotates q (at ``p_i``) and k (at ``j``)
  with rotate-half (non-interleaved) RoPE before the dot product;
* ``pos_encoding_mode="ALIBI"`` adds ``slope[h] * (j - p_i)`` to the scaled
  logits;
* ``logits_soft_cap=c`` (``c > 0``) then maps ``logits -> c * tanh(logits / c)``;
* masks (all ANDed): causal (bottom-right) keeps ``j <= p_i``; ``window_left=w``
  (``w >= 0``) keeps ``j >= p_i - w`` only -- the upper bound ``j <= p_i`` comes
  from ``causal`` alone, so a non-causal windowed query also sees every key to
  its right; ``custom_mask`` (True = attend) is ANDed in as well;
* masked logits are ``-inf``; a query whose keys are all masked (or
  ``kv_len == 0``) yields output 0 and LSE ``-inf`` -- never NaN.  A NaN
  query that sees a key yields a NaN output row and a NaN LSE.
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

__all__ = [
    "alibi_slopes",
    "apply_rope_llama",
    "single_attention",
    "batch_ragged_attention",
    "unpack_custom_mask",
    "pack_custom_mask",
    "paged_kv_to_ragged",
    "batch_decode_paged",
    "batch_prefill_paged",
    "merge_state",
    "merge_states",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
]

PagedKVCache = Union[Tensor, Tuple[Tensor, Tensor], Sequence[Tensor]]

_F64 = torch.float64
_NEG_INF = float("-inf")

# FlashInfer's PosEncodingMode enum values, accepted as an alternative to names.
_POS_ENCODING_MODES = {0: "NONE", 1: "ROPE_LLAMA", 2: "ALIBI"}


# --------------------------------------------------------------------------- #
# Small helpers
# --------------------------------------------------------------------------- #
def _to_list(x: Union[Tensor, Sequence[int]]) -> list:
    """Return a python list of ints from a tensor (any device) or a sequence."""
    if isinstance(x, Tensor):
        return [int(v) for v in x.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in x]


def _normalize_pos_encoding_mode(mode: Union[str, int, None]) -> str:
    """Map a pos-encoding mode (name, FlashInfer enum int, or None) to a name."""
    if mode is None:
        return "NONE"
    if isinstance(mode, bool):
        raise ValueError(f"invalid pos_encoding_mode {mode!r}")
    if isinstance(mode, int):
        if mode not in _POS_ENCODING_MODES:
            raise ValueError(f"invalid pos_encoding_mode {mode!r}")
        return _POS_ENCODING_MODES[mode]
    if isinstance(mode, str):
        name = mode.upper()
        if name in _POS_ENCODING_MODES.values():
            return name
    raise ValueError(
        f"invalid pos_encoding_mode {mode!r}; expected one of "
        f"{sorted(_POS_ENCODING_MODES.values())}"
    )


def _dequant(x: Tensor, scale: Optional[float]) -> Tensor:
    """Upcast ``x`` to float64 and multiply by ``scale`` (None means 1.0)."""
    out = x.to(_F64)
    if scale is not None:
        out = out * float(scale)
    return out


# --------------------------------------------------------------------------- #
# Position encodings
# --------------------------------------------------------------------------- #
def alibi_slopes(num_heads: int) -> Tensor:
    """Standard ALiBi slopes (ALiBi paper / HF ``get_alibi_slopes``), float64.

    With ``m = 2 ** floor(log2(num_heads))`` and ``base = 2 ** (-8 / m)`` the
    first ``m`` slopes are ``base ** (h + 1)``; the remaining ``num_heads - m``
    slopes are ``(2 ** (-4 / m)) ** (1 + 2 * i)``.

    Args:
        num_heads: number of query heads (>= 1).

    Returns:
        A float64 CPU tensor of shape ``[num_heads]``.
    """
    num_heads = int(num_heads)
    if num_heads < 1:
        raise ValueError(f"num_heads must be >= 1, got {num_heads}")
    m = 2 ** int(math.floor(math.log2(num_heads)))
    base = 2.0 ** (-8.0 / m)
    slopes = [base ** (h + 1) for h in range(m)]
    if m < num_heads:
        extra_base = 2.0 ** (-4.0 / m)
        slopes += [extra_base ** (1 + 2 * i) for i in range(num_heads - m)]
    return torch.tensor(slopes, dtype=_F64)


def apply_rope_llama(
    x: Tensor,
    positions: Tensor,
    rope_scale: float = 1.0,
    rope_theta: float = 1e4,
) -> Tensor:
    """Rotate-half (Llama / HF style, non-interleaved) rotary embedding.

    For head dim ``D`` (even), ``half = D // 2``,
    ``inv_freq[i] = 1 / rope_theta ** (2 i / D)`` and
    ``angle = (position / rope_scale) * inv_freq[i]``::

        out[i]        = x[i] * cos - x[i + half] * sin
        out[i + half] = x[i + half] * cos + x[i] * sin

    Args:
        x: ``[n, H, D]`` tensor (any float dtype, upcast to float64).
        positions: ``[n]`` positions (integer or float), one per row of ``x``.
        rope_scale: position interpolation divisor.
        rope_theta: RoPE base.

    Returns:
        The rotated tensor, float64, shape ``[n, H, D]``.
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [n, H, D], got shape {tuple(x.shape)}")
    n, _, d = x.shape
    if d % 2 != 0:
        raise ValueError(f"RoPE needs an even head dim, got {d}")
    pos = torch.as_tensor(positions, device=x.device).to(_F64).reshape(-1)
    if pos.numel() != n:
        raise ValueError(f"positions has {pos.numel()} entries, x has {n} rows")
    xd = x.to(_F64)
    half = d // 2
    i = torch.arange(half, dtype=_F64, device=x.device)
    inv_freq = 1.0 / (float(rope_theta) ** (2.0 * i / d))
    angle = (pos / float(rope_scale))[:, None] * inv_freq[None, :]  # [n, half]
    cos = torch.cos(angle)[:, None, :]
    sin = torch.sin(angle)[:, None, :]
    x1, x2 = xd[..., :half], xd[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


# --------------------------------------------------------------------------- #
# Single-request attention
# --------------------------------------------------------------------------- #
def single_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    sm_scale: Optional[float] = None,
    window_left: int = -1,
    logits_soft_cap: Optional[float] = None,
    pos_encoding_mode: Union[str, int] = "NONE",
    rope_scale: Optional[float] = None,
    rope_theta: Optional[float] = None,
    custom_mask: Optional[Tensor] = None,
    k_scale: Optional[float] = None,
    v_scale: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Reference attention for one request (see the module docstring).

    Args:
        q: ``[qo_len, H_qo, D_qk]``.
        k: ``[kv_len, H_kv, D_qk]`` (may be fp8; dequantised with ``k_scale``).
        v: ``[kv_len, H_kv, D_vo]`` (may be fp8; dequantised with ``v_scale``).
        causal: bottom-right causal mask (``j <= kv_len - qo_len + i``).
        sm_scale: logit scale; default ``1 / sqrt(D_qk)``.
        window_left: ``w >= 0`` keeps keys ``j >= p_i - w``; ``-1`` disables.
        logits_soft_cap: ``c > 0`` applies ``c * tanh(logits / c)``; None/0 off.
        pos_encoding_mode: ``"NONE"``, ``"ROPE_LLAMA"`` or ``"ALIBI"`` (the
            FlashInfer enum ints 0/1/2 are accepted too).
        rope_scale: RoPE position divisor (default 1.0).
        rope_theta: RoPE base (default 1e4).
        custom_mask: bool ``[qo_len, kv_len]``, True = attend; ANDed in.
        k_scale: fp8 dequant scale for k (None = 1.0).
        v_scale: fp8 dequant scale for v (None = 1.0).

    Returns:
        ``(o, lse)``: float32 ``[qo_len, H_qo, D_vo]`` and float32
        ``[qo_len, H_qo]`` (natural log).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            "q, k, v must be 3-D [len, heads, dim]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    qo_len, h_qo, d_qk = q.shape
    kv_len, h_kv, d_k = k.shape
    if tuple(v.shape[:2]) != (kv_len, h_kv):
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} disagree")
    if d_k != d_qk:
        raise ValueError(f"q head dim {d_qk} != k head dim {d_k}")
    if h_kv < 1 or h_qo % h_kv != 0:
        raise ValueError(f"H_qo={h_qo} must be a multiple of H_kv={h_kv}")
    group = h_qo // h_kv
    mode = _normalize_pos_encoding_mode(pos_encoding_mode)
    device = q.device

    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d_qk)
    if logits_soft_cap is not None and float(logits_soft_cap) < 0:
        raise ValueError(f"logits_soft_cap must be >= 0, got {logits_soft_cap}")
    window_left = int(window_left)
    if window_left < -1:
        raise ValueError(f"window_left must be >= -1, got {window_left}")

    qd = q.to(_F64)
    kd = _dequant(k, k_scale).to(device)
    vd = _dequant(v, v_scale).to(device)

    q_pos = torch.arange(qo_len, dtype=torch.int64, device=device) + (kv_len - qo_len)
    kv_pos = torch.arange(kv_len, dtype=torch.int64, device=device)

    if mode == "ROPE_LLAMA":
        rs = 1.0 if rope_scale is None else float(rope_scale)
        rt = 1e4 if rope_theta is None else float(rope_theta)
        qd = apply_rope_llama(qd, q_pos, rope_scale=rs, rope_theta=rt)
        kd = apply_rope_llama(kd, kv_pos, rope_scale=rs, rope_theta=rt)

    # GQA: expand kv heads so that query head h reads kv head h // group.
    kd = kd.repeat_interleave(group, dim=1)  # [kv_len, H_qo, D_qk]
    vd = vd.repeat_interleave(group, dim=1)  # [kv_len, H_qo, D_vo]

    logits = torch.einsum("qhd,khd->hqk", qd, kd) * float(sm_scale)  # [H, q, k]

    rel = (kv_pos[None, :] - q_pos[:, None]).to(_F64)  # [q, k] = j - p_i
    if mode == "ALIBI":
        slopes = alibi_slopes(h_qo).to(device)
        logits = logits + slopes[:, None, None] * rel[None, :, :]

    if logits_soft_cap is not None and float(logits_soft_cap) > 0:
        cap = float(logits_soft_cap)
        logits = cap * torch.tanh(logits / cap)

    allowed = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    if causal:
        allowed &= rel <= 0
    if window_left >= 0:
        allowed &= rel >= -window_left
    if custom_mask is not None:
        if custom_mask.dtype != torch.bool:
            raise TypeError(f"custom_mask must be bool, got {custom_mask.dtype}")
        if tuple(custom_mask.shape) != (qo_len, kv_len):
            raise ValueError(
                f"custom_mask shape {tuple(custom_mask.shape)} != "
                f"({qo_len}, {kv_len})"
            )
        allowed &= custom_mask.to(device)

    logits = logits.masked_fill(~allowed[None, :, :], _NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)  # [H, q]; -inf for empty rows
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(logits - safe_lse[..., None])  # exp(-inf) = 0 on masked keys
    o = torch.einsum("hqk,khd->qhd", p, vd)
    return o.to(torch.float32), lse.transpose(0, 1).contiguous().to(torch.float32)


# --------------------------------------------------------------------------- #
# Batched (ragged) attention
# --------------------------------------------------------------------------- #
def batch_ragged_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qo_indptr: Tensor,
    kv_indptr: Tensor,
    *,
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
    """Reference attention over concatenated (ragged) requests.

    Request ``r`` owns queries ``q[qo_indptr[r]:qo_indptr[r+1]]`` and keys /
    values ``k, v[kv_indptr[r]:kv_indptr[r+1]]``; positions restart at each
    request.  ``custom_mask`` is FlashInfer's flattened 1-D bool mask: for each
    request a row-major ``qo_len x kv_len`` block, concatenated in request
    order (a bit-packed uint8 mask must first go through
    :func:`unpack_custom_mask`).  Other keyword arguments are as in
    :func:`single_attention`.

    Returns:
        ``(o, lse)``: float32 ``[total_qo, H_qo, D_vo]`` and ``[total_qo, H_qo]``.
    """
    qo = _to_list(qo_indptr)
    kv = _to_list(kv_indptr)
    if len(qo) != len(kv) or len(qo) < 1:
        raise ValueError("qo_indptr and kv_indptr must have the same length >= 1")
    if qo[-1] > q.shape[0] or kv[-1] > k.shape[0] or kv[-1] > v.shape[0]:
        raise ValueError("indptr exceeds the q/k/v lengths")
    flat_mask = None
    if custom_mask is not None:
        if custom_mask.dtype != torch.bool:
            raise TypeError(
                f"custom_mask must be a flat bool tensor, got {custom_mask.dtype} "
                "(unpack bit-packed masks with unpack_custom_mask first)"
            )
        flat_mask = custom_mask.reshape(-1)
        need = sum((qo[r + 1] - qo[r]) * (kv[r + 1] - kv[r]) for r in range(len(qo) - 1))
        if flat_mask.numel() < need:
            raise ValueError(f"custom_mask has {flat_mask.numel()} entries, need {need}")

    h_qo = q.shape[1]
    d_vo = v.shape[2]
    o = torch.zeros(q.shape[0], h_qo, d_vo, dtype=torch.float32, device=q.device)
    lse = torch.full((q.shape[0], h_qo), _NEG_INF, dtype=torch.float32, device=q.device)
    mask_off = 0
    for r in range(len(qo) - 1):
        qs, qe, ks, ke = qo[r], qo[r + 1], kv[r], kv[r + 1]
        if qe < qs or ke < ks:
            raise ValueError("indptr must be non-decreasing")
        req_mask = None
        if flat_mask is not None:
            n = (qe - qs) * (ke - ks)
            req_mask = flat_mask[mask_off:mask_off + n].reshape(qe - qs, ke - ks)
            mask_off += n
        if qe == qs:
            continue
        o_r, lse_r = single_attention(
            q[qs:qe], k[ks:ke], v[ks:ke],
            causal=causal, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, pos_encoding_mode=pos_encoding_mode,
            rope_scale=rope_scale, rope_theta=rope_theta, custom_mask=req_mask,
            k_scale=k_scale, v_scale=v_scale,
        )
        o[qs:qe] = o_r
        lse[qs:qe] = lse_r
    return o, lse


# --------------------------------------------------------------------------- #
# Custom-mask bit packing
# --------------------------------------------------------------------------- #
def unpack_custom_mask(packed: Tensor, total_bits: int) -> Tensor:
    """Unpack a little-endian bit-packed uint8 mask into a flat bool tensor.

    Bit ``i`` of the flat mask is ``(packed[i // 8] >> (i % 8)) & 1``
    (``numpy.packbits(..., bitorder="little")`` layout, as in FlashInfer).

    Returns:
        bool tensor ``[total_bits]`` on ``packed``'s device.
    """
    total_bits = int(total_bits)
    flat = packed.reshape(-1)
    if total_bits < 0 or flat.numel() * 8 < total_bits:
        raise ValueError(f"{flat.numel()} bytes cannot hold {total_bits} bits")
    idx = torch.arange(total_bits, dtype=torch.int64, device=packed.device)
    byte = flat.to(torch.int64)[idx // 8]
    return ((byte >> (idx % 8)) & 1).to(torch.bool)


def pack_custom_mask(mask_bool_flat: Tensor) -> Tensor:
    """Inverse of :func:`unpack_custom_mask`: pack a bool mask little-endian.

    The mask is flattened (row-major); the result has ``ceil(n / 8)`` bytes and
    any padding bits of the last byte are 0.

    Returns:
        uint8 tensor on the mask's device.
    """
    bits = mask_bool_flat.reshape(-1).to(torch.bool).to(torch.int64)
    n = bits.numel()
    nbytes = (n + 7) // 8
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=bits.device)
    padded[:n] = bits
    weights = (2 ** torch.arange(8, dtype=torch.int64, device=bits.device))
    return (padded.reshape(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)


# --------------------------------------------------------------------------- #
# Paged KV cache
# --------------------------------------------------------------------------- #
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
    indptr = _to_list(kv_indptr)
    last = _to_list(kv_last_page_len)
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
    to its largest finite value, see ``_to_cache_dtype``).  The cache
    formats are those of :func:`paged_kv_to_ragged`.  ``kv_last_page_len``
    describes the cache *after* the append (FlashInfer semantics); a position
    at or beyond the resulting sequence length raises ``IndexError``.
    """
    k_pages, v_pages, page_size = _paged_views(paged_kv_cache, kv_layout)
    indptr, _, lens = _request_lengths(kv_indptr, kv_last_page_len, page_size)
    bi = _to_list(batch_indices)
    pos = _to_list(positions)
    nnz = append_key.shape[0]
    if append_value.shape[0] != nnz or len(bi) < nnz or len(pos) < nnz:
        raise ValueError("append_key/value, batch_indices and positions disagree on nnz")
    indices = _to_list(kv_indices)
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
    k_pages[page_t, slot_t] = _to_cache_dtype(append_key.to(k_pages.device), k_pages.dtype)
    v_pages[page_t, slot_t] = _to_cache_dtype(append_value.to(v_pages.device), v_pages.dtype)


def _to_cache_dtype(x: Tensor, dtype: torch.dtype) -> Tensor:
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
    indptr = _to_list(append_indptr)
    lens = _to_list(seq_lens)
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


# --------------------------------------------------------------------------- #
# Attention-state merging
# --------------------------------------------------------------------------- #
def merge_states(v: Tensor, s: Tensor) -> Tuple[Tensor, Tensor]:
    """Merge ``num_states`` partial attention states per (token, head).

    Args:
        v: ``[seq, num_states, H, D]`` partial outputs.
        s: ``[seq, num_states, H]`` natural-log LSEs.

    Returns:
        ``(v, s)`` float32 ``[seq, H, D]`` and ``[seq, H]`` with
        ``v = sum_i e^{s_i} v_i / sum_i e^{s_i}`` and ``s = log sum_i e^{s_i}``,
        computed with max subtraction.  If every state is ``-inf`` (or
        ``num_states == 0``) the result is ``v = 0``, ``s = -inf``; a NaN
        LSE makes the result NaN (it is not an empty state).
    """
    if v.dim() != 4 or s.dim() != 3 or tuple(v.shape[:3]) != tuple(s.shape):
        raise ValueError(f"bad shapes v={tuple(v.shape)} s={tuple(s.shape)}")
    seq, n, h, d = v.shape
    if n == 0:
        return (
            torch.zeros(seq, h, d, dtype=torch.float32, device=v.device),
            torch.full((seq, h), _NEG_INF, dtype=torch.float32, device=v.device),
        )
    vd = v.to(_F64)
    sd = s.to(_F64).to(v.device)
    s_max = sd.amax(dim=1, keepdim=True)  # [seq, 1, H]
    s_max = torch.where(torch.isfinite(s_max), s_max, torch.zeros_like(s_max))
    w = torch.exp(sd - s_max)  # [seq, n, H]; 0 for -inf states
    total = w.sum(dim=1)  # [seq, H]
    contrib = torch.where(w[..., None] > 0, w[..., None] * vd, torch.zeros_like(vd))
    num = contrib.sum(dim=1)  # [seq, H, D]
    has = total != 0  # NaN (a NaN state) is not empty: it propagates
    safe_total = torch.where(has, total, torch.ones_like(total))
    v_out = torch.where(has[..., None], num / safe_total[..., None], torch.zeros_like(num))
    s_out = torch.where(
        has, s_max.squeeze(1) + torch.log(safe_total), torch.full_like(total, _NEG_INF)
    )
    return v_out.to(torch.float32), s_out.to(torch.float32)


def merge_state(v_a: Tensor, s_a: Tensor, v_b: Tensor, s_b: Tensor) -> Tuple[Tensor, Tensor]:
    """Merge two attention states (``[seq, H, D]`` outputs, ``[seq, H]`` LSEs).

    ``v = (e^{s_a} v_a + e^{s_b} v_b) / (e^{s_a} + e^{s_b})`` and
    ``s = log(e^{s_a} + e^{s_b})``, computed stably; both ``-inf`` gives
    ``v = 0``, ``s = -inf``.

    Returns:
        ``(v, s)`` as float32.
    """
    if v_a.shape != v_b.shape or s_a.shape != s_b.shape:
        raise ValueError("the two states must have identical shapes")
    v = torch.stack([v_a.to(_F64), v_b.to(_F64).to(v_a.device)], dim=1)
    s = torch.stack([s_a.to(_F64), s_b.to(_F64).to(s_a.device)], dim=1)
    return merge_states(v, s)


# --------------------------------------------------------------------------- #
# Custom variants (jitattn.variant): the same semantics with torch callables
# --------------------------------------------------------------------------- #
def variant_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    qo_indptr: Sequence[int],
    kv_indptr: Sequence[int],
    *,
    causal: bool = False,
    sm_scale: Optional[float] = None,
    query_transform=None,
    key_transform=None,
    logits_transform=None,
    logits_mask=None,
    output_transform=None,
    use_softmax: bool = True,
) -> Tuple[Tensor, Tensor]:
    """Reference of a custom variant over a ragged batch, hooks given as torch callables.

    ``q`` ``[total_qo, H_qo, D_qk]``; ``k``/``v`` ``[total_kv, H_kv, D]``; request r owns rows
    ``qo_indptr[r]:qo_indptr[r+1]`` of q and ``kv_indptr[r]:kv_indptr[r+1]`` of k/v. Each hook is
    called with keyword tensors broadcastable against its value, named as the C++ variables of
    ``jitattn.variant`` (``q``/``k``/``logits``/``out``, ``dim``, ``request``, ``q_idx``, ``kv_idx``,
    ``qo_len``, ``kv_len``, ``qo_head``, ``kv_head``); ``logits_mask`` returns a bool tensor.
    Shapes: q/out ``[len, H, D]``, logits ``[H_qo, qo_len, kv_len]``.

    Returns ``(o, lse)`` float32; with ``use_softmax=False`` ``o = sum_j w_j v_j`` over visible
    keys and ``lse`` is NaN.
    """
    qo_indptr, kv_indptr = _to_list(qo_indptr), _to_list(kv_indptr)
    h_qo, d_qk = q.shape[1], q.shape[2]
    h_kv, d_vo = k.shape[1], v.shape[2]
    group = h_qo // h_kv
    scale = 1.0 / math.sqrt(d_qk) if sm_scale is None else float(sm_scale)
    dev = q.device
    o_all = torch.zeros(q.shape[0], h_qo, d_vo, dtype=torch.float32, device=dev)
    lse_all = torch.zeros(q.shape[0], h_qo, dtype=torch.float32, device=dev)
    ar = functools.partial(torch.arange, dtype=torch.int64, device=dev)
    for r in range(len(qo_indptr) - 1):
        q0, q1, k0, k1 = qo_indptr[r], qo_indptr[r + 1], kv_indptr[r], kv_indptr[r + 1]
        qo_len, kv_len = q1 - q0, k1 - k0
        if qo_len == 0:
            continue
        qd, kd, vd = q[q0:q1].to(_F64), k[k0:k1].to(_F64), v[k0:k1].to(_F64)
        common = dict(request=r, qo_len=qo_len, kv_len=kv_len)
        if query_transform is not None:
            qd = query_transform(q=qd, dim=ar(d_qk)[None, None, :], q_idx=ar(qo_len)[:, None, None],
                                 qo_head=ar(h_qo)[None, :, None], **common).to(_F64)
        if key_transform is not None:
            kd = key_transform(k=kd, dim=ar(d_qk)[None, None, :], kv_idx=ar(kv_len)[:, None, None],
                               kv_head=ar(h_kv)[None, :, None], **common).to(_F64)
        kd = kd.repeat_interleave(group, dim=1)
        vd = vd.repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", qd, kd) * scale
        qo_head = ar(h_qo)[:, None, None]
        idx = dict(q_idx=ar(qo_len)[None, :, None], kv_idx=ar(kv_len)[None, None, :], qo_head=qo_head,
                   kv_head=qo_head // group, **common)
        allowed = torch.ones(h_qo, qo_len, kv_len, dtype=torch.bool, device=dev)
        if causal:
            allowed &= idx["kv_idx"] <= idx["q_idx"] + (kv_len - qo_len)
        if logits_mask is not None:
            allowed &= logits_mask(logits=logits, **idx).to(torch.bool)
        if logits_transform is not None:
            logits = logits_transform(logits=logits, **idx).to(_F64)
        if use_softmax:
            logits = logits.masked_fill(~allowed, _NEG_INF)
            lse = torch.logsumexp(logits, dim=-1)
            safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            weights = torch.exp(logits - safe[..., None])
        else:
            weights = torch.where(allowed, logits, torch.zeros_like(logits))
            lse = torch.full(logits.shape[:2], float("nan"), dtype=_F64, device=dev)
        out = torch.einsum("hqk,khd->qhd", weights, vd)
        if output_transform is not None:
            out = output_transform(out=out, dim=ar(d_vo)[None, None, :], q_idx=ar(qo_len)[:, None, None],
                                   qo_head=ar(h_qo)[None, :, None], **common).to(_F64)
        o_all[q0:q1] = out.to(torch.float32)
        lse_all[q0:q1] = lse.transpose(0, 1).to(torch.float32)
    return o_all, lse_all

"""Reference attention for one request and for ragged batches (RoPE, ALiBi, soft cap, masks, fp8 scales)."""

from __future__ import annotations

import math
from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from .common import F64, NEG_INF, dequantize, pos_encoding_name, to_list


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
    return torch.tensor(slopes, dtype=F64)


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
    pos = torch.as_tensor(positions, device=x.device).to(F64).reshape(-1)
    if pos.numel() != n:
        raise ValueError(f"positions has {pos.numel()} entries, x has {n} rows")
    xd = x.to(F64)
    half = d // 2
    i = torch.arange(half, dtype=F64, device=x.device)
    inv_freq = 1.0 / (float(rope_theta) ** (2.0 * i / d))
    angle = (pos / float(rope_scale))[:, None] * inv_freq[None, :]  # [n, half]
    cos = torch.cos(angle)[:, None, :]
    sin = torch.sin(angle)[:, None, :]
    x1, x2 = xd[..., :half], xd[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


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
    qo_len, h_qo, d_qk, kv_len, h_kv = _check_qkv(q, k, v)
    group = h_qo // h_kv
    mode = pos_encoding_name(pos_encoding_mode)
    device = q.device

    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(d_qk)
    if logits_soft_cap is not None and float(logits_soft_cap) < 0:
        raise ValueError(f"logits_soft_cap must be >= 0, got {logits_soft_cap}")
    window_left = int(window_left)
    if window_left < -1:
        raise ValueError(f"window_left must be >= -1, got {window_left}")

    qd = q.to(F64)
    kd = dequantize(k, k_scale).to(device)
    vd = dequantize(v, v_scale).to(device)

    q_pos = torch.arange(qo_len, dtype=torch.int64, device=device) + (kv_len - qo_len)
    kv_pos = torch.arange(kv_len, dtype=torch.int64, device=device)

    rel = (kv_pos[None, :] - q_pos[:, None]).to(F64)  # [q, k] = j - p_i
    logits = _logits(qd, kd, q_pos, kv_pos, rel, mode, float(sm_scale), logits_soft_cap, rope_scale, rope_theta, group)
    # GQA: expand kv heads so that query head h reads kv head h // group.
    vd = vd.repeat_interleave(group, dim=1)  # [kv_len, H_qo, D_vo]

    allowed = _allowed(rel, causal, window_left, custom_mask)
    logits = logits.masked_fill(~allowed[None, :, :], NEG_INF)
    lse = torch.logsumexp(logits, dim=-1)  # [H, q]; -inf for empty rows
    safe_lse = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    p = torch.exp(logits - safe_lse[..., None])  # exp(-inf) = 0 on masked keys
    o = torch.einsum("hqk,khd->qhd", p, vd)
    return o.to(torch.float32), lse.transpose(0, 1).contiguous().to(torch.float32)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> Tuple[int, int, int, int, int]:
    """(qo_len, H_qo, D_qk, kv_len, H_kv) of a request's q / k / v, checked against each other."""
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
    return qo_len, h_qo, d_qk, kv_len, h_kv


def _logits(qd: Tensor, kd: Tensor, q_pos: Tensor, kv_pos: Tensor, rel: Tensor, mode: str, sm_scale: float,
            logits_soft_cap: Optional[float], rope_scale: Optional[float], rope_theta: Optional[float],
            group: int) -> Tensor:
    """``[H_qo, qo_len, kv_len]`` float64 logits: RoPE'd q / k (``ROPE_LLAMA``), scaled, ALiBi's bias, soft cap."""
    if mode == "ROPE_LLAMA":
        rs = 1.0 if rope_scale is None else float(rope_scale)
        rt = 1e4 if rope_theta is None else float(rope_theta)
        qd = apply_rope_llama(qd, q_pos, rope_scale=rs, rope_theta=rt)
        kd = apply_rope_llama(kd, kv_pos, rope_scale=rs, rope_theta=rt)
    kd = kd.repeat_interleave(group, dim=1)  # GQA: query head h reads kv head h // group
    logits = torch.einsum("qhd,khd->hqk", qd, kd) * sm_scale  # [H, q, k]
    if mode == "ALIBI":
        slopes = alibi_slopes(qd.shape[1]).to(qd.device)
        logits = logits + slopes[:, None, None] * rel[None, :, :]
    if logits_soft_cap is not None and float(logits_soft_cap) > 0:
        cap = float(logits_soft_cap)
        logits = cap * torch.tanh(logits / cap)
    return logits


def _allowed(rel: Tensor, causal: bool, window_left: int, custom_mask: Optional[Tensor]) -> Tensor:
    """Bool ``[qo_len, kv_len]``: the (query, key) pairs every mask keeps (``rel`` = key position - query's)."""
    qo_len, kv_len = rel.shape
    allowed = torch.ones(qo_len, kv_len, dtype=torch.bool, device=rel.device)
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
        allowed &= custom_mask.to(rel.device)
    return allowed


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
    qo = to_list(qo_indptr)
    kv = to_list(kv_indptr)
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
    lse = torch.full((q.shape[0], h_qo), NEG_INF, dtype=torch.float32, device=q.device)
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

"""Reference of custom attention variants (hooks as torch callables)."""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import torch
from torch import Tensor

from .common import F64, NEG_INF, to_list


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
    qo_indptr, kv_indptr = to_list(qo_indptr), to_list(kv_indptr)
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
        qd, kd, vd = q[q0:q1].to(F64), k[k0:k1].to(F64), v[k0:k1].to(F64)
        common = dict(request=r, qo_len=qo_len, kv_len=kv_len)
        if query_transform is not None:
            qd = query_transform(q=qd, dim=ar(d_qk)[None, None, :], q_idx=ar(qo_len)[:, None, None],
                                 qo_head=ar(h_qo)[None, :, None], **common).to(F64)
        if key_transform is not None:
            kd = key_transform(k=kd, dim=ar(d_qk)[None, None, :], kv_idx=ar(kv_len)[:, None, None],
                               kv_head=ar(h_kv)[None, :, None], **common).to(F64)
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
            logits = logits_transform(logits=logits, **idx).to(F64)
        if use_softmax:
            logits = logits.masked_fill(~allowed, NEG_INF)
            lse = torch.logsumexp(logits, dim=-1)
            safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
            weights = torch.exp(logits - safe[..., None])
        else:
            weights = torch.where(allowed, logits, torch.zeros_like(logits))
            lse = torch.full(logits.shape[:2], float("nan"), dtype=F64, device=dev)
        out = torch.einsum("hqk,khd->qhd", weights, vd)
        if output_transform is not None:
            out = output_transform(out=out, dim=ar(d_vo)[None, None, :], q_idx=ar(qo_len)[:, None, None],
                                   qo_head=ar(h_qo)[None, :, None], **common).to(F64)
        o_all[q0:q1] = out.to(torch.float32)
        lse_all[q0:q1] = lse.transpose(0, 1).to(torch.float32)
    return o_all, lse_all

"""Reference block-sparse attention: FlashInfer's BSR and variable-block patterns as dense masks.

Without ``causal`` a pattern is a dense ``[M, N]`` mask over ordinary attention. ``causal`` follows
FlashInfer's block-sparse wrappers: within each block row, over the selected columns gathered in the
order the pattern lists them, bottom-right aligned (the block row's last query sees them all).
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .attention import single_attention
from .common import to_list


def _column_blocks(N: int, C: int) -> list[Tuple[int, int]]:
    """(first column, width) of each column block; the last one is N's remainder."""
    return [(j * C, min(C, N - j * C)) for j in range(-(-N // C))]


def bsr_dense_mask(indptr: Tensor, indices: Tensor, M: int, N: int, R: int, C: int,
                   mask: Optional[Tensor] = None) -> Tensor:
    """Bool ``[M, N]``: True where the BSR pattern (and ``mask`` ``[nnz, R, C]`` inside each block) attends."""
    ptr, idx = to_list(indptr), to_list(indices)
    cols = _column_blocks(N, C)
    dense = torch.zeros(M, N, dtype=torch.bool)
    for row_block in range(len(ptr) - 1):
        r0 = row_block * R
        rows = min(R, M - r0)
        for b in range(ptr[row_block], ptr[row_block + 1]):
            c0, width = cols[idx[b]]
            block = torch.ones(rows, width, dtype=torch.bool) if mask is None else mask[b, :rows, :width].cpu()
            dense[r0:r0 + rows, c0:c0 + width] = block
    return dense


def block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, indptr: Tensor, indices: Tensor, R: int, C: int, *,
    mask: Optional[Tensor] = None, causal: bool = False, sm_scale: Optional[float] = None,
    logits_soft_cap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """BSR attention of q ``[M, H_qo, D]`` over k/v ``[N, H_kv, D]`` -> (o float32, natural-log lse).

    ``mask`` overrides ``causal`` (as in FlashInfer)."""
    M, N = q.shape[0], k.shape[0]
    options = dict(sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)
    if not causal or mask is not None:
        dense = bsr_dense_mask(indptr, indices, M, N, R, C, mask).to(q.device)
        return single_attention(q, k, v, custom_mask=dense, **options)
    ptr, idx = to_list(indptr), to_list(indices)
    cols = _column_blocks(N, C)
    outs, lses = [], []
    for row_block in range(len(ptr) - 1):
        rows = slice(row_block * R, min(M, (row_block + 1) * R))
        gathered = [torch.arange(cols[j][0], cols[j][0] + cols[j][1]) for j in idx[ptr[row_block]:ptr[row_block + 1]]]
        keys = torch.cat(gathered).to(k.device) if gathered else torch.zeros(0, dtype=torch.int64, device=k.device)
        o, lse = single_attention(q[rows], k[keys], v[keys], causal=True, **options)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def variable_block_sparse_attention(
    q: Tensor, k: Tensor, v: Tensor, block_mask_map: Tensor, block_row_sz: Tensor, block_col_sz: Tensor, *,
    causal: bool = False, sm_scale: Optional[float] = None, logits_soft_cap: Optional[float] = None,
) -> Tuple[Tensor, Tensor]:
    """Per-kv-head variable-block attention of q ``[H_qo, L, D]`` over k/v ``[H_kv, L_kv, D]`` (HND) ->
    (o float32 ``[H_qo, L, D_vo]``, natural-log lse ``[H_qo, L]``). Query head h reads kv head
    ``h // (H_qo // H_kv)`` and that kv head's pattern."""
    heads = k.shape[0]
    group = q.shape[0] // heads
    options = dict(sm_scale=sm_scale, logits_soft_cap=logits_soft_cap)
    outs, lses = [], []
    for h in range(heads):
        q_h = q[h * group:(h + 1) * group].transpose(0, 1)  # [L, group, D]
        k_h, v_h = k[h:h + 1].transpose(0, 1), v[h:h + 1].transpose(0, 1)
        row_sz, col_sz = to_list(block_row_sz[h]), to_list(block_col_sz[h])
        blocks = block_mask_map[h].cpu()
        if not causal:
            dense = blocks.repeat_interleave(torch.tensor(row_sz), dim=0).repeat_interleave(torch.tensor(col_sz), dim=1)
            o, lse = single_attention(q_h, k_h, v_h, custom_mask=dense.to(q.device), **options)
        else:
            col_first = [sum(col_sz[:c]) for c in range(len(col_sz))]
            parts = []
            for r in range(len(row_sz)):
                rows = slice(sum(row_sz[:r]), sum(row_sz[:r + 1]))
                keys = [torch.arange(col_first[c], col_first[c] + col_sz[c]) for c in range(len(col_sz)) if blocks[r, c]]
                keys = torch.cat(keys) if keys else torch.zeros(0, dtype=torch.int64)
                parts.append(single_attention(q_h[rows], k_h[keys.to(k.device)], v_h[keys.to(k.device)], causal=True,
                                              **options))
            o, lse = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        outs.append(o.transpose(0, 1))
        lses.append(lse.transpose(0, 1))
    return torch.cat(outs), torch.cat(lses)

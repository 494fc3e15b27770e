"""One call into an attention module (decode or prefill family, any target).

Wrappers validate their inputs and then call ``launch_attention``; it only
translates tensors into the params struct of ``jitattn.families.attention``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..families.attention import POS_ENCODING_CODES
from ..jit import Module
from ..spec import KVLayout, PosEncoding
from .checks import cpu_threads, stream_handle


@dataclass(frozen=True)
class AttentionScalars:
    """Run-time scalars of one plan (all already defaulted)."""

    causal: bool
    pos_encoding: PosEncoding
    window_left: int
    sm_scale: float
    logits_soft_cap: float  # <= 0: off
    rope_scale: float
    rope_theta: float


def _ptr(tensor: torch.Tensor | None) -> int | None:
    return tensor.data_ptr() if tensor is not None else None


def kv_strides(cache: torch.Tensor, paged: bool, kv_layout: KVLayout) -> tuple[int, int, int]:
    """(stride_page, stride_token, stride_head) in elements of a k or v tensor."""
    if not paged:  # [tokens, heads, dim]
        return 0, cache.stride(0), cache.stride(1)
    if kv_layout is KVLayout.NHD:  # [pages, page_size, heads, dim]
        return cache.stride(0), cache.stride(1), cache.stride(2)
    return cache.stride(0), cache.stride(2), cache.stride(1)  # HND: [pages, heads, page_size, dim]


def launch_attention(
    module: Module, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor | None, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor | None, kv_last_page_len: torch.Tensor | None, page_size: int,
    kv_layout: KVLayout, custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None,
    num_kv_heads: int, scalars: AttentionScalars, k_scale: float = 1.0, v_scale: float = 1.0,
    workspace: torch.Tensor | None = None, split_indptr: torch.Tensor | None = None, kv_chunk_size: int = 0,
) -> None:
    """Launch ``module``'s attention entry on q's device and current stream.

    ``kv_indices is None`` means ragged KV (k/v ``[tokens, heads, dim]``);
    otherwise k/v are 4-D paged tensors in ``kv_layout``.
    """
    if q.is_cuda and q.device.index != torch.cuda.current_device():
        # The module launches on (and reads attributes of) the current device.
        with torch.cuda.device(q.device):
            return launch_attention(
                module, q=q, k=k, v=v, o=o, lse=lse, qo_indptr=qo_indptr, kv_indptr=kv_indptr,
                kv_indices=kv_indices, kv_last_page_len=kv_last_page_len, page_size=page_size,
                kv_layout=kv_layout, custom_mask=custom_mask, mask_indptr=mask_indptr, num_kv_heads=num_kv_heads,
                scalars=scalars, k_scale=k_scale, v_scale=v_scale, workspace=workspace,
                split_indptr=split_indptr, kv_chunk_size=kv_chunk_size,
            )
    paged = kv_indices is not None
    k_page, k_tok, k_head = kv_strides(k, paged, kv_layout)
    v_page, v_tok, v_head = kv_strides(v, paged, kv_layout)
    module.launch(
        "attention", stream_handle(q.device),
        q=_ptr(q), k=_ptr(k), v=_ptr(v), o=_ptr(o), lse=_ptr(lse),
        qo_indptr=_ptr(qo_indptr), kv_indptr=_ptr(kv_indptr), kv_indices=_ptr(kv_indices),
        kv_last_page_len=_ptr(kv_last_page_len), custom_mask=_ptr(custom_mask), mask_indptr=_ptr(mask_indptr),
        batch_size=qo_indptr.shape[0] - 1, num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads,
        head_dim_qk=q.shape[2], head_dim_vo=o.shape[2], page_size=page_size if paged else 1,
        q_stride_n=q.stride(0), q_stride_h=q.stride(1),
        k_stride_page=k_page, k_stride_n=k_tok, k_stride_h=k_head,
        v_stride_page=v_page, v_stride_n=v_tok, v_stride_h=v_head,
        o_stride_n=o.stride(0), o_stride_h=o.stride(1),
        lse_stride_n=lse.stride(0) if lse is not None else 0, lse_stride_h=lse.stride(1) if lse is not None else 0,
        kv_paged=int(paged), causal=int(scalars.causal), pos_encoding=POS_ENCODING_CODES[scalars.pos_encoding.value],
        window_left=scalars.window_left, sm_scale=scalars.sm_scale, logits_soft_cap=scalars.logits_soft_cap,
        rope_rcp_scale=1.0 / scalars.rope_scale, rope_rcp_theta=1.0 / scalars.rope_theta,
        k_scale=k_scale, v_scale=v_scale,
        workspace=_ptr(workspace), workspace_bytes=workspace.numel() * workspace.element_size() if workspace is not None else 0,
        split_indptr=_ptr(split_indptr), kv_chunk_size=kv_chunk_size if split_indptr is not None else 0,
        num_threads=cpu_threads(),
    )

"""One request's k and v (a single-request decode or prefill) checked and seen as a paged cache of one page."""

from __future__ import annotations

import torch

from ..spec import KVLayout

# One request's k / v shape in each layout, as error messages name it.
KV_SHAPES = {KVLayout.NHD: "[kv_len, num_kv_heads, head_dim]", KVLayout.HND: "[num_kv_heads, kv_len, head_dim]"}


def check_single_kv(what: str, k: torch.Tensor, v: torch.Tensor, layout: KVLayout, num_qo_heads: int,
                    head_dim: int) -> tuple[int, int]:
    """One request's k and v (3-D tensors, checked) against each other and q's ``num_qo_heads`` and ``head_dim``: one
    dtype, one kv_len, one head count that divides q's (read in ``layout``: a mistaken layout shows here), k's head
    dim q's (v's may differ). Returns (kv_len, num_kv_heads)."""
    if k.shape[2] != head_dim:
        raise ValueError(f"{what}: q has head_dim {head_dim} but k has {k.shape[2]}; q and k must share it")
    if k.dtype != v.dtype:
        raise TypeError(f"{what}: k is {k.dtype} but v is {v.dtype}; pass k and v of one dtype")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"{what}: k has shape {tuple(k.shape)} but v {tuple(v.shape)}; both are {KV_SHAPES[layout]} "
                         f"({layout.value.upper()}) with the same kv_len and num_kv_heads")
    kv_len, kv_heads = (k.shape[0], k.shape[1]) if layout is KVLayout.NHD else (k.shape[1], k.shape[0])
    if kv_heads == 0 or num_qo_heads % kv_heads:
        raise ValueError(f"{what}: k has shape {tuple(k.shape)}, read as {KV_SHAPES[layout]} (kv_layout="
                         f"'{layout.value.upper()}'): {kv_heads} kv heads, which do not divide q's {num_qo_heads}; "
                         "check kv_layout and the tensors' shapes")
    return kv_len, kv_heads


def single_request_pages(k: torch.Tensor, v: torch.Tensor, layout: KVLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's k/v ``[kv_len, H, D]`` (NHD) / ``[H, kv_len, D]`` (HND) as a cache of one page. With kv_len 0
    the cache is one unreferenced page of one token, so its page size matches the plan's (the kernels read no key of
    it)."""
    token_dim = 0 if layout is KVLayout.NHD else 1
    if k.shape[token_dim] == 0:
        k = k.new_zeros(k.shape[:token_dim] + (1,) + k.shape[token_dim + 1:])
        v = v.new_zeros(v.shape[:token_dim] + (1,) + v.shape[token_dim + 1:])
    return k.unsqueeze(0), v.unsqueeze(0)

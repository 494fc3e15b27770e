"""The paged KV cache formats the wrappers accept, reduced to (k, v) 4-D views.

Accepted (FlashInfer's formats, plus SGLang's token pool):

- one tensor ``[pages, 2, page_size, H_kv, D]`` (NHD) / ``[pages, 2, H_kv, page_size, D]`` (HND);
- a ``(k, v)`` tuple of 4-D tensors ``[pages, page_size, H_kv, D]`` / ``[pages, H_kv, page_size, D]``;
- a ``(k, v)`` tuple of 3-D tensors ``[tokens, H_kv, D]``: page_size 1.

Views are never copied: the kernels take strides.
"""

from __future__ import annotations

import torch

from ..spec import KVLayout
from .checks import check_tensor


def split_paged_kv_cache(
    paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], kv_layout: KVLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v), each a 4-D view in ``kv_layout``."""
    if isinstance(paged_kv_cache, torch.Tensor):
        if paged_kv_cache.dim() != 5 or paged_kv_cache.shape[1] != 2:
            raise ValueError(
                f"paged_kv_cache has shape {tuple(paged_kv_cache.shape)}; a single tensor must be "
                "[pages, 2, page_size, H_kv, D] (NHD) or [pages, 2, H_kv, page_size, D] (HND); "
                "or pass a (k, v) tuple"
            )
        return paged_kv_cache.unbind(1)
    if not isinstance(paged_kv_cache, (tuple, list)):
        raise TypeError(f"paged_kv_cache must be a 5-D tensor or a (k_cache, v_cache) tuple, got "
                        f"{type(paged_kv_cache).__name__}")
    if len(paged_kv_cache) != 2:
        raise ValueError(f"paged_kv_cache as a tuple must be (k_cache, v_cache); got {len(paged_kv_cache)} items")
    k, v = paged_kv_cache
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError("paged_kv_cache tuple must hold two tensors (k_cache, v_cache)")
    if k.dim() != v.dim() or k.dim() not in (3, 4):
        raise ValueError(
            f"k_cache/v_cache have shapes {tuple(k.shape)}/{tuple(v.shape)}; expected 4-D "
            "[pages, page_size, H_kv, D] (NHD) / [pages, H_kv, page_size, D] (HND), or 3-D [tokens, H_kv, D]"
        )
    if k.dim() == 3:  # token pool: page_size 1
        dim = 1 if kv_layout is KVLayout.NHD else 2
        return k.unsqueeze(dim), v.unsqueeze(dim)
    return k, v


def kv_strides(cache: torch.Tensor, paged: bool, kv_layout: KVLayout) -> tuple[int, int, int]:
    """(stride_page, stride_token, stride_head) in elements of a k or v tensor (ragged: stride_page 0)."""
    strides = cache.stride()
    if not paged:  # [tokens, heads, dim]
        return 0, strides[0], strides[1]
    if kv_layout is KVLayout.NHD:  # [pages, page_size, heads, dim]
        return strides[0], strides[1], strides[2]
    return strides[0], strides[2], strides[1]  # HND: [pages, heads, page_size, dim]


def check_kv_tensors(k: torch.Tensor, v: torch.Tensor, dtypes: tuple[torch.dtype, ...]) -> None:
    """k and v views of one cache: the same shape, dtype and device, a supported dtype, rows contiguous."""
    if tuple(k.shape) != tuple(v.shape):
        raise ValueError(f"paged_kv_cache: k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} differ in shape")
    if k.dtype != v.dtype:
        raise TypeError(f"paged_kv_cache: k_cache is {_name(k.dtype)} but v_cache is {_name(v.dtype)}")
    if k.device != v.device:
        raise ValueError(f"paged_kv_cache: k_cache is on {k.device} but v_cache is on {v.device}")
    for name, t in (("k_cache", k), ("v_cache", v)):
        check_tensor(f"paged_kv_cache ({name})", t, dtypes=dtypes)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cache_geometry(k: torch.Tensor, kv_layout: KVLayout) -> tuple[int, int, int, int]:
    """(num_pages, page_size, num_kv_heads, head_dim) of a 4-D k or v view."""
    if kv_layout is KVLayout.NHD:
        pages, page_size, heads, dim = k.shape
    else:
        pages, heads, page_size, dim = k.shape
    return pages, page_size, heads, dim


def check_kv_pair(
    k: torch.Tensor, v: torch.Tensor, kv_layout: KVLayout, *, num_kv_heads: int, head_dim_qk: int,
    head_dim_vo: int, page_size: int | None, dtype: torch.dtype,
) -> int:
    """Validate the (k, v) views against the plan; returns the number of pages."""
    k_pages, k_page_size, k_heads, k_dim = cache_geometry(k, kv_layout)
    v_pages, v_page_size, v_heads, v_dim = cache_geometry(v, kv_layout)
    layout = kv_layout.value.upper()
    if (k_heads, v_heads) != (num_kv_heads, num_kv_heads):
        raise ValueError(f"kv cache has {k_heads} (k) / {v_heads} (v) kv heads ({layout} layout) but the plan has "
                         f"num_kv_heads={num_kv_heads}; check kv_layout and num_kv_heads")
    if k_dim != head_dim_qk or v_dim != head_dim_vo:
        raise ValueError(f"kv cache head dims are k={k_dim}, v={v_dim}; the plan has {head_dim_qk}/{head_dim_vo}")
    if page_size is not None and (k_page_size, v_page_size) != (page_size, page_size):
        raise ValueError(f"kv cache page size is {k_page_size} (k) / {v_page_size} (v) ({layout} layout) but the plan "
                         f"has page_size={page_size} (for a contiguous k/v: their token counts must agree)")
    if k_pages != v_pages:
        raise ValueError(f"k and v caches have different page counts ({k_pages} vs {v_pages})")
    if k.dtype != v.dtype:
        raise TypeError(f"k and v caches have different dtypes ({k.dtype} vs {v.dtype}); keep both in one dtype")
    if k.dtype != dtype:
        raise TypeError(f"kv cache dtype is {k.dtype} but the plan has kv_data_type={dtype}; "
                        "pass kv_data_type to plan()")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("kv cache must be contiguous in its last (head_dim) dimension")
    return k_pages


def hnd_ragged_views(plan, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HND ragged k / v ``[H_kv, total_kv, D]`` as the ``[total_kv, H_kv, D]`` views the kernels read, checked
    against ``plan`` (None: unplanned, run() says so) in the caller's order first, so an error shows the shape the
    caller passed. Under torch.compile the token count is left to the op's check when the graph runs (traced, the
    plan's total_kv would become a guard: a recompile at every plan)."""
    tokens = 0 if plan is None or torch.compiler.is_compiling() else plan.total_kv
    for name, t, dim in (("k", k, plan and plan.head_dim_qk), ("v", v, plan and plan.head_dim_vo)):
        check_tensor(name, t, ndim=3)
        if plan is not None and (t.shape[0] != plan.num_kv_heads or t.shape[2] != dim or t.shape[1] < tokens):
            raise ValueError(f"{name} has shape {tuple(t.shape)}; this wrapper's kv_layout is HND, so {name} is "
                             f"[num_kv_heads={plan.num_kv_heads}, >= {plan.total_kv} tokens, {dim}] (NHD tensors "
                             "need a wrapper built with kv_layout='NHD')")
    return k.transpose(0, 1), v.transpose(0, 1)

"""FlashInfer's older shared-prefix wrappers: one shared prefix in plain tensors plus each request's own paged
KV, merged by LSE (``jitattn.ops.cascade`` exports them, as ``flashinfer.cascade`` does)."""

from __future__ import annotations

import torch

from ..page_table import (check_cache_pool, check_indptr, check_page_table, check_paged_index, positive_int,
                          to_host_int32_many)
from ..runtime.checks import check_planned_dtype, check_tensor, not_planned
from ..runtime.grad import no_backward
from ..runtime.merge import merge_state_in_place
from ..runtime.options import check_flag, f32_scale, number, parse_dtype, parse_kv_layout, resolve_batch_invariant
from ..runtime.wrapper import NotCopyable, workspace_target
from ..spec import KVLayout
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .single_kv import KV_SHAPES
from .prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache

__all__ = ["BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper"]


def check_shared_kv(k_shared: torch.Tensor, v_shared: torch.Tensor, kv_layout: str, num_kv_heads: int) -> None:
    """The shared prefix's k/v against the wrapper's layout and the planned ``num_kv_heads`` (the single prefill
    over them would take their own head count, another GQA grouping, and give a wrong result)."""
    layout = parse_kv_layout(kv_layout)
    heads_dim, len_dim = (1, 0) if layout is KVLayout.NHD else (0, 1)
    for name, t in (("k_shared", k_shared), ("v_shared", v_shared)):
        check_tensor(name, t, ndim=3)
        if t.shape[heads_dim] == num_kv_heads:
            continue
        name_of = layout.value.upper()
        if t.shape[len_dim] == num_kv_heads:  # the other layout's shape
            raise ValueError(f"{name} has shape {tuple(t.shape)}, which does not fit kv_layout {name_of}: this "
                             f"wrapper expects {KV_SHAPES[layout]} (num_kv_heads={num_kv_heads}); transpose it, or "
                             "construct the wrapper with the kv_layout it has")
        raise ValueError(f"{name} has {t.shape[heads_dim]} kv heads; the plan has num_kv_heads={num_kv_heads} "
                         f"({name} is {KV_SHAPES[layout]} for kv_layout {name_of}: shape {tuple(t.shape)})")
    if k_shared.shape[len_dim] != v_shared.shape[len_dim]:
        raise ValueError(f"k_shared has {k_shared.shape[len_dim]} tokens but v_shared has {v_shared.shape[len_dim]}; "
                         "give both the shared prefix's length")


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper(NotCopyable):
    """Decode over a shared prefix kept in plain tensors plus each request's own paged KV (FlashInfer's older API).

    ``forward`` attends every query to ``k_shared``/``v_shared`` (one single-request prefill
    over the batch's queries), decodes over the unique pages, and merges the two states by LSE.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        workspace_target(float_workspace_buffer, type(self).__name__)  # (the inner wrapper would name itself)
        self._kv_layout = kv_layout
        self._batch_decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._num_kv_heads: int | None = None  # the plan's

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        workspace_target(float_workspace_buffer, f"{type(self).__name__}.reset_workspace_buffer")  # in its own name
        self._batch_decode_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self, unique_kv_indptr: torch.Tensor, unique_kv_indices: torch.Tensor, unique_kv_last_page_len: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, data_type: str = "float16", *,
        batch_invariant: bool | None = None,
    ) -> None:
        """Plan the unique (paged) part; ``data_type`` is the q and kv dtype. ``batch_invariant``: as the
        decode wrapper's (the shared part is one prefill, merged with the unique part in a fixed order)."""
        self._num_kv_heads = None  # a plan that raises leaves none
        self._index = check_paged_index(unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len, page_size,
                                        names=("unique_kv_indptr", "unique_kv_indices", "unique_kv_last_page_len"))
        self._batch_decode_wrapper.plan_checked(self._index, num_qo_heads, num_kv_heads, head_dim,
                                                q_data_type=data_type, kv_data_type=data_type,
                                                batch_invariant=batch_invariant)
        self._num_kv_heads = int(num_kv_heads)
        self._data_type = parse_dtype(data_type, "data_type")

    plan = begin_forward

    @no_backward
    def forward(
        self, q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor,
        unique_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """q ``[batch, H_qo, D]``, k/v_shared ``[shared_len, H_kv, D]`` (NHD) / ``[H_kv, shared_len, D]`` (HND)."""
        if self._num_kv_heads is None:  # (before the shared part runs: nothing is computed for a call refused)
            raise not_planned(type(self).__name__, "forward", "begin_forward() once per batch")
        check_shared_kv(k_shared, v_shared, self._kv_layout, self._num_kv_heads)
        check_tensor("q", q, ndim=3)
        check_cache_pool(self._index, unique_kv_cache)  # (the decode wrapper's own check says "indices")
        for name, t in (("q", q), ("k_shared", k_shared), ("v_shared", v_shared)):
            check_planned_dtype(name, t, self._data_type, "data_type")
        out, lse = single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False, kv_layout=self._kv_layout,
                                                return_lse=True)
        unique_out, unique_lse = self._batch_decode_wrapper.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(out, lse, unique_out, unique_lse)
        return out

    run = forward

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper(NotCopyable):
    """Prefill/append over a shared prefix in plain tensors plus each request's own paged KV (FlashInfer's older API).

    The shared prefix precedes every request's own KV, so ``causal`` applies to the unique part only.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        workspace_target(float_workspace_buffer, type(self).__name__)  # (the inner wrapper would name itself)
        self._kv_layout = kv_layout
        self._batch_prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._plan_args: tuple = ()
        self._planned: dict | None = None  # the options the unique part was last planned with

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        workspace_target(float_workspace_buffer, f"{type(self).__name__}.reset_workspace_buffer")  # in its own name
        self._batch_prefill_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
        *, batch_invariant: bool | None = None,
    ) -> None:
        """Check and keep (host copies) the unique part's page table; ``forward`` plans it with the dtypes and options
        it is given, so the caller may refill its arrays for the next batch meanwhile.

        ``batch_invariant`` is accepted and changes nothing (prefill never splits the KV)."""
        self._plan_args, self._planned = (), None  # a begin_forward that raises leaves none
        resolve_batch_invariant(batch_invariant)
        names = ("qo_indptr", "paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")
        arrays = [t.clone() for t in to_host_int32_many(names, (  # one transfer from a GPU
            qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len))]
        num_qo_heads, num_kv_heads, head_dim, page_size = (positive_int(v, n) for v, n in (
            (num_qo_heads, "num_qo_heads"), (num_kv_heads, "num_kv_heads"), (head_dim, "head_dim"),
            (page_size, "page_size")))
        check_indptr(names[0], arrays[0])
        check_page_table(*arrays[1:], page_size, names=names[1:])
        if arrays[0].numel() != arrays[1].numel():
            raise ValueError(f"qo_indptr describes {arrays[0].numel() - 1} requests but paged_kv_indptr "
                             f"{arrays[1].numel() - 1}")
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        self._plan_args = (*arrays, num_qo_heads, num_kv_heads, head_dim, page_size)

    plan = begin_forward

    @no_backward
    def forward(
        self, q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor,
        unique_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], causal: bool = False,
        use_fp16_qk_reduction: bool = False, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None,
    ) -> torch.Tensor:
        """q ``[total_qo, H_qo, D]``; k/v_shared ``[shared_len, H_kv, D]`` (NHD) / ``[H_kv, shared_len, D]`` (HND)."""
        if not self._plan_args:
            raise RuntimeError("BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward() called before "
                               "begin_forward(); call begin_forward() once per batch first")
        check_flag(use_fp16_qk_reduction, "use_fp16_qk_reduction")
        for name, value in (("rope_scale", rope_scale), ("rope_theta", rope_theta)):  # (taken, as FlashInfer's)
            if value is not None and not f32_scale(number(value, name)):
                raise ValueError(f"{name}={value!r} must be a positive finite number (no RoPE is applied here: "
                                 "leave it None)")
        check_tensor("q", q, ndim=3)
        unique_k = unique_kv_cache[0] if isinstance(unique_kv_cache, (tuple, list)) else unique_kv_cache
        check_tensor("unique_kv_cache", unique_k)
        options = dict(causal=causal, sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=unique_k.dtype)
        if options != self._planned:  # plan once per batch and option set, as every layer passes the same
            self._planned = None  # a refused plan leaves the unique part unplanned: the next call plans it again
            self._batch_prefill_wrapper.plan(*self._plan_args, **options)
            self._planned = options
        check_shared_kv(k_shared, v_shared, self._kv_layout, self._plan_args[5])  # [5]: num_kv_heads
        out, lse = single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False, kv_layout=self._kv_layout,
                                                sm_scale=sm_scale, return_lse=True)
        unique_out, unique_lse = self._batch_prefill_wrapper.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(out, lse, unique_out, unique_lse)
        return out

    run = forward

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

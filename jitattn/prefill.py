"""Prefill / append attention over ragged or paged KV (FlashInfer-compatible names and arguments)."""

from __future__ import annotations

import torch

from .attention.batch import AttentionPlan, log_plan, upload
from .attention.wrapper import BatchWrapperBase
from .attention.checks import check_tensor, target_of
from .attention.kv import split_paged_kv_cache
from .attention.options import parse_dtype, parse_kv_layout, parse_pos_encoding, resolve_scalars
from .attention.specs import attention_spec
from .jit import load
from .plan import PagedIndex, SplitPlan, check_indptr, check_paged_index, packed_mask_indptr, segment_packbits
from .variant import AttentionVariant
from .spec import KVLayout, KVStorage, MaskMode, Op, Target

__all__ = [
    "BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper", "single_prefill_with_kv_cache",
]


def _plan_prefill(
    wrapper: str, target: Target, device: torch.device, kv_layout: KVLayout, *, qo_indptr: torch.Tensor,
    kv_indptr_host: torch.Tensor, index: PagedIndex | None, kv_lens: list[int], num_qo_heads: int,
    num_kv_heads: int, head_dim_qk: int, head_dim_vo: int | None, custom_mask: torch.Tensor | None,
    packed_custom_mask: torch.Tensor | None, causal: bool, pos_encoding_mode, sm_scale, window_left,
    logits_soft_cap, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type=None,
    buffers: dict[str, torch.Tensor | None], use_cuda_graph: bool = False, variant: AttentionVariant | None = None,
) -> AttentionPlan:
    """Validate and upload one prefill batch (shared by the paged and ragged wrappers)."""
    head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
    q_dtype = parse_dtype(q_data_type, "q_data_type")
    kv_dtype = parse_dtype(kv_data_type, "kv_data_type") if kv_data_type is not None else q_dtype
    o_dtype = parse_dtype(o_data_type, "o_data_type") if o_data_type is not None else q_dtype
    pos = parse_pos_encoding(pos_encoding_mode)
    qo_host = check_indptr("qo_indptr", qo_indptr)
    qo_lens = (qo_host[1:] - qo_host[:-1]).tolist()
    if len(qo_lens) != len(kv_lens):
        raise ValueError(f"qo_indptr describes {len(qo_lens)} requests but the kv index describes {len(kv_lens)}")
    for r, (q, k) in enumerate(zip(qo_lens, kv_lens)):
        if causal and custom_mask is None and packed_custom_mask is None and q > k:
            raise ValueError(
                f"request {r}: qo_len {q} > kv_len {k} with causal=True; bottom-right causal needs "
                "kv_len >= qo_len (the new tokens' KV must be in the cache)"
            )
    mask_host = mask_indptr_host = None
    if custom_mask is not None:
        mask_host, mask_indptr_host = segment_packbits(custom_mask, qo_lens, kv_lens)
    elif packed_custom_mask is not None:
        check_tensor("packed_custom_mask", packed_custom_mask, ndim=1, dtypes=(torch.uint8,))
        mask_indptr_host = packed_mask_indptr(qo_lens, kv_lens)
        if packed_custom_mask.numel() != int(mask_indptr_host[-1]):
            raise ValueError(
                f"packed_custom_mask has {packed_custom_mask.numel()} bytes; expected {int(mask_indptr_host[-1])} "
                "(each request's qo_len*kv_len bits packed little-endian, starting on a byte)"
            )
        mask_host = packed_custom_mask.detach().to("cpu")
    mask_mode = MaskMode.CUSTOM if mask_host is not None else (MaskMode.CAUSAL if causal else MaskMode.NONE)
    scalars = resolve_scalars(
        head_dim_qk=head_dim_qk, causal=mask_mode is MaskMode.CAUSAL, pos_encoding=pos, window_left=window_left,
        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
    )
    spec = attention_spec(
        Op.PREFILL, target, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype, head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, pos_encoding=pos,
        use_sliding_window=scalars.window_left >= 0, use_logits_soft_cap=scalars.logits_soft_cap > 0,
        mask_mode=mask_mode, kv_layout=kv_layout, kv_storage=KVStorage.PAGED if index else KVStorage.RAGGED,
        variant=variant,
    )
    module = load(spec)
    plan = AttentionPlan(
        spec=spec, module=module, scalars=scalars, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
        page_size=index.page_size if index else None, kv_layout=kv_layout, total_qo=int(qo_host[-1]),
        qo_indptr=upload(qo_host, device, buffers.get("qo_indptr"), "qo_indptr"),
        kv_indptr=upload(kv_indptr_host, device, buffers.get("kv_indptr"), "kv_indptr"),
        kv_indices=upload(index.indices, device, buffers.get("kv_indices"), "kv_indices") if index else None,
        kv_last_page_len=upload(index.last_page_len, device, buffers.get("kv_last_page_len"), "kv_last_page_len")
        if index else None,
        custom_mask=upload(mask_host, device, buffers.get("custom_mask"), "custom_mask") if mask_host is not None else None,
        mask_indptr=upload(mask_indptr_host, device, buffers.get("mask_indptr"), "mask_indptr")
        if mask_indptr_host is not None else None,
        index=index, split=SplitPlan(0, tuple(range(len(kv_lens) + 1))), split_indptr=None,
        total_kv=None if index else int(kv_indptr_host[-1]), use_cuda_graph=use_cuda_graph, wrapper=wrapper,
    )
    log_plan(wrapper, plan, 0)
    return plan


class _PrefillWrapperBase(BatchWrapperBase):
    def workspace_size(
        self, max_batch_size: int, max_qo_tokens: int, max_kv_tokens: int, num_qo_heads: int, num_kv_heads: int,
        head_dim_qk: int, page_size: int = 1, head_dim_vo: int | None = None,
    ) -> tuple[int, int]:
        """(float_bytes, int_bytes) that any plan within these limits needs.

        Prefill does not split the KV, so it needs no float workspace; int_bytes is the
        page table and indptr arrays this wrapper keeps in its own buffers (never in the
        shared float workspace), without a custom mask (add ``ceil(qo_len * kv_len / 8)``
        bytes per request for one).
        """
        max_pages = (max_kv_tokens + page_size - 1) // page_size + max_batch_size
        return 0, 4 * (3 * (max_batch_size + 1) + max_pages)


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapperBase):
    """Batched prefill/append attention: ragged queries over a paged KV cache."""

    _NAME = "BatchPrefillWithPagedKVCacheWrapper"

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None, paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None, mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, {
            "qo_indptr": qo_indptr_buf, "kv_indptr": paged_kv_indptr_buf, "kv_indices": paged_kv_indices_buf,
            "kv_last_page_len": paged_kv_last_page_len_buf, "custom_mask": custom_mask_buf,
            "mask_indptr": mask_indptr_buf,
        }, {"qo_indptr": "qo_indptr_buf", "kv_indptr": "paged_kv_indptr_buf", "kv_indices": "paged_kv_indices_buf",
            "kv_last_page_len": "paged_kv_last_page_len_buf"})

    def plan(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
        page_size: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, sm_scale: float | None = None, window_left: int = -1,
        logits_soft_cap: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None, non_blocking: bool = True,
        prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0,
        max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None, max_token_per_sequence=None,
        max_sequence_kv=None, variant: AttentionVariant | None = None,
    ) -> None:
        """Plan one batch. ``custom_mask`` (bool, flattened per request) overrides ``causal``.

        ``variant`` (a ``jitattn.AttentionVariant``) selects a custom variant; its extra
        parameters are then passed to ``run(..., name=value)``.

        Causal is bottom-right: query i of a request with qo_len q and kv_len k sees kv positions <= k - q + i.
        """
        index = check_paged_index(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                                  names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        self._plan = _plan_prefill(
            self._NAME, self._target, self._device, self._kv_layout, qo_indptr=qo_indptr,
            kv_indptr_host=index.indptr, index=index, kv_lens=list(index.kv_lens), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            buffers=self._buffers, use_cuda_graph=self._use_cuda_graph, variant=variant,
        )

    begin_forward = plan

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
        k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None, return_lse: bool = False, **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[total_qo, num_qo_heads, head_dim_qk]`` -> out ``[total_qo, num_qo_heads, head_dim_vo]`` (and lse).

        ``variant_args``: the planned custom variant's parameters, by name."""
        k, v = split_paged_kv_cache(paged_kv_cache, self._kv_layout)
        return self._run(q, k, v, k_scale, v_scale, out, lse, return_lse, variant_args)



class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapperBase):
    """Batched prefill attention: ragged queries over ragged (contiguous per request) K/V."""

    _NAME = "BatchPrefillWithRaggedKVCacheWrapper"

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None, kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None, mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
    ) -> None:
        if parse_kv_layout(kv_layout) is not KVLayout.NHD:
            raise ValueError("BatchPrefillWithRaggedKVCacheWrapper supports kv_layout='NHD' only ([tokens, heads, dim])")
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, {
            "qo_indptr": qo_indptr_buf, "kv_indptr": kv_indptr_buf, "custom_mask": custom_mask_buf,
            "mask_indptr": mask_indptr_buf,
        }, {"qo_indptr": "qo_indptr_buf", "kv_indptr": "kv_indptr_buf"})

    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
        head_dim_qk: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap: float | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None,
        o_data_type: str | torch.dtype | None = None, non_blocking: bool = True,
        variant: AttentionVariant | None = None,
    ) -> None:
        """Plan one batch; request r's keys are rows ``kv_indptr[r]:kv_indptr[r+1]`` of k/v.

        ``variant``: a custom variant, as in the paged wrapper's ``plan``."""
        kv_host = check_indptr("kv_indptr", kv_indptr)
        self._plan = _plan_prefill(
            self._NAME, self._target, self._device, self._kv_layout, qo_indptr=qo_indptr, kv_indptr_host=kv_host,
            index=None, kv_lens=(kv_host[1:] - kv_host[:-1]).tolist(), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            buffers=self._buffers, use_cuda_graph=self._use_cuda_graph, variant=variant,
        )

    begin_forward = plan

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, k_scale: float | None = None,
        v_scale: float | None = None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
        return_lse: bool = False, **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[total_qo, H_qo, D_qk]``, k ``[total_kv, H_kv, D_qk]``, v ``[total_kv, H_kv, D_vo]`` -> out (and lse).

        ``variant_args``: the planned custom variant's parameters, by name."""
        return self._run(q, k, v, k_scale, v_scale, out, lse, return_lse, variant_args)



def single_prefill_with_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None, causal: bool = False, kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
    window_left: int = -1, logits_soft_cap: float | None = None, rope_scale: float | None = None,
    rope_theta: float | None = None, return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[qo_len, H_qo, D_qk]`` over k/v ``[kv_len, H_kv, D]`` (NHD) or ``[H_kv, kv_len, D]`` (HND)."""
    layout = parse_kv_layout(kv_layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3)
    target_of("single_prefill_with_kv_cache", (q, k, v))
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if layout is KVLayout.NHD else (k.shape[1], k.shape[0])
    if custom_mask is not None and custom_mask.dim() == 2:
        custom_mask = custom_mask.reshape(-1)
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.uint8, device=q.device), kv_layout)
    pages = 1 if kv_len > 0 else 0
    # The whole sequence is one page of page_size kv_len.
    wrapper.plan(
        torch.tensor([0, q.shape[0]], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
        torch.zeros(pages, dtype=torch.int32), torch.tensor([kv_len], dtype=torch.int32), q.shape[1],
        num_kv_heads, q.shape[2], max(kv_len, 1), head_dim_vo=v.shape[2], custom_mask=custom_mask,
        packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
        sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
        rope_theta=rope_theta, q_data_type=q.dtype, kv_data_type=k.dtype,
    )
    return wrapper.run(q, (k.unsqueeze(0), v.unsqueeze(0)), return_lse=return_lse)

"""Decode attention over a paged KV cache (FlashInfer-compatible names and arguments)."""

from __future__ import annotations

import torch

from .attention.batch import AttentionPlan, check_workspace, log_plan, num_sms, upload_int32
from .attention.wrapper import BatchWrapperBase
from .attention.checks import check_tensor, cpu_threads, target_of
from .attention.kv import split_paged_kv_cache
from .attention.options import parse_dtype, parse_kv_layout, parse_pos_encoding, resolve_scalars
from .attention.specs import attention_spec
from .jit import load
from .families.decode import MAX_RESIDENT_BLOCKS, resident_blocks
from .plan import SplitPlan, check_paged_index, max_decode_chunks, plan_decode_split, split_workspace_bytes
from .variant import AttentionVariant
from .spec import KVLayout, KVStorage, MaskMode, Op, Target

__all__ = ["BatchDecodeWithPagedKVCacheWrapper", "single_decode_with_kv_cache"]

_WRAPPER = "BatchDecodeWithPagedKVCacheWrapper"


class BatchDecodeWithPagedKVCacheWrapper(BatchWrapperBase):
    """Batched decode (one query token per request) over a paged KV cache.

    ``plan()`` once per batch (it validates the page table on the host,
    chooses the kernel and the split-KV schedule), then ``run()`` once per
    layer. The target follows ``float_workspace_buffer``'s device.
    """

    _NAME = _WRAPPER

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto",
    ) -> None:
        self._use_tensor_cores = bool(use_tensor_cores)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, {
            "kv_indptr": paged_kv_indptr_buffer, "kv_indices": paged_kv_indices_buffer,
            "kv_last_page_len": paged_kv_last_page_len_buffer,
        }, {"kv_indptr": "paged_kv_indptr_buffer", "kv_indices": "paged_kv_indices_buffer",
            "kv_last_page_len": "paged_kv_last_page_len_buffer"})
        # Under CUDA graphs every array a captured launch reads must keep its address across plans.
        self._own_buffers: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if self._use_cuda_graph:
            rows = paged_kv_indptr_buffer.numel()
            self._own_buffers = tuple(torch.empty(rows, dtype=torch.int32, device=self._device) for _ in range(2))

    def plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
        logits_soft_cap: float | None = None, q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None, data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        non_blocking: bool = True, fixed_split_size: int | None = None, disable_split_kv: bool = False,
        variant: AttentionVariant | None = None,
    ) -> None:
        """Plan decode for one batch.

        ``variant`` (a ``jitattn.AttentionVariant``) selects a custom variant; its extra
        parameters are then passed to ``run(..., name=value)``. A variant without softmax or
        with an output transform is never split over the KV.

        Index arrays are int32, on the host (no device sync) or on the device
        (copied to the host once here). ``data_type`` (deprecated in
        FlashInfer) sets both q and kv dtypes. ``fixed_split_size`` is in pages.
        """
        if data_type is not None:
            q_data_type = kv_data_type = data_type
        q_dtype = parse_dtype(q_data_type, "q_data_type")
        kv_dtype = parse_dtype(kv_data_type, "kv_data_type") if kv_data_type is not None else q_dtype
        pos = parse_pos_encoding(pos_encoding_mode)
        index = check_paged_index(indptr, indices, last_page_len, page_size)
        scalars = resolve_scalars(
            head_dim_qk=head_dim, causal=False, pos_encoding=pos, window_left=window_left,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        )
        spec = attention_spec(
            Op.DECODE, self._target, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=q_dtype, head_dim_qk=head_dim,
            head_dim_vo=head_dim, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, pos_encoding=pos,
            use_sliding_window=scalars.window_left >= 0, use_logits_soft_cap=scalars.logits_soft_cap > 0,
            mask_mode=MaskMode.NONE, kv_layout=self._kv_layout, kv_storage=KVStorage.PAGED, variant=variant,
        )
        if variant is not None and not variant.splittable:
            disable_split_kv = True  # partial states of such a variant cannot be merged by LSE
        if self._use_cuda_graph:
            # Under CUDA graphs the grid must not depend on lengths: no split.
            split = SplitPlan(0, tuple(range(index.batch_size + 1)))
        else:
            # The cpu target runs the same plan; its "SMs" are the OpenMP threads.
            workers = num_sms(self._device.index or 0) if self._target is Target.CUDA else cpu_threads()
            split = plan_decode_split(
                index.kv_lens, num_kv_heads=num_kv_heads, num_sms=workers, page_size=page_size,
                fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                blocks_per_sm=resident_blocks(spec) if self._target is Target.CUDA else 2,
            )
        workspace_bytes = split_workspace_bytes(split.num_chunks, num_qo_heads, head_dim) if split.kv_chunk_size else 0
        check_workspace(self._workspace, workspace_bytes, _WRAPPER)
        if self._use_cuda_graph and self._plan is not None and self._plan.total_qo != index.batch_size:
            raise ValueError(
                f"a use_cuda_graph wrapper keeps its batch size ({self._plan.total_qo}); got {index.batch_size}. "
                "Captured launches have the batch size baked in: use one wrapper per captured batch size"
            )
        module = load(spec)
        device = self._device
        indptr_buf, indices_buf, last_buf = (self._buffers[r] for r in ("kv_indptr", "kv_indices", "kv_last_page_len"))
        qo_indptr_buf, split_indptr_buf = self._own_buffers
        qo_indptr_dev, indptr_dev, indices_dev, last_dev, split_dev = upload_int32([
            ("qo_indptr", torch.arange(index.batch_size + 1, dtype=torch.int32), qo_indptr_buf),
            ("paged_kv_indptr", index.indptr, indptr_buf),
            ("paged_kv_indices", index.indices, indices_buf),
            ("paged_kv_last_page_len", index.last_page_len, last_buf),
            ("split_indptr", torch.tensor(split.split_indptr, dtype=torch.int32), split_indptr_buf),
        ], device)
        self._plan = AttentionPlan(
            spec=spec, module=module, scalars=scalars, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=q_dtype,
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim, head_dim_vo=head_dim,
            page_size=page_size, kv_layout=self._kv_layout, total_qo=index.batch_size,
            qo_indptr=qo_indptr_dev, kv_indptr=indptr_dev, kv_indices=indices_dev, kv_last_page_len=last_dev,
            custom_mask=None, mask_indptr=None, index=index, split=split, split_indptr=split_dev,
            use_cuda_graph=self._use_cuda_graph, wrapper=_WRAPPER,
        )
        log_plan(_WRAPPER, self._plan, workspace_bytes)

    begin_forward = plan

    def workspace_size(
        self, max_batch_size: int, max_kv_tokens: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
        page_size: int, fixed_split_size: int | None = None,
    ) -> tuple[int, int]:
        """(float_bytes, int_bytes) that any plan within these limits needs on this wrapper's device.

        float_bytes is what ``float_workspace_buffer`` must hold (split-KV partial outputs:
        ``chunks * num_qo_heads * (head_dim + 1) * 4``); int_bytes is the plan metadata this
        wrapper keeps in its own buffers (never in the shared float workspace).
        """
        int_bytes = 2 * (max_batch_size + 1) * 4
        workers = num_sms(self._device.index or 0) if self._target is Target.CUDA else cpu_threads()
        chunks = max_decode_chunks(max_batch_size, max_kv_tokens, num_kv_heads=num_kv_heads, num_sms=workers,
                                   page_size=page_size, fixed_split_size=fixed_split_size,
                                   blocks_per_sm=MAX_RESIDENT_BLOCKS)
        return split_workspace_bytes(chunks, num_qo_heads, head_dim), int_bytes

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
        k_scale: float | None = None, v_scale: float | None = None, out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None, return_lse: bool = False, **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode attention: q ``[batch, num_qo_heads, head_dim]`` -> out (and natural-log lse ``[batch, heads]``).

        ``variant_args``: the planned custom variant's parameters, by name.
        """
        k, v = split_paged_kv_cache(paged_kv_cache, self._kv_layout)
        return self._run(q, k, v, k_scale, v_scale, out, lse, return_lse, variant_args)


def single_decode_with_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False, q_scale: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
    sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode one query ``[num_qo_heads, head_dim]`` against k/v ``[kv_len, H_kv, D]`` (NHD) or ``[H_kv, kv_len, D]`` (HND)."""
    layout = parse_kv_layout(kv_layout)
    check_tensor("q", q, ndim=2)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    target_of("single_decode_with_kv_cache", (q, k, v))
    kv_len, num_kv_heads = (k.shape[0], k.shape[1]) if layout is KVLayout.NHD else (k.shape[1], k.shape[0])
    if q_scale is not None:
        sm_scale = (sm_scale if sm_scale is not None else q.shape[-1] ** -0.5) * float(q_scale)
    # Room for the largest split the planner can choose (chunks of >= 256 tokens).
    max_chunks = kv_len // 256 + 2
    workspace = torch.empty(split_workspace_bytes(max_chunks, q.shape[0], v.shape[-1]), dtype=torch.uint8,
                            device=q.device)
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout=kv_layout)
    pages = 1 if kv_len > 0 else 0
    wrapper.plan(
        torch.tensor([0, pages], dtype=torch.int32), torch.zeros(pages, dtype=torch.int32),
        torch.tensor([kv_len], dtype=torch.int32), q.shape[0], num_kv_heads, q.shape[1], max(kv_len, 1),
        pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
        q_data_type=q.dtype, kv_data_type=k.dtype, sm_scale=sm_scale, rope_scale=rope_scale,
        rope_theta=rope_theta,
    )
    # The whole sequence is one page of page_size kv_len.
    result = wrapper.run(q.unsqueeze(0), (k.unsqueeze(0), v.unsqueeze(0)), k_scale=k_scale, v_scale=v_scale,
                         return_lse=return_lse)
    if return_lse:
        return result[0][0], result[1][0]
    return result[0]

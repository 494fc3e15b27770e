"""Prefill / append attention over ragged or paged KV (FlashInfer-compatible names and arguments)."""

from __future__ import annotations

import functools
import threading

import torch

from ..runtime.batch import AttentionPlan, check_sinks
from ..runtime.builder import HostIndex, attention_options, build_plan
from ..runtime.fp8_prefill import is_fp8
from ..runtime.kv import hnd_ragged_views
from ..runtime.kv_upcast import KVUpcast, ragged_indptr
from ..runtime.rope_first import OPERAND_DTYPE, RopeFirst
from ..runtime.wrapper import BatchWrapperBase, drops_plan_on_failure, plan_arguments, returning_lse
from ..runtime.checks import check_tensor, refuse_paged_arguments, stream_capturing, target_of
from ..runtime.grad import no_backward
from ..runtime.compiled import gathered_kv_rows, rope_first_operands
from ..runtime.options import (PAGE_TABLE_HINT, check_flag, hashable, parse_kv_layout, per_tensor_scale,
                                 refuse_unsupported, resolve_batch_invariant, resolve_flag)
from ..page_table import PagedIndex, check_indptr, check_paged_index
from ..kv_split import check_fixed_split_size, check_workspace_limits, unsplit
from ..masks import host_mask, multi_item_mask, packed_mask_indptr, segment_packbits
from ..variant import AttentionVariant
from ..spec import KVLayout, MaskMode, Op, Target
from .prefill_fp8 import single_prefill_fp8
from .prefill_routes import PlanSite, fp8_upcast_route, paged_gather, rope_first_route
from .single_kv import check_single_kv, single_request_pages

__all__ = ["BatchPrefillWithPagedKVCacheWrapper", "BatchPrefillWithRaggedKVCacheWrapper",
           "single_prefill_with_kv_cache", "single_prefill_with_kv_cache_return_lse"]

# The FlashInfer options forward() may change, with their plan() defaults.
_FORWARD_OPTIONS = ("causal", "pos_encoding_mode", "use_fp16_qk_reduction", "window_left", "logits_soft_cap",
                    "sm_scale", "rope_scale", "rope_theta")


def _plan_prefill(
    wrapper: str, target: Target, device: torch.device, kv_layout: KVLayout, *, qo_indptr: torch.Tensor,
    kv_indptr_host: torch.Tensor, index: PagedIndex | None, kv_lens: list[int], num_qo_heads: int,
    num_kv_heads: int, head_dim_qk: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode="NONE",
    sm_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
    rope_scale: float | None = None, rope_theta: float | None = None, q_data_type="float16", kv_data_type=None,
    o_data_type=None, buffers: dict[str, torch.Tensor | None], use_cuda_graph: bool = False,
    variant: AttentionVariant | None = None, multi_item: dict | None = None,
) -> AttentionPlan:
    """Validate and upload one prefill batch (shared by the paged and ragged wrappers). ``multi_item``: FlashInfer's
    multi-item scoring arguments (``prefix_len_ptr``, ``token_pos_in_items_ptr``, ``token_pos_in_items_len``),
    turned into the equivalent custom mask."""
    causal = resolve_flag(causal, "causal")
    qo_host = check_indptr("qo_indptr", qo_indptr)
    qo_lens = (qo_host[1:] - qo_host[:-1]).tolist()
    if len(qo_lens) != len(kv_lens):
        raise ValueError(f"qo_indptr describes {len(qo_lens)} requests but the kv index describes {len(kv_lens)}")
    if multi_item is not None and multi_item.get("prefix_len_ptr") is not None:
        if custom_mask is not None or packed_custom_mask is not None:
            raise ValueError("multi-item scoring (prefix_len_ptr) builds its own mask; do not pass custom_mask too")
        if multi_item.get("token_pos_in_items_ptr") is None:
            raise ValueError("prefix_len_ptr needs token_pos_in_items_ptr (multi-item scoring takes both)")
        custom_mask = multi_item_mask(qo_lens, kv_lens, multi_item["prefix_len_ptr"],
                                      multi_item["token_pos_in_items_ptr"], multi_item["token_pos_in_items_len"])
    elif multi_item is not None and multi_item.get("token_pos_in_items_ptr") is not None:
        raise ValueError("token_pos_in_items_ptr needs prefix_len_ptr (multi-item scoring takes both)")
    mask_host = mask_indptr_host = None
    if packed_custom_mask is not None:  # FlashInfer's precedence: with both given, the packed mask is used
        check_tensor("packed_custom_mask", packed_custom_mask, ndim=1, dtypes=(torch.uint8,))
        mask_indptr_host = packed_mask_indptr(qo_lens, kv_lens)
        if packed_custom_mask.numel() != int(mask_indptr_host[-1]):
            raise ValueError(
                f"packed_custom_mask has {packed_custom_mask.numel()} bytes; expected {int(mask_indptr_host[-1])} "
                "(each request's qo_len*kv_len bits packed little-endian, starting on a byte)"
            )
        mask_host = host_mask("packed_custom_mask", packed_custom_mask)
    elif custom_mask is not None:
        mask_host, mask_indptr_host = segment_packbits(custom_mask, qo_lens, kv_lens)
    mask_mode = MaskMode.CUSTOM if mask_host is not None else (MaskMode.CAUSAL if causal else MaskMode.NONE)
    options = attention_options(
        Op.PREFILL, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
        head_dim_vo=head_dim_vo, q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
        pos_encoding_mode=pos_encoding_mode, mask_mode=mask_mode, window_left=window_left,
        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        variant=variant)
    host = HostIndex(qo_host, kv_indptr_host, index, mask_host, mask_indptr_host)
    return build_plan(wrapper, target, device, kv_layout, options, host, unsplit(len(kv_lens)), buffers, use_cuda_graph)


class _PrefillWrapperBase(BatchWrapperBase):
    _rope: RopeFirst | None = None  # JITATTN_PREFILL_ROPE_FIRST's rotation of the current plan

    def rope_operands(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What the current plan's kernel reads for ragged ``q``, ``k``, ``v``: their rotated f16 copies when the
        plan applies RoPE first (``plan(rope_first=...)``), else the tensors as given."""
        return (q, k, v) if self._rope is None else self._rope(q, k, v)

    def _site(self) -> PlanSite:
        return PlanSite(self._NAME, self._target, self._device, self._use_cuda_graph)

    def workspace_size(
        self, max_batch_size: int, max_qo_tokens: int, max_kv_tokens: int, num_qo_heads: int, num_kv_heads: int,
        head_dim_qk: int, page_size: int = 1, head_dim_vo: int | None = None) -> tuple[int, int]:
        """(float_bytes, int_bytes) that any plan within these limits needs. Prefill does not split the KV, so it
        needs no float workspace; int_bytes is the page table and indptr arrays this wrapper keeps in its own buffers
        (never in the shared float workspace), without a custom mask (add ``ceil(qo_len * kv_len / 8)`` bytes per
        request for one)."""
        check_workspace_limits(max_batch_size=max_batch_size, max_qo_tokens=max_qo_tokens, max_kv_tokens=max_kv_tokens,
                               num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
                               page_size=page_size, head_dim_vo=head_dim_vo)
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
        backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, {
            "qo_indptr": qo_indptr_buf, "kv_indptr": paged_kv_indptr_buf, "kv_indices": paged_kv_indices_buf,
            "kv_last_page_len": paged_kv_last_page_len_buf, "custom_mask": custom_mask_buf,
            "mask_indptr": mask_indptr_buf,
        }, {"qo_indptr": "qo_indptr_buf", "kv_indptr": "paged_kv_indptr_buf", "kv_indices": "paged_kv_indices_buf",
            "kv_last_page_len": "paged_kv_last_page_len_buf"}, jit_args=jit_args, jit_kwargs=jit_kwargs)
        self._upcast: KVUpcast | None = None  # JITATTN_PREFILL_FP8_UPCAST's gather of the current plan

    def kv_rows(self, paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
        """The ragged k / v rows of ``paged_kv_cache`` the current plan reads, when it gathers them (``_upcast``)."""
        return self._upcast(paged_kv_cache)

    @drops_plan_on_failure
    def plan(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
        page_size: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, sm_scale: float | None = None, window_left: int = -1,
        logits_soft_cap: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True, prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None, token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
        seq_lens_q: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
        max_token_per_sequence: int | None = None, max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None, disable_split_kv: bool = False,
        o_data_type: str | torch.dtype | None = None, variant: AttentionVariant | None = None, *,
        batch_invariant: bool | None = None, fp8_upcast: bool | None = None, rope_first: bool | None = None,
    ) -> None:
        """Plan one batch. ``custom_mask`` (bool, flattened per request) overrides ``causal``.

        Causal is bottom-right: query i of a request with qo_len q and kv_len k sees kv positions
        <= k - q + i (with q > k the first q - k queries see none: output 0, LSE -inf). ``prefix_len_ptr``/``token_pos_in_items_ptr``/``token_pos_in_items_len``:
        FlashInfer's multi-item scoring (each item sees the shared prefix and itself, causally;
        ``max_item_len_ptr`` is a speed hint and not needed). ``seq_lens``, ``seq_lens_q``,
        ``block_tables``, ``max_token_per_sequence``, ``max_sequence_kv`` (trtllm-gen inputs) are
        not supported. Prefill never splits the KV, so ``fixed_split_size``/``disable_split_kv``
        change nothing; ``use_fp16_qk_reduction`` and ``non_blocking`` only tune speed.
        ``o_data_type`` (a jitattn extension) sets the output dtype; ``variant`` a custom variant,
        whose parameters then go to ``run(..., name=value)``. ``batch_invariant`` (default
        ``JITATTN_BATCH_INVARIANT``) is accepted and changes nothing: prefill never splits the KV, and
        each tile of a request's queries reduces its keys in one fixed order whatever the batch.
        ``fp8_upcast`` (a jitattn extension; None: ``JITATTN_PREFILL_FP8_UPCAST``): with fp8 KV, each ``run()``
        first reads the batch's pages into a 16-bit ragged K / V (exact; temporary memory of 2 x KV tokens x
        kv heads x head_dim 16-bit values) and runs the 16-bit kernel on it; False keeps the fp8 kernel.
        ``rope_first`` (a jitattn extension; None: ``JITATTN_PREFILL_ROPE_FIRST``): with ``ROPE_LLAMA``, each
        ``run()`` first rotates q and the batch's keys into f16 copies (the pages gathered, as above) and runs the
        kernel without RoPE on them; False keeps RoPE in the kernel.
        """
        self._plan_call = plan_arguments(locals())
        resolve_batch_invariant(batch_invariant)  # validated; prefill is batch-invariant by construction
        if fp8_upcast is not None and not isinstance(fp8_upcast, bool):
            raise TypeError(f"fp8_upcast={fp8_upcast!r} must be True, False or None (None: JITATTN_PREFILL_FP8_UPCAST)")
        refuse_unsupported(f"{self._NAME}.plan", PAGE_TABLE_HINT, seq_lens=seq_lens, seq_lens_q=seq_lens_q,
                           block_tables=block_tables,
                           max_token_per_sequence=max_token_per_sequence, max_sequence_kv=max_sequence_kv)
        check_fixed_split_size(fixed_split_size)
        index = check_paged_index(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size,
                                  names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"))
        options = dict(
            head_dim_vo=head_dim_vo, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, o_data_type=o_data_type, variant=variant,
            multi_item=dict(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                            token_pos_in_items_len=token_pos_in_items_len),
        )
        first = rope_first_route(self._site(), self._rope, qo_indptr, lambda: ragged_indptr(index), num_qo_heads,
                                 num_kv_heads, head_dim_qk, options, rope_first)
        rope = None
        if first is not None:  # the pages gathered into ragged f16 rows, then rotated
            gather = paged_gather(self._site(), self._kv_layout, index, num_kv_heads, head_dim_qk, options,
                                  OPERAND_DTYPE)
            options, rope = first
        else:
            gather = fp8_upcast_route(self._site(), self._kv_layout, index, num_qo_heads, num_kv_heads, head_dim_qk,
                                      options, fp8_upcast)
            if gather is None:
                self.plan_checked(qo_indptr, index, num_qo_heads, num_kv_heads, head_dim_qk, **options)
                return
            options = {**options, "kv_data_type": gather.out_dtype}
        plan = _plan_prefill(
            self._NAME, self._target, self._device, self._kv_layout, qo_indptr=qo_indptr,
            kv_indptr_host=gather.kv_indptr, index=None, kv_lens=list(index.kv_lens), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, buffers=self._buffers,
            use_cuda_graph=self._use_cuda_graph, **options)
        self._plan, self._upcast, self._rope = plan, gather, rope  # together: a plan() that fails drops all three

    def plan_checked(self, qo_indptr: torch.Tensor, index: PagedIndex, num_qo_heads: int, num_kv_heads: int,
                     head_dim_qk: int, **options) -> None:
        """Plan over a page table that is already checked (``plan()``'s, or a cascade level's), with ``plan()``'s
        keyword options."""
        plan = _plan_prefill(
            self._NAME, self._target, self._device, self._kv_layout, qo_indptr=qo_indptr,
            kv_indptr_host=index.indptr, index=index, kv_lens=list(index.kv_lens), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, buffers=self._buffers,
            use_cuda_graph=self._use_cuda_graph, **options,
        )
        self._plan, self._upcast, self._rope = plan, None, None

    begin_forward = plan

    def drop_plan(self) -> None:
        super().drop_plan()
        self._upcast = self._rope = None

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *args,
        q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
        enable_pdl: bool | None = None, window_left: int | None = None, sinks: torch.Tensor | None = None,
        **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[total_qo, num_qo_heads, head_dim_qk]`` -> out ``[total_qo, num_qo_heads, head_dim_vo]`` (and lse).

        ``q_scale``/``k_scale``/``v_scale``: dequantization; ``window_left`` must equal the planned
        one; ``enable_pdl`` only tunes speed. ``sinks``: float32 ``[num_qo_heads]`` attention sinks, as
        in ``BatchDecodeWithPagedKVCacheWrapper.run`` (the lse returned is the keys' alone).
        ``args``/``variant_args``: the planned custom variant's parameters, in declaration order / by name."""
        q, paged_kv_cache = self.kernel_operands(q, paged_kv_cache)
        return self._run(q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, variant_args, args, q_scale,
                         window_left, sinks, enable_pdl)

    run_return_lse = returning_lse(run)

    def kernel_operands(self, q: torch.Tensor, paged_kv_cache):
        """What the plan's kernel reads: the cache's rows gathered (fp8 upcast, RoPE first), rotated (RoPE first)."""
        if self._upcast is not None:
            paged_kv_cache = gathered_kv_rows(self._op_key, self._upcast, paged_kv_cache)
        if self._rope is not None:
            q, k, v = rope_first_operands(self._op_key, self._rope, q, *paged_kv_cache)
            paged_kv_cache = (k, v)
        return q, paged_kv_cache

    def forward(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
        k_scale: float | None = None, v_scale: float | None = None, window_left: int = -1,
        logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, **variant_args,
    ) -> torch.Tensor:
        """Older spelling of ``run``: the options given here replace the planned ones (re-planning if needed);
        ``variant_args``: the planned custom variant's parameters, as ``run`` takes them."""
        options = _forward_options(locals())
        return self._forward(options, (q, paged_kv_cache), dict(k_scale=k_scale, v_scale=v_scale, **variant_args))

    def forward_return_lse(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
        k_scale: float | None = None, v_scale: float | None = None, window_left: int = -1,
        logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, **variant_args,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Older spelling of ``run(..., return_lse=True)``, with ``forward``'s options."""
        options = _forward_options(locals())
        return self._forward(options, (q, paged_kv_cache),
                             dict(k_scale=k_scale, v_scale=v_scale, return_lse=True, **variant_args))


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapperBase):
    """Batched prefill attention: ragged queries over ragged (contiguous per request) K/V.

    k/v are ``[total_kv, H_kv, D]`` (NHD) or ``[H_kv, total_kv, D]`` (HND), used as strided views.
    """

    _NAME = "BatchPrefillWithRaggedKVCacheWrapper"

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None, kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None, mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto", jit_args=None, jit_kwargs=None) -> None:
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, {
            "qo_indptr": qo_indptr_buf, "kv_indptr": kv_indptr_buf, "custom_mask": custom_mask_buf,
            "mask_indptr": mask_indptr_buf,
        }, {"qo_indptr": "qo_indptr_buf", "kv_indptr": "kv_indptr_buf"}, jit_args=jit_args, jit_kwargs=jit_kwargs)
        self._ragged_layout = self._kv_layout
        self._kv_layout = KVLayout.NHD  # HND k/v are passed to the kernel as [tokens, heads, dim] views

    @drops_plan_on_failure
    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
        head_dim_qk: int, head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None, causal: bool = False, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, window_left: int = -1, logits_soft_cap: float | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None,
        non_blocking: bool = True, prefix_len_ptr: torch.Tensor | None = None,
        token_pos_in_items_ptr: torch.Tensor | None = None, token_pos_in_items_len: int = 0,
        max_item_len_ptr: torch.Tensor | None = None, fixed_split_size: int | None = None,
        disable_split_kv: bool = False, o_data_type: str | torch.dtype | None = None,
        variant: AttentionVariant | None = None, *, batch_invariant: bool | None = None,
        rope_first: bool | None = None,
    ) -> None:
        """Plan one batch; request r's keys are rows ``kv_indptr[r]:kv_indptr[r+1]`` of k/v. Options as in the paged
        wrapper's ``plan`` (multi-item scoring, ``batch_invariant`` and ``rope_first`` included)."""
        self._plan_call = plan_arguments(locals())
        resolve_batch_invariant(batch_invariant)  # validated; prefill is batch-invariant by construction
        check_fixed_split_size(fixed_split_size)
        refuse_paged_arguments(self._NAME, num_qo_heads)
        kv_host = check_indptr("kv_indptr", kv_indptr)
        options = dict(
            head_dim_vo=head_dim_vo, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal,
            pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
            logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, o_data_type=o_data_type, variant=variant,
            multi_item=dict(prefix_len_ptr=prefix_len_ptr, token_pos_in_items_ptr=token_pos_in_items_ptr,
                            token_pos_in_items_len=token_pos_in_items_len),
        )
        first = rope_first_route(self._site(), self._rope, qo_indptr, lambda: kv_host, num_qo_heads, num_kv_heads,
                                 head_dim_qk, options, rope_first)
        options, rope = first if first is not None else (options, None)
        plan = _plan_prefill(
            self._NAME, self._target, self._device, self._kv_layout, qo_indptr=qo_indptr, kv_indptr_host=kv_host,
            index=None, kv_lens=(kv_host[1:] - kv_host[:-1]).tolist(), num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, buffers=self._buffers,
            use_cuda_graph=self._use_cuda_graph, **options)
        self._plan, self._rope = plan, rope

    begin_forward = plan

    def drop_plan(self) -> None:
        super().drop_plan()
        self._rope = None

    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None, return_lse: bool = False, enable_pdl: bool | None = None,
        k_scale: float | None = None, v_scale: float | None = None, q_scale: float | None = None,
        window_left: int | None = None, sinks: torch.Tensor | None = None, **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[total_qo, H_qo, D_qk]``, k ``[total_kv, H_kv, D_qk]``, v ``[total_kv, H_kv, D_vo]`` (NHD; HND:
        ``[H_kv, total_kv, D]``) -> out (and lse). ``k_scale``/``v_scale`` (jitattn extensions): fp8
        dequantization. ``sinks`` (a jitattn extension): float32 ``[num_qo_heads]`` attention sinks, as in
        the paged wrapper. ``args``/``variant_args``: the planned custom variant's parameters."""
        k, v = hnd_ragged_views(self._plan, k, v) if self._ragged_layout is KVLayout.HND else (k, v)
        if self._rope is not None:  # RoPE first: the plan is of the rotated copies made here
            q, k, v = rope_first_operands(self._op_key, self._rope, q, k, v)
        return self._run(q, (k, v), k_scale, v_scale, out, lse, return_lse, variant_args, args, q_scale, window_left,
                         sinks, enable_pdl)

    run_return_lse = returning_lse(run)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
        pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, window_left: int = -1,
        logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, **variant_args,
    ) -> torch.Tensor:
        """Older spelling of ``run``: the options given here replace the planned ones (re-planning if needed);
        ``variant_args``: the planned custom variant's parameters, as ``run`` takes them."""
        options = _forward_options(locals())
        return self._forward(options, (q, k, v), variant_args)

    def forward_return_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
        pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, window_left: int = -1,
        logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, **variant_args,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Older spelling of ``run(..., return_lse=True)``, with ``forward``'s options."""
        options = _forward_options(locals())
        return self._forward(options, (q, k, v), dict(return_lse=True, **variant_args))


def _forward_options(arguments: dict) -> dict:
    """The plan-time options among a ``forward()`` call's arguments."""
    return {name: arguments[name] for name in _FORWARD_OPTIONS if name in arguments}


@no_backward
def single_prefill_with_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q: torch.Tensor | float | None = None,
    scale_k: torch.Tensor | float | None = None, scale_v: torch.Tensor | float | None = None,
    o_dtype: torch.dtype | None = None, custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None, causal: bool = False, kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
    window_left: int = -1, logits_soft_cap: float | None = None, rope_scale: float | None = None,
    rope_theta: float | None = None, backend: str = "auto", return_lse: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of q ``[qo_len, H_qo, D_qk]`` over k/v ``[kv_len, H_kv, D]`` (NHD) or ``[H_kv, kv_len, D]`` (HND).

    ``scale_q``/``scale_k``/``scale_v``: per-tensor dequantization scales (``scale_q`` and
    ``scale_k`` multiply ``sm_scale``, ``scale_v`` the output); ``o_dtype`` the output dtype
    (default q's); ``backend`` is accepted for compatibility ("auto", "fa2", "fa3" pick the same kernel).
    ``sinks`` (a jitattn extension): float32 ``[num_qo_heads]`` attention sinks, as in
    ``BatchPrefillWithPagedKVCacheWrapper.run`` (the lse returned is the keys' alone).
    """
    check_flag(use_fp16_qk_reduction, "use_fp16_qk_reduction")
    if is_fp8(q):  # ops/prefill_fp8.py: the sm90 fp8 kernel, or this op over operands converted to 16 bits
        return single_prefill_fp8(
            q, k, v, scale_q, scale_k, scale_v, o_dtype, kv_layout=kv_layout, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
            sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
            rope_theta=rope_theta, return_lse=return_lse, sinks=sinks, single_prefill=single_prefill_with_kv_cache)
    if sinks is not None and isinstance(q, torch.Tensor) and q.dim() == 3:  # errors name this function, not the
        check_sinks("single_prefill_with_kv_cache", sinks, q.shape[1], q.device)  # wrapper under it
    wrapper, kv = plan_single_prefill(
        q, k, v, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask, causal=causal, kv_layout=kv_layout,
        pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
        logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta, o_dtype=o_dtype,
        backend=backend)
    return wrapper.run(q, kv, q_scale=per_tensor_scale(scale_q, "scale_q"),
                       k_scale=per_tensor_scale(scale_k, "scale_k"), v_scale=per_tensor_scale(scale_v, "scale_v"),
                       return_lse=return_lse, sinks=sinks)


def plan_single_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None, causal: bool = False, kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE", sm_scale: float | None = None, window_left: int = -1,
    logits_soft_cap: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
    o_dtype: torch.dtype | None = None, backend: str = "auto",
) -> tuple[BatchPrefillWithPagedKVCacheWrapper, tuple[torch.Tensor, torch.Tensor]]:
    """What ``single_prefill_with_kv_cache`` runs for these tensors and options: a paged prefill wrapper planned
    for one request (shared by calls with equal shapes and options, see ``_single_request_plan``) and k/v as
    its one page; ``wrapper.run(q, kv, ...)`` computes the attention."""
    layout = parse_kv_layout(kv_layout)
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3)
    target_of("single_prefill_with_kv_cache", (q, k, v))
    kv_len, num_kv_heads = check_single_kv("single_prefill_with_kv_cache", k, v, layout, q.shape[1], q.shape[2])
    if isinstance(custom_mask, torch.Tensor) and custom_mask.dim() == 2:
        if tuple(custom_mask.shape) != (q.shape[0], kv_len):
            raise ValueError(f"custom_mask has shape {tuple(custom_mask.shape)}; a 2-D mask must be [qo_len, kv_len] = "
                             f"{(q.shape[0], kv_len)} (True: the key is visible to the query)")
        custom_mask = custom_mask.reshape(-1)
    shape = (q.device, kv_layout, backend, q.shape[0], kv_len, q.shape[1], num_kv_heads, q.shape[2], v.shape[2])
    options = (causal, pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, q.dtype,
               k.dtype, o_dtype)
    if q.is_cuda and stream_capturing():
        raise RuntimeError(
            "single_prefill_with_kv_cache() (also POD's prefill part) is being captured into a CUDA graph, but it "
            "plans its request on every call, which a replay would not repeat; call it outside the capture, or "
            "capture a BatchPrefillWithPagedKVCacheWrapper built with use_cuda_graph=True and planned before it")
    if custom_mask is None and packed_custom_mask is None and hashable(options):
        wrapper = _single_request_plan(threading.get_ident(), *shape, *options)  # see _single_request_plan
    else:
        wrapper = _plan_single_request(*shape, *options, custom_mask=custom_mask, packed_custom_mask=packed_custom_mask)
    return wrapper, single_request_pages(k, v, layout)


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)


def _plan_single_request(device, kv_layout, backend, qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim_qk,
                         head_dim_vo, causal, pos_encoding_mode, sm_scale, window_left, logits_soft_cap, rope_scale,
                         rope_theta, q_dtype, kv_dtype, o_dtype, custom_mask=None, packed_custom_mask=None):
    """A paged prefill wrapper planned for one request whose whole KV is one page of ``kv_len`` tokens."""
    wrapper = BatchPrefillWithPagedKVCacheWrapper(torch.empty(0, dtype=torch.uint8, device=device), kv_layout,
                                                  backend=backend)
    pages = 1 if kv_len > 0 else 0
    wrapper.plan(
        torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
        torch.zeros(pages, dtype=torch.int32), torch.tensor([kv_len], dtype=torch.int32), num_qo_heads,
        num_kv_heads, head_dim_qk, max(kv_len, 1), head_dim_vo=head_dim_vo, custom_mask=custom_mask,
        packed_custom_mask=packed_custom_mask, causal=causal, pos_encoding_mode=pos_encoding_mode,
        sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
        rope_theta=rope_theta, q_data_type=q_dtype, kv_data_type=kv_dtype, o_data_type=o_dtype,
    )
    return wrapper


# Without a mask, the plan of one request depends on its shapes and options alone, so calls with equal ones share a
# planned wrapper: planning costs more host time than the launch (280-350 us against ~60 us on the H200 host), and
# loops call with the same shapes (POD's prefill part, a model's fixed-length prefill). Per thread: a run() writes
# the tensors' addresses into the plan's launch struct. A plan that raises is not kept. A call being captured into
# a CUDA graph is refused before it plans (plan_single_prefill): a cached plan evicted later would leave the graph
# reading freed memory, and a plan made during the capture would upload its arrays inside it.
@functools.lru_cache(maxsize=64)
def _single_request_plan(thread: int, *shape_and_options):
    return _plan_single_request(*shape_and_options)

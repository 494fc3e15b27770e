"""POD attention (FlashInfer's ``flashinfer.pod``): a chunked-prefill batch's prefill and decode parts.

FlashInfer runs both parts in one fused launch (prefill and decode blocks co-resident on the SMs).
Here each part is its own launch of jitattn's wrappers: the prefill part on the (single or paged) prefill
kernels, the decode part on the decode kernel (on the paged prefill kernel when a decode request has several
queries). The two run side by side (``runtime.side_by_side``): the prefill on the share of the SMs its estimated
time needs, the decode kernel on a second stream over the rest; each part's results are the bits its launch
alone gives.

``run`` returns ``(out_p, out_d)``, or with an LSE asked for ``((out_p, out_d), (lse_p, lse_d))`` (FlashInfer's
batch wrapper returns that; its single-prefill wrapper computes the LSE and drops it, here it is returned,
None for a part that did not ask). LSE in natural log (``jitattn.flashinfer``: base 2).
"""

from __future__ import annotations

import dataclasses

import numpy as np

import torch

from ..runtime.wrapper import NotCopyable, host_side, workspace_target
from ..runtime.checks import check_planned_dtype, check_tensor, named_refusals, not_planned
from ..runtime.grad import no_backward
from ..runtime.options import (check_flag, check_flags, number, parse_kv_layout, parse_pos_encoding,
                                 refuse_unsupported, resolve_dtypes, resolve_flag, resolve_window_left)
from .decode import BatchDecodeWithPagedKVCacheWrapper
from ..page_table import check_indptr, check_paged_index
from ..runtime.side_by_side import prefill_blocks, side_by_side
from .prefill import BatchPrefillWithPagedKVCacheWrapper, plan_single_prefill

__all__ = ["BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper"]

_JIT_HINT = "custom kernels are given as plan(..., variant=jitattn.AttentionVariant(...)) on the prefill/decode wrappers"


def _planned_options(pos_encoding_mode, window_left, sm_scale, rope_scale, rope_theta) -> dict:
    """The position / scale options of a plan, parsed (what a run-time repeat of them is compared with)."""
    return dict(pos_encoding_mode=parse_pos_encoding(pos_encoding_mode), window_left=resolve_window_left(window_left),
                sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)


_SCALES = ("sm_scale", "rope_scale", "rope_theta")


def _effective(name: str, value):
    """A decode option as the kernel takes it, for comparing a run's with the plan's: a scale in float32
    (``head_dim ** -0.5`` and ``1 / sqrt(head_dim)`` differ in the last bit of a double)."""
    return float(np.float32(number(value, f"{name}_d"))) if name in _SCALES else value


def _pod_result(out_p, out_d, lse_p, lse_d, with_lse: bool):
    return ((out_p, out_d), (lse_p, lse_d)) if with_lse else (out_p, out_d)


def _check_query(name: str, q: torch.Tensor, plan) -> None:
    """``q`` (``q_p`` or ``q_d``) against its part's plan, named as the caller passed it."""
    check_tensor(name, q, ndim=3)
    check_planned_dtype(name, q, plan.q_dtype, "q_data_type")
    expected = (plan.q_rows, plan.num_qo_heads, plan.head_dim_qk)
    if tuple(q.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(q.shape)}; the plan expects {expected}")


class PODWithPagedKVCacheWrapper(NotCopyable):
    """One prefill request (contiguous k/v, its options given to ``run``) and a decode batch over a paged KV
    cache (planned by ``plan``, FlashInfer's decode ``plan`` arguments), computed together.

    ``run``'s decode options (``*_d``) are the planned ones, as in FlashInfer: given, they must equal
    the plan's (or be the defaults); a decode query sees its whole KV, so ``causal_d`` changes nothing
    and decode masks are refused. ``q_scale``/``k_scale``/``v_scale`` apply to the decode part.
    ``use_fp16_qk_reduction``, ``enable_pdl`` and ``non_blocking`` only tune speed.
    """

    _NAME = "PODWithPagedKVCacheWrapper"

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None, paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None, jit_args=None,
    ) -> None:
        refuse_unsupported(f"{self._NAME}()", _JIT_HINT, jit_args=jit_args)
        workspace_target(float_workspace_buffer, self._NAME)  # (the inner wrapper would name itself)
        self._decode = BatchDecodeWithPagedKVCacheWrapper(
            float_workspace_buffer, kv_layout, use_cuda_graph, paged_kv_indptr_buffer=paged_kv_indptr_buffer,
            paged_kv_indices_buffer=paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer)
        self._planned: dict | None = None  # the decode part's planned options
        self._blocks, self._blocks_for = 0, None  # the prefill part's grid cap and the prefill plan it is for

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._decode.is_cuda_graph_enabled

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        workspace_target(float_workspace_buffer, f"{self._NAME}.reset_workspace_buffer")  # in this wrapper's name
        self._decode.reset_workspace_buffer(float_workspace_buffer)

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

    @host_side
    def plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
        q_data_type: str | torch.dtype | None = "float16", kv_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, non_blocking: bool = True, *, batch_invariant: bool | None = None,
    ) -> None:
        """Plan the decode part (a paged decode batch); ``data_type`` fills only the dtypes not given, as in
        FlashInfer's POD. ``batch_invariant`` (a jitattn extension): the decode part's, as the decode wrapper's
        (the single prefill part is batch-invariant by construction)."""
        check_flag(non_blocking, "non_blocking")
        self._planned, self._blocks_for = None, None
        q_dtype, kv_dtype = resolve_dtypes(q_data_type, kv_data_type, data_type)
        self._decode.plan(indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                          pos_encoding_mode=pos_encoding_mode, window_left=window_left, q_data_type=q_dtype,
                          kv_data_type=kv_dtype, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
                          batch_invariant=batch_invariant)
        self._planned = _planned_options(pos_encoding_mode, window_left, sm_scale, rope_scale, rope_theta)

    begin_forward = plan

    @host_side  # under torch.compile a graph break: the parts' launches compose in Python
    @no_backward
    def run(
        self, q_p: torch.Tensor, k_p: torch.Tensor, v_p: torch.Tensor, q_d: torch.Tensor,
        paged_kv_cache_d: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        custom_mask_p: torch.Tensor | None = None, packed_custom_mask_p: torch.Tensor | None = None,
        causal_p: bool = False, kv_layout_p: str = "NHD", pos_encoding_mode_p: str = "NONE",
        sm_scale_p: float | None = None, window_left_p: int = -1, rope_scale_p: float | None = None,
        rope_theta_p: float | None = None, return_lse_p: bool = False, custom_mask_d: torch.Tensor | None = None,
        packed_custom_mask_d: torch.Tensor | None = None, causal_d: bool = False, kv_layout_d: str = "NHD",
        pos_encoding_mode_d: str = "NONE", sm_scale_d: float | None = None, window_left_d: int = -1,
        rope_scale_d: float | None = None, rope_theta_d: float | None = None, q_scale: float | None = None,
        k_scale: float | None = None, v_scale: float | None = None, return_lse_d: bool = False,
        use_fp16_qk_reduction: bool = False, enable_pdl: bool | None = None, *args,
    ):
        """The prefill request (q_p ``[qo_len, H_qo, D]``, k_p/v_p ``[kv_len, H_kv, D]`` in ``kv_layout_p``) and
        the planned decode batch (q_d ``[batch, H_qo, D]`` over ``paged_kv_cache_d``); see the module for the
        return value."""
        check_flags(enable_pdl=enable_pdl, use_fp16_qk_reduction=use_fp16_qk_reduction)
        if self._planned is None:
            raise not_planned(self._NAME)
        if args:
            raise TypeError(f"{self._NAME}.run() takes no extra positional arguments; got {len(args)}")
        return_lse_p, return_lse_d = resolve_flag(return_lse_p, "return_lse_p"), resolve_flag(return_lse_d,
                                                                                                "return_lse_d")
        self._check_decode_options(custom_mask_d, packed_custom_mask_d, causal_d, kv_layout_d, dict(
            pos_encoding_mode=pos_encoding_mode_d, window_left=window_left_d, sm_scale=sm_scale_d,
            rope_scale=rope_scale_d, rope_theta=rope_theta_d))
        for name, t in (("q_p", q_p), ("k_p", k_p), ("v_p", v_p)):
            check_tensor(name, t, ndim=3)
        _check_query("q_d", q_d, self._decode.current_plan)
        prefill_part = "prefill part (q_p, k_p, v_p)"
        wrapper, kv_p = named_refusals(self._NAME, prefill_part, lambda: plan_single_prefill(
            q_p, k_p, v_p, custom_mask=custom_mask_p, packed_custom_mask=packed_custom_mask_p, causal=causal_p,
            kv_layout=kv_layout_p, pos_encoding_mode=pos_encoding_mode_p, sm_scale=sm_scale_p,
            window_left=window_left_p, rope_scale=rope_scale_p, rope_theta=rope_theta_p))
        launch = wrapper.current_plan.launch
        if self._blocks_for is not wrapper.current_plan:  # a prefill plan's cap is the same on every run()
            self._blocks = prefill_blocks(wrapper.current_plan, [q_p.shape[0]], self._decode.current_plan)
            self._blocks_for = wrapper.current_plan
        blocks = self._blocks

        def run_prefill():
            with launch.grid_at_most(blocks):  # the plan may be shared: capped for this launch only
                return named_refusals(self._NAME, prefill_part,
                                       lambda: wrapper.run(q_p, kv_p, return_lse=return_lse_p))

        prefill, decode = side_by_side(run_prefill, lambda: named_refusals(
            self._NAME, "decode part (q_d, paged_kv_cache_d, indices)", lambda: self._decode.run(
                q_d, paged_kv_cache_d, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse_d)),
            q_p.device)
        out_p, lse_p = prefill if return_lse_p else (prefill, None)
        out_d, lse_d = decode if return_lse_d else (decode, None)
        return _pod_result(out_p, out_d, lse_p, lse_d, return_lse_p or return_lse_d)

    def _check_decode_options(self, custom_mask_d, packed_custom_mask_d, causal_d, kv_layout_d, raw: dict) -> None:
        """The run's decode options (``raw``: as given) against the plan's: the defaults, or what was planned."""
        refuse_unsupported(f"{self._NAME}.run", "a decode query sees its whole KV; leave the decode masks unset",
                           custom_mask_d=custom_mask_d, packed_custom_mask_d=packed_custom_mask_d)
        resolve_flag(causal_d, "causal_d")  # one query at the end of its KV: causal or not, the same keys
        if kv_layout_d != "NHD" and named_refusals(self._NAME, "kv_layout_d", lambda: parse_kv_layout(
                kv_layout_d)) is not self._decode.kv_layout:
            raise ValueError(f"{self._NAME}.run(kv_layout_d={kv_layout_d!r}): the decode cache's layout is the "
                             f"wrapper's ({self._decode.kv_layout.value.upper()}); construct the wrapper with it")
        given, defaults = _planned_options(**raw), _planned_options("NONE", -1, None, None, None)
        scalars = self._decode.current_plan.scalars  # the planned scales with their defaults applied
        planned = {**self._planned, **{name: getattr(scalars, name) for name in _SCALES}}
        differing = [f"{name}_d={raw[name]!r}" for name, value in given.items() if value != defaults[name] and
                     _effective(name, value) != _effective(name, planned[name])]
        if differing:
            raise ValueError(f"{self._NAME}.run({', '.join(differing)}) differs from the plan; the decode part's "
                             "options are planned: pass them to plan()")


class BatchPODWithPagedKVCacheWrapper(NotCopyable):
    """A batch of prefill requests and a batch of decode requests, each over a paged KV cache.

    ``plan`` takes both page tables (and each part's ``qo_indptr``) with shared options; ``run``'s
    ``causal_p`` / ``custom_mask_p`` / ``packed_custom_mask_p`` choose the prefill part's mask (planned on
    the first run that uses them; a mask is planned on every run that passes one). The decode part
    is non-causal, as FlashInfer's: on the decode kernel when every decode request has one query, else
    on the paged prefill kernel. ``q_scale``/``k_scale``/``v_scale`` apply to the decode part.
    """

    _NAME = "BatchPODWithPagedKVCacheWrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        workspace_target(float_workspace_buffer, self._NAME)  # (the inner wrappers would name themselves)
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._decode_kernel = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._decode_queries = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._decode: BatchDecodeWithPagedKVCacheWrapper | BatchPrefillWithPagedKVCacheWrapper | None = None
        self._prefill_batch: tuple | None = None  # (qo_indptr, page table, heads, head_dim, options) of plan()
        self._prefill_mask: tuple | None = None  # the (causal, mask) the prefill part is planned with
        self._prefill_blocks = 0  # the prefill part's grid cap beside the decode part (runtime.side_by_side)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return False

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

    @host_side
    def plan(
        self, qo_indptr_p: torch.Tensor, kv_indptr_p: torch.Tensor, kv_indices_p: torch.Tensor,
        last_page_len_p: torch.Tensor, qo_indptr_d: torch.Tensor, kv_indptr_d: torch.Tensor,
        kv_indices_d: torch.Tensor, last_page_len_d: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
        head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
        q_data_type: str | torch.dtype | None = "float16", kv_data_type: str | torch.dtype | None = None,
        data_type: str | torch.dtype | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, non_blocking: bool = True, *, batch_invariant: bool | None = None,
    ) -> None:
        """Plan the decode part and check the prefill part's batch (planned at ``run`` with its mask);
        ``batch_invariant`` (a jitattn extension): the decode part's, as the decode wrapper's (the prefill part is
        batch-invariant by construction)."""
        check_flag(non_blocking, "non_blocking")
        self._decode = self._prefill_batch = self._prefill_mask = None
        q_dtype, kv_dtype = resolve_dtypes(q_data_type, kv_data_type, data_type)
        options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, sm_scale=sm_scale,
                       rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_dtype, kv_data_type=kv_dtype)
        qo_p = check_indptr("qo_indptr_p", qo_indptr_p)
        index_p = check_paged_index(kv_indptr_p, kv_indices_p, last_page_len_p, page_size,
                                    names=("kv_indptr_p", "kv_indices_p", "last_page_len_p"))
        if qo_p.numel() != index_p.batch_size + 1:
            raise ValueError(f"qo_indptr_p describes {qo_p.numel() - 1} prefill requests but kv_indptr_p "
                             f"{index_p.batch_size}")
        qo_d, kv_d = check_indptr("qo_indptr_d", qo_indptr_d), check_indptr("kv_indptr_d", kv_indptr_d)
        if qo_d.numel() != kv_d.numel():  # else the decode kernel's path would ignore qo_indptr_d
            raise ValueError(f"qo_indptr_d describes {qo_d.numel() - 1} decode requests but kv_indptr_d "
                             f"{kv_d.numel() - 1}; pass one entry per decode request to both")
        check_paged_index(kv_indptr_d, kv_indices_d, last_page_len_d, page_size,  # errors in the caller's names
                          names=("kv_indptr_d", "kv_indices_d", "last_page_len_d"))
        if torch.equal(qo_d, torch.arange(qo_d.numel(), dtype=torch.int32)):  # one query per decode request
            self._decode_kernel.plan(kv_indptr_d, kv_indices_d, last_page_len_d, num_qo_heads, num_kv_heads, head_dim,
                                     page_size, batch_invariant=batch_invariant, **options)
            decode = self._decode_kernel
        else:
            self._decode_queries.plan(qo_d, kv_indptr_d, kv_indices_d, last_page_len_d, num_qo_heads, num_kv_heads,
                                      head_dim, page_size, causal=False, fp8_upcast=False, rope_first=False,
                                      batch_invariant=batch_invariant, **options)
            decode = self._decode_queries
        # copies: the prefill part is planned at run() (with its mask), and the caller may reuse its host arrays
        index_p = dataclasses.replace(index_p, indptr=index_p.indptr.clone(), indices=index_p.indices.clone(),
                                      last_page_len=index_p.last_page_len.clone())
        self._prefill_batch = (qo_p.clone(), index_p, num_qo_heads, num_kv_heads, head_dim, options)
        self._decode = decode

    begin_forward = plan

    @host_side  # under torch.compile a graph break: the parts' launches compose in Python
    @no_backward
    def run(
        self, q_p: torch.Tensor, paged_kv_cache_p: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        q_d: torch.Tensor, paged_kv_cache_d: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        custom_mask_p: torch.Tensor | None = None, packed_custom_mask_p: torch.Tensor | None = None,
        causal_p: bool = False, q_scale: float | None = None, k_scale: float | None = None,
        v_scale: float | None = None, return_lse: bool = False, use_fp16_qk_reduction: bool = False,
        enable_pdl: bool | None = None,
    ):
        """The prefill batch (q_p ``[total_qo_p, H_qo, D]`` over ``paged_kv_cache_p``) and the decode batch (q_d
        over ``paged_kv_cache_d``): ``(out_p, out_d)``, or ``((out_p, out_d), (lse_p, lse_d))`` with
        ``return_lse``."""
        check_flags(enable_pdl=enable_pdl, use_fp16_qk_reduction=use_fp16_qk_reduction)
        if self._decode is None:
            raise not_planned(self._NAME)
        return_lse = resolve_flag(return_lse, "return_lse")
        self._plan_prefill_mask(resolve_flag(causal_p, "causal_p"), custom_mask_p, packed_custom_mask_p)
        _check_query("q_p", q_p, self._prefill.current_plan)
        _check_query("q_d", q_d, self._decode.current_plan)
        launch = self._prefill.current_plan.launch

        def run_prefill():
            with launch.grid_at_most(self._prefill_blocks):
                return named_refusals(self._NAME, "prefill part (q_p, paged_kv_cache_p, kv_indices_p)",
                                       lambda: self._prefill.run(q_p, paged_kv_cache_p, return_lse=return_lse))

        def run_decode():
            return named_refusals(self._NAME, "decode part (q_d, paged_kv_cache_d, kv_indices_d)",
                                   lambda: self._decode.run(q_d, paged_kv_cache_d, q_scale=q_scale, k_scale=k_scale,
                                                            v_scale=v_scale, return_lse=return_lse))

        if self._decode is self._decode_kernel:
            prefill, decode = side_by_side(run_prefill, run_decode, q_p.device)
        else:
            prefill, decode = run_prefill(), run_decode()
        if return_lse:
            return _pod_result(prefill[0], decode[0], prefill[1], decode[1], True)
        return _pod_result(prefill, decode, None, None, False)

    def _plan_prefill_mask(self, causal: bool, custom_mask, packed_custom_mask) -> None:
        """Plan the prefill part with this run's mask (once per ``causal`` value; on every run with a mask)."""
        has_mask = custom_mask is not None or packed_custom_mask is not None
        if not has_mask and self._prefill_mask == (causal, False):
            return
        self._prefill_mask = None
        qo_indptr, index, num_qo_heads, num_kv_heads, head_dim, options = self._prefill_batch
        named_refusals(self._NAME, "prefill part's mask (custom_mask_p, packed_custom_mask_p)",
                        lambda: self._prefill.plan_checked(qo_indptr, index, num_qo_heads, num_kv_heads, head_dim,
                                                           causal=causal, custom_mask=custom_mask,
                                                           packed_custom_mask=packed_custom_mask, **options))
        # Side by side when the decode part is the decode kernel's (a multi-query decode part runs on the
        # prefill kernel, as persistent as the prefill part: then one after the other).
        qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).numpy()
        self._prefill_blocks = (prefill_blocks(self._prefill.current_plan, qo_lens, self._decode.current_plan)
                                if self._decode is self._decode_kernel else 0)
        self._prefill_mask = (causal, has_mask)

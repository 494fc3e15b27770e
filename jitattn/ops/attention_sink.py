"""``BatchAttentionWithAttentionSinkWrapper``: FlashInfer's attention-sink wrapper, by name and arguments.

FlashInfer builds it as a custom variant of its paged prefill wrapper whose ``run`` takes the
sink tensor and ``sm_scale`` positionally (``run(q, kv_cache, sink, sm_scale)``). Here it is the
paged prefill wrapper planned with the sink build of its kernel (``use_sinks``): the sinks are
float32 ``[num_qo_heads]`` natural-log logits on the scale of the scaled logits, the output of
head h is ``o * e^lse / (e^lse + e^sink[h])`` and the lse returned is that of the keys alone.
Every other wrapper takes the same sinks as ``run(..., sinks=...)``.
"""

from __future__ import annotations

import functools

import torch

from ..runtime.grad import no_backward
from ..runtime.options import (check_flag, f32_scale, number, parse_pos_encoding, positive_int, resolve_dtypes,
                               resolve_window_left)
from ..runtime.wrapper import drops_plan_on_failure, returning_lse
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from ..spec import PosEncoding

__all__ = ["BatchAttentionWithAttentionSinkWrapper"]


class BatchAttentionWithAttentionSinkWrapper(BatchPrefillWithPagedKVCacheWrapper):
    """Prefill and decode over a paged KV cache with attention sinks (gpt-oss), FlashInfer-compatible.

    The constructor's ``q_data_type``, ``kv_data_type``, ``head_dim_qk``, ``head_dim_vo`` and
    ``window_left`` name the kernel FlashInfer would build; here ``plan()`` (the paged prefill
    wrapper's) picks the kernel from its own arguments, so they are not needed. A
    ``pos_encoding_mode`` given here applies when ``plan()`` leaves its own at ``"NONE"``;
    ``use_fp16_qk_reduction`` only tunes speed.
    """

    _NAME = "BatchAttentionWithAttentionSinkWrapper"

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None, paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None, paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None, mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto", pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
        q_data_type: torch.dtype = torch.bfloat16, kv_data_type: torch.dtype = torch.bfloat16,
        head_dim_qk: int = 128, head_dim_vo: int = 128, window_left: int = -1,
    ) -> None:
        check_flag(use_fp16_qk_reduction, "use_fp16_qk_reduction")
        # FlashInfer builds its kernel from these; plan() takes them here (checked, so a typo is not silent)
        resolve_dtypes(q_data_type, kv_data_type, None)
        positive_int(head_dim_qk, "head_dim_qk")
        positive_int(head_dim_vo, "head_dim_vo")
        resolve_window_left(window_left)
        super().__init__(
            float_workspace_buffer, kv_layout, use_cuda_graph=use_cuda_graph, qo_indptr_buf=qo_indptr_buf,
            paged_kv_indptr_buf=paged_kv_indptr_buf, paged_kv_indices_buf=paged_kv_indices_buf,
            paged_kv_last_page_len_buf=paged_kv_last_page_len_buf, custom_mask_buf=custom_mask_buf,
            mask_indptr_buf=mask_indptr_buf, backend=backend,
        )
        self._default_pos_encoding = parse_pos_encoding(pos_encoding_mode)

    @drops_plan_on_failure  # the sink build's load too: a plan() that raises leaves none
    @functools.wraps(BatchPrefillWithPagedKVCacheWrapper.plan)  # its signature, for inspect and IDEs
    def plan(self, *args, **kwargs) -> None:
        if self._default_pos_encoding is not PosEncoding.NONE and "pos_encoding_mode" not in kwargs and len(args) < 13:
            kwargs["pos_encoding_mode"] = self._default_pos_encoding
        super().plan(*args, **kwargs)
        self._plan.sink_launch_ready()

    plan.__doc__ = ("The paged prefill wrapper's ``plan`` (the same arguments); the sink build of the kernel is "
                    "loaded here, not at the first run.")
    begin_forward = plan

    @no_backward
    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *args,
        q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
        enable_pdl: bool | None = None, window_left: int | None = None, sinks: torch.Tensor | None = None,
        **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``run(q, paged_kv_cache, sink, sm_scale)`` as FlashInfer's: ``sink`` float32 ``[num_qo_heads]``
        (or ``sinks=`` by keyword); ``sm_scale`` (optional) replaces the planned scale for this call.
        Other arguments as the paged prefill wrapper's ``run``."""
        check_flag(enable_pdl, "enable_pdl")
        if variant_args:
            raise TypeError(f"{self._NAME}.run() got unexpected keyword argument(s) {sorted(variant_args)}")
        if len(args) > 2:
            raise TypeError(f"{self._NAME}.run() takes the sink tensor and sm_scale after the KV cache; got "
                            f"{len(args)} extra positional arguments")
        if args:
            if sinks is not None:
                raise TypeError(f"{self._NAME}.run() got the sinks both by position and by keyword")
            sinks = args[0]
        if sinks is None:
            raise TypeError(f"{self._NAME}.run() needs the sinks: run(q, paged_kv_cache, sinks) "
                            "(float32 [num_qo_heads])")
        if len(args) == 2 and args[1] is not None and self._plan is not None:
            # The scale is a run-time scalar of the kernel: a different one is a factor on q_scale.
            q_scale = (1.0 if q_scale is None else float(q_scale)) * self._scale_factor(args[1])
        q, paged_kv_cache = self.kernel_operands(q, paged_kv_cache)  # (the fp8 upcast or RoPE first, when planned)
        return self._run(q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, {}, (), q_scale, window_left,
                         sinks)

    run_return_lse = returning_lse(run)  # this run (the parent's takes no sink)

    def _scale_factor(self, sm_scale) -> float:
        """``run``'s positional ``sm_scale`` as the factor on the planned scale, checked as ``plan()`` checks its
        ``sm_scale``: a number (a string is a TypeError) within float32's normal range, the factor too."""
        scale = number(sm_scale, "sm_scale")
        if not f32_scale(scale):
            raise ValueError(f"{self._NAME}.run(): sm_scale={sm_scale!r} must be a positive finite number within "
                             "float32's normal range")
        factor = scale / self._plan.scalars.sm_scale
        if not f32_scale(factor):  # the kernel takes it as a factor on the planned scale
            raise ValueError(f"{self._NAME}.run(): sm_scale={sm_scale!r} is too far from the planned sm_scale="
                             f"{self._plan.scalars.sm_scale} (their ratio leaves float32's normal range); pass it "
                             "to plan() instead")
        return factor


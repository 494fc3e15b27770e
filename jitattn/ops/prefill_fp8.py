"""``single_prefill_with_kv_cache`` of an fp8 query: the sm90 tier's fp8 kernel where it runs the call, else the
16-bit kernel over converted operands (``runtime/fp8_prefill.py`` has the semantics of both)."""

from __future__ import annotations

import functools
import threading

import torch

from .. import hardware
from ..kernels import prefill as prefill_family
from ..runtime import fp8_prefill
from ..runtime.checks import stream_capturing
from ..runtime.options import hashable, parse_kv_layout
from ..runtime.specs import attention_spec
from ..spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

__all__ = ["single_prefill_fp8"]


def single_prefill_fp8(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q, scale_k, scale_v,
                       o_dtype: torch.dtype | None, *, kv_layout: str, custom_mask, packed_custom_mask, causal: bool,
                       pos_encoding_mode: str, sm_scale, window_left: int, logits_soft_cap, rope_scale, rope_theta,
                       return_lse: bool, sinks, single_prefill):
    """The attention of fp8 ``q`` over fp8 ``k`` / ``v`` (``single_prefill``: the 16-bit op, for the conversion)."""
    layout = parse_kv_layout(kv_layout)
    options = (custom_mask, packed_custom_mask, causal, pos_encoding_mode, window_left, logits_soft_cap)
    fp8 = fp8_prefill.prepare(q, k, v, scale_q, scale_k, scale_v, o_dtype, layout,
                              keep_fp8=fp8_kernel_runs(q, k, v, layout, *options))
    if fp8.fp8:
        if stream_capturing():  # as the 16-bit path: a cached plan would upload and be evicted under a capture
            raise RuntimeError("single_prefill_with_kv_cache() is being captured into a CUDA graph, but it plans its "
                               "request on every call, which a replay would not repeat; call it outside the capture, "
                               "or capture a BatchPrefillWithRaggedKVCacheWrapper built with use_cuda_graph=True")
        kv_len, kv_heads = (k.shape[0], k.shape[1]) if layout is KVLayout.NHD else (k.shape[1], k.shape[0])
        plan = (q.device, layout, q.shape[0], kv_len, q.shape[1], kv_heads, q.shape[2], bool(causal), pos_encoding_mode,
                sm_scale, window_left, logits_soft_cap, q.dtype, fp8.kernel_o_dtype)
        wrapper = _fp8_plan(threading.get_ident(), *plan) if hashable(plan) else _plan(*plan)
        q_scale, k_scale, v_scale = fp8.scales
        result = wrapper.run(q, k, v, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                             sinks=sinks)
    else:
        result = single_prefill(fp8.q, fp8.k, fp8.v, *fp8.scales, o_dtype=fp8.kernel_o_dtype, custom_mask=custom_mask,
                                packed_custom_mask=packed_custom_mask, causal=causal, kv_layout=kv_layout,
                                pos_encoding_mode=pos_encoding_mode, sm_scale=sm_scale, window_left=window_left,
                                logits_soft_cap=logits_soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
                                return_lse=return_lse, sinks=sinks)
    return fp8.output(result)


def fp8_kernel_runs(q, k, v, layout: KVLayout, custom_mask, packed_custom_mask, causal, pos_encoding_mode,
                    window_left, logits_soft_cap) -> bool:
    """Whether the sm90 fp8 kernel takes this call: a CUDA device of a 9.0a-only arch list, JITATTN_PREFILL_TIER
    not sm80, the spec one the fp8 kernel runs (head_dim 128, ragged, no custom mask, RoPE or ALiBi with a soft
    cap). Its scales may be floats or tensors (read on the device). Bad options are left to the 16-bit call, which
    names them."""
    if not (all(isinstance(x, torch.Tensor) and x.dim() == 3 for x in (q, k, v)) and q.is_cuda
            and q.dtype == k.dtype == v.dtype):
        return False
    if custom_mask is not None or packed_custom_mask is not None or pos_encoding_mode not in ("NONE", "ALIBI"):
        return False
    heads = 1 if layout is KVLayout.NHD else 0
    try:
        spec = attention_spec(
            Op.PREFILL, Target.CUDA, q_dtype=q.dtype, kv_dtype=k.dtype, o_dtype=torch.bfloat16, head_dim_qk=q.shape[2],
            head_dim_vo=v.shape[2], num_qo_heads=q.shape[1], num_kv_heads=k.shape[heads],
            pos_encoding=PosEncoding.ALIBI if pos_encoding_mode == "ALIBI" else PosEncoding.NONE,
            use_sliding_window=isinstance(window_left, int) and window_left >= 0,
            use_logits_soft_cap=bool(logits_soft_cap), mask_mode=MaskMode.CAUSAL if causal else MaskMode.NONE,
            kv_layout=layout, kv_storage=KVStorage.RAGGED)
        archs = hardware.known_arch_list()
        return archs is not None and prefill_family.tier(spec, archs) == "sm90"
    except (ValueError, TypeError):
        return False


# One planned ragged wrapper per thread and shapes / options, as single_prefill_with_kv_cache keeps its 16-bit plans
# (a run() writes the tensors' addresses into its plan's launch struct).
@functools.lru_cache(maxsize=32)
def _fp8_plan(thread: int, *plan):
    return _plan(*plan)


def _plan(device, layout: KVLayout, qo_len: int, kv_len: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
          causal: bool, pos_encoding_mode: str, sm_scale, window_left: int, logits_soft_cap, dtype: torch.dtype,
          o_dtype: torch.dtype):
    """A ragged prefill wrapper planned for one request of fp8 q, k and v."""
    from .prefill import BatchPrefillWithRaggedKVCacheWrapper

    wrapper = BatchPrefillWithRaggedKVCacheWrapper(torch.empty(0, dtype=torch.uint8, device=device),
                                                   layout.value.upper())
    wrapper.plan(torch.tensor([0, qo_len], dtype=torch.int32), torch.tensor([0, kv_len], dtype=torch.int32),
                 num_qo_heads, num_kv_heads, head_dim, causal=causal, pos_encoding_mode=pos_encoding_mode,
                 sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap, q_data_type=dtype,
                 kv_data_type=dtype, o_data_type=o_dtype)
    return wrapper

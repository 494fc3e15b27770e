"""Peer libraries on the same data as a jitattn case (``--peer flashinfer``; skipped when not importable).

FlashInfer runs through its own public wrappers, planned once with the same page table, dtypes and
options, timed like jitattn (``Timer.measure``: median after warm-up, L2 flushed between calls).
Its output is compared with jitattn's (``max_rel_err_vs_jitattn``), so a wrong peer result shows.
MLA rows use FlashInfer's ``BatchMLAPagedAttentionWrapper`` (``run_flashinfer_mla``).
FlashInfer JIT-compiles each variant on first use (seconds per variant), outside the timing.
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from typing import Callable

import torch

from .configs import MLA, Attn
from .inputs import AttnData, indptr_of, plan_kwargs
from .rows import BudgetExceeded, Context, cuda_ok, first_line, rate_of, rel_err

PEERS = ("flashinfer",)


def available(peer: str) -> bool:
    return importlib.util.find_spec(peer) is not None


def flashinfer_unsupported(case: Attn, ctx: Context) -> str | None:
    if not ctx.cuda:
        return "FlashInfer needs CUDA"
    if not available("flashinfer"):
        return "flashinfer is not installed"
    if case.sinks:
        return "FlashInfer 0.5.3 has sinks only as a sm80 prefill variant or trtllm-gen: compared with the plain kernel"
    if case.batch_invariant:
        return "batch-invariant mode: compared with the plain kernel"
    if case.dtype != "bf16" and case.dtype != "f16":
        return f"FlashInfer takes no {case.dtype} queries"
    if case.dim_vo != case.head_dim:
        return "head_dim_vo != head_dim: not wired for FlashInfer's wrappers here"
    if case.head_dim not in (64, 128, 256):
        # 0.5.3 on the H200: wrong output at head_dim 96, and an illegal memory access on the
        # tensor-core decode path (which leaves the CUDA context unusable for the rest of the run)
        return f"FlashInfer 0.5.3 is not correct at head_dim {case.head_dim}"
    return None


def _flashinfer_call(data: AttnData, workspace: torch.Tensor):
    """Plan FlashInfer's wrapper for the case once; the returned callable runs one step into a fresh output."""
    import flashinfer

    case = data.case
    options = plan_kwargs(case)
    options.pop("batch_invariant")  # jitattn's keyword (always False here: see flashinfer_unsupported)
    out = torch.empty_like(data.out)
    if case.op == "decode":
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
        t = data.table
        wrapper.plan(t.indptr.cuda(), t.indices.cuda(), t.last.cuda(), case.num_qo_heads, case.num_kv_heads,
                     case.head_dim, case.page_size, **options)
        return lambda: wrapper.run(data.q, data.cache, out=out), out
    qo_indptr = indptr_of(list(case.queries)).cuda()
    if data.custom_mask is not None:  # the same flat bool mask jitattn plans with
        options["custom_mask"] = data.custom_mask.cuda()
    if case.storage == "paged":
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        t = data.table
        wrapper.plan(qo_indptr, t.indptr.cuda(), t.indices.cuda(), t.last.cuda(), case.num_qo_heads,
                     case.num_kv_heads, case.head_dim, case.page_size, causal=case.causal, **options)
        return lambda: wrapper.run(data.q, data.cache, out=out), out
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(qo_indptr, indptr_of(list(case.kv_lens)).cuda(), case.num_qo_heads, case.num_kv_heads,
                 case.head_dim, causal=case.causal, **options)
    return lambda: wrapper.run(data.q, data.k, data.v, out=out), out


def measure_flashinfer(case, ctx: Context, build: Callable[[], Callable], jit_out: list[torch.Tensor],
                       jit_time_us: float | None, before: Callable[[], None] | None = None) -> dict:
    """FlashInfer's call ``build()`` returns, on jitattn's data: checked once (after ``before()``, which restores
    in-place inputs) against jitattn's outputs ``jit_out``, then timed as jitattn's row was.
    {time_us, rate, fraction, speedup (FlashInfer time / jitattn time), max_rel_err_vs_jitattn} | {error}."""
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(tempfile.gettempdir(), "flashinfer-bench"))
    try:
        ctx.check_budget("FlashInfer")
        fn = build()
        if before is not None:
            before()
        out = fn()
        ctx.sync()
        err = rel_err(list(out) if isinstance(out, (tuple, list)) else [out], jit_out)
        timing = ctx.timer.measure(fn, ctx.measure_s)
        rate, unit, _, fraction = rate_of(case.kind, case.bytes, getattr(case, "flops", None), timing.median_us,
                                          ctx.ceilings, getattr(case, "ceiling", None))
        return {
            "time_us": timing.median_us, "timing": timing.to_dict(), "rate": rate, "rate_unit": unit,
            "fraction": fraction, "max_rel_err_vs_jitattn": err,
            "speedup": (timing.median_us / jit_time_us) if jit_time_us else None,
        }
    except BudgetExceeded as exc:
        return {"error": str(exc)}
    except Exception as exc:  # the row keeps jitattn's numbers; a broken context is noticed after the case
        return {"error": first_line(exc) + ("" if not ctx.cuda or cuda_ok() else " (the CUDA context is unusable)")}


def run_flashinfer(case: Attn, data: AttnData, ctx: Context, jit_time_us: float | None) -> dict:
    """FlashInfer's wrapper on the case's data (:func:`measure_flashinfer`) | {n/a}."""
    why = flashinfer_unsupported(case, ctx)
    if why is not None:
        return {"n/a": why}

    def build():
        fn, _ = _flashinfer_call(data, torch.empty(256 << 20, dtype=torch.uint8, device=ctx.device))
        return fn

    return measure_flashinfer(case, ctx, build, [data.out], jit_time_us)


def flashinfer_mla_unsupported(case: MLA, ctx: Context) -> str | None:
    if not ctx.cuda:
        return "FlashInfer needs CUDA"
    if not available("flashinfer"):
        return "flashinfer is not installed"
    if case.cache_dtype != case.dtype:
        return "FlashInfer 0.5.3's BatchMLAPagedAttentionWrapper takes no fp8 dequantization scales"
    return None


def run_flashinfer_mla(case: MLA, tensors: tuple, jit_out: torch.Tensor, ctx: Context,
                       jit_time_us: float | None) -> dict:
    """FlashInfer's ``BatchMLAPagedAttentionWrapper`` on jitattn's data (``tensors``: qo_indptr, kv_indptr,
    kv_indices, kv_len_arr on the host, then q_nope, q_pe, ckv, kpe); result shaped as ``run_flashinfer``'s."""
    why = flashinfer_mla_unsupported(case, ctx)
    if why is not None:
        return {"n/a": why}
    os.environ.setdefault("FLASHINFER_WORKSPACE_BASE", os.path.join(tempfile.gettempdir(), "flashinfer-bench"))
    try:
        import flashinfer

        ctx.check_budget("FlashInfer")
        qo_indptr, kv_indptr, kv_indices, kv_lens, q_nope, q_pe, ckv, kpe = tensors
        wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(
            torch.empty(256 << 20, dtype=torch.uint8, device=ctx.device))
        wrapper.plan(qo_indptr.cuda(), kv_indptr.cuda(), kv_indices.cuda(), kv_lens.cuda(), case.num_heads,
                     case.ckv_dim, case.kpe_dim, case.page_size, case.q_len > 1, 1.0 / math.sqrt(192), q_nope.dtype,
                     ckv.dtype)
        out = torch.empty_like(jit_out)

        def fn():
            return wrapper.run(q_nope, q_pe, ckv, kpe, out=out)

        fn()
        ctx.sync()
        err = rel_err([out], [jit_out])
        timing = ctx.timer.measure(fn, ctx.measure_s)
        rate, unit, _, fraction = rate_of(case.kind, case.bytes, case.flops, timing.median_us, ctx.ceilings)
        seconds = timing.median_us * 1e-6
        return {
            "time_us": timing.median_us, "timing": timing.to_dict(), "rate": rate, "rate_unit": unit,
            "fraction": fraction, "max_rel_err_vs_jitattn": err,
            "tflops": case.flops / seconds / 1e12, "tb_per_s": case.bytes / seconds / 1e12,
            "speedup": (timing.median_us / jit_time_us) if jit_time_us else None,
        }
    except BudgetExceeded as exc:
        return {"error": str(exc)}
    except Exception as exc:  # the row keeps jitattn's numbers
        return {"error": first_line(exc) + ("" if cuda_ok() else " (the CUDA context is unusable)")}

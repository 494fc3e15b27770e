"""Multi-head latent attention (DeepSeek-style MLA) over a paged latent cache, FlashInfer-compatible.

With weight absorption every query head attends over one latent head per token: keys are the
compressed KV ``ckv`` (512 wide) joined with the rope part ``kpe`` (64), values are ``ckv``. That
is attention with head_dim_qk = ckv + kpe, head_dim_vo = ckv and a single KV head, which the
paged prefill kernels compute (decode is a prefill with one query per request; speculative
multi-token decode and chunked prefill are more queries per request, ``causal`` bottom-right).

Keys need ``ckv`` and ``kpe`` side by side: pass them as slices of one ``[pages, page_size,
ckv + kpe]`` buffer (``ckv = buf[..., :512]``, ``kpe = buf[..., 512:]``) and nothing is copied;
separate tensors are joined into a temporary key cache on every ``run()`` (correct, slower).
An fp8 (e4m3/e5m2) latent cache is dequantized with per-tensor ``k_scale`` (keys: ckv and kpe,
which must share one scale) and ``v_scale`` (values, i.e. ckv again), keyword-only jitattn
extensions of ``run()`` as on the other wrappers (FlashInfer 0.5.3's MLA takes none).

CUDA graphs: ``use_cuda_graph=True`` with the fixed ``qo_indptr``, ``kv_indptr``, ``kv_indices`` and
``kv_len_arr`` buffers (FlashInfer's), sized for the largest batch; every ``plan()`` refills them (the
last-page lengths the kernels read live in a buffer of ``kv_len_arr``'s size the wrapper owns), so a
captured ``run()`` replays the latest plan of the same batch size and total query count. On the sm90 MLA
kernel the arrays the kernel reads are the wrapper's own instead (only ``kv_len_arr`` is refilled among the
caller's): the first plan sizes fixed device arrays for the work list and the index arrays
(``mla_kernel.GraphArrays``: the capacity any lengths of that batch shape can need, padded with items the
kernel skips), which every plan rewrites on the current stream; a later plan of another batch size, query
count, head count, page size, ``causal`` or ``sm_scale`` is refused.

Kernels: on an H100/H200 (a 9.0a arch list) a plan with a 16-bit or fp8 latent cache of ckv 512 / kpe 64 runs
the dedicated MLA kernel (``jitattn.runtime.mla_kernel``: the heads of a request packed into the rows of one wgmma
tile, the latent KV tile loaded once for all of them, split-KV for small batches), CUDA graphs included;
everything else -- the cpu target, other GPUs -- runs the paged prefill kernels. ``JITATTN_MLA_KERNEL=prefill``
forces the prefill kernels (``sm90``: the MLA kernel or an error). Tensors the MLA kernel cannot read in
place (rows not on 16 bytes, e.g. an fp8 cache with 8-byte-aligned rows, or ``out`` rows not on 4) make that
``run()`` take the prefill kernels (planned once, at the first such run) under ``auto`` without CUDA graphs;
``sm90`` and CUDA-graph wrappers raise instead.
"""

from __future__ import annotations

import numbers

import numpy as np
import torch

from ..runtime.checks import check_tensor, not_planned, refuse_written_over, stream_capturing
from ..runtime.grad import claim_outputs, no_backward
from ..runtime.compiled import mla_run_compiled, register_wrapper
from ..runtime.options import (
    f32_scale, fp8_scale, parse_dtype, positive_int, refuse_unsupported, resolve_batch_invariant, resolve_flag,
)
from ..log import logger
from ..env import mla_kernel as mla_kernel_choice
from ..hardware import num_sms
from ..kernels.mla import CKV_DIM
from ..runtime.wrapper import NotCopyable, host_side, returning_lse
from ..runtime.mla_kernel import GraphArrays, KernelPlan, device_facts, layout_problem, select_kernel, unsupported_reason
from ..kernels.mla_plan import workspace_row_bytes
from ..page_table import check_indptr, check_page_table, to_host_int32
from ..spec import check_head_dims
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["BatchMLAPagedAttentionWrapper"]

_NAME = "BatchMLAPagedAttentionWrapper"


class _LatentPrefill(BatchPrefillWithPagedKVCacheWrapper):
    """The paged prefill wrapper the MLA wrapper plans and runs on; its errors name the MLA wrapper."""

    _NAME = _NAME


def _check_plan_scalars(num_heads, head_dim_ckv, head_dim_kpe, sm_scale, causal) -> None:
    for name, value in (("num_heads", num_heads), ("head_dim_ckv", head_dim_ckv), ("head_dim_kpe", head_dim_kpe)):
        positive_int(value, name)
    try:  # the attention runs with head_dim_qk = ckv + kpe and head_dim_vo = ckv
        check_head_dims(int(head_dim_ckv) + int(head_dim_kpe), int(head_dim_ckv))
    except ValueError:
        raise ValueError(f"head_dim_ckv={head_dim_ckv}, head_dim_kpe={head_dim_kpe} is not supported: MLA runs on "
                         "head_dim_ckv 512 with head_dim_kpe 64 (DeepSeek-V2 / V3), or on pairs whose sum and ckv "
                         "make a supported prefill shape (ckv 128 with kpe 64)") from None
    # a normal float32, as every op's sm_scale: the kernels hold it in float32 (1e-300 would be 0 there)
    if not isinstance(sm_scale, numbers.Real) or isinstance(sm_scale, bool) or not f32_scale(float(sm_scale)):
        raise ValueError(f"sm_scale={sm_scale!r} must be a positive finite float within float32's normal range "
                         "(MLA: e.g. 1/sqrt(192))")
    resolve_flag(causal, "causal")


class BatchMLAPagedAttentionWrapper(NotCopyable):
    """MLA attention: queries ``q_nope`` ``[tokens, heads, ckv]`` and ``q_pe`` ``[tokens, heads, kpe]`` over a
    paged latent cache ``ckv_cache`` ``[pages, page_size, ckv]``, ``kpe_cache`` ``[pages, page_size, kpe]``.

    ``plan()`` once per batch (``kv_len_arr`` gives each request's KV length; ``kv_indptr`` /
    ``kv_indices`` its pages), ``run()`` once per layer. The LSE is the natural log, as everywhere
    in jitattn (``return_lse_base_on_e`` is accepted and changes nothing).
    """

    def __init__(
        self, float_workspace_buffer: torch.Tensor, use_cuda_graph: bool = False,
        qo_indptr: torch.Tensor | None = None, kv_indptr: torch.Tensor | None = None,
        kv_indices: torch.Tensor | None = None, kv_len_arr: torch.Tensor | None = None, backend: str = "auto",
    ) -> None:
        use_cuda_graph = resolve_flag(use_cuda_graph, "use_cuda_graph")
        if use_cuda_graph:
            for name, buffer in (("qo_indptr", qo_indptr), ("kv_indptr", kv_indptr), ("kv_indices", kv_indices),
                                 ("kv_len_arr", kv_len_arr)):
                if buffer is None:
                    raise ValueError(f"use_cuda_graph=True needs the fixed buffer {name} (sized for the largest batch)")
                if not isinstance(buffer, torch.Tensor) or buffer.dim() != 1 or buffer.dtype != torch.int32:
                    raise ValueError(f"{name} buffer must be a 1-D int32 tensor (sized for the largest batch); got "
                                     f"{_describe(buffer)}")
                if not buffer.is_contiguous():
                    raise ValueError(f"{name} buffer (strides {tuple(buffer.stride())}) is not contiguous: the kernels "
                                     "read it packed; allocate it with torch.empty")
                if isinstance(float_workspace_buffer, torch.Tensor) and buffer.device != float_workspace_buffer.device:
                    raise ValueError(f"{name} buffer is on {buffer.device} but float_workspace_buffer is on "
                                     f"{float_workspace_buffer.device}; allocate the fixed buffers on the same device")
        # The last-page lengths the kernels read are derived from kv_len_arr: a buffer of the same size.
        last_page_buffer = torch.empty_like(kv_len_arr) if use_cuda_graph else None
        self._kv_len_arr_buf = kv_len_arr if use_cuda_graph else None
        self._graph_buffers = (dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                                    kv_len_arr=kv_len_arr) if use_cuda_graph else {})
        self._inner = _LatentPrefill(
            float_workspace_buffer, "NHD", use_cuda_graph=use_cuda_graph, qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=kv_indptr, paged_kv_indices_buf=kv_indices,
            paged_kv_last_page_len_buf=last_page_buffer, backend=backend,
        )
        self._workspace = float_workspace_buffer
        self._use_cuda_graph = use_cuda_graph
        self._dims: tuple[int, int] | None = None  # (head_dim_ckv, head_dim_kpe) of the plan
        self._page_size = 0  # the plan's
        self._rows: tuple[int, int] = (0, 0)  # (total query tokens, num_heads) of the plan
        self._kernel: KernelPlan | None = None  # the sm90 MLA kernel's plan, None: the prefill kernels'
        self._highest_page = -1  # the highest page the sm90 plan reads (checked against the cache at run)
        self._readable_strides: tuple | None = None  # strides of the last tensors the sm90 kernel could read
        self._launched: tuple | None = None  # _signature of the last run() this plan's sm90 kernel launched
        self._prefill_args: dict | None = None  # an sm90 plan's arguments for the prefill kernels (run()'s fallback)
        self._graph_arrays: GraphArrays | None = None  # use_cuda_graph: the sm90 plans' fixed memory (first plan)
        self._graph_kernel: str | None = None  # use_cuda_graph: the kernel of the first plan, which a capture keeps
        self._op_key = register_wrapper(self)  # the compiled run()'s handle on this wrapper (runtime.compiled)

    @property
    def kernel(self) -> str:
        """The kernel the last plan runs on: ``"sm90"`` (the dedicated MLA kernel) or ``"prefill"``."""
        return "sm90" if self._kernel is not None else "prefill"

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._inner.is_cuda_graph_enabled

    @host_side
    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len_arr: torch.Tensor,
        num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int, causal: bool, sm_scale: float,
        q_data_type: str | torch.dtype, kv_data_type: str | torch.dtype, use_profiler: bool = False, *,
        batch_invariant: bool | None = None,
    ) -> None:
        """Plan one batch. ``sm_scale`` is required (MLA scales by the pre-absorption head dim, e.g. 1/sqrt(192)).

        The batch size is ``qo_indptr``'s (``len(qo_indptr) - 1``); ``kv_indptr`` and ``kv_len_arr`` may be
        longer (fixed buffers sized for the largest batch, as FlashInfer takes them) and are read up to it.

        ``batch_invariant`` (default ``JITATTN_BATCH_INVARIANT``): the sm90 MLA kernel then never splits a
        request's KV (its split depends on the batch), so each request's bits are those it gets alone; the
        prefill kernels never split it anyway."""
        # Unplanned until this plan succeeds: a plan() that raises leaves none (run() would run the last batch's).
        # A refused batch leaves the fixed buffers as they were (checked before anything is written).
        self._kernel, self._dims, self._prefill_args = None, None, None
        self._launched = None
        invariant = resolve_batch_invariant(batch_invariant)
        refuse_unsupported(f"{_NAME}.plan", "leave use_profiler off", use_profiler=use_profiler or None)
        # for both kernels (the prefill kernels would take a None sm_scale as 1/sqrt(576))
        _check_plan_scalars(num_heads, head_dim_ckv, head_dim_kpe, sm_scale, causal)
        num_heads, head_dim_ckv, head_dim_kpe = int(num_heads), int(head_dim_ckv), int(head_dim_kpe)  # numpy ints too
        sm_scale, causal = float(sm_scale), bool(causal)  # numpy bools / 0 / 1 (checked above) as a bool
        qo_indptr = to_host_int32("qo_indptr", qo_indptr)
        indptr, lens = _batch_prefixes(qo_indptr, to_host_int32("kv_indptr", kv_indptr),
                                       to_host_int32("kv_len_arr", kv_len_arr))
        kv_indices = to_host_int32("kv_indices", kv_indices)
        page_size = positive_int(page_size, "page_size")
        # For both kernels, in this wrapper's names (the prefill kernels' plan would name its paged_kv_* arguments);
        # last_page_len is derived below from kv_len_arr checked against the page counts: in range by construction.
        self._highest_page = check_page_table(indptr, kv_indices, None, page_size,
                                              names=("kv_indptr", "kv_indices", "kv_len_arr"))
        # numpy views of the host tensors: a few microseconds per operation, where torch's take several times that
        indptr_np, lens_np = indptr.numpy(), lens.numpy().astype(np.int64)
        pages = indptr_np[1:].astype(np.int64) - indptr_np[:-1]
        needed = (lens_np + page_size - 1) // page_size
        if (lens_np < 0).any():
            r = int(np.flatnonzero(lens_np < 0)[0])
            raise ValueError(f"kv_len_arr[{r}] = {int(lens_np[r])} is negative; it holds each request's KV length")
        bad = needed != pages
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(f"request {r}: kv_len_arr[{r}] = {int(lens_np[r])} needs {int(needed[r])} pages of "
                             f"{page_size}, but kv_indptr gives it {int(pages[r])}")
        last_page_len = torch.from_numpy(np.where(pages > 0, lens_np - (pages - 1) * page_size, 0).astype(np.int32))
        # Checked before anything is written, so a batch too large leaves the buffers intact.
        needed = dict(qo_indptr=qo_indptr.numel(), kv_indptr=indptr.numel(), kv_indices=kv_indices.numel(),
                      kv_len_arr=lens.numel())
        for name, buffer in self._graph_buffers.items():
            if buffer.numel() < needed[name]:
                raise ValueError(f"{name} buffer holds {buffer.numel()} entries but this batch needs {needed[name]}; "
                                 "allocate the fixed buffers for the largest batch")
        prefill_args = dict(
            qo_indptr=qo_indptr, paged_kv_indptr=indptr, paged_kv_indices=kv_indices,
            paged_kv_last_page_len=last_page_len, num_qo_heads=num_heads, num_kv_heads=1,
            head_dim_qk=head_dim_ckv + head_dim_kpe, page_size=page_size, head_dim_vo=head_dim_ckv, causal=causal,
            sm_scale=sm_scale, q_data_type=q_data_type, kv_data_type=kv_data_type,
        )
        if self._sm90_plan(qo_indptr, indptr, kv_indices, lens, last_page_len, num_heads, head_dim_ckv,
                           head_dim_kpe, page_size, causal, sm_scale, q_data_type, kv_data_type,
                           split=not invariant) is None:
            self._inner.plan(**prefill_args)
        else:
            # Kept for run(): tensors the kernel cannot read plan the prefill kernels then, over this batch's
            # arrays (the plan's host copies, KernelPlan.host_arrays: the caller's may hold the next batch by then).
            self._prefill_args = prefill_args
        if self._use_cuda_graph:  # a captured run() is of one kernel: every later plan must take it too
            kernel = self.kernel
            if self._graph_kernel not in (None, kernel):
                self._kernel, self._prefill_args = None, None
                raise ValueError(f"this plan runs on the {kernel} kernel(s), but the CUDA-graph wrapper's first plan "
                                 f"ran on the {self._graph_kernel} one(s) (JITATTN_MLA_KERNEL changed?); a captured "
                                 "run() keeps its kernel: use a new wrapper")
            self._graph_kernel = kernel
        if self._kv_len_arr_buf is not None:  # FlashInfer keeps the lengths in the caller's buffer too
            self._kv_len_arr_buf[: lens.numel()].copy_(lens)
        self._dims, self._page_size = (head_dim_ckv, head_dim_kpe), page_size
        self._causal, self._sm_scale = causal, sm_scale  # FlashInfer's plan attributes, as engines read them
        self._rows = (int(qo_indptr.numpy()[-1]), num_heads)

    @no_backward
    def run(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
        profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False, *,
        k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """-> out ``[tokens, heads, ckv]`` (and the natural-log lse ``[tokens, heads]``).

        ``k_scale``/``v_scale`` (jitattn extensions, keyword-only): per-tensor dequantization scales of an
        fp8 latent cache (a float or a one-element cpu tensor); ``k_scale`` multiplies the logits (ckv and
        kpe share it), ``v_scale`` the output. Default 1.
        """
        if return_lse is not False and return_lse is not True:  # the hot path passes a bool: two identity tests
            return_lse = resolve_flag(return_lse, "return_lse")
        if return_lse_base_on_e is not False and return_lse_base_on_e is not True:  # jitattn.flashinfer reads it
            resolve_flag(return_lse_base_on_e, "return_lse_base_on_e")
        if profiler_buffer is not None or kv_len is not None or page_table is not None:
            refuse_unsupported(f"{_NAME}.run", "the batch is described by plan()", profiler_buffer=profiler_buffer,
                               kv_len=kv_len, page_table=page_table)
        if torch.compiler.is_compiling():  # one opaque op (the checks below compare addresses)
            return mla_run_compiled(self._op_key, q_nope, q_pe, ckv_cache, kpe_cache, out=out, lse=lse,
                                    return_lse=return_lse, k_scale=k_scale, v_scale=v_scale)
        claim_outputs(_NAME, out, lse)
        refuse_written_over(f"{_NAME}.run()", (("out", out), ("lse", lse)),  # addresses: checked on every call
                            (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv_cache), ("kpe_cache", kpe_cache)))
        signature = None
        if self._kernel is not None:
            # Tensors like those of this plan's last launch (shapes, strides, dtypes, devices) pass every check
            # they passed then; only their addresses can differ (the 16-byte rule below is per call).
            signature = _signature(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse)
            if signature is not None and signature == self._launched and not (
                    (q_nope.data_ptr() | q_pe.data_ptr() | ckv_cache.data_ptr() | kpe_cache.data_ptr()) & 15
                    or out is not None and out.data_ptr() & 3):
                return self._relaunch_sm90(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, k_scale, v_scale)
        if self._dims is None:
            raise not_planned(_NAME)
        ckv_dim, kpe_dim = self._dims
        for name, t, dim in (("q_nope", q_nope, ckv_dim), ("q_pe", q_pe, kpe_dim)):
            check_tensor(name, t, ndim=3)
            if t.shape[-1] != dim:
                raise ValueError(f"{name} has head dim {t.shape[-1]}; the plan has {dim}")
            if tuple(t.shape[:2]) != self._rows:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; the plan has {self._rows[0]} query tokens "
                                 f"(qo_indptr[-1]) and num_heads={self._rows[1]}: expected {self._rows + (dim,)}")
        for name, t, dim in (("ckv_cache", ckv_cache, ckv_dim), ("kpe_cache", kpe_cache, kpe_dim)):
            check_tensor(name, t, ndim=3)
            if t.shape[-1] != dim:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected [pages, page_size, {dim}]")
            if t.shape[1] != self._page_size:
                raise ValueError(f"{name} has shape {tuple(t.shape)}: pages of {t.shape[1]} tokens, but the plan has "
                                 f"page_size={self._page_size}")
        if self._highest_page >= ckv_cache.shape[0]:  # (in the caller's names: the fallback's plan has its own)
            raise ValueError(f"kv_indices reference page {self._highest_page} but ckv_cache has {ckv_cache.shape[0]} "
                             "pages")
        if self._kernel is not None:
            return self._run_sm90(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, k_scale, v_scale,
                                  signature)
        return self._run_prefill(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, k_scale, v_scale)

    run_return_lse = returning_lse(run)
    # run() under a name jitattn.flashinfer's base-2 subclass does not override: the compiled op calls it
    # (runtime/compiled.py), whose LSE is the natural log whichever of the two classes planned
    run_natural_lse = run

    def _run_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                     out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool, k_scale, v_scale):
        if self._prefill_args is not None:  # an sm90 plan meeting tensors its kernel cannot read: plan once
            qo_indptr, kv_indptr, kv_indices = self._kernel.host_arrays
            self._inner.plan(**{**self._prefill_args, "qo_indptr": qo_indptr, "paged_kv_indptr": kv_indptr,
                                "paged_kv_indices": kv_indices})
            self._prefill_args = None
        for name, t in (("q_nope", q_nope), ("q_pe", q_pe)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{_NAME}.run(): {name} must be a torch.Tensor, got {type(t).__name__}")
        if q_nope.dtype != q_pe.dtype:
            raise TypeError(f"{_NAME}.run(): q_nope is {q_nope.dtype} but q_pe is {q_pe.dtype}; pass both in the "
                            "planned q_data_type")
        q = torch.cat([q_nope, q_pe], dim=-1)
        keys = latent_keys(ckv_cache, kpe_cache)
        return self._inner.run(q, (keys.unsqueeze(2), ckv_cache.unsqueeze(2)), k_scale=k_scale, v_scale=v_scale,
                               out=out, lse=lse, return_lse=return_lse)

    def _sm90_plan(self, qo_indptr: torch.Tensor, indptr: torch.Tensor, kv_indices: torch.Tensor, lens: torch.Tensor,
                   last_page_len: torch.Tensor, num_heads: int, head_dim_ckv: int, head_dim_kpe: int, page_size: int,
                   causal: bool, sm_scale: float, q_data_type, kv_data_type, split: bool) -> KernelPlan | None:
        """Plans the batch on the sm90 MLA kernel when it can run it (else None: the prefill kernels)."""
        workspace = self._workspace
        if not isinstance(workspace, torch.Tensor):
            return None  # the prefill wrapper reports the bad workspace
        q_dtype = parse_dtype(q_data_type, "q_data_type")
        kv_dtype = parse_dtype(kv_data_type, "kv_data_type")
        capability, archs = device_facts(workspace.device)
        reason = unsupported_reason(workspace.device, q_dtype, kv_dtype, head_dim_ckv, head_dim_kpe, capability, archs)
        if select_kernel(reason) != "sm90":
            logger.debug("%s.plan: the prefill kernels (%s)", _NAME, reason or "JITATTN_MLA_KERNEL=prefill")
            return None
        check_indptr("qo_indptr", qo_indptr)
        if qo_indptr.numel() != indptr.numel():
            raise ValueError(f"qo_indptr describes {qo_indptr.numel() - 1} requests but kv_indptr "
                             f"{indptr.numel() - 1}")
        graph = None
        if self._use_cuda_graph:
            baked = (num_heads, page_size, bool(causal), float(sm_scale), q_dtype, kv_dtype)
            batch, total_q, pages = lens.numel(), int(qo_indptr[-1]), int(indptr[-1])
            graph = self._graph_arrays
            if graph is None:  # kept only once this first plan has succeeded (it fixes the wrapper's batch shape)
                rows = workspace.numel() * workspace.element_size() // workspace_row_bytes(CKV_DIM)
                graph = GraphArrays(workspace.device, batch, total_q, self._graph_buffers["kv_indices"].numel(), rows,
                                    baked, num_sms(workspace.device.index or 0))
            graph.refuse(batch, total_q, pages, baked)
        self._kernel = KernelPlan(workspace, qo_indptr, indptr, kv_indices, lens, num_heads,
                                  page_size, bool(causal), float(sm_scale), q_dtype, kv_dtype, split=split, graph=graph)
        self._graph_arrays = graph
        work = self._kernel.work
        logger.debug("%s.plan: the sm90 MLA kernel, %d items on %d blocks, %d merges (chunks of %d KV blocks)",
                     _NAME, work.num_items, work.grid, work.num_merges, work.chunk_blocks)
        return self._kernel

    def _run_sm90(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
                  out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool, k_scale, v_scale,
                  signature: tuple | None):
        if ckv_cache.shape[:2] != kpe_cache.shape[:2]:
            raise ValueError(f"ckv_cache {tuple(ckv_cache.shape)} and kpe_cache {tuple(kpe_cache.shape)} must have the "
                             "same [pages, page_size]")
        if ckv_cache.shape[1] != self._kernel.params.page_size:
            raise ValueError(f"ckv_cache has page_size {ckv_cache.shape[1]}; the plan has {self._kernel.params.page_size}")
        tokens, heads = self._rows
        if out is None:
            out = torch.empty((tokens, heads, self._dims[0]), dtype=q_nope.dtype, device=q_nope.device)
        else:
            check_tensor("out", out, ndim=3)
            if tuple(out.shape) != (tokens, heads, self._dims[0]):
                raise ValueError(f"out has shape {tuple(out.shape)}; expected {(tokens, heads, self._dims[0])}")
        if lse is None and return_lse:
            lse = torch.empty((tokens, heads), dtype=torch.float32, device=q_nope.device)
        elif lse is not None:
            if lse.dtype != torch.float32 or tuple(lse.shape) != (tokens, heads) or lse.device != q_nope.device:
                raise ValueError(f"lse must be float32 {(tokens, heads)} on {q_nope.device}; got {_describe(lse)}")
        # The layout rules by strides (the last ones that passed) and pointers: a few attribute reads a call.
        strides = (q_nope.stride(), q_pe.stride(), ckv_cache.stride(), kpe_cache.stride(), out.stride())
        pointers = q_nope.data_ptr() | q_pe.data_ptr() | ckv_cache.data_ptr() | kpe_cache.data_ptr()
        if strides == self._readable_strides and not (pointers & 15 or out.data_ptr() & 3):
            problem = None
        else:
            problem = layout_problem(q_nope, q_pe, ckv_cache, kpe_cache, out)
            if problem is None:
                self._readable_strides = strides
        if problem is not None:
            if self._use_cuda_graph:
                raise ValueError(f"the sm90 MLA kernel cannot read these tensors ({problem}), and a CUDA-graph "
                                 "wrapper cannot switch kernels at run(): pass .contiguous() views")
            if q_nope.is_cuda and stream_capturing():
                raise RuntimeError(f"{_NAME}.run() is being captured into a CUDA graph, but the sm90 MLA kernel "
                                   f"cannot read these tensors ({problem}) and the prefill kernels' plan would be made "
                                   "inside the capture; pass .contiguous() views")
            if mla_kernel_choice() == "sm90":
                raise ValueError(f"JITATTN_MLA_KERNEL=sm90, but the sm90 MLA kernel cannot read these tensors: "
                                 f"{problem}; pass .contiguous() views or set JITATTN_MLA_KERNEL=auto")
            logger.debug("%s.run: the prefill kernels (%s)", _NAME, problem)
            return self._run_prefill(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, k_scale, v_scale)
        self._kernel.launch(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, fp8_scale(k_scale, "k_scale"),
                            fp8_scale(v_scale, "v_scale"))
        self._launched = signature
        return (out, lse) if return_lse else out

    def _relaunch_sm90(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor,
                       kpe_cache: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool,
                       k_scale, v_scale):
        """run() of tensors like the last launch's (``_signature``): the outputs allocated, the kernel launched."""
        tokens, heads = self._rows
        if out is None:
            out = torch.empty((tokens, heads, self._dims[0]), dtype=q_nope.dtype, device=q_nope.device)
        if lse is None and return_lse:
            lse = torch.empty((tokens, heads), dtype=torch.float32, device=q_nope.device)
        self._kernel.relaunch(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, fp8_scale(k_scale, "k_scale"),
                              fp8_scale(v_scale, "v_scale"), same_strides=True)
        return (out, lse) if return_lse else out


def _signature(*args) -> tuple | None:
    """What run()'s checks of its tensors depend on, for each of ``args`` (tensors, None or a flag): shape,
    strides, dtype, device; None when one is neither (the checks then say what is wrong)."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.shape, a.stride(), a.dtype, a.get_device()))
        elif a is None or isinstance(a, bool):
            key.append(a)
        else:
            return None
    return tuple(key)


def _batch_prefixes(qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                    kv_len_arr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch's ``kv_indptr`` and ``kv_len_arr`` (host int32): as FlashInfer, the batch size is ``qo_indptr``'s and
    longer ``kv_indptr`` / ``kv_len_arr`` (buffers sized for the largest batch) are read up to it."""
    batch = qo_indptr.numel() - 1
    if batch < 0:
        raise ValueError("qo_indptr is empty; it needs batch_size + 1 entries (starting with 0)")
    for name, values, needed in (("kv_indptr", kv_indptr, batch + 1), ("kv_len_arr", kv_len_arr, batch)):
        if values.numel() < needed:
            raise ValueError(f"{name} has {values.numel()} entries, but qo_indptr describes {batch} requests, which "
                             f"need {needed}; pass one entry per request ({name} buffers may be longer)")
    return kv_indptr[: batch + 1], kv_len_arr[:batch]


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')} on {value.device}"
    return type(value).__name__


def latent_keys(ckv_cache: torch.Tensor, kpe_cache: torch.Tensor) -> torch.Tensor:
    """``[pages, page_size, ckv + kpe]`` keys: a view when ``kpe`` follows ``ckv`` in one buffer, else a copy."""
    if ckv_cache.shape[:2] != kpe_cache.shape[:2]:
        raise ValueError(f"ckv_cache {tuple(ckv_cache.shape)} and kpe_cache {tuple(kpe_cache.shape)} must have the same "
                         "[pages, page_size]")
    if ckv_cache.dtype != kpe_cache.dtype or ckv_cache.device != kpe_cache.device:
        raise TypeError("ckv_cache and kpe_cache must have the same dtype and device")
    width = ckv_cache.shape[-1] + kpe_cache.shape[-1]
    adjacent = (ckv_cache.stride() == kpe_cache.stride() and ckv_cache.stride(-1) == 1
                and kpe_cache.data_ptr() == ckv_cache.data_ptr() + ckv_cache.shape[-1] * ckv_cache.element_size()
                and ckv_cache.stride(1) >= width)
    if adjacent:
        return ckv_cache.as_strided(ckv_cache.shape[:2] + (width,), ckv_cache.stride())
    return torch.cat([ckv_cache, kpe_cache], dim=-1)

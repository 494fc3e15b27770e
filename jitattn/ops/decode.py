"""Decode attention over a paged KV cache (FlashInfer-compatible names and arguments)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from ..runtime.batch import check_sinks, check_workspace, upload_int32
from ..runtime.builder import HostIndex, attention_options, build_plan, kernel_spec, make_plan, num_workers
from ..runtime.wrapper import BatchWrapperBase, drops_plan_on_failure, host_side, plan_arguments, returning_lse
from ..runtime.checks import check_tensor, fast_page_table, target_of
from ..runtime.grad import no_backward
from ..runtime.launch import PreparedAttention
from ..runtime.options import (
    PAGE_TABLE_HINT, check_flag, check_flags, fp8_scale, parse_kv_layout, positive_int, refuse_unsupported,
    resolve_batch_invariant,
)
from ..jit import load, resident_blocks, short_items_blocks
from ..page_table import PagedIndex, check_host_last_page_lens, check_paged_index
from ..kv_split import (
    MAX_RESIDENT_BLOCKS, KVSplit, check_fixed_split_size, check_workspace_limits, decode_kv_split, max_decode_chunks,
    short_items_split, split_workspace_bytes, unsplit, window_lens,
)
from ..variant import AttentionVariant
from .single_kv import check_single_kv, single_request_pages
from ..spec import KVStorage, Op, Target

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper", "CUDAGraphBatchDecodeWithPagedKVCacheWrapper", "fast_decode_plan",
    "single_decode_with_kv_cache",
]

_WRAPPER = "BatchDecodeWithPagedKVCacheWrapper"
# plan()'s default q dtype, compared by identity: data_type may fill it, never an explicit q_data_type.
_DEFAULT_Q_DTYPE = "float16"


@functools.lru_cache(maxsize=64)
def _host_range(n: int) -> torch.Tensor:
    """0..n-1 as a host int32 tensor (decode's qo_indptr; plans only read it)."""
    return torch.arange(n, dtype=torch.int32)


class BatchDecodeWithPagedKVCacheWrapper(BatchWrapperBase):
    """Batched decode (one query token per request) over a paged KV cache.

    ``plan()`` once per batch (it validates the page table on the host,
    chooses the kernel and the split-KV schedule), then ``run()`` once per
    layer. The target follows ``float_workspace_buffer``'s device.
    ``use_tensor_cores`` is accepted for compatibility: the kernel picks its
    tensor-core or CUDA-core path itself.
    """

    _NAME = _WRAPPER

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD", use_cuda_graph: bool = False,
        use_tensor_cores: bool = False, paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None, backend: str = "auto", jit_args=None,
    ) -> None:
        check_flag(use_tensor_cores, "use_tensor_cores")
        self._use_tensor_cores = bool(use_tensor_cores)
        super().__init__(float_workspace_buffer, kv_layout, use_cuda_graph, backend, {
            "kv_indptr": paged_kv_indptr_buffer, "kv_indices": paged_kv_indices_buffer,
            "kv_last_page_len": paged_kv_last_page_len_buffer,
        }, {"kv_indptr": "paged_kv_indptr_buffer", "kv_indices": "paged_kv_indices_buffer",
            "kv_last_page_len": "paged_kv_last_page_len_buffer"}, jit_args=jit_args)
        # Under CUDA graphs every array a captured launch reads must keep its address across plans.
        self._own_buffers: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
        if self._use_cuda_graph:
            rows = paged_kv_indptr_buffer.numel()
            self._own_buffers = tuple(torch.empty(rows, dtype=torch.int32, device=self._device) for _ in range(2))
        self._split_counters: torch.Tensor | None = None  # split-KV chunk counters, zero between launches
        self._fast_specs: dict[tuple, tuple] = {}  # fast_decode_plan: (options) -> (spec, module)
        self._fast_ranges: dict[int, torch.Tensor] = {}  # fast_decode_plan: batch size -> arange on the device
        # (what the last plan's launch struct was filled from, that launch): see _launch_to_reuse
        self._last_launch: tuple[tuple, PreparedAttention] | None = None
        self._graph_batch: int | None = None  # use_cuda_graph: its first successful plan's batch size
        self._checked_index: PagedIndex | None = None  # plan_checked's page table, for the plan() it calls

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @drops_plan_on_failure
    def plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode: str = "NONE", window_left: int = -1,
        logits_soft_cap: float | None = None, q_data_type: str | torch.dtype = _DEFAULT_Q_DTYPE,
        kv_data_type: str | torch.dtype | None = None, data_type: str | torch.dtype | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        non_blocking: bool = True, block_tables: torch.Tensor | None = None, seq_lens: torch.Tensor | None = None,
        fixed_split_size: int | None = None, disable_split_kv: bool = False,
        variant: AttentionVariant | None = None, *, batch_invariant: bool | None = None,
    ) -> None:
        """Plan decode for one batch.

        ``variant`` (a ``jitattn.AttentionVariant``) selects a custom variant; its extra
        parameters are then passed to ``run(..., name=value)``. A variant without softmax or
        with an output transform is never split over the KV.

        ``batch_invariant`` (default: ``JITATTN_BATCH_INVARIANT``): each request's KV is cut into
        chunks of a fixed length (``fixed_split_size`` pages, else 1024 tokens rounded up to pages)
        whatever the rest of the batch, merged in chunk order, so its output is bitwise the same in
        any batch (CUDA graphs included: the split plan is then capturable).

        Index arrays are int32, on the host (no device sync) or on the device
        (copied to the host once here). The plan's arrays go to the device on the current
        stream without waiting (FlashInfer's ``non_blocking=True``): run on that stream. ``data_type`` (deprecated in FlashInfer) fills the
        q and kv dtypes the caller did not give. ``fixed_split_size`` is in pages.
        ``block_tables``/``seq_lens`` (FlashInfer's trtllm-gen inputs) are not supported.
        """
        self._plan_call = plan_arguments(locals())
        if block_tables is not None or seq_lens is not None:
            refuse_unsupported(f"{_WRAPPER}.plan", PAGE_TABLE_HINT, block_tables=block_tables, seq_lens=seq_lens)
        if q_data_type is _DEFAULT_Q_DTYPE and data_type is not None:
            q_data_type = None  # the default, not the caller's choice: data_type fills it
        options = attention_options(
            Op.DECODE, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
            q_data_type=q_data_type, kv_data_type=kv_data_type, data_type=data_type,
            pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta, variant=variant,
        )
        index = self._checked_index if self._checked_index is not None else check_paged_index(
            indptr, indices, last_page_len, page_size)
        spec = kernel_spec(options, self._target, self._kv_layout, KVStorage.PAGED)
        if variant is not None and not variant.splittable:
            disable_split_kv = True  # partial states of such a variant cannot be merged by LSE
        batch_invariant = resolve_batch_invariant(batch_invariant)
        lens = window_lens(index.kv_len_array, options.scalars.window_left)
        split = self._split(spec, lens, num_kv_heads, page_size, fixed_split_size, disable_split_kv, batch_invariant)
        split = self._with_layout(split, spec, num_kv_heads, index, options.scalars.window_left)
        workspace_bytes = split_workspace_bytes(split.num_chunks, num_qo_heads, head_dim) if split.kv_chunk_size else 0
        check_workspace(self._workspace, workspace_bytes, _WRAPPER)
        self._check_graph_batch(index.batch_size)
        qo_indptr = _host_range(index.batch_size + 1)
        qo_indptr_buf, split_indptr_buf = self._own_buffers
        buffers = {**self._buffers, "qo_indptr": qo_indptr_buf, "split_indptr": split_indptr_buf}
        counters = self._counters(split, index.batch_size, num_kv_heads)
        launch_key = (spec, options, index.batch_size, page_size, split.kv_chunk_size, split.num_chunks,
                      split.short_items, self._use_cuda_graph, counters.data_ptr() if counters is not None else 0)
        self._plan = build_plan(_WRAPPER, self._target, self._device, self._kv_layout, options,
                                HostIndex(qo_indptr, index.indptr, index), split, buffers, self._use_cuda_graph,
                                workspace_bytes, spec=spec, split_counters=counters,
                                launch=self._launch_to_reuse(launch_key, spec))
        self._last_launch = (launch_key, self._plan.launch)
        if self._use_cuda_graph:
            self._graph_batch = index.batch_size

    begin_forward = plan

    def plan_checked(self, index: PagedIndex, num_qo_heads: int, num_kv_heads: int, head_dim: int,
                     **options) -> None:
        """``plan()`` over a page table that is already checked (a cascade level's, the shared-prefix wrapper's,
        in their own names), with ``plan()``'s keyword options: the table is not validated a second time."""
        self._checked_index = index
        try:
            self.plan(index.indptr, index.indices, index.last_page_len, num_qo_heads, num_kv_heads, head_dim,
                      index.page_size, **options)
        finally:
            self._checked_index = None

    def _split(self, spec, kv_lens: np.ndarray, num_kv_heads: int, page_size: int,
               fixed_split_size: int | None, disable_split_kv: bool, batch_invariant: bool = False) -> KVSplit:
        check_fixed_split_size(fixed_split_size)
        if batch_invariant:
            # The chunk length is a constant, so the launch (kv_chunk_size, grid, the whole workspace) is
            # the same for every batch of a size: capturable under CUDA graphs too.
            return decode_kv_split(kv_lens, num_kv_heads=num_kv_heads, num_sms=1, page_size=page_size,
                                   fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
                                   batch_invariant=True)
        if self._use_cuda_graph:
            # Under CUDA graphs the grid must not depend on lengths: no split (nor does the layout: a batch size
            # of one captured wrapper always takes the same one).
            return unsplit(len(kv_lens))
        # The cpu target runs the same plan; its "SMs" are the OpenMP threads.
        return decode_kv_split(
            kv_lens, num_kv_heads=num_kv_heads, num_sms=num_workers(self._device), page_size=page_size,
            fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
            blocks_per_sm=resident_blocks(spec) if self._target is Target.CUDA else 2,
        )

    def _with_layout(self, split: KVSplit, spec, num_kv_heads: int, index: PagedIndex, window_left: int) -> KVSplit:
        """``split``, marked for the module's short-items layout when it has one and the plan suits it."""
        short_blocks = short_items_blocks(spec)
        if not short_blocks:
            return split
        return short_items_split(split, index, num_kv_heads, num_workers(self._device), window_left,
                                 (resident_blocks(spec), short_blocks))

    def _launch_to_reuse(self, key: tuple, spec) -> PreparedAttention | None:
        """The last plan's launch when its struct was filled from ``key`` (kernel, options, batch, page size,
        split, counters), else None. A serving loop's steps mostly repeat these: pointing that struct at the
        step's arrays costs less than filling a new one. Not for a variant (its struct's address belongs to
        the plan). When it returns a launch, no plan is current until the caller has made the new one, so
        a failure on the way leaves none rather than one whose launch reads another's arrays."""
        last, self._last_launch = self._last_launch, None
        if spec.variant is not None or last is None or last[0] != key:
            return None
        self._plan = None
        return last[1]

    def _counters(self, split: KVSplit, batch: int, num_kv_heads: int) -> torch.Tensor | None:
        """This wrapper's split-KV counters (grown, never shrunk; each launch leaves them zero)."""
        if not split.kv_chunk_size or self._target is not Target.CUDA:
            return None
        if self._split_counters is None or self._split_counters.numel() < batch * num_kv_heads:
            self._split_counters = torch.zeros(max(256, 2 * batch * num_kv_heads), dtype=torch.int32,
                                               device=self._device)
        return self._split_counters

    def _check_graph_batch(self, batch_size: int) -> None:
        """A use_cuda_graph wrapper keeps the batch size of its first successful plan (``_graph_batch``, kept apart
        from the plan, which a failed plan() drops: a captured launch keeps the size all the same)."""
        if self._use_cuda_graph and self._graph_batch is not None and self._graph_batch != batch_size:
            raise ValueError(
                f"a use_cuda_graph wrapper keeps its batch size ({self._graph_batch}); got {batch_size}. "
                "Captured launches have the batch size baked in: use one wrapper per captured batch size"
            )

    def _fast_arrays(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, batch: int,
                     split) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
        """``fast_decode_plan``'s device arrays: the page table (copied into the CUDA-graph buffers, or moved to
        the device), the query indptr (0..batch) and the split-KV indptr."""
        device = self._device
        if self._use_cuda_graph:
            roles = (("kv_indptr", indptr), ("kv_indices", indices), ("kv_last_page_len", last_page_len))
            for role, src in roles:  # all checked before any is written: a refused step leaves the last one's arrays
                if src.numel() > self._buffers[role].numel():
                    raise ValueError(f"{role} has {src.numel()} entries; its CUDA-graph buffer holds "
                                     f"{self._buffers[role].numel()}")
            arrays = []
            for role, src in roles:
                buffer = self._buffers[role]
                buffer[: src.numel()].copy_(src, non_blocking=True)
                arrays.append(buffer)
            own = self._own_buffers[0]
            if self._plan is None:
                own.copy_(torch.arange(own.numel(), dtype=torch.int32))
            qo_indptr = split_indptr = own[: batch + 1]  # the batch's part (it sizes the launch)
            if split.kv_chunk_size:  # batch-invariant: a split plan whose chunk offsets keep their address
                split_indptr = self._own_buffers[1]
                split_indptr[: batch + 1].copy_(split.host_indptr())
        else:
            arrays = [t if t.device == device else t.to(device, non_blocking=True)
                      for t in (indptr, indices, last_page_len)]
            if batch not in self._fast_ranges:
                self._fast_ranges[batch] = torch.arange(batch + 1, dtype=torch.int32, device=device)
            qo_indptr = self._fast_ranges[batch]
            split_indptr = qo_indptr
            if split.kv_chunk_size:
                split_indptr = upload_int32([("split_indptr", split.host_indptr(), None)], device)[0]
        return arrays, qo_indptr, split_indptr

    @drops_plan_on_failure  # as plan(): a refused plan leaves none
    def _fast_plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, page_size: int, pos_encoding_mode, window_left, logits_soft_cap,
        q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta, fixed_split_size,
        disable_split_kv, indptr_host: torch.Tensor | None, batch_invariant: bool = False,
    ) -> None:
        """``fast_decode_plan``: no device sync, no page-table validation, device arrays used in place."""
        page_size = positive_int(page_size, "page_size")  # the kernels divide by it
        options = attention_options(
            Op.DECODE, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
            q_data_type=q_data_type, kv_data_type=kv_data_type, data_type=data_type,
            pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
        )
        key = (options.q_dtype, options.kv_dtype, options.pos_encoding, options.scalars.window_left >= 0,
               options.scalars.logits_soft_cap > 0, num_qo_heads, num_kv_heads, head_dim)
        if key not in self._fast_specs:
            spec = kernel_spec(options, self._target, self._kv_layout, KVStorage.PAGED)
            self._fast_specs[key] = (spec, load(spec))
        spec, module = self._fast_specs[key]
        indptr, indices, last_page_len, indptr_host, batch = fast_page_table(indptr, indices, last_page_len,
                                                                             indptr_host)
        check_host_last_page_lens(indptr_host, last_page_len, page_size)
        self._check_graph_batch(batch)
        # Without last_page_len on the host every request counts its full last page. Chunk sizes are whole pages,
        # so the chunk counts are the same as with the exact lengths (under a window too, where chunks start
        # mid-page: min(len, window_left + 1) of both lengths rounds up to the same pages).
        upper_lens = np.diff(indptr_host.numpy()).astype(np.int64) * page_size
        lens = window_lens(upper_lens, options.scalars.window_left)
        split = self._split(spec, lens, num_kv_heads, page_size, fixed_split_size, disable_split_kv, batch_invariant)
        workspace_bytes = split_workspace_bytes(split.num_chunks, num_qo_heads, head_dim) if split.kv_chunk_size else 0
        check_workspace(self._workspace, workspace_bytes, _WRAPPER)
        arrays, qo_indptr, split_indptr = self._fast_arrays(indptr, indices, last_page_len, batch, split)
        # The page table is trusted here (as FlashInfer's fast path does): max_page_index is unknown.
        index = PagedIndex(indptr=indptr_host, indices=indices, last_page_len=last_page_len, page_size=page_size,
                           kv_len_array=upper_lens, max_page_index=-1)
        split = self._with_layout(split, spec, num_kv_heads, index, options.scalars.window_left)
        counters = self._counters(split, batch, num_kv_heads)
        launch_key = (spec, options, batch, page_size, split.kv_chunk_size, split.num_chunks, split.short_items,
                      self._use_cuda_graph, counters.data_ptr() if counters is not None else 0)
        launch = self._launch_to_reuse(launch_key, spec)
        if launch is not None:
            launch.point_at(qo_indptr, arrays[0], arrays[1], arrays[2], split_indptr)
        self._plan = make_plan(
            _WRAPPER, spec, module, options, self._kv_layout, qo_indptr=qo_indptr, kv_indptr=arrays[0],
            kv_indices=arrays[1], kv_last_page_len=arrays[2], custom_mask=None, mask_indptr=None, index=index,
            total_qo=batch, total_kv=None, split=split, split_indptr=split_indptr,
            use_cuda_graph=self._use_cuda_graph, workspace_bytes=workspace_bytes, split_counters=counters,
            launch=launch,
        )
        self._last_launch = (launch_key, self._plan.launch)
        if self._use_cuda_graph:
            self._graph_batch = batch

    def workspace_size(
        self, max_batch_size: int, max_kv_tokens: int, num_qo_heads: int, num_kv_heads: int, head_dim: int,
        page_size: int, fixed_split_size: int | None = None, *, batch_invariant: bool | None = None,
    ) -> tuple[int, int]:
        """(float_bytes, int_bytes) that any plan within these limits needs on this wrapper's device: at most
        ``max_batch_size`` requests holding ``max_kv_tokens`` KV tokens together (the batch's total).
        ``batch_invariant``: the bound for plans made with it (default ``JITATTN_BATCH_INVARIANT``).

        float_bytes is what ``float_workspace_buffer`` must hold (split-KV partial outputs: ``chunks * num_qo_heads
        * (head_dim + 1) * 4``); int_bytes is the plan metadata this wrapper keeps in its own buffers (never in the
        shared float workspace)."""
        check_workspace_limits(max_batch_size=max_batch_size, max_kv_tokens=max_kv_tokens, num_qo_heads=num_qo_heads,
                               num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size,
                               fixed_split_size=fixed_split_size)
        int_bytes = 2 * (max_batch_size + 1) * 4
        chunks = max_decode_chunks(max_batch_size, max_kv_tokens, num_kv_heads=num_kv_heads,
                                   num_sms=num_workers(self._device),
                                   page_size=page_size, fixed_split_size=fixed_split_size,
                                   blocks_per_sm=MAX_RESIDENT_BLOCKS,
                                   batch_invariant=resolve_batch_invariant(batch_invariant))
        return split_workspace_bytes(chunks, num_qo_heads, head_dim), int_bytes

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *args,
        q_scale: float | None = None, k_scale: float | None = None, v_scale: float | None = None,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
        enable_pdl: bool | None = None, window_left: int | None = None, sinks: torch.Tensor | None = None,
        q_len_per_req: int = 1, **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Decode attention: q ``[batch, num_qo_heads, head_dim]`` -> out (and natural-log lse ``[batch, heads]``).

        ``q_scale``/``k_scale`` multiply ``sm_scale``, ``v_scale`` the output (fp8 dequantization);
        ``window_left`` must equal the planned one; ``enable_pdl`` only tunes speed and is ignored.
        ``sinks``: float32 ``[num_qo_heads]`` attention sinks (gpt-oss), natural-log logits on the scale of
        the scaled (and soft-capped) logits: the output of head h is ``o * e^lse / (e^lse + e^sinks[h])``
        and the returned lse is that of the keys alone. The plan needs nothing: the first run with sinks
        after a ``plan()`` loads the sink build of the planned kernel (a cache lookup once built).
        ``q_len_per_req`` other than 1 (trtllm-gen) is not supported yet.
        ``args``/``variant_args``: the planned custom variant's parameters, in declaration order / by name.
        """
        if q_len_per_req != 1:
            refuse_unsupported(f"{_WRAPPER}.run", "several queries per request (q_len_per_req) are not implemented "
                               "yet", q_len_per_req=q_len_per_req)
        return self._run(q, paged_kv_cache, k_scale, v_scale, out, lse, return_lse, variant_args, args, q_scale,
                         window_left, sinks, enable_pdl)

    run_return_lse = returning_lse(run)

    def forward(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        pos_encoding_mode: str = "NONE", q_scale: float | None = None, k_scale: float | None = None,
        v_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        **variant_args,
    ) -> torch.Tensor:
        """Older spelling of ``run``: the options given here replace the planned ones (re-planning if needed);
        ``variant_args``: the planned custom variant's parameters, as ``run`` takes them."""
        options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                       sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
        return self._forward(options, (q, paged_kv_cache),
                             dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, **variant_args))

    def forward_return_lse(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        pos_encoding_mode: str = "NONE", q_scale: float | None = None, k_scale: float | None = None,
        v_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
        sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
        **variant_args,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Older spelling of ``run(..., return_lse=True)``, with ``forward``'s options."""
        options = dict(pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
                       sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
        return self._forward(options, (q, paged_kv_cache),
                             dict(q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=True, **variant_args))


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """The CUDA-graph decode wrapper under FlashInfer's older name: fixed index buffers, capturable ``run()``."""

    def __init__(
        self, workspace_buffer: torch.Tensor, indptr_buffer: torch.Tensor, indices_buffer: torch.Tensor,
        last_page_len_buffer: torch.Tensor, kv_layout: str = "NHD", use_tensor_cores: bool = False,
    ) -> None:
        super().__init__(workspace_buffer, kv_layout, use_cuda_graph=True, use_tensor_cores=use_tensor_cores,
                         paged_kv_indptr_buffer=indptr_buffer, paged_kv_indices_buffer=indices_buffer,
                         paged_kv_last_page_len_buffer=last_page_len_buffer)


@host_side
def fast_decode_plan(
    self: BatchDecodeWithPagedKVCacheWrapper, indptr: torch.Tensor, indices: torch.Tensor,
    last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
    pos_encoding_mode: str = "NONE", window_left: int = -1, logits_soft_cap: float | None = None,
    q_data_type: str | torch.dtype | None = None, kv_data_type: str | torch.dtype | None = None,
    data_type: str | torch.dtype | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
    rope_theta: float | None = None, non_blocking: bool = True, fixed_split_size: int | None = None,
    disable_split_kv: bool = False, global_override_indptr_cpu: torch.Tensor | None = None, *,
    batch_invariant: bool | None = None,
) -> None:
    """``plan()`` for a serving loop that calls it every step (SGLang binds it with ``functools.partial``).

    ``batch_invariant`` (default ``JITATTN_BATCH_INVARIANT``): as ``plan()``'s.

    The page indices are not validated or copied to the host: the device arrays are used in place
    (copied into the fixed buffers of a CUDA-graph wrapper; a strided view into a packed copy), so the
    caller must keep them unchanged until the step's ``run()`` calls are done, and their page indices must
    lie inside the KV cache. The arrays' dtypes, ranks and lengths are checked. Only ``indptr`` is read on
    the host, from ``global_override_indptr_cpu`` when given (no device sync); otherwise it is copied once.
    Compiled kernels are looked up once per option set. Everything else is as ``plan()``.
    """
    check_flags(disable_split_kv=disable_split_kv, non_blocking=non_blocking)
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper):
        raise TypeError(f"fast_decode_plan needs a BatchDecodeWithPagedKVCacheWrapper; got {type(self).__name__}")
    self._fast_plan(
        indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode,
        window_left, logits_soft_cap, q_data_type, kv_data_type, data_type, sm_scale, rope_scale, rope_theta,
        fixed_split_size, disable_split_kv, global_override_indptr_cpu, resolve_batch_invariant(batch_invariant),
    )
    # forward() compares its options with these (once planned: a failed plan leaves none); it cannot re-plan (the
    # arrays are used in place, not kept)
    self._plan_call = dict(fast_decode_plan=True, pos_encoding_mode=pos_encoding_mode, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
                           rope_theta=rope_theta)


@no_backward
def single_decode_with_kv_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_layout: str = "NHD", pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False, q_scale: float | None = None, k_scale: float | None = None,
    v_scale: float | None = None, window_left: int = -1, logits_soft_cap: float | None = None,
    sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
    return_lse: bool = False, sinks: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Decode one query ``[num_qo_heads, head_dim]`` against k/v ``[kv_len, H_kv, D]`` (NHD) or ``[H_kv, kv_len, D]`` (HND).

    ``sinks`` (a jitattn extension): float32 ``[num_qo_heads]`` attention sinks, as in
    ``BatchDecodeWithPagedKVCacheWrapper.run`` (the lse returned is the keys' alone)."""
    check_flag(use_tensor_cores, "use_tensor_cores")
    layout = parse_kv_layout(kv_layout)
    check_tensor("q", q, ndim=2)
    check_tensor("k", k, ndim=3)
    check_tensor("v", v, ndim=3)
    target_of("single_decode_with_kv_cache", (q, k, v))
    kv_len, num_kv_heads = check_single_kv("single_decode_with_kv_cache", k, v, layout, q.shape[0], q.shape[1])
    if sinks is not None:  # checked here too, so that errors name this function rather than the wrapper under it
        check_sinks("single_decode_with_kv_cache", sinks, q.shape[0], q.device)
    if q_scale is not None:  # the rules of run()'s scales: a number or a one-element host tensor
        sm_scale = (sm_scale if sm_scale is not None else q.shape[-1] ** -0.5) * fp8_scale(q_scale, "q_scale")
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
    # The whole sequence is one page of page_size kv_len (an empty one: a page table with no page).
    result = wrapper.run(q.unsqueeze(0), single_request_pages(k, v, layout), k_scale=k_scale, v_scale=v_scale,
                         return_lse=return_lse, sinks=sinks)
    if return_lse:
        return result[0][0], result[1][0]
    return result[0]

"""Cascade attention: shared-prefix levels computed once, merged by LSE.

Level i has its own page table and ``qo_indptr``: a level's "request" is a
node of the prefix tree, whose queries are all the query tokens below that
node and whose KV is the node's own pages. Each level runs once (a shared
level with few nodes as several KV chunks), writing its state into one buffer;
one ``merge_states`` over every level's (and chunk's) state per query gives the
output (natural-log LSE). Without CUDA graphs the non-causal prefill-kernel
levels are one launch, and a last level of one query per request (decode under
a shared prefix) runs on the decode kernel, which on cuda also merges the earlier
levels' states into its result (no merge kernel). Under CUDA graphs each level is its
own launch, a shared level is cut into a chunk count fixed by the batch shape
(``kv_split.graph_level_chunks``) and the decode-kernel last level stays, on
wrappers with buffers of their own, so every plan of a shape replays into the
same memory. Causal masking applies to the last level only (the earlier levels
are prefixes every query sees whole).
"""

from __future__ import annotations

import functools

import torch

from .attention.batch import WorkspaceTooSmall, run_plan, share_queries
from .attention.builder import attention_options, kernel_spec, num_workers
from .attention.merge import PreparedMerge, merge_state, merge_state_in_place, merge_states, merge_states_with_sinks
from .attention.options import fp8_scale, parse_pos_encoding, resolve_batch_invariant, resolve_flag, resolve_window_left
from .kv_split import (
    batch_invariant_chunk, cascade_chunk_pages, cascade_level_chunks, check_fixed_split_size, concat_level_tables,
    graph_level_chunks, split_level_page_table,
)
from .page_table import PagedIndex, check_indptr, check_paged_index
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .families.prefill import query_tile_rows
from .jit import resident_blocks
from .prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache
from .spec import KVStorage, Op, PosEncoding
from .variant import AttentionVariant

__all__ = [
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper", "merge_state", "merge_state_in_place", "merge_states",
]


class MultiLevelCascadeAttentionWrapper:
    """Multi-level cascade attention over a paged KV cache (FlashInfer-compatible)."""

    def __init__(
        self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
        use_cuda_graph: bool = False, qo_indptr_buf_arr: list[torch.Tensor] | None = None,
        paged_kv_indptr_buf_arr: list[torch.Tensor] | None = None,
        paged_kv_indices_buf_arr: list[torch.Tensor] | None = None,
        paged_kv_last_page_len_buf_arr: list[torch.Tensor] | None = None,
    ) -> None:
        if not isinstance(num_levels, int) or num_levels < 1:
            raise ValueError(f"num_levels={num_levels!r} must be a positive int")
        self._num_levels = num_levels
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("MultiLevelCascadeAttentionWrapper: float_workspace_buffer must be a torch.Tensor "
                            "(e.g. torch.empty(128 << 20, dtype=torch.uint8))")
        self._device = float_workspace_buffer.device
        self._level_chunks: list[int] = []  # KV chunks per level of the last plan (empty: not planned)
        # (wrapper, states it writes): prefill wrappers, then the decode wrapper of a one-query-per-request last level
        self._launches: list[tuple[BatchPrefillWithPagedKVCacheWrapper | BatchDecodeWithPagedKVCacheWrapper, int]] = []
        self._states: _LevelStates | None = None  # the plan's state buffers (None: one state, written as out)
        # States the last launch (the cuda decode kernel) merges into its own result (0: a merge kernel does)
        self._fused_states = 0
        self._batch_invariant = False  # the last plan's mode
        self._workspace, self._kv_layout = float_workspace_buffer, kv_layout
        self._decode: BatchDecodeWithPagedKVCacheWrapper | None = None  # a last level of one query per request
        # Under CUDA graphs: the wrappers (with buffers of their own, sized for a batch shape) of levels cut
        # into chunks, by (level, chunk nodes + 1), and of a last level on the decode kernel, by batch size; and
        # the state buffers by layout. Kept for every shape planned (a few), so a run() captured for one shape
        # reads the same memory after any later plan of that shape, other shapes planned in between.
        self._graph_levels: dict[tuple[int, int], BatchPrefillWithPagedKVCacheWrapper] = {}
        self._graph_decoders: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}
        self._graph_states: dict[tuple, _LevelStates] = {}

        def buf(arr, i):
            return arr[i] if arr is not None else None

        self._index_capacity = [buf(paged_kv_indices_buf_arr, i) for i in range(num_levels)]  # graph mode: pages
        self._wrappers = [
            BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer, kv_layout, use_cuda_graph=use_cuda_graph,
                qo_indptr_buf=buf(qo_indptr_buf_arr, i), paged_kv_indptr_buf=buf(paged_kv_indptr_buf_arr, i),
                paged_kv_indices_buf=buf(paged_kv_indices_buf_arr, i),
                paged_kv_last_page_len_buf=buf(paged_kv_last_page_len_buf_arr, i),
            )
            for i in range(num_levels)
        ]

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffers=None) -> None:
        if not isinstance(float_workspace_buffer, torch.Tensor):
            raise TypeError("MultiLevelCascadeAttentionWrapper.reset_workspace_buffer: float_workspace_buffer must "
                            "be a torch.Tensor")
        self._workspace = float_workspace_buffer
        for wrapper in (self._wrappers + ([self._decode] if self._decode is not None else [])
                        + list(self._graph_levels.values()) + list(self._graph_decoders.values())):
            wrapper.reset_workspace_buffer(float_workspace_buffer)

    def plan(
        self, qo_indptr_arr: list[torch.Tensor], paged_kv_indptr_arr: list[torch.Tensor],
        paged_kv_indices_arr: list[torch.Tensor], paged_kv_last_page_len: list[torch.Tensor],
        num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, causal: bool = False,
        pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False, sm_scale: float | None = None,
        window_left: int = -1, logits_soft_cap: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None, variant: AttentionVariant | None = None,
        fixed_split_size: int | None = None, *, batch_invariant: bool | None = None,
    ) -> None:
        """Plan every level: ``*_arr[i]`` is level i's index array (one entry per level).

        A shared (non-causal) level whose few nodes cannot fill the device is cut into
        chunks of its nodes' KV that run in parallel and are merged by LSE;
        ``fixed_split_size`` (a jitattn extension) caps a chunk at that many pages (not under CUDA graphs,
        where the chunk count follows the batch shape).

        Under CUDA graphs (``use_cuda_graph=True``) the chunked shared levels and a decode-kernel last level
        run on wrappers with buffers of their own, kept per shape (the caller's level buffers are then not
        written for them; nothing reads them back); a last level of as many queries as nodes must have one
        query per node.

        ``batch_invariant`` (default ``JITATTN_BATCH_INVARIANT``): a shared level's nodes are cut into
        chunks of a fixed length (``fixed_split_size`` pages, else 1024 tokens rounded up to pages), the
        same whatever the other nodes, and every query merges its states in one fixed order (level by
        level, chunk by chunk; a chunk past a node's end is an empty state, which adds exact zeros), so a
        query's output is bitwise the same in any batch.

        ``variant``: a custom variant run at every level (its ``q_idx``/``kv_idx`` are relative to
        the level's node); the levels are merged by LSE, so it must use softmax and have no output
        transform."""
        for name, arr in (("qo_indptr_arr", qo_indptr_arr), ("paged_kv_indptr_arr", paged_kv_indptr_arr),
                          ("paged_kv_indices_arr", paged_kv_indices_arr),
                          ("paged_kv_last_page_len", paged_kv_last_page_len)):
            if not isinstance(arr, (list, tuple)):
                raise TypeError(f"{name} must be a list with one int32 tensor per level, got {type(arr).__name__}")
            if len(arr) != self._num_levels:
                raise ValueError(f"{name} has {len(arr)} entries; this wrapper has num_levels={self._num_levels}")
            for level, a in enumerate(arr if name in ("qo_indptr_arr", "paged_kv_indptr_arr") else ()):
                if not isinstance(a, torch.Tensor) or a.dim() != 1 or a.numel() < 1:
                    got = f"shape {tuple(a.shape)}" if isinstance(a, torch.Tensor) else type(a).__name__
                    raise ValueError(f"{name}[{level}] must be a 1-D int32 tensor of batch + 1 offsets, got {got}")
        causal = resolve_flag(causal, "causal")
        check_fixed_split_size(fixed_split_size)
        if parse_pos_encoding(pos_encoding_mode) is not PosEncoding.NONE or resolve_window_left(window_left) >= 0:
            raise ValueError(
                "cascade levels see positions relative to their own KV, so in-kernel RoPE/ALiBi and sliding "
                "windows would be wrong; apply RoPE before writing the cache and use pos_encoding_mode='NONE', "
                "window_left=-1 (or use the flat wrappers)"
            )
        if variant is not None and not variant.splittable:
            raise ValueError(
                f"variant {variant.name!r} cannot run in cascade: the levels are merged by their LSE, which needs "
                "use_softmax=True and no output_transform; use the flat prefill wrapper for it"
            )
        totals = {int(qo[-1]) for qo in qo_indptr_arr}
        if len(totals) != 1:
            raise ValueError(f"every level's qo_indptr must end at the same token count; got {sorted(totals)}")
        (total_q,) = totals
        group = num_qo_heads // max(1, num_kv_heads)
        tile_rows = query_tile_rows(head_dim, head_dim)
        # A split shared level fills one wave of the prefill kernel's resident blocks (one per SM on the
        # sm90 tier, whose blocks take items dynamically).
        prefill = self._wrappers[0]
        blocks_per_sm = resident_blocks(kernel_spec(
            attention_options(Op.PREFILL, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
                              q_data_type=q_data_type, kv_data_type=kv_data_type, logits_soft_cap=logits_soft_cap),
            prefill._target, prefill._kv_layout, KVStorage.PAGED))
        self._batch_invariant = resolve_batch_invariant(batch_invariant)
        self._level_chunks = []  # unplanned until every level's plan below has succeeded
        level_chunks: list[int] = []
        names = ("paged_kv_indptr_arr[i]", "paged_kv_indices_arr[i]", "paged_kv_last_page_len[i]")
        graphs = self._wrappers[0].is_cuda_graph_enabled
        # Under graphs (not batch-invariant, no variant) a shared level is still cut into chunks and a last
        # level of one query per request still runs on the decode kernel, with counts that depend on the batch
        # shape alone (nodes, queries: what a captured launch keeps), not on the lengths.
        graph_fixed = graphs and not self._batch_invariant and variant is None
        tables: list[tuple[torch.Tensor, PagedIndex, bool]] = []  # per level: (qo_indptr, page table, causal)
        for level in range(self._num_levels):
            level_causal = causal if level == self._num_levels - 1 else False
            qo_host = check_indptr("qo_indptr_arr[i]", qo_indptr_arr[level])
            index = check_paged_index(paged_kv_indptr_arr[level], paged_kv_indices_arr[level],
                                      paged_kv_last_page_len[level], page_size, names=names)
            qo_lens = (qo_host[1:] - qo_host[:-1]).tolist()
            if len(qo_lens) != index.batch_size:
                raise ValueError(f"level {level}: qo_indptr_arr[{level}] has {len(qo_lens)} nodes but "
                                 f"paged_kv_indptr_arr[{level}] has {index.batch_size}; a level's arrays describe "
                                 "the same nodes")
            last = level == self._num_levels - 1
            # Under graphs the last level's kernel follows the shape: one query per node when total_q equals
            # the node count (then every node must have exactly one), else the prefill kernels.
            one_each = bool(qo_lens) and all(n == 1 for n in qo_lens)
            if graph_fixed and last and len(qo_lens) == total_q and not one_each:
                raise ValueError(f"under CUDA graphs a last level of as many queries as nodes ({total_q}) takes one "
                                 "query per node (its decode-kernel launch is captured for that shape); got "
                                 f"{qo_lens[:8]}...: plan other query counts on a wrapper of their own")
            # graphs: one query per node is a property of the shape (total_q == nodes, both captured)
            shape_one_each = graph_fixed and len(qo_lens) == total_q and one_each if graphs else one_each
            relaxable = shape_one_each if graphs else max(qo_lens, default=0) <= 1
            if level_causal and relaxable and not self._batch_invariant:
                # One query per request sees every key: causal or not, the same. Under graphs only when
                # that holds for the shape (one query per request: total_q == nodes, both captured), not in
                # batch-invariant mode (whether a request's level may split must not depend on its
                # companions' query counts).
                level_causal = False
            chunks = 1
            # A last level of one query per request (decode under a shared prefix) runs on the decode
            # kernel, which splits long KV itself; the earlier levels run on the prefill kernels. In a
            # prefill's 128-row tiles such a request fills a few rows (H200: b128 over 8k shared + 256
            # each, its one-launch cascade took 216.8 us on the sm90 tier). Under graphs on a decode wrapper
            # with buffers of its own (the level's are the caller's); not in batch-invariant mode (its merge
            # order is the levels' chunk order).
            decode_last = (last and level > 0 and not level_causal and shape_one_each and not self._batch_invariant
                           and variant is None)
            # Splitting shifts positions inside a chunk: only for plain, non-causal levels; under graphs into
            # a count fixed by the shape (graph_fixed), on a prefill wrapper with buffers of its own.
            if graph_fixed and not level_causal and not decode_last:
                chunks = graph_level_chunks(total_q, group=group, tile_rows=tile_rows, num_kv_heads=num_kv_heads,
                                            num_sms=num_workers(self._device), blocks_per_sm=blocks_per_sm)
                if chunks > 1:
                    qo_host, index = split_level_page_table(qo_host, index, chunks)
            elif not level_causal and variant is None and not graphs and not decode_last:
                chunks = cascade_level_chunks(index.kv_lens, num_kv_heads=num_kv_heads,
                                              num_sms=num_workers(self._device),
                                              page_size=page_size, fixed_split_size=fixed_split_size,
                                              blocks_per_sm=blocks_per_sm,
                                              query_tiles=sum(-(-n * group // tile_rows) for n in qo_lens),
                                              batch_invariant=self._batch_invariant)
                pages_per_chunk = None  # fixed_split_size: the nodes' pages shared out evenly
                if self._batch_invariant:
                    pages_per_chunk = batch_invariant_chunk(page_size, fixed_split_size) // page_size
                elif chunks > 1 and fixed_split_size is None:
                    longest = max(-(-n // page_size) for n in index.kv_lens)
                    chunks, pages_per_chunk = cascade_chunk_pages(longest, chunks, page_size)
                if chunks > 1:
                    qo_host, index = split_level_page_table(qo_host, index, chunks, pages_per_chunk)
            level_chunks.append(chunks)
            tables.append((qo_host, index, level_causal))
        options = dict(sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                       kv_data_type=kv_data_type, variant=variant)
        last_index = tables[-1][1]
        prefill_tables = tables[:-1] if decode_last else tables
        prefill_chunks = level_chunks[:-1] if decode_last else level_chunks
        # Without graphs (their buffers are per level) and with every level non-causal, all the levels
        # are one batch: one launch computes every state (the level page tables one after another).
        if len(prefill_tables) > 1 and not graphs and not any(level_causal for _, _, level_causal in prefill_tables):
            qo_all, index_all = concat_level_tables([(qo, index) for qo, index, _ in prefill_tables])
            launch_levels = [(self._wrappers[0], qo_all, index_all, False, sum(prefill_chunks))]
        else:
            launch_levels = [(self._graph_level(level, qo.numel()) if graph_fixed and chunks > 1 else wrapper, qo, index,
                              level_causal, chunks)
                             for level, (wrapper, (qo, index, level_causal), chunks)
                             in enumerate(zip(self._wrappers, prefill_tables, prefill_chunks))]
        launches: list[tuple[BatchPrefillWithPagedKVCacheWrapper | BatchDecodeWithPagedKVCacheWrapper, int]] = []
        for wrapper, qo, index, level_causal, states in launch_levels:
            # The level's checked page table is handed on, not checked again.
            wrapper._plan_index(qo, index, num_qo_heads, num_kv_heads, head_dim, causal=level_causal, **options)
            if states > 1:  # every chunk (and level) reads the queries in place
                share_queries(wrapper._plan, total_q)
            launches.append((wrapper, states))
        if decode_last:
            if graphs:
                decoder = self._graph_decoder(last_index.batch_size)
            else:
                if self._decode is None:
                    self._decode = BatchDecodeWithPagedKVCacheWrapper(self._workspace, self._kv_layout)
                decoder = self._decode
            decode_args = (last_index.indptr, last_index.indices, last_index.last_page_len, num_qo_heads, num_kv_heads,
                           head_dim, page_size)
            decode_options = dict(logits_soft_cap=logits_soft_cap, q_data_type=q_data_type, kv_data_type=kv_data_type,
                                  sm_scale=sm_scale, fixed_split_size=fixed_split_size, batch_invariant=False)
            try:
                decoder.plan(*decode_args, **decode_options)
            except WorkspaceTooSmall:  # the level's split-KV partials do not fit: each request in one piece
                decoder.plan(*decode_args, **decode_options, disable_split_kv=True)
            launches.append((decoder, 1))

        plan = launches[-1][0]._plan
        multi = sum(level_chunks) > 1 or self._batch_invariant
        layout = ([states for _, states in launches], total_q, num_qo_heads, plan.head_dim_vo, plan.o_dtype,
                  self._device)
        if not multi:
            self._states = None
        elif graphs:  # one set of state buffers per layout, kept (see _graph_levels)
            key = (tuple(layout[0]), *layout[1:])
            if key not in self._graph_states:
                self._graph_states[key] = _LevelStates(*layout)
            self._states = self._graph_states[key]
        elif self._states is None or self._states.layout != layout:
            # Kept while the layout holds: FlashInfer's protocol re-plans before every run.
            self._states = _LevelStates(*layout)
        # The cuda decode kernel of the last level reads the earlier states and writes the merged output
        # itself (H200: the merge kernel took 8-10 us of the suite's cascades).
        self._fused_states = 0
        decode_plan = launches[-1][0]._plan if decode_last else None
        if (self._states is not None and decode_plan is not None and not self._batch_invariant and variant is None
                and decode_plan.launch is not None and self._device.type == "cuda"):  # states: the decode's dtype
            decode_plan.launch.set_prior(self._states.values, self._states.lses, total_q)
            self._fused_states = sum(states for _, states in launches[:-1])
        self._launches, self._level_chunks = launches, level_chunks

    begin_forward = plan

    def _pages_capacity(self, level: int) -> int:
        """The most pages a plan may give ``level`` under graphs: its fixed ``kv_indices`` buffer's size."""
        buffer = self._index_capacity[level]
        if buffer is None:
            raise ValueError(f"use_cuda_graph=True needs paged_kv_indices_buf_arr[{level}] (sized for the largest batch)")
        return buffer.numel()

    def _graph_level(self, level: int, qo_entries: int) -> BatchPrefillWithPagedKVCacheWrapper:
        """Under graphs, the wrapper of a level cut into chunks: its own buffers for ``qo_entries - 1`` chunk
        nodes (the caller's are sized for the level's nodes), the same ones for every plan of that count."""
        wrapper = self._graph_levels.get((level, qo_entries))
        if wrapper is None:
            i32 = dict(dtype=torch.int32, device=self._device)
            wrapper = BatchPrefillWithPagedKVCacheWrapper(
                self._workspace, self._kv_layout, use_cuda_graph=True, qo_indptr_buf=torch.empty(qo_entries, **i32),
                paged_kv_indptr_buf=torch.empty(qo_entries, **i32),
                paged_kv_indices_buf=torch.empty(self._pages_capacity(level), **i32),
                paged_kv_last_page_len_buf=torch.empty(qo_entries - 1, **i32))
            self._graph_levels[level, qo_entries] = wrapper
        return wrapper

    def _graph_decoder(self, batch: int) -> BatchDecodeWithPagedKVCacheWrapper:
        """Under graphs, the decode wrapper of a last level of one query per request (buffers of its own, the
        same ones for every plan of that batch size)."""
        decoder = self._graph_decoders.get(batch)
        if decoder is None:
            i32 = dict(dtype=torch.int32, device=self._device)
            decoder = BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, self._kv_layout, use_cuda_graph=True,
                paged_kv_indptr_buffer=torch.empty(batch + 1, **i32),
                paged_kv_indices_buffer=torch.empty(self._pages_capacity(self._num_levels - 1), **i32),
                paged_kv_last_page_len_buffer=torch.empty(max(batch, 1), **i32))
            self._graph_decoders[batch] = decoder
        return decoder

    def workspace_size(
        self, max_batch_size: int, max_qo_tokens: int, max_kv_tokens: int, num_qo_heads: int, num_kv_heads: int,
        head_dim_qk: int, page_size: int = 1, head_dim_vo: int | None = None, *, fixed_split_size: int | None = None,
    ) -> tuple[int, int]:
        """(float_bytes, int_bytes) for every level together; arguments as the prefill wrapper's, plus the
        ``fixed_split_size`` a plan passes. A last level of one query per request runs on the decode kernel,
        whose split-KV partials live in the float workspace (a plan whose split does not fit decodes each
        request whole instead, correct but slower)."""
        prefill = [w.workspace_size(max_batch_size, max_qo_tokens, max_kv_tokens, num_qo_heads, num_kv_heads,
                                    head_dim_qk, page_size, head_dim_vo) for w in self._wrappers]
        if self._decode is None:
            self._decode = BatchDecodeWithPagedKVCacheWrapper(self._workspace, self._kv_layout)
        decode_float, decode_int = self._decode.workspace_size(max_batch_size, max_kv_tokens, num_qo_heads,
                                                               num_kv_heads, head_dim_qk, page_size, fixed_split_size,
                                                               batch_invariant=False)
        return max([decode_float] + [f for f, _ in prefill]), sum(i for _, i in prefill) + decode_int

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._wrappers[0].is_cuda_graph_enabled

    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
        k_scale: float | None = None, v_scale: float | None = None, return_lse: bool = False,
        sinks: torch.Tensor | None = None, **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[total_qo, num_qo_heads, head_dim]`` -> attention over every level's KV (and its natural-log lse).

        ``sinks`` (a jitattn extension): float32 ``[num_qo_heads]`` attention sinks, applied once to the
        final output (the levels and chunks merge without them; the lse returned is the keys' alone).
        ``variant_args``: the planned custom variant's parameters, by name (the same for every level)."""
        if not self._level_chunks:
            raise RuntimeError("MultiLevelCascadeAttentionWrapper.run() called before plan(); call plan() first")
        states = self._states
        if states is None:  # one state and no batch-invariant mode: the level's launch writes the output
            return self._wrappers[0].run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                                         sinks=sinks, **variant_args)
        # Every level (each chunk of a split one) writes its state into the plan's chunk-major buffer;
        # one merge of all the states per query then gives the result (sinks applied there, once).
        # Batch-invariant mode always merges, so a query whose batch has one state gets the bits it
        # gets among more (empty extra states add exact zeros to the merge).
        if not variant_args and sinks is None and not torch.compiler.is_compiling():
            # The per-layer path: each level's plan launched as its wrapper's run() would (that adds only
            # argument defaults here), the merged lse left in a scratch buffer unless asked for.
            k_scale = 1.0 if k_scale is None else fp8_scale(k_scale, "k_scale")
            v_scale = 1.0 if v_scale is None else fp8_scale(v_scale, "v_scale")
            fused = self._fused_states
            for (wrapper, _), (out, lse) in zip(self._launches[:-1] if fused else self._launches, states.levels):
                run_plan(wrapper._plan, wrapper._NAME, wrapper._workspace, q, paged_kv_cache, k_scale=k_scale,
                         v_scale=v_scale, out=out, lse=lse, return_lse=False, fixed_outputs=True)
            if fused:  # the decode launch merges the states above into its own result as it writes it
                wrapper = self._launches[-1][0]
                params = wrapper._plan.launch.params
                params.prior_states = fused
                try:
                    return run_plan(wrapper._plan, wrapper._NAME, wrapper._workspace, q, paged_kv_cache,
                                    k_scale=k_scale, v_scale=v_scale, out=None, lse=None, return_lse=return_lse)
                finally:
                    params.prior_states = 0  # every other launch of the plan (sinks, torch.compile) merges after
            out, lse = states.merge(states.v, states.s, return_lse)
            return (out, lse) if return_lse else out
        for (wrapper, _), (out, lse) in zip(self._launches, states.levels):
            wrapper.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, **variant_args)
        if sinks is not None:
            out, lse = merge_states_with_sinks(states.v, states.s, sinks)
        elif torch.compiler.is_compiling():
            out, lse = merge_states(states.v, states.s)
        else:
            out, lse = states.merge(states.v, states.s)
        return (out, lse) if return_lse else out

    run_return_lse = functools.partialmethod(run, return_lse=True)
    forward = run
    forward_return_lse = run_return_lse


class _LevelStates:
    """The attention states of a cascade plan's levels: reused by every run(), and by later plans of the
    same ``layout`` (a graph captured around run() keeps their addresses).

    ``levels``: per launch (a level, or every level in one) the (out, lse) rows it writes; ``v``/``s``:
    all of them as the ``[total_q, num_states, ...]`` views ``merge_states`` reads. Runs are ordered on
    a stream, so one buffer serves every call (like the workspace, a plan must not run on two streams
    at once)."""

    def __init__(self, launch_states: list[int], total_q: int, num_heads: int, head_dim_vo: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layout = (launch_states, total_q, num_heads, head_dim_vo, dtype, device)
        num_states = sum(launch_states)
        values = torch.empty((num_states * total_q, num_heads, head_dim_vo), dtype=dtype, device=device)
        lses = torch.empty((num_states * total_q, num_heads), dtype=torch.float32, device=device)
        self.values, self.lses = values, lses  # state s of query row i at row s * total_q + i
        self.levels: list[tuple[torch.Tensor, torch.Tensor]] = []
        row = 0
        for chunks in launch_states:
            rows = chunks * total_q
            self.levels.append((values[row: row + rows], lses[row: row + rows]))
            row += rows
        self.v = values.view(num_states, total_q, num_heads, head_dim_vo).transpose(0, 1)
        self.s = lses.view(num_states, total_q, num_heads).transpose(0, 1)
        self.merge = PreparedMerge(self.v, self.s)


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper:
    """Decode over a shared prefix kept in plain tensors plus each request's own paged KV (FlashInfer's older API).

    ``forward`` attends every query to ``k_shared``/``v_shared`` (one single-request prefill
    over the batch's queries), decodes over the unique pages, and merges the two states by LSE.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        self._kv_layout = kv_layout
        self._batch_decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        self._batch_decode_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self, unique_kv_indptr: torch.Tensor, unique_kv_indices: torch.Tensor, unique_kv_last_page_len: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int, data_type: str = "float16", *,
        batch_invariant: bool | None = None,
    ) -> None:
        """Plan the unique (paged) part; ``data_type`` is the q and kv dtype. ``batch_invariant``: as the
        decode wrapper's (the shared part is one prefill, merged with the unique part in a fixed order)."""
        self._batch_decode_wrapper.plan(
            unique_kv_indptr, unique_kv_indices, unique_kv_last_page_len, num_qo_heads, num_kv_heads, head_dim,
            page_size, q_data_type=data_type, kv_data_type=data_type, batch_invariant=batch_invariant,
        )

    plan = begin_forward

    def forward(
        self, q: torch.Tensor, k_shared: torch.Tensor, v_shared: torch.Tensor,
        unique_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """q ``[batch, H_qo, D]``, k/v_shared ``[shared_len, H_kv, D]`` (NHD) / ``[H_kv, shared_len, D]`` (HND)."""
        out, lse = single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False, kv_layout=self._kv_layout,
                                                return_lse=True)
        unique_out, unique_lse = self._batch_decode_wrapper.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(out, lse, unique_out, unique_lse)
        return out

    run = forward

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper:
    """Prefill/append over a shared prefix in plain tensors plus each request's own paged KV (FlashInfer's older API).

    The shared prefix precedes every request's own KV, so ``causal`` applies to the unique part only.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        self._kv_layout = kv_layout
        self._batch_prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._plan_args: tuple = ()
        self._planned: dict | None = None  # the options the unique part was last planned with

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        self._batch_prefill_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def begin_forward(
        self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor, paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor, num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
        *, batch_invariant: bool | None = None,
    ) -> None:
        """Record the unique part's page table; ``forward`` plans it with the dtypes and options it is given.

        ``batch_invariant`` is accepted and changes nothing (prefill never splits the KV)."""
        resolve_batch_invariant(batch_invariant)
        self._plan_args = (qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, num_qo_heads,
                           num_kv_heads, head_dim, page_size)
        self._planned = None

    plan = begin_forward

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
        unique_k = unique_kv_cache[0] if isinstance(unique_kv_cache, (tuple, list)) else unique_kv_cache
        options = dict(causal=causal, sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=unique_k.dtype)
        if options != self._planned:  # plan once per batch and option set, as every layer passes the same
            self._batch_prefill_wrapper.plan(*self._plan_args, **options)
            self._planned = options
        out, lse = single_prefill_with_kv_cache(q, k_shared, v_shared, causal=False, kv_layout=self._kv_layout,
                                                sm_scale=sm_scale, return_lse=True)
        unique_out, unique_lse = self._batch_prefill_wrapper.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(out, lse, unique_out, unique_lse)
        return out

    run = forward

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

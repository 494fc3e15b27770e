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

from dataclasses import dataclass

import torch

from ..runtime.batch import WorkspaceTooSmall, check_sinks, share_queries
from ..runtime.builder import attention_options, kernel_spec, num_workers
from ..runtime.cascade_states import LevelStates
from ..runtime.checks import check_tensor, not_planned, target_of
from ..runtime.grad import no_backward
from ..runtime.compiled import cascade_run_compiled, register_wrapper
from ..runtime.merge import merge_state, merge_state_in_place, merge_states, merge_states_with_sinks
from ..runtime.wrapper import NotCopyable, host_side, returning_lse, workspace_target
from ..runtime.options import (check_flag, fp8_scale, parse_pos_encoding, per_level, positive_int,
                               resolve_batch_invariant, resolve_flag, resolve_window_left)
from ..kv_split import (batch_invariant_chunk, cascade_chunk_pages, cascade_level_chunks, check_fixed_split_size,
                        concat_level_tables, graph_level_chunks, split_level_page_table)
from ..page_table import PagedIndex, check_cache_pool, check_indptr, check_paged_index
from .decode import BatchDecodeWithPagedKVCacheWrapper
from ..kernels.prefill import query_tile_rows
from ..hardware import capability
from ..jit import resident_blocks
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from .shared_prefix import (BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
                            BatchPrefillWithSharedPrefixPagedKVCacheWrapper)
from ..spec import KVStorage, Op, PosEncoding
from ..variant import AttentionVariant

__all__ = ["BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
           "MultiLevelCascadeAttentionWrapper", "merge_state", "merge_state_in_place", "merge_states"]


class MultiLevelCascadeAttentionWrapper(NotCopyable):
    """Multi-level cascade attention over a paged KV cache (FlashInfer-compatible)."""

    def __init__(
        self, num_levels: int, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
        use_cuda_graph: bool = False, qo_indptr_buf_arr: list[torch.Tensor] | None = None,
        paged_kv_indptr_buf_arr: list[torch.Tensor] | None = None,
        paged_kv_indices_buf_arr: list[torch.Tensor] | None = None,
        paged_kv_last_page_len_buf_arr: list[torch.Tensor] | None = None,
    ) -> None:
        self._num_levels = positive_int(num_levels, "num_levels")
        _, self._device = workspace_target(float_workspace_buffer, "MultiLevelCascadeAttentionWrapper")
        self._level_chunks: list[int] = []  # KV chunks per level of the last plan (empty: not planned)
        # (wrapper, states it writes): prefill wrappers, then the decode wrapper of a one-query-per-request last level
        self._launches: list[tuple[BatchPrefillWithPagedKVCacheWrapper | BatchDecodeWithPagedKVCacheWrapper, int]] = []
        self._states: LevelStates | None = None  # the plan's state buffers (None: one state, written as out)
        # States the last launch (the cuda decode kernel) merges into its own result (0: a merge kernel does)
        self._fused_states = 0
        self._dependent_decode = False  # that launch is a programmatic dependent of the levels' (sm_90 and later)
        self._batch_invariant = False  # the last plan's mode
        self._workspace, self._kv_layout, self._op_key = float_workspace_buffer, kv_layout, register_wrapper(self)
        self._decode: BatchDecodeWithPagedKVCacheWrapper | None = None  # a last level of one query per request
        # Under CUDA graphs: the wrappers (with buffers of their own, sized for a batch shape) of levels cut
        # into chunks, by (level, chunk nodes + 1), and of a last level on the decode kernel, by batch size; and
        # the state buffers by layout. Kept for every shape planned (a few), so a run() captured for one shape
        # reads the same memory after any later plan of that shape, other shapes planned in between.
        self._graph_levels: dict[tuple[int, int], BatchPrefillWithPagedKVCacheWrapper] = {}
        self._graph_decoders: dict[int, BatchDecodeWithPagedKVCacheWrapper] = {}
        self._graph_states: dict[tuple, LevelStates] = {}

        arrays = {"qo_indptr_buf_arr": qo_indptr_buf_arr, "paged_kv_indptr_buf_arr": paged_kv_indptr_buf_arr,
                  "paged_kv_indices_buf_arr": paged_kv_indices_buf_arr,
                  "paged_kv_last_page_len_buf_arr": paged_kv_last_page_len_buf_arr}
        use_cuda_graph = resolve_flag(use_cuda_graph, "use_cuda_graph")
        if use_cuda_graph and any(v is None for v in arrays.values()):  # (the levels would name their own)
            raise ValueError(f"use_cuda_graph=True needs {', '.join(arrays)}: one fixed buffer per level, each sized "
                             "for the largest batch")
        bufs = [per_level(name, values, self._num_levels) for name, values in arrays.items()]
        self._index_capacity = bufs[2]  # graph mode: pages
        self._wrappers = [BatchPrefillWithPagedKVCacheWrapper(
            float_workspace_buffer, kv_layout, use_cuda_graph=use_cuda_graph, qo_indptr_buf=qo, paged_kv_indptr_buf=kvp,
            paged_kv_indices_buf=idx, paged_kv_last_page_len_buf=last) for qo, kvp, idx, last in zip(*bufs)]

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffers=None) -> None:
        name = "MultiLevelCascadeAttentionWrapper.reset_workspace_buffer"  # (its levels' wrappers check it again)
        workspace_target(float_workspace_buffer, name)
        target_of(name, (float_workspace_buffer, self._workspace))
        per_level("int_workspace_buffers", int_workspace_buffers, self._num_levels)  # (accepted, not used)
        self._workspace = float_workspace_buffer
        for wrapper in (self._wrappers + ([self._decode] if self._decode is not None else [])
                        + list(self._graph_levels.values()) + list(self._graph_decoders.values())):
            wrapper.reset_workspace_buffer(float_workspace_buffer)

    @host_side
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

        ``variant``: a custom variant run at every level: the levels are merged by LSE, so it must use softmax and
        have no output transform, and it may not read positions (``request``, ``q_idx``, ``kv_idx``, ``qo_len``,
        ``kv_len``: a level's are its node's)."""
        self._level_chunks = []  # unplanned until every check and level plan below has succeeded
        check_flag(use_fp16_qk_reduction, "use_fp16_qk_reduction")
        causal, total_q = self._check_plan(qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr,
                                           paged_kv_last_page_len, causal, pos_encoding_mode, window_left, variant,
                                           fixed_split_size)
        self._batch_invariant = resolve_batch_invariant(batch_invariant)
        rules = self._level_rules(total_q, causal, variant, fixed_split_size, num_qo_heads, num_kv_heads, head_dim,
                                  page_size, q_data_type, kv_data_type, logits_soft_cap)
        tables: list[tuple[torch.Tensor, PagedIndex, bool]] = []  # per level: (qo_indptr, page table, causal)
        level_chunks: list[int] = []
        decode_last = False
        for level in range(self._num_levels):
            qo_host, index, level_causal, chunks, decode_last = self._level_table(
                level, rules, qo_indptr_arr[level], paged_kv_indptr_arr[level], paged_kv_indices_arr[level],
                paged_kv_last_page_len[level])
            level_chunks.append(chunks)
            tables.append((qo_host, index, level_causal))
        self._highest = max((index for _, index, _ in tables), key=lambda index: index.max_page_index)
        options = dict(sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                       kv_data_type=kv_data_type, variant=variant)
        launches = self._prefill_launches(rules, tables, level_chunks, decode_last, num_qo_heads, num_kv_heads,
                                          head_dim, options)
        if decode_last:
            launches.append((self._plan_decode_level(tables[-1][1], rules.graphs, num_qo_heads, num_kv_heads, head_dim,
                                                     page_size, options, fixed_split_size), 1))
        self._plan_states(launches, level_chunks, decode_last, rules.graphs, total_q, num_qo_heads, variant)
        self._launches, self._level_chunks = launches, level_chunks

    def _check_plan(self, qo_indptr_arr, paged_kv_indptr_arr, paged_kv_indices_arr, paged_kv_last_page_len, causal,
                    pos_encoding_mode, window_left, variant, fixed_split_size) -> tuple[bool, int]:
        """The arrays' shape of lists and the options every level shares: (causal, total query count)."""
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
        if variant is not None and (not variant.splittable or variant.position_names):
            why = (f"it reads {', '.join(variant.position_names)}, which each level gives relative to its own node"
                   if variant.splittable else "its levels' LSE merge needs softmax and no output_transform")
            raise ValueError(f"variant {variant.name!r} cannot run in cascade: {why}; use the flat prefill wrapper")
        totals = {int(qo[-1]) for qo in qo_indptr_arr}
        if len(totals) != 1:
            raise ValueError(f"every level's qo_indptr must end at the same token count; got {sorted(totals)}")
        (total_q,) = totals
        return causal, total_q

    def _level_rules(self, total_q, causal, variant, fixed_split_size, num_qo_heads, num_kv_heads, head_dim,
                     page_size, q_data_type, kv_data_type, logits_soft_cap) -> _LevelRules:
        prefill = self._wrappers[0]
        # A split shared level fills one wave of the prefill kernel's resident blocks (one per SM on the
        # sm90 tier, whose blocks take items dynamically).
        blocks_per_sm = resident_blocks(kernel_spec(
            attention_options(Op.PREFILL, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim,
                              q_data_type=q_data_type, kv_data_type=kv_data_type, logits_soft_cap=logits_soft_cap),
            prefill.target, prefill.kv_layout, KVStorage.PAGED))
        graphs = prefill.is_cuda_graph_enabled
        # Under graphs (not batch-invariant, no variant) a shared level is still cut into chunks and a last
        # level of one query per request still runs on the decode kernel, with counts that depend on the batch
        # shape alone (nodes, queries: what a captured launch keeps), not on the lengths.
        return _LevelRules(
            total_q=total_q, causal=causal, variant=variant, fixed_split_size=fixed_split_size, page_size=page_size,
            group=num_qo_heads // max(1, num_kv_heads), tile_rows=query_tile_rows(head_dim, head_dim),
            num_kv_heads=num_kv_heads, blocks_per_sm=blocks_per_sm, num_sms=num_workers(self._device),
            graphs=graphs, graph_fixed=graphs and not self._batch_invariant and variant is None,
            batch_invariant=self._batch_invariant)

    def _level_table(self, level: int, rules: _LevelRules, qo_indptr, kv_indptr, kv_indices, last_page_len):
        """Level ``level``'s checked table, cut into chunks where it is split: (qo_indptr, page table, causal,
        chunks, whether it runs on the decode kernel)."""
        last = level == self._num_levels - 1
        level_causal = rules.causal if last else False
        qo_host = check_indptr(f"qo_indptr_arr[{level}]", qo_indptr)
        index = check_paged_index(kv_indptr, kv_indices, last_page_len, rules.page_size,
                                  names=(f"paged_kv_indptr_arr[{level}]", f"paged_kv_indices_arr[{level}]",
                                         f"paged_kv_last_page_len[{level}]"))
        qo_lens = (qo_host[1:] - qo_host[:-1]).tolist()
        if len(qo_lens) != index.batch_size:
            raise ValueError(f"level {level}: qo_indptr_arr[{level}] has {len(qo_lens)} nodes but "
                             f"paged_kv_indptr_arr[{level}] has {index.batch_size}; a level's arrays describe "
                             "the same nodes")
        # Under graphs the last level's kernel follows the shape: one query per node when total_q equals
        # the node count (then every node must have exactly one), else the prefill kernels.
        one_each = bool(qo_lens) and all(n == 1 for n in qo_lens)
        if rules.graph_fixed and last and len(qo_lens) == rules.total_q and not one_each:
            raise ValueError(f"under CUDA graphs a last level of as many queries as nodes ({rules.total_q}) takes one "
                             "query per node (its decode-kernel launch is captured for that shape); got "
                             f"{qo_lens[:8]}...: plan other query counts on a wrapper of their own")
        # graphs: one query per node is a property of the shape (total_q == nodes, both captured)
        shape_one_each = (rules.graph_fixed and len(qo_lens) == rules.total_q and one_each if rules.graphs
                          else one_each)
        relaxable = shape_one_each if rules.graphs else max(qo_lens, default=0) <= 1
        if level_causal and relaxable and not rules.batch_invariant:
            # One query per request sees every key: causal or not, the same. Under graphs only when
            # that holds for the shape (one query per request: total_q == nodes, both captured), not in
            # batch-invariant mode (whether a request's level may split must not depend on its
            # companions' query counts).
            level_causal = False
        # A last level of one query per request (decode under a shared prefix) runs on the decode
        # kernel, which splits long KV itself; the earlier levels run on the prefill kernels. In a
        # prefill's 128-row tiles such a request fills a few rows (H200: b128 over 8k shared + 256
        # each, its one-launch cascade took 216.8 us on the sm90 tier). Under graphs on a decode wrapper
        # with buffers of its own (the level's are the caller's); not in batch-invariant mode (its merge
        # order is the levels' chunk order).
        decode_last = (last and level > 0 and not level_causal and shape_one_each and not rules.batch_invariant
                       and rules.variant is None)
        chunks = 1
        # Splitting shifts positions inside a chunk: only for plain, non-causal levels; under graphs into
        # a count fixed by the shape (graph_fixed), on a prefill wrapper with buffers of its own.
        if rules.graph_fixed and not level_causal and not decode_last:
            chunks = graph_level_chunks(rules.total_q, group=rules.group, tile_rows=rules.tile_rows,
                                        num_kv_heads=rules.num_kv_heads, num_sms=rules.num_sms,
                                        blocks_per_sm=rules.blocks_per_sm)
            if chunks > 1:
                qo_host, index = split_level_page_table(qo_host, index, chunks)
        elif not level_causal and rules.variant is None and not rules.graphs and not decode_last:
            qo_host, index, chunks = self._split_shared_level(rules, qo_host, index, qo_lens)
        return qo_host, index, level_causal, chunks, decode_last

    @staticmethod
    def _split_shared_level(rules: _LevelRules, qo_host, index, qo_lens):
        """A shared level cut into the chunks that fill the device (without graphs): (qo_indptr, table, chunks)."""
        chunks = cascade_level_chunks(index.kv_lens, num_kv_heads=rules.num_kv_heads, num_sms=rules.num_sms,
                                      page_size=rules.page_size, fixed_split_size=rules.fixed_split_size,
                                      blocks_per_sm=rules.blocks_per_sm,
                                      query_tiles=sum(-(-n * rules.group // rules.tile_rows) for n in qo_lens),
                                      batch_invariant=rules.batch_invariant)
        pages_per_chunk = None  # fixed_split_size: the nodes' pages shared out evenly
        if rules.batch_invariant:
            pages_per_chunk = batch_invariant_chunk(rules.page_size, rules.fixed_split_size) // rules.page_size
        elif chunks > 1 and rules.fixed_split_size is None:
            longest = max(-(-n // rules.page_size) for n in index.kv_lens)
            chunks, pages_per_chunk = cascade_chunk_pages(longest, chunks, rules.page_size)
        if chunks > 1:
            qo_host, index = split_level_page_table(qo_host, index, chunks, pages_per_chunk)
        return qo_host, index, chunks

    def _prefill_launches(self, rules: _LevelRules, tables, level_chunks, decode_last, num_qo_heads, num_kv_heads,
                          head_dim, options) -> list[tuple]:
        """The prefill-kernel launches of the levels (all but a decode-kernel last level), planned."""
        prefill_tables = tables[:-1] if decode_last else tables
        prefill_chunks = level_chunks[:-1] if decode_last else level_chunks
        # Without graphs (their buffers are per level) and with every level non-causal, all the levels
        # are one batch: one launch computes every state (the level page tables one after another).
        if len(prefill_tables) > 1 and not rules.graphs and not any(causal for _, _, causal in prefill_tables):
            qo_all, index_all = concat_level_tables([(qo, index) for qo, index, _ in prefill_tables])
            launch_levels = [(self._wrappers[0], qo_all, index_all, False, sum(prefill_chunks))]
        else:
            launch_levels = [(self._graph_level(level, qo.numel()) if rules.graph_fixed and chunks > 1 else wrapper, qo,
                              index, level_causal, chunks)
                             for level, (wrapper, (qo, index, level_causal), chunks)
                             in enumerate(zip(self._wrappers, prefill_tables, prefill_chunks))]
        launches = []
        for wrapper, qo, index, level_causal, states in launch_levels:
            # The level's checked page table is handed on, not checked again.
            wrapper.plan_checked(qo, index, num_qo_heads, num_kv_heads, head_dim, causal=level_causal, **options)
            if states > 1:  # every chunk (and level) reads the queries in place
                share_queries(wrapper.current_plan, rules.total_q)
            launches.append((wrapper, states))
        return launches

    def _plan_decode_level(self, index: PagedIndex, graphs: bool, num_qo_heads, num_kv_heads, head_dim, page_size,
                           options, fixed_split_size) -> BatchDecodeWithPagedKVCacheWrapper:
        """The decode wrapper of a last level of one query per request, planned."""
        if graphs:
            decoder = self._graph_decoder(index.batch_size)
        else:
            if self._decode is None:
                self._decode = BatchDecodeWithPagedKVCacheWrapper(self._workspace, self._kv_layout)
            decoder = self._decode
        decode_args = (index, num_qo_heads, num_kv_heads, head_dim)  # the level's checked page table, handed on
        decode_options = dict(logits_soft_cap=options["logits_soft_cap"], q_data_type=options["q_data_type"],
                              kv_data_type=options["kv_data_type"], sm_scale=options["sm_scale"],
                              fixed_split_size=fixed_split_size, batch_invariant=False)
        try:
            decoder.plan_checked(*decode_args, **decode_options)
        except WorkspaceTooSmall:  # the level's split-KV partials do not fit: each request in one piece
            decoder.plan_checked(*decode_args, **decode_options, disable_split_kv=True)
        return decoder

    def _plan_states(self, launches, level_chunks, decode_last, graphs, total_q, num_qo_heads, variant) -> None:
        """The state buffers the levels write (None: one state, written as the output), and the states a cuda
        decode-kernel last level merges into its own result."""
        plan = launches[-1][0].current_plan
        multi = sum(level_chunks) > 1 or self._batch_invariant
        layout = ([states for _, states in launches], total_q, num_qo_heads, plan.head_dim_vo, plan.o_dtype,
                  self._device)
        if not multi:
            self._states = None
        elif graphs:  # one set of state buffers per layout, kept (see _graph_levels)
            key = (tuple(layout[0]), *layout[1:])
            if key not in self._graph_states:
                self._graph_states[key] = LevelStates(*layout)
            self._states = self._graph_states[key]
        elif self._states is None or self._states.layout != layout:
            # Kept while the layout holds: FlashInfer's protocol re-plans before every run.
            self._states = LevelStates(*layout)
        # The cuda decode kernel of the last level reads the earlier states and writes the merged output
        # itself (H200: the merge kernel took 8-10 us of the suite's cascades).
        self._fused_states, self._dependent_decode = 0, False
        decode_plan = plan if decode_last else None
        if (self._states is not None and decode_plan is not None and not self._batch_invariant and variant is None
                and decode_plan.launch is not None and self._device.type == "cuda"):  # states: the decode's dtype
            decode_plan.launch.set_prior(self._states.values, self._states.lses, total_q)
            self._fused_states = sum(states for _, states in launches[:-1])
            # On sm_90 and later the decode launch is a programmatic dependent of the last level's (it reads
            # nothing else that launch writes): its blocks start as that launch's blocks finish.
            self._dependent_decode = capability(self._device.index) >= (9, 0)

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
        """Under graphs, the decode wrapper of a last level of one query per request (its own buffers, per batch)."""
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

    @no_backward
    def run(
        self, q: torch.Tensor, paged_kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor], *,
        k_scale: float | None = None, v_scale: float | None = None, return_lse: bool = False,
        sinks: torch.Tensor | None = None, **variant_args,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[total_qo, num_qo_heads, head_dim]`` -> attention over every level's KV (and its natural-log lse).

        ``sinks`` (a jitattn extension): float32 ``[num_qo_heads]`` attention sinks, applied once to the
        final output (the levels and chunks merge without them; the lse returned is the keys' alone).
        ``variant_args``: the planned custom variant's parameters, by name (the same for every level; no out/lse)."""
        if variant_args and ("out" in variant_args or "lse" in variant_args):
            raise TypeError("MultiLevelCascadeAttentionWrapper.run() takes no out= or lse= (FlashInfer's takes (q, "
                            "paged_kv_cache) only): it returns a new output; for the lse pass return_lse=True")
        if len(self._level_chunks) == 0:  # (not its values: traced, they would be guards, a recompile a plan)
            raise not_planned("MultiLevelCascadeAttentionWrapper")
        check_tensor("MultiLevelCascadeAttentionWrapper.run(): q", q, last_dim_contiguous=False)
        return_lse = resolve_flag(return_lse, "return_lse")  # (a level wrapper's run() would check only one plan's)
        check_cache_pool(self._highest, paged_kv_cache)  # the level named (a decode level's own check would not)
        states = self._states
        if states is None:  # one state and no batch-invariant mode: the level's launch writes the output
            return self._wrappers[0].run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse,
                                         sinks=sinks, **variant_args)
        if sinks is not None and q.dim() == 3:  # checked before any level runs (the final merge applies them)
            check_sinks("MultiLevelCascadeAttentionWrapper.run()", sinks, q.shape[1], q.device)
        # Every level (each chunk of a split one) writes its state into the plan's chunk-major buffer, then one merge
        # per query (sinks applied there; batch-invariant mode always merges: empty states add exact zeros).
        if not variant_args and sinks is None:
            if torch.compiler.is_compiling():  # one op (runtime/compiled.py)
                return cascade_run_compiled(self._op_key, q, paged_kv_cache, self._kv_layout, k_scale, v_scale,
                                            return_lse)
            # The per-layer path: each level's plan launched as its wrapper's run() would (that adds only
            # argument defaults here), the merged lse left in a scratch buffer unless asked for.
            k_scale = 1.0 if k_scale is None else fp8_scale(k_scale, "k_scale")
            v_scale = 1.0 if v_scale is None else fp8_scale(v_scale, "v_scale")
            fused = self._fused_states
            for (wrapper, _), (out, lse) in zip(self._launches[:-1] if fused else self._launches, states.levels):
                wrapper.run_planned(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                                    return_lse=False, fixed_outputs=True)
            if fused:  # the decode launch merges the states above into its own result as it writes it
                wrapper = self._launches[-1][0]
                params = wrapper.current_plan.launch.params
                params.prior_states, params.prior_pdl = fused, int(self._dependent_decode)
                try:
                    return wrapper.run_planned(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, out=None,
                                               lse=None, return_lse=return_lse)
                finally:
                    # every other launch of the plan (sinks, torch.compile) merges after, not as a dependent
                    params.prior_states = params.prior_pdl = 0
            out, lse = states.merge(states.v, states.s, return_lse)
            return (out, lse) if return_lse else out
        for (wrapper, _), (out, lse) in zip(self._launches, states.levels):
            wrapper.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, **variant_args)
        if sinks is not None:
            out, lse = merge_states_with_sinks(states.v, states.s, sinks)
        else:  # (variant parameters: refused under torch.compile by the level's run)
            out, lse = states.merge(states.v, states.s)
        return (out, lse) if return_lse else out

    run_return_lse = returning_lse(run)
    forward = run
    forward_return_lse = run_return_lse
    run_natural_lse = run  # (not overridden by jitattn.flashinfer's base-2 run: the compiled op calls it)


@dataclass(frozen=True)
class _LevelRules:
    """One plan's constants that decide how each level is launched (see ``plan``)."""

    total_q: int
    causal: bool
    variant: AttentionVariant | None
    fixed_split_size: int | None
    page_size: int
    group: int  # query heads per KV head
    tile_rows: int  # the prefill kernel's query tile
    num_kv_heads: int
    blocks_per_sm: int
    num_sms: int
    graphs: bool
    graph_fixed: bool  # under graphs, chunk and kernel counts follow the batch shape (not batch-invariant, no variant)
    batch_invariant: bool

"""CUDA-graph capture of the flat decode step, one graph per batch-size bucket.

A bucket's graph replays the whole model forward for ``bucket`` requests: embedding, every
layer's append + decode attention + MLP, and the lm head. Everything it reads lives in fixed
buffers: token ids, positions, append indices, and the page table of a ``use_cuda_graph=True``
decode wrapper, which ``plan()`` refills before each replay. A batch smaller than its bucket is
padded with rows that point at the pool's scratch page (one token, written and read there only).

A cascade step is captured the same way (``CascadeGraph``): one level per level of the batch's
prefix tree (``attention.prefix_tree``, cut to at most ``MAX_SHARED_LEVELS`` levels by the engine with
``attention.limit_levels``) and each row's own pages last. A captured launch keeps its shape, so
each shared level is padded with empty nodes (no queries, no pages) to a node count of the bucket's
(``node_capacity``: a power of two from 8 up to the bucket, which bounds any tree over the bucket's
rows), and one graph is kept per (bucket, node counts): a step of any number of prefix groups and
levels replays a graph, none runs eagerly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

import jitattn

from .attention import SeqView, SharedNode, page_table, to_device, tree_cascade_levels
from .kv_pool import KVPool
from .model import LlamaModel


def bucket_of(batch_size: int, max_batch_size: int) -> int:
    """The smallest of ``bucket_sizes(max_batch_size)`` that holds ``batch_size`` rows, without listing them (an
    engine's limit may be far above any batch it runs)."""
    if not 1 <= batch_size <= max_batch_size:
        raise ValueError(f"a batch of {batch_size} rows is outside the buckets of 1 to {max_batch_size} rows")
    rounded = next(b for b in (1, 2, 4) if b >= batch_size) if batch_size <= 4 else -(-batch_size // 8) * 8
    return min(rounded, max_batch_size)


def bucket_sizes(max_batch_size: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to ``max_batch_size`` (inclusive)."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size] + list(range(8, max_batch_size + 1, 8))
    if not sizes or sizes[-1] != max_batch_size:
        sizes.append(max_batch_size)
    return sorted(set(sizes))


class _CapturedStep:
    """What the captured decode step of one bucket keeps: fixed input buffers, every row's page table (the
    appends read it), the forward it replays. Subclasses make ``wrapper`` and plan it before ``_replay``."""

    wrapper: object

    def __init__(self, model: LlamaModel, pool: KVPool, bucket: int, max_pages_per_seq: int, memory_pool) -> None:
        dev = model.device
        i32 = dict(dtype=torch.int32, device=dev)
        self.model, self.pool, self.bucket = model, pool, bucket
        self.input_ids = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.positions = torch.zeros(bucket, dtype=torch.long, device=dev)
        self.batch_indices = torch.arange(bucket, **i32)
        self.append_positions = torch.zeros(bucket, **i32)
        self.indptr = torch.zeros(bucket + 1, **i32)
        self.indices = torch.zeros(bucket * max_pages_per_seq, **i32)
        self.last_page_len = torch.ones(bucket, **i32)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.memory_pool = memory_pool
        self.logits: torch.Tensor | None = None

    def _attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.caches[layer]
        jitattn.append_paged_kv_cache(k, v, self.batch_indices, self.append_positions, cache, self.indices,
                                      self.indptr, self.last_page_len)
        return self.wrapper.run(q, cache)

    def _forward(self) -> torch.Tensor:
        return self.model.logits(self.model.forward(self.input_ids, self.positions, self._attention))

    def _rows(self, seqs: list[SeqView]) -> list[SeqView]:
        """``seqs`` padded to the bucket with rows on the scratch page."""
        return list(seqs) + [SeqView((KVPool.SCRATCH_PAGE,), 1, 1)] * (self.bucket - len(seqs))

    def _replay(self, rows: list[SeqView], input_ids: torch.Tensor, n: int,
                append_positions: torch.Tensor | None = None) -> torch.Tensor:
        """Fill the inputs of ``rows`` (planned already), capture on the first use, replay; the first ``n`` logits.
        ``input_ids``: the ``n`` real rows' ids on the device (padding rows keep earlier, valid ids);
        ``append_positions``: where each row's new token goes in the append table (default: its position)."""
        self.input_ids[:n].copy_(input_ids)
        positions = torch.tensor([s.kv_len - 1 for s in rows])
        staged = torch.stack([positions, positions if append_positions is None else append_positions.long()])
        staged = to_device(staged, self.positions.device)
        self.positions.copy_(staged[0])
        self.append_positions.copy_(staged[1])
        if self.graph is None:
            self.logits = self._forward()  # warm-up outside the capture (loads kernels, same writes)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.memory_pool):
                self.logits = self._forward()
            self.graph = graph  # kept once captured: a capture that raised is tried again, never replayed
        self.graph.replay()
        return self.logits[:n]


class DecodeGraph(_CapturedStep):
    """The captured decode step of one bucket (see the module docstring)."""

    def __init__(self, model: LlamaModel, pool: KVPool, workspace: torch.Tensor, bucket: int, max_pages_per_seq: int,
                 memory_pool=None) -> None:
        super().__init__(model, pool, bucket, max_pages_per_seq, memory_pool)
        self.wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
            workspace, use_cuda_graph=True, paged_kv_indptr_buffer=self.indptr, paged_kv_indices_buffer=self.indices,
            paged_kv_last_page_len_buffer=self.last_page_len)

    def run(self, seqs: list[SeqView], input_ids: torch.Tensor) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` of one decode step (captured on the bucket's first use); ``input_ids``
        on the device."""
        rows = self._rows(seqs)
        c = self.model.config
        self.wrapper.plan(*page_table(rows, self.pool.page_size), self.model.num_q_heads, self.model.num_kv_heads,
                          c.head_dim, self.pool.page_size, q_data_type=self.model.dtype, kv_data_type=self.model.dtype)
        return self._replay(rows, input_ids, len(seqs))


MAX_SHARED_LEVELS = 6  # shared levels a captured cascade step takes (the engine cuts deeper trees to this many)


def node_capacity(nodes: int, bucket: int) -> int:
    """Nodes a captured shared level is sized for: the next power of two >= ``nodes``, at least 8, at most
    ``bucket`` (a level over ``bucket`` rows has at most that many nodes)."""
    capacity = 8
    while capacity < nodes:
        capacity *= 2
    return max(nodes, min(capacity, bucket))


def padded_cascade_levels(seqs: list[SeqView], tree: list[list[SharedNode]], bucket: int,
                          page_size: int) -> tuple[tuple[list, list, list, list], tuple[int, ...]]:
    """The plan arrays of a captured cascade step over ``seqs`` (padded to ``bucket`` rows on the scratch
    page) and ``tree`` (:func:`prefix_tree` of ``seqs``, its first ``MAX_SHARED_LEVELS`` levels), each shared
    level padded with empty nodes to its ``node_capacity``; and those capacities (the graph's shape)."""
    rows = list(seqs) + [SeqView((KVPool.SCRATCH_PAGE,), 1, 1)] * (bucket - len(seqs))
    qo, kv_indptr, kv_indices, last = tree_cascade_levels(rows, tree[:MAX_SHARED_LEVELS], page_size)
    capacities = tuple(node_capacity(t.numel() - 1, bucket) for t in qo[:-1])
    for level, capacity in enumerate(capacities):
        extra = capacity - (qo[level].numel() - 1)
        qo[level] = torch.cat([qo[level], qo[level][-1:].expand(extra)])
        kv_indptr[level] = torch.cat([kv_indptr[level], kv_indptr[level][-1:].expand(extra)])
        last[level] = torch.cat([last[level], torch.full((extra,), page_size, dtype=torch.int32)])
    return (qo, kv_indptr, kv_indices, last), capacities


class CascadeGraph(_CapturedStep):
    """The captured cascade decode step of one bucket and one shape: ``capacities[l]`` nodes at shared level l,
    then one per row (see the module docstring)."""

    def __init__(self, model: LlamaModel, pool: KVPool, workspace: torch.Tensor, bucket: int, max_pages_per_seq: int,
                 capacities: tuple[int, ...], memory_pool=None) -> None:
        super().__init__(model, pool, bucket, max_pages_per_seq, memory_pool)
        self.capacities = tuple(capacities)
        i32 = dict(dtype=torch.int32, device=model.device)
        nodes = [*self.capacities, bucket]
        level_pages = bucket * max_pages_per_seq
        self.wrapper = jitattn.MultiLevelCascadeAttentionWrapper(
            len(nodes), workspace, use_cuda_graph=True,
            qo_indptr_buf_arr=[torch.zeros(n + 1, **i32) for n in nodes],
            paged_kv_indptr_buf_arr=[torch.zeros(n + 1, **i32) for n in nodes],
            paged_kv_indices_buf_arr=[torch.zeros(level_pages, **i32) for _ in nodes],
            paged_kv_last_page_len_buf_arr=[torch.zeros(n, **i32) for n in nodes])

    def run(self, seqs: list[SeqView], input_ids: torch.Tensor, levels: tuple[list, list, list, list]) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` of one cascade decode step over ``levels`` (:func:`padded_cascade_levels`
        of ``seqs`` for this graph's bucket and capacities); captured on first use."""
        shape = (levels[0][-1].numel() - 1, tuple(t.numel() - 1 for t in levels[0][:-1]))
        if shape != (self.bucket, self.capacities):
            raise ValueError(f"levels of {shape[0]} rows and {shape[1]} shared nodes; this graph is captured for "
                             f"{self.bucket} rows and {self.capacities}")
        n, ps = len(seqs), self.pool.page_size
        rows = self._rows(seqs)
        # the appends' table: each row's last page only (its new token's), the position counted from that page
        last_page = [(s.kv_len - 1) // ps for s in rows]
        tail_indptr, tail_indices, tail_last = page_table(rows, ps, last_page)
        staged = to_device(torch.cat([tail_indptr, tail_indices, tail_last]), self.indptr.device)
        a, b = tail_indptr.numel(), tail_indptr.numel() + tail_indices.numel()
        self.indptr.copy_(staged[:a])
        self.indices[: b - a].copy_(staged[a:b])
        self.last_page_len.copy_(staged[b:])
        append_positions = torch.tensor([(s.kv_len - 1) % ps for s in rows], dtype=torch.int32)
        c = self.model.config
        self.wrapper.plan(*levels, self.model.num_q_heads, self.model.num_kv_heads, c.head_dim, ps, causal=False,
                          q_data_type=self.model.dtype, kv_data_type=self.model.dtype)
        return self._replay(rows, input_ids, n, append_positions)


class StepGraphs:
    """An engine's captured decode steps: ``flat`` by batch-size bucket, ``cascade`` by (bucket, node counts of
    its shared levels), each captured on first use; all in one memory pool (None: the default)."""

    def __init__(self, model: LlamaModel, pool: KVPool, workspace: torch.Tensor, max_batch_size: int,
                 max_pages_per_seq: int, memory_pool=None) -> None:
        self.model, self.pool, self.workspace, self.memory_pool = model, pool, workspace, memory_pool
        self.max_batch_size, self.max_pages_per_seq = max_batch_size, max_pages_per_seq
        self.flat: dict[int, DecodeGraph] = {}
        self.cascade: dict[tuple[int, tuple[int, ...]], CascadeGraph] = {}

    @property
    def buckets(self) -> list[int]:
        """Every bucket (``capture`` captures them all)."""
        return bucket_sizes(self.max_batch_size)

    def bucket(self, batch_size: int) -> int:
        """The smallest bucket of at least ``batch_size`` rows."""
        return bucket_of(batch_size, self.max_batch_size)

    def flat_graph(self, bucket: int) -> DecodeGraph:
        if bucket not in self.flat:
            self.flat[bucket] = DecodeGraph(self.model, self.pool, self.workspace, bucket, self.max_pages_per_seq,
                                            self.memory_pool)
        return self.flat[bucket]

    def cascade_graph(self, bucket: int, capacities: tuple[int, ...]) -> CascadeGraph:
        key = (bucket, capacities)
        if key not in self.cascade:
            self.cascade[key] = CascadeGraph(self.model, self.pool, self.workspace, bucket, self.max_pages_per_seq,
                                             capacities, self.memory_pool)
        return self.cascade[key]

    def capture(self, shared_levels: Sequence[int]) -> int:
        """Capture every bucket's flat step and its cascade steps of each count in ``shared_levels`` (one empty
        node a level: sized by ``node_capacity``) not captured yet, every row on the scratch page; returns how many
        were captured."""
        ids = torch.zeros(0, dtype=torch.long, device=self.model.device)
        captured = 0
        with torch.no_grad():
            for bucket in self.buckets:
                if bucket not in self.flat:
                    self.flat_graph(bucket).run([], ids)
                    captured += 1
                for depth in shared_levels:
                    tree = [[SharedNode(0, bucket, 0, 0)]] * depth
                    levels, capacities = padded_cascade_levels([], tree, bucket, self.pool.page_size)
                    if (bucket, capacities) not in self.cascade:
                        self.cascade_graph(bucket, capacities).run([], ids, levels)
                        captured += 1
        return captured

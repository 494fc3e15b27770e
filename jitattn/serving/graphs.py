"""CUDA-graph capture of the flat decode step, one graph per batch-size bucket.

A bucket's graph replays the whole model forward for ``bucket`` requests: embedding, every
layer's append + decode attention + MLP, and the lm head. Everything it reads lives in fixed
buffers: token ids, positions, append indices, and the page table of a ``use_cuda_graph=True``
decode wrapper, which ``plan()`` refills before each replay. A batch smaller than its bucket is
padded with rows that point at the pool's scratch page (one token, written and read there only).

A cascade step is captured the same way (``CascadeGraph``, one per bucket): two levels whose node
counts are fixed -- level 0 the prefix groups' shared pages (runs of groups sharing nothing as one
node), padded to ``max_groups`` nodes plus one for the padding rows (empty nodes have no queries, the
padding node no pages), level 1
each row's own pages -- so the cascade wrapper's launches keep their shape from step to step. A
step with more groups than that runs eagerly.
"""

from __future__ import annotations

import torch

import jitattn

from .attention import SeqView, cascade_levels, page_table
from .kv_pool import KVPool
from .model import LlamaModel


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

    def _replay(self, rows: list[SeqView], input_ids: list[int], n: int) -> torch.Tensor:
        """Fill the inputs of ``rows`` (planned already), capture on the first use, replay; the first ``n`` logits."""
        self.input_ids.copy_(torch.tensor(input_ids + [0] * (self.bucket - n)), non_blocking=True)
        positions = torch.tensor([s.kv_len - 1 for s in rows])
        self.positions.copy_(positions, non_blocking=True)
        self.append_positions.copy_(positions.to(torch.int32), non_blocking=True)
        if self.graph is None:
            self.logits = self._forward()  # warm-up outside the capture (loads kernels, same writes)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, pool=self.memory_pool):
                self.logits = self._forward()
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

    def run(self, seqs: list[SeqView], input_ids: list[int]) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` of one decode step (captured on the bucket's first use)."""
        rows = self._rows(seqs)
        c = self.model.config
        self.wrapper.plan(*page_table(rows, self.pool.page_size), self.model.num_q_heads, self.model.num_kv_heads,
                          c.head_dim, self.pool.page_size, q_data_type=self.model.dtype, kv_data_type=self.model.dtype)
        return self._replay(rows, input_ids, len(seqs))


def cascade_nodes(groups: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(rows, shared pages) of a captured cascade step's level-0 nodes: each group that shares pages, and each
    run of consecutive groups that share none as one node of no pages (which can hold any contiguous rows)."""
    nodes: list[tuple[int, int]] = []
    for size, common in groups:
        if common == 0 and nodes and nodes[-1][1] == 0:
            nodes[-1] = (nodes[-1][0] + size, 0)
        else:
            nodes.append((size, common))
    return nodes


class CascadeGraph(_CapturedStep):
    """The captured cascade decode step of one bucket (see the module docstring)."""

    def __init__(self, model: LlamaModel, pool: KVPool, workspace: torch.Tensor, bucket: int, max_pages_per_seq: int,
                 max_groups: int, memory_pool=None) -> None:
        super().__init__(model, pool, bucket, max_pages_per_seq, memory_pool)
        self.max_groups = max_groups
        i32 = dict(dtype=torch.int32, device=model.device)
        nodes = max_groups + 1  # the groups, then the padding rows' node
        level_pages = bucket * max_pages_per_seq
        self.wrapper = jitattn.MultiLevelCascadeAttentionWrapper(
            2, workspace, use_cuda_graph=True,
            qo_indptr_buf_arr=[torch.zeros(nodes + 1, **i32), torch.zeros(bucket + 1, **i32)],
            paged_kv_indptr_buf_arr=[torch.zeros(nodes + 1, **i32), torch.zeros(bucket + 1, **i32)],
            paged_kv_indices_buf_arr=[torch.zeros(level_pages, **i32), torch.zeros(level_pages, **i32)],
            paged_kv_last_page_len_buf_arr=[torch.zeros(nodes, **i32), torch.zeros(bucket, **i32)])

    def run(self, seqs: list[SeqView], input_ids: list[int], groups: list[tuple[int, int]]) -> torch.Tensor:
        """Logits ``[len(seqs), vocab]`` of one cascade decode step over ``groups`` (``prefix_groups`` of
        ``seqs``: at most ``max_groups`` ``cascade_nodes``); captured on the bucket's first use."""
        nodes = cascade_nodes(groups)
        if len(nodes) > self.max_groups:
            raise ValueError(f"{len(nodes)} prefix groups; this graph takes at most {self.max_groups}")
        n, ps = len(seqs), self.pool.page_size
        rows = self._rows(seqs)
        # every row's whole page table, for the appends (the cascade's levels are split copies of it)
        full_indptr, full_indices, full_last = page_table(rows, ps)
        self.indptr.copy_(full_indptr, non_blocking=True)
        self.indices[: full_indices.numel()].copy_(full_indices, non_blocking=True)
        self.last_page_len.copy_(full_last, non_blocking=True)
        # the nodes, empty ones up to max_groups, then the padding rows' node (no pages)
        padded = nodes + [(0, 0)] * (self.max_groups - len(nodes)) + [(self.bucket - n, 0)]
        c = self.model.config
        self.wrapper.plan(*cascade_levels(rows, padded, ps), self.model.num_q_heads, self.model.num_kv_heads,
                          c.head_dim, ps, causal=False, q_data_type=self.model.dtype, kv_data_type=self.model.dtype)
        return self._replay(rows, input_ids, n)

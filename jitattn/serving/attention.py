"""One step's attention: page tables in, a planned wrapper and the per-layer callback out.

Every step plans once (host index arrays, no device sync) and every layer of the model then
calls the same :class:`StepAttention`: append the layer's new k/v to its cache
(``append_paged_kv_cache``), run the planned wrapper. Prefill chunks run on the paged prefill
wrapper (causal). Decode runs on ``MultiLevelCascadeAttentionWrapper`` when some requests share
prefix pages, one level per level of the batch's prefix tree (each node's shared pages read once
for the requests under it: a system prompt, a few-shot block, a fork...) and each request's own
pages last, and on the flat ``BatchDecodeWithPagedKVCacheWrapper`` otherwise. The three wrappers share one float
workspace, as serving engines do.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

import jitattn

from .kv_pool import KVPool


@dataclass(frozen=True)
class SeqView:
    """A request as one step sees it: its pages, its KV length after the step, the tokens it appends."""

    pages: tuple[int, ...]  # exactly ceil(kv_len / page_size) pages
    kv_len: int
    new_tokens: int


_FIND = object()  # decode_step's default: find the prefix tree itself


def _int32(values, count: int = -1) -> torch.Tensor:
    """A host int32 tensor of an iterable of ints (``count``: their number, when known). np.fromiter: half the
    time of array.array on a step's page ids."""
    return torch.from_numpy(np.fromiter(values, dtype=np.int32, count=count))


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device`` without waiting for the GPU: through page-locked memory, ordered on the stream
    (the host can prepare a step while the one before it runs)."""
    if device.type != "cuda":
        return host.to(device)
    # torch.empty(pin_memory=True) takes a block of torch's caching host allocator; Tensor.pin_memory() first asks
    # the driver whether the tensor is pinned and took ~0.3-0.9 ms a call on the H200 machine
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged.to(device, non_blocking=True)


def _indptr(counts: list[int]) -> torch.Tensor:
    out = torch.zeros(len(counts) + 1, dtype=torch.int32)
    if counts:
        out[1:] = torch.tensor(counts, dtype=torch.int64).cumsum(0)
    return out


def page_table(seqs: list[SeqView], page_size: int, skip_pages: list[int] | None = None):
    """(indptr, indices, last_page_len) host int32 tensors; ``skip_pages[i]`` leading pages of seq i left out."""
    skip = skip_pages or [0] * len(seqs)
    rows = [s.pages[k:] for s, k in zip(seqs, skip)]
    indices = _int32(itertools.chain.from_iterable(rows), sum(len(r) for r in rows))
    last = torch.tensor([(s.kv_len - 1) % page_size + 1 for s in seqs], dtype=torch.int32)
    return _indptr([len(r) for r in rows]), indices, last


@dataclass(frozen=True)
class SharedNode:
    """A node of a decode batch's prefix tree: seqs ``first`` .. ``end - 1`` all hold the same pages at
    ``page_begin`` .. ``page_end - 1`` (read once for all of them), none of them a member's last page."""

    first: int
    end: int
    page_begin: int
    page_end: int


def prefix_tree(seqs: list[SeqView]) -> list[list[SharedNode]]:
    """The shared nodes of ``seqs``' prefix tree, level by level from the root: a level-l node's members share
    its pages after their level-(l-1) node's; its children split it where their next pages differ.

    Shared pages are found among consecutive seqs (order the batch by pages, as the engine does, so each
    subtree's seqs are consecutive); a seq's last page (it still receives tokens) is never shared. Depth is
    what the batch has: a system prompt, a few-shot block, a fork, a branch of it... each a level.
    """
    levels: list[list[SharedNode]] = []

    def split(first: int, end: int, offset: int, level: int) -> None:
        k = first
        while k < end:
            pages = seqs[k].pages
            if len(pages) - 1 <= offset:  # nothing shareable left after offset: its own pages only
                k += 1
                continue
            m = k + 1
            while m < end and len(seqs[m].pages) - 1 > offset and seqs[m].pages[offset] == pages[offset]:
                m += 1
            if m - k > 1:
                common = min(len(seqs[i].pages) for i in range(k, m)) - 1
                ref = pages[offset:common]
                for i in range(k + 1, m):  # one tuple-slice comparison per member while they agree
                    if seqs[i].pages[offset:common] != ref:
                        common = next(c for c in range(offset, common) if seqs[i].pages[c] != pages[c])
                        ref = pages[offset:common]
                while len(levels) <= level:
                    levels.append([])
                levels[level].append(SharedNode(k, m, offset, common))
                split(k, m, common, level + 1)
            k = m

    split(0, len(seqs), 0, 0)
    return levels


def tree_cascade_levels(seqs: list[SeqView], tree: list[list[SharedNode]], page_size: int) -> tuple[list, list, list, list]:
    """``MultiLevelCascadeAttentionWrapper.plan``'s four array lists for ``tree`` (:func:`prefix_tree` of
    ``seqs``): one level per tree level, each node's shared pages once (the seqs no node of the level covers
    in runs of empty nodes), then each seq's own pages (those after its deepest node's)."""
    qo, kv_indptr, kv_indices, last = [], [], [], []
    for nodes in tree:
        rows, page_rows, at = [], [], 0
        for node in nodes:
            if node.first > at:  # seqs this level does not cover: one node of no pages
                rows.append(node.first - at)
                page_rows.append(())
            rows.append(node.end - node.first)
            page_rows.append(seqs[node.first].pages[node.page_begin:node.page_end])
            at = node.end
        if at < len(seqs):
            rows.append(len(seqs) - at)
            page_rows.append(())
        qo.append(_indptr(rows))
        kv_indptr.append(_indptr([len(r) for r in page_rows]))
        kv_indices.append(_int32(itertools.chain.from_iterable(page_rows)))
        last.append(torch.full((len(rows),), page_size, dtype=torch.int32))  # shared pages are always full
    own_indptr, own_indices, own_last = page_table(seqs, page_size, own_pages_from(len(seqs), tree))
    return (qo + [_indptr([1] * len(seqs))], kv_indptr + [own_indptr], kv_indices + [own_indices],
            last + [own_last])


def shared_tokens(tree: list[list[SharedNode]], page_size: int) -> int:
    """KV tokens of ``tree``'s nodes, each node's pages once (what its shared levels read per layer)."""
    return sum(node.page_end - node.page_begin for nodes in tree for node in nodes) * page_size


def kv_tokens_read(seqs: list[SeqView], tree: list[list[SharedNode]], page_size: int) -> int:
    """KV tokens a decode step over ``tree``'s levels reads per layer: each node's pages once, then each seq's
    own tokens (``tree`` empty: flat decode, every seq's whole history)."""
    own_from = own_pages_from(len(seqs), tree)
    return shared_tokens(tree, page_size) + sum(s.kv_len - start * page_size for s, start in zip(seqs, own_from))


def pages_saved(tree: list[list[SharedNode]]) -> int:
    """Pages a batch references more than once, counted beyond the first reference: each node's pages once per
    member after the first (:func:`prefix_tree` finds every page consecutive seqs share)."""
    return sum((node.end - node.first - 1) * (node.page_end - node.page_begin) for nodes in tree for node in nodes)


def limit_levels(tree: list[list[SharedNode]], num_seqs: int, max_levels: int) -> list[list[SharedNode]]:
    """``tree`` (:func:`prefix_tree`) with at most ``max_levels`` levels: the first ``max_levels - 1`` as they
    are, and in the last one each seq's deepest node from that level down, its pages counted from the start of
    the seq's node at that level (consecutive seqs of one deepest node form one node). ``max_levels=1`` is the
    two-level cascade: one node per prefix group, its whole shared prefix (a root shared by every group is read
    once per group), then each seq's own pages."""
    if max_levels < 1:
        raise ValueError(f"max_levels={max_levels} must be at least 1")
    if len(tree) <= max_levels:
        return tree
    keep = max_levels - 1
    deepest: list[SharedNode | None] = [None] * num_seqs
    for nodes in tree[keep:]:  # shallow to deep: a deeper node overwrites its members' entries
        for node in nodes:
            deepest[node.first:node.end] = [node] * (node.end - node.first)
    begin = [0] * num_seqs
    for node in tree[keep]:
        begin[node.first:node.end] = [node.page_begin] * (node.end - node.first)
    merged, i = [], 0
    while i < num_seqs:
        node = deepest[i]
        j = i + 1
        while j < num_seqs and deepest[j] is node:
            j += 1
        if node is not None:
            merged.append(SharedNode(i, j, begin[i], node.page_end))
        i = j
    return tree[:keep] + [merged]


def own_pages_from(num_seqs: int, tree: list[list[SharedNode]]) -> list[int]:
    """Each seq's first page of its own: the end of its deepest node's pages (0 outside every node)."""
    own_from = [0] * num_seqs
    for nodes in tree:  # root first: a deeper node overwrites its members' entries
        for node in nodes:
            own_from[node.first:node.end] = [node.page_end] * (node.end - node.first)
    return own_from


class StepAttention:
    """The attention callback of one step: append this layer's k/v, run the planned wrapper."""

    def __init__(self, pool: KVPool, wrapper, seqs: list[SeqView], device: torch.device) -> None:
        ps = pool.page_size
        # The append's page table holds only the pages the new tokens land in (a seq's pages from the one holding
        # its first new token), positions counted from there: a decode step's table is one page per seq, not its
        # whole history (132k page ids at 128 requests over 16k tokens, ~12 ms of host time per step).
        skip = [(s.kv_len - s.new_tokens) // ps for s in seqs]
        indptr, indices, last = page_table(seqs, ps, skip)
        # numpy, not torch.repeat_interleave: on the host that took ~10 ms per call on the H200 machine (a decode
        # step of 128 requests spent 67 ms of its ~95 ms there, 2026-12-03)
        new_tokens = np.array([s.new_tokens for s in seqs], dtype=np.int64)
        batch = np.repeat(np.arange(len(seqs), dtype=np.int32), new_tokens)
        # position of each new token in the table: its seq's kv_len - new_tokens - skipped tokens + (index within
        # the seq's new tokens)
        starts = np.array([s.kv_len - s.new_tokens - k * ps for s, k in zip(seqs, skip)], dtype=np.int64)
        within = np.arange(len(batch)) - np.repeat(np.cumsum(new_tokens) - new_tokens, new_tokens)
        positions = (np.repeat(starts, new_tokens) + within).astype(np.int32)
        batch, positions = torch.from_numpy(batch), torch.from_numpy(positions)
        # moved to the device once per step (one copy), not once per layer
        sizes = [t.numel() for t in (batch, positions, indices, indptr, last)]
        packed = to_device(torch.cat([batch, positions, indices, indptr, last]), device)
        self._append_index = list(packed.split(sizes))
        self.pool, self.wrapper = pool, wrapper
        self.kind = type(wrapper).__name__

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        cache = self.pool.caches[layer]
        batch, positions, indices, indptr, last = self._append_index
        jitattn.append_paged_kv_cache(k, v, batch, positions, cache, indices, indptr, last)
        return self.wrapper.run(q, cache)


class AttentionPlanner:
    """The wrappers of one engine (one shared float workspace) and the plan of each step."""

    def __init__(self, pool: KVPool, num_q_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device, cascade: bool = True, workspace_bytes: int | None = None) -> None:
        self.pool, self.dtype, self.device, self.use_cascade = pool, dtype, torch.device(device), cascade
        self.heads = (num_q_heads, num_kv_heads, head_dim)
        if workspace_bytes is None:
            workspace_bytes = (256 << 20) if self.device.type == "cuda" else (32 << 20)
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=self.device)
        self.prefill = jitattn.BatchPrefillWithPagedKVCacheWrapper(self.workspace)
        self.decode = jitattn.BatchDecodeWithPagedKVCacheWrapper(self.workspace)
        self._cascades: dict[int, jitattn.MultiLevelCascadeAttentionWrapper] = {}  # by number of levels
        self.last_decode_levels = 0  # levels of the last decode step's cascade (shared levels + own), 0: flat
        self.last_decode_kv_tokens = 0  # KV tokens the last decode step reads per layer (kv_tokens_read)

    def prefill_step(self, seqs: list[SeqView]) -> StepAttention:
        """Chunked prefill: each seq's ``new_tokens`` queries attend causally to its whole KV."""
        ps = self.pool.page_size
        self.prefill.plan(_indptr([s.new_tokens for s in seqs]), *page_table(seqs, ps), *self.heads, ps,
                          causal=True, q_data_type=self.dtype, kv_data_type=self.dtype)
        return StepAttention(self.pool, self.prefill, seqs, self.device)

    def cascade_tree(self, seqs: list[SeqView], shared: list[list[SharedNode]] | None = None
                     ) -> list[list[SharedNode]] | None:
        """The prefix tree of a decode batch (:func:`prefix_tree`; ``shared``: it, when the caller has it) when
        cascade is on and some seqs share pages, else None (flat decode)."""
        if not self.use_cascade:
            return None
        return (prefix_tree(seqs) if shared is None else shared) or None

    def decode_step(self, seqs: list[SeqView], tree: list[list[SharedNode]] | None | object = _FIND) -> StepAttention:
        """One token per seq: flat, or a cascade with one level per level of the batch's prefix tree and the
        seqs' own pages last, when consecutive seqs share prefix pages.

        ``tree``: :meth:`cascade_tree` of ``seqs`` when the caller has it already (None: flat)."""
        ps = self.pool.page_size
        if tree is _FIND:
            tree = self.cascade_tree(seqs)
        tree = tree or []
        self.last_decode_levels = len(tree) + 1 if tree else 0
        self.last_decode_kv_tokens = kv_tokens_read(seqs, tree, ps)
        if not tree:
            self.decode.plan(*page_table(seqs, ps), *self.heads, ps, q_data_type=self.dtype, kv_data_type=self.dtype)
            return StepAttention(self.pool, self.decode, seqs, self.device)
        wrapper = self.cascade_wrapper(len(tree) + 1)
        wrapper.plan(*tree_cascade_levels(seqs, tree, ps), *self.heads, ps, causal=False, q_data_type=self.dtype,
                     kv_data_type=self.dtype)
        return StepAttention(self.pool, wrapper, seqs, self.device)

    def cascade_wrapper(self, num_levels: int) -> jitattn.MultiLevelCascadeAttentionWrapper:
        """The (eager) cascade wrapper of ``num_levels`` levels, made on first use; all share the workspace."""
        if num_levels not in self._cascades:
            self._cascades[num_levels] = jitattn.MultiLevelCascadeAttentionWrapper(num_levels, self.workspace)
        return self._cascades[num_levels]

"""Split-KV scheduling: how each request's KV is cut into chunks that run in parallel and merge by LSE.

Decode batches (``decode_kv_split``, and its worst case ``max_decode_chunks`` for workspace
sizing) and shared cascade levels (``cascade_level_chunks``, ``split_level_page_table``). Pure
functions; the wrappers call them once per ``plan()``.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from .page_table import PagedIndex

# No cuda decode layout is sized for more resident blocks per SM than this: it bounds the split a
# plan can choose, so workspace_size() can size the split-KV workspace without knowing the kernel.
MAX_RESIDENT_BLOCKS = 4

# Batch-invariant mode: every request's KV is cut into chunks of this many tokens (rounded up to whole
# pages), whatever else is in the batch, so its partial states and their merge order are its own.
BATCH_INVARIANT_CHUNK_TOKENS = 1024


def check_fixed_split_size(fixed_split_size: int | None) -> None:
    """A plan's ``fixed_split_size`` (pages per KV chunk): None or a positive int."""
    if fixed_split_size is None:
        return
    if isinstance(fixed_split_size, bool) or not isinstance(fixed_split_size, numbers.Integral):
        raise TypeError(f"fixed_split_size={fixed_split_size!r} must be None or a positive int (pages per chunk)")
    if fixed_split_size < 1:
        raise ValueError(f"fixed_split_size={fixed_split_size} must be None or a positive int (pages per chunk)")


def batch_invariant_chunk(page_size: int, fixed_split_size: int | None = None) -> int:
    """Tokens per chunk in batch-invariant mode: ``fixed_split_size`` pages when given, else
    ``BATCH_INVARIANT_CHUNK_TOKENS`` rounded up to whole pages."""
    check_fixed_split_size(fixed_split_size)
    if fixed_split_size is not None:
        return fixed_split_size * page_size
    return math.ceil(BATCH_INVARIANT_CHUNK_TOKENS / page_size) * page_size


@dataclass(frozen=True)
class KVSplit:
    """How each request's KV is cut into chunks processed in parallel."""

    kv_chunk_size: int  # tokens per chunk; 0 = no split
    split_indptr: tuple[int, ...]  # first chunk index of each request; len batch + 1
    # split_indptr as int32 when the planner computed it so (host_indptr then converts nothing)
    indptr_array: np.ndarray | None = field(default=None, compare=False, repr=False)
    # the cuda decode module's short-items layout (more resident blocks, fewer or shorter stages): see short_items_split
    short_items: bool = False

    @property
    def num_chunks(self) -> int:
        return self.split_indptr[-1]

    def host_indptr(self) -> torch.Tensor:
        """``split_indptr`` as a host int32 tensor, to be copied (it may share the split's own array)."""
        array = self.indptr_array if self.indptr_array is not None else np.array(self.split_indptr, dtype=np.int32)
        return torch.from_numpy(array)


def window_lens(kv_lens: np.ndarray, window_left: int) -> np.ndarray:
    """The tokens each decode request reads under a sliding window of ``window_left`` (-1: none): what its split
    chunks cover (the kernels count a windowed request's chunks from the window's first token)."""
    # min(len, window_left + 1) without forming window_left + 1 (int32 lengths, a window up to int64's max)
    return np.minimum(kv_lens - 1, np.int64(window_left)) + 1 if window_left >= 0 else kv_lens


@functools.lru_cache(maxsize=64)
def unsplit(batch: int) -> KVSplit:
    """The plan of ``batch`` requests each in one piece (one immutable value per batch size)."""
    return KVSplit(0, tuple(range(batch + 1)))


def decode_kv_split(
    kv_lens: Sequence[int] | np.ndarray, *, num_kv_heads: int, num_sms: int, page_size: int,
    fixed_split_size: int | None = None, disable_split_kv: bool = False, min_chunk_tokens: int = 256,
    blocks_per_sm: int = 2, batch_invariant: bool = False,
) -> KVSplit:
    """Choose the split-KV chunk size for a decode batch.

    A block processes one (chunk, kv head). Balance the work: the chunk length
    is the total KV work divided over ``blocks_per_sm`` blocks per SM (over one
    block per SM, in one wave, when the batch has no more KV heads than SMs), so a
    single long request is cut to fill every SM and a long request among many
    short ones (a skewed batch) is cut to the others' scale. A batch whose
    longest request is under 1.5 balanced chunks already keeps the SMs busy
    and is not split: there the partial outputs, the merge and the short tail
    chunks cost more than the split evens out (H200, b32 x 4096: 157 us split
    vs 138 us whole). Chunks are never shorter than ``min_chunk_tokens`` and
    end on page boundaries. ``fixed_split_size`` (in pages) forces the chunk
    length, which makes every request's result independent of the rest of the
    batch.

    ``batch_invariant``: the chunk is ``batch_invariant_chunk`` (a constant, or ``fixed_split_size``
    pages) and the plan is a split plan even when no request is long enough to be cut (a request of
    one chunk is written directly, as unsplit), so a request's chunks, and the bits of its result,
    never depend on the other requests; ``disable_split_kv`` (every request whole) is invariant too.

    ``kv_lens``: each request's KV length, a sequence of ints or an int64 array (``PagedIndex.kv_len_array``,
    used without a copy: the per-request counts are numpy operations).
    """
    lens = np.asarray(kv_lens, dtype=np.int64)
    batch = lens.size
    if disable_split_kv:
        return unsplit(batch)
    if batch_invariant:
        return _split_by(lens, batch_invariant_chunk(page_size, fixed_split_size))
    longest = int(lens.max()) if batch else 0
    if longest == 0:
        return unsplit(batch)
    if fixed_split_size is not None:
        check_fixed_split_size(fixed_split_size)
        chunk = fixed_split_size * page_size
    else:
        total = int(lens.sum())
        chunk = _balanced_chunk(total, num_kv_heads, blocks_per_sm * num_sms, page_size, min_chunk_tokens)
        if batch * num_kv_heads <= num_sms:
            wave = _one_wave_chunk(lens.tolist(), total, num_kv_heads, num_sms, page_size, min_chunk_tokens)
            chunk = wave or chunk
        if 2 * longest < 3 * chunk:
            return unsplit(batch)
    return _split_by(lens, chunk)


# An unsplit decode plan of at least this many blocks (requests x KV heads) per SM launches the module's
# short-items layout where it has one (``kernels.decode.short_items_layout``: three resident blocks of two stages
# instead of two of three) when its requests are short or its pages shared (below). H200 (events, L2 evicted;
# 2026-12-04 (x) and (y)): 128 requests x 8 KV heads (7.8 blocks per SM) gain 3-9% at every length up to 2048
# tokens, the cascade's last level (256 tokens) 6%, flat decode over 8k shared pages 16%; long requests read from
# DRAM lose 1% (256 x 4096 tokens, 64 x 2048 MHA); 64 x 8 (3.9 per SM, 1.3 waves of three) lose 9%; split plans
# (fewer, longer blocks) lose up to 35%.
SHORT_ITEMS_MIN_BLOCKS_PER_SM = 6
SHORT_ITEMS_MAX_TOKENS = 1024  # ... a request of at most this many tokens is short
# ... or, with a short-items layout of at least this many resident blocks (16-bit head dim 64: four blocks of 64-token
# stages), fewer blocks that its one wave holds and the default layout's does not. H200, 2026-12-05 (h) (events, L2
# evicted): gpt-oss window 128, 64 requests x 8 KV heads (3.9 blocks per SM): 16.6 us in the default layout, 15.7
# in three blocks of 128-token stages, 13.0 in four of 64 (SDPA 13.8); with sinks 17.2 -> 13.3.
SHORT_ITEMS_ONE_WAVE_MIN_BLOCKS = 4


def short_items_split(split: KVSplit, index: PagedIndex, num_kv_heads: int, num_sms: int,
                      window_left: int = -1, blocks_per_sm: tuple[int, int] = (0, 0)) -> KVSplit:
    """``split`` with ``short_items`` set when it is unsplit, has ``SHORT_ITEMS_MIN_BLOCKS_PER_SM`` blocks per SM (or
    fits one wave of a short-items layout of at least ``SHORT_ITEMS_ONE_WAVE_MIN_BLOCKS`` and not the default's:
    ``blocks_per_sm`` is the module's (default, short-items) resident blocks), and either every request is short
    (``SHORT_ITEMS_MAX_TOKENS``; a sliding window of ``window_left`` >= 0 reads at most ``window_left + 1`` tokens of
    each) or the page table references its pages at least twice over on average (its highest page id below half the
    references: the re-reads come from L2). The caller checks that the module has the layout."""
    blocks = index.batch_size * num_kv_heads
    default_blocks, short_blocks = blocks_per_sm
    one_wave = (short_blocks >= SHORT_ITEMS_ONE_WAVE_MIN_BLOCKS
                and default_blocks * num_sms < blocks <= short_blocks * num_sms)
    if split.kv_chunk_size or (blocks < SHORT_ITEMS_MIN_BLOCKS_PER_SM * num_sms and not one_wave):
        return split
    longest = int(index.kv_len_array.max())
    if window_left >= 0:
        longest = min(longest, window_left + 1)
    if longest > SHORT_ITEMS_MAX_TOKENS:
        references = int(index.indptr[-1])
        if index.max_page_index < 0 or 2 * (index.max_page_index + 1) > references:
            return split  # long requests that do not share their pages
    return KVSplit(split.kv_chunk_size, split.split_indptr, split.indptr_array, short_items=True)


# A chunk at least as long as every request leaves each in one piece, so a longer one counts as this one
# (numpy's int64 would overflow on an absurd fixed_split_size).
_LONGEST_CHUNK = 1 << 62


def _split_by(lens: np.ndarray, chunk: int) -> KVSplit:
    """Each request cut into chunks of ``chunk`` tokens (an empty request still takes one)."""
    counts = np.where(lens > 0, (lens - 1) // min(chunk, _LONGEST_CHUNK) + 1, 1)
    indptr = np.zeros(lens.size + 1, dtype=np.int64)
    np.cumsum(counts, out=indptr[1:])
    return KVSplit(chunk, tuple(indptr.tolist()), indptr.astype(np.int32))


def _balanced_chunk(total_tokens: int, num_kv_heads: int, slots: int, page_size: int, min_chunk_tokens: int) -> int:
    """The total KV work over ``slots`` blocks, in whole pages, at least ``min_chunk_tokens``."""
    balanced = math.ceil(total_tokens * num_kv_heads / slots)
    return math.ceil(max(min_chunk_tokens, balanced) / page_size) * page_size


def _blocks(kv_lens: list[int], num_kv_heads: int, chunk: int) -> int:
    """Blocks of a split by ``chunk`` tokens (as ``_split_by`` counts chunks), each chunk once per KV head.
    On a list: the one-wave search below runs it several times on a batch of at most ``num_sms`` requests."""
    return sum((n - 1) // chunk + 1 if n > 0 else 1 for n in kv_lens) * num_kv_heads


def _one_wave_chunk(kv_lens: list[int], total_tokens: int, num_kv_heads: int, num_sms: int, page_size: int,
                    min_chunk_tokens: int) -> int | None:
    """For a batch whose KV heads fit the SMs: the shortest chunk (whole pages) whose blocks fit one
    block per SM, each SM's whole share of the bandwidth to one block (H200, 1 x 32768: 42.9 us in
    128 blocks of 2048 tokens against 47.1 in 264 of 1008; 16 x 4096: 71.6 unsplit against 91.2).
    None when that chunk is over 1.25x the balanced one: a long request among short ones (a skewed
    batch) would stay whole, so it keeps the resident-blocks split."""
    balanced = _balanced_chunk(total_tokens, num_kv_heads, num_sms, page_size, min_chunk_tokens)
    lo, hi = balanced // page_size, int(1.25 * balanced) // page_size  # in pages
    if hi < lo or _blocks(kv_lens, num_kv_heads, hi * page_size) > num_sms:
        return None
    while lo < hi:  # the blocks fall as the chunk grows: the first page count that fits
        mid = (lo + hi) // 2
        if _blocks(kv_lens, num_kv_heads, mid * page_size) <= num_sms:
            hi = mid
        else:
            lo = mid + 1
    return lo * page_size


def max_decode_chunks(
    max_batch: int, max_kv_tokens: int, *, num_kv_heads: int, num_sms: int, page_size: int,
    fixed_split_size: int | None = None, min_chunk_tokens: int = 256, blocks_per_sm: int = 2,
    batch_invariant: bool = False,
) -> int:
    """An upper bound on ``decode_kv_split(...).num_chunks`` over every batch within the limits."""
    if batch_invariant:
        chunk = batch_invariant_chunk(page_size, fixed_split_size)
    elif fixed_split_size is not None:
        chunk = fixed_split_size * page_size
    else:
        # chunk >= total * H / (blocks_per_sm * SMs), so sum(ceil(len / chunk)) <= blocks_per_sm * SMs / H + batch
        chunk = max(min_chunk_tokens, 1)
        return max_batch + min(math.ceil(blocks_per_sm * num_sms / max(1, num_kv_heads)),
                               math.ceil(max_kv_tokens / chunk))
    return max_batch + math.ceil(max_kv_tokens / chunk)


def check_workspace_limits(**limits) -> None:
    """The limits a ``workspace_size()`` is given: ints >= 1 (``max_kv_tokens`` / ``max_qo_tokens`` >= 0; None, an
    optional one left out, passes)."""
    for name, value in limits.items():
        low = 0 if name in ("max_kv_tokens", "max_qo_tokens") else 1
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low):
            raise ValueError(f"{name}={value!r} must be an int >= {low}")
    heads = limits.get("num_qo_heads"), limits.get("num_kv_heads")
    if None not in heads and heads[0] % heads[1]:
        raise ValueError(f"num_qo_heads={heads[0]} is not a multiple of num_kv_heads={heads[1]}: plan() refuses such "
                         "a batch (each KV head serves a whole group of query heads)")


def split_workspace_bytes(num_chunks: int, num_qo_heads: int, head_dim_vo: int) -> int:
    """Bytes of float workspace a split plan needs: fp32 partial o and lse per chunk and head."""
    return num_chunks * num_qo_heads * (head_dim_vo + 1) * 4


def cascade_level_chunks(
    kv_lens: tuple[int, ...], *, num_kv_heads: int, num_sms: int, page_size: int,
    fixed_split_size: int | None = None, min_chunk_tokens: int = 256, blocks_per_sm: int = 2,
    query_tiles: int | None = None, batch_invariant: bool = False,
) -> int:
    """How many chunks to cut each node's KV of one shared cascade level into (1 = no split).

    A shared level has few nodes (often one) whose KV is long: without a split
    it keeps only ``query_tiles * num_kv_heads`` blocks busy (``query_tiles``: the
    thread blocks' query tiles over all nodes, one per node by default). Every
    chunk adds a state to merge per query, so the split stops once the blocks fill
    the device's ``blocks_per_sm * num_sms`` slots in one wave (the prefill tiers take
    items dynamically, so a level cut into one item per slot runs in one item's time; a
    partial second wave costs as long as a whole one: H200, sm90 tier, shared level's
    kernel time, b128 over 8k shared 51.0 us in 4 chunks vs 56.6 in 8; b32 over 32k
    55.2 us in 16 vs 65.0 in 32). ``fixed_split_size`` caps a chunk at that many pages.
    ``batch_invariant``: enough chunks of ``batch_invariant_chunk`` tokens for the
    longest node (cut with ``split_level_page_table(..., pages_per_chunk=...)``, so
    each node's chunks are its own).
    """
    if not kv_lens or max(kv_lens) == 0:
        return 1
    longest_pages = max((n + page_size - 1) // page_size for n in kv_lens)
    if batch_invariant:
        return max(1, math.ceil(longest_pages / (batch_invariant_chunk(page_size, fixed_split_size) // page_size)))
    if fixed_split_size is not None:
        check_fixed_split_size(fixed_split_size)
        return max(1, math.ceil(longest_pages / fixed_split_size))
    blocks = (query_tiles or len(kv_lens)) * num_kv_heads
    wanted = blocks_per_sm * num_sms // blocks
    limit = max(1, max(kv_lens) // min_chunk_tokens)
    return max(1, min(wanted, limit, longest_pages))


# Chunks of a split cascade level are whole multiples of this many tokens (when the page size divides it):
# the prefill kernels' KV blocks (sm90 paged head_dim 128: 128 tokens; the sm80 tier's 64 or fewer) then
# never straddle a chunk end.
CHUNK_ALIGN_TOKENS = 128


def cascade_chunk_pages(longest_pages: int, chunks: int, page_size: int) -> tuple[int, int]:
    """(chunks, pages per chunk) for cutting a level whose longest node has ``longest_pages`` pages into
    about ``chunks`` chunks of whole ``CHUNK_ALIGN_TOKENS`` blocks (for ``split_level_page_table``'s
    ``pages_per_chunk``). A chunk ending inside a KV block costs a partial block per chunk (H200, sm90
    tier, kernel time of the shared level: b32 over 32k shared, 34 chunks of 61 pages 79.4 us, 32 of 64
    pages 65.0; b128 over 8k, 9 chunks of 57 pages 75.9, 8 of 64 pages 56.6)."""
    per = math.ceil(longest_pages / max(1, chunks))
    if CHUNK_ALIGN_TOKENS % page_size == 0:
        align = CHUNK_ALIGN_TOKENS // page_size
        per = math.ceil(per / align) * align
    return math.ceil(longest_pages / per), per


def graph_level_chunks(total_q: int, *, group: int, tile_rows: int, num_kv_heads: int, num_sms: int,
                       blocks_per_sm: int = 2, max_chunks: int = 32) -> int:
    """How many chunks to cut each node of a shared cascade level into under CUDA graphs (1 = no split).

    A captured launch keeps its batch size and its state buffers, so the count must not follow the
    lengths (which change between replays), only the batch shape: enough chunks that the level's
    query tiles (``total_q`` queries of ``group`` heads in tiles of ``tile_rows`` rows; nodes without
    queries, as a captured step's padding has, add none) times the KV heads fill ``blocks_per_sm``
    blocks per SM in one wave, at most ``max_chunks`` (each adds a state per query to merge). A
    chunk past a node's last page is empty: a state that merges as zeros.
    """
    tiles = max(1, -(-total_q * group // tile_rows))
    return max(1, min(max_chunks, blocks_per_sm * num_sms // (tiles * num_kv_heads)))


def split_level_page_table(qo_indptr: torch.Tensor, index: PagedIndex, num_chunks: int,
                           pages_per_chunk: int | None = None) -> tuple[torch.Tensor, PagedIndex]:
    """The page table of a level whose nodes are each cut into ``num_chunks`` chunks.

    ``pages_per_chunk`` (batch-invariant mode, and the planner's whole-KV-block chunks of
    ``cascade_chunk_pages``): every chunk but a node's last is that many pages, so a node's cut does
    not depend on the other nodes (its chunks past its end are empty); by default a node's pages are
    shared out evenly over the ``num_chunks`` chunks.

    The expanded batch is chunk-major: request ``c * nodes + r`` is chunk c of
    node r, and its rows are ``c * total_q + qo_indptr[r] ...``: its queries are
    those rows modulo ``total_q`` (``attention.batch.share_queries``), and the
    partial outputs reshape to ``[num_chunks, total_q, ...]`` for an LSE merge. Chunk boundaries fall on
    pages; a chunk past a node's last page is empty (kv_len 0).
    Returns (qo_indptr, the chunks' page table), host int32; the table is derived from a checked
    one, so it is not checked again.
    """
    total_q = int(qo_indptr[-1])
    pages = (index.indptr[1:] - index.indptr[:-1]).tolist()
    starts = index.indptr[:-1].tolist()
    lasts = index.last_page_len.tolist()
    qo_starts = qo_indptr[:-1].tolist()
    new_qo, new_kv, new_last, new_indices, kv_lens = [], [0], [], [], []
    for c in range(num_chunks):
        for r, num_pages in enumerate(pages):
            per_chunk = pages_per_chunk or (math.ceil(num_pages / num_chunks) if num_pages else 0)
            first, end = min(c * per_chunk, num_pages), min((c + 1) * per_chunk, num_pages)
            new_qo.append(c * total_q + qo_starts[r])
            new_indices.append(index.indices[starts[r] + first: starts[r] + end])
            new_kv.append(new_kv[-1] + end - first)
            last = 0 if end == first else (lasts[r] if end == num_pages else index.page_size)
            new_last.append(last)
            kv_lens.append((end - first - 1) * index.page_size + last if end > first else 0)
    new_qo.append(num_chunks * total_q)
    i32 = torch.int32
    indices = torch.cat(new_indices).to(i32) if new_indices else torch.zeros(0, dtype=i32)
    chunked = PagedIndex(indptr=torch.tensor(new_kv, dtype=i32), indices=indices,
                         last_page_len=torch.tensor(new_last, dtype=i32), page_size=index.page_size,
                         kv_len_array=np.array(kv_lens, dtype=np.int64), max_page_index=index.max_page_index,
                         indices_name=index.indices_name)
    return torch.tensor(new_qo, dtype=i32), chunked


def concat_level_tables(levels: list[tuple[torch.Tensor, PagedIndex]]) -> tuple[torch.Tensor, PagedIndex]:
    """The cascade levels' (qo_indptr, page table) pairs as one batch, level after level.

    Level L's rows follow the rows of the levels before it (its requests' queries are then those rows
    modulo ``total_q``, see ``split_level_page_table``), so one launch computes every level's states
    into one chunk-major buffer. The tables are derived from checked ones: not checked again.
    """
    start = torch.zeros(1, dtype=torch.int32)
    qo_parts, kv_parts, indices, lasts, kv_lens = [start], [start], [], [], []  # kv_lens: one array per level
    row = page = 0
    for qo_indptr, index in levels:
        qo_parts.append(qo_indptr[1:].to(torch.int32) + row)
        kv_parts.append(index.indptr[1:].to(torch.int32) + page)
        used = int(index.indptr[-1])
        indices.append(index.indices[:used])
        lasts.append(index.last_page_len)
        kv_lens.append(index.kv_len_array)
        row += int(qo_indptr[-1])
        page += used
    first = levels[0][1]
    highest = max((index for _, index in levels), key=lambda index: index.max_page_index)  # (its name in errors)
    table = PagedIndex(indptr=torch.cat(kv_parts), indices=torch.cat(indices).to(torch.int32),
                       last_page_len=torch.cat(lasts).to(torch.int32), page_size=first.page_size,
                       kv_len_array=np.concatenate(kv_lens), max_page_index=highest.max_page_index,
                       indices_name=highest.indices_name)
    return torch.cat(qo_parts), table

"""Work items of the dedicated MLA kernel (``jitattn/kernels/mla.py``), on the host. Pure: no torch device work.

Request r has ``qo_len * num_heads`` rows (query token, head; head fastest), cut into tiles of 64
rows. A tile sees KV blocks of 64 latent tokens up to the last visible key of its last row
(``causal``: bottom-right). When the tiles alone would leave SMs idle, each tile's blocks are cut
into chunks (split-KV); the chunks of a tile write partial states that a merge kernel combines.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .mla import ITEM_INTS, KV_BLOCK, MERGE_INTS, ROWS

MIN_CHUNK_BLOCKS = 4  # a split chunk covers at least this many KV blocks (256 tokens): its fixed cost amortised
ITEM_COST = 2         # fixed cost of an item in KV-block times (the Q load, the first block's latency, the epilogue)
MERGE_COST = 1        # cost of merging one chunk's partial state, in KV-block times (and once for the launch)
_NO_MERGES = torch.zeros(0, MERGE_INTS, dtype=torch.int32)  # the merges of an unsplit plan (no elements to write)


@dataclass(frozen=True)
class MLAWork:
    """The kernel's work list: ``items`` ``[num_items, 8]`` and ``merges`` ``[num_merges, 4]`` int32 (host)."""

    items: torch.Tensor
    merges: torch.Tensor
    workspace_rows: int  # partial-state rows the split items write
    grid: int            # blocks of the main kernel
    chunk_blocks: int    # KV blocks per split chunk (0: no split)

    @property
    def num_items(self) -> int:
        return int(self.items.shape[0])

    @property
    def num_merges(self) -> int:
        return int(self.merges.shape[0])


def workspace_row_bytes(ckv_dim: int) -> int:
    """Bytes of one partial-state row: fp32 output and fp32 LSE."""
    return 4 * (ckv_dim + 1)


def _ceil_div(a: np.ndarray, b) -> np.ndarray:
    return -(-a // b)


def _tiles(qo_lens, kv_lens, num_heads: int, causal: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(request, first row, KV blocks) of every tile, request by request, int64 arrays."""
    qo = np.asarray(qo_lens, dtype=np.int64).reshape(-1)
    kv = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    per_request = _ceil_div(qo * num_heads, ROWS)
    tiles = int(per_request.min()) if per_request.size else 0
    if per_request.size and tiles == per_request.max():  # as many tiles each (a decode batch): no gathers
        tile = np.arange(qo.size * tiles, dtype=np.int64)
        request, row0 = tile // tiles, tile % tiles * ROWS
        if not causal or qo.max() == 1:  # every tile sees all its request's keys: count them once a request
            blocks = _ceil_div(np.maximum(kv, 0), KV_BLOCK)
            return request, row0, blocks if tiles == 1 else np.repeat(blocks, tiles)
        qo_r, kv_r = (qo, kv) if tiles == 1 else (np.repeat(qo, tiles), np.repeat(kv, tiles))
    else:
        request = np.repeat(np.arange(qo.size, dtype=np.int64), per_request)
        first = np.cumsum(per_request) - per_request  # each request's first tile
        row0 = (np.arange(request.size, dtype=np.int64) - first[request]) * ROWS
        qo_r, kv_r = qo[request], kv[request]
    if causal:
        last_token = np.minimum(qo_r - 1, (row0 + ROWS - 1) // num_heads)
        kv_end = np.minimum(kv_r, kv_r - qo_r + last_token + 1)
    else:
        kv_end = kv_r
    return request, row0, _ceil_div(np.maximum(kv_end, 0), KV_BLOCK)


def plan_work(qo_lens, kv_lens, num_heads: int, causal: bool, num_sms: int, workspace_capacity_rows: int,
              split: bool = True) -> MLAWork:
    """The work list for a batch (``qo_lens``, ``kv_lens`` per request: sequences of ints) on a GPU of
    ``num_sms`` SMs.

    ``workspace_capacity_rows``: partial rows the workspace holds; chunks widen until the split fits
    (no split at all needs none). ``split=False`` never splits (one item per tile).
    """
    if num_heads < 1 or num_sms < 1:
        raise ValueError(f"num_heads={num_heads}, num_sms={num_sms} must be >= 1")
    request, row0, nblk = _tiles(qo_lens, kv_lens, num_heads, causal)
    chunk = _choose_chunk(nblk, num_sms, workspace_capacity_rows) if split and nblk.size else 0
    if not chunk:  # one item per tile, heaviest first (request order among equals), no merges
        items = np.zeros((nblk.size, ITEM_INTS), dtype=np.int32)
        if nblk.size and nblk.min() == nblk.max():  # equal tiles (a uniform decode batch): already in order
            items[:, 0], items[:, 1], items[:, 3], items[:, 4] = request, row0, nblk, -1
        else:
            order = np.argsort(-nblk, kind="stable")
            items[:, 0], items[:, 1], items[:, 3], items[:, 4] = request[order], row0[order], nblk[order], -1
        return MLAWork(torch.from_numpy(items), _NO_MERGES, 0, max(1, min(int(nblk.size), num_sms)), 0)
    chunks = _chunks(nblk, chunk)
    is_split = chunks > 1
    size = _ceil_div(nblk, chunks)  # a tile's chunks balanced: sizes differ by at most one block
    part_first = np.cumsum(np.where(is_split, ROWS * chunks, 0)) - np.where(is_split, ROWS * chunks, 0)
    tile = np.repeat(np.arange(nblk.size, dtype=np.int64), chunks)
    c = np.arange(tile.size, dtype=np.int64) - np.repeat(np.cumsum(chunks) - chunks, chunks)
    begin = c * size[tile]
    end = np.minimum(nblk[tile], begin + size[tile])
    part_row = np.where(is_split[tile], part_first[tile] + ROWS * c, -1)
    zeros = np.zeros_like(tile)
    items = np.stack([request[tile], row0[tile], begin, end, part_row, zeros, zeros, zeros], axis=1)
    items = items[np.argsort(begin - end, kind="stable")]  # heaviest first (request order among equals)
    merges = np.stack([request, row0, chunks, part_first], axis=1)[is_split]
    workspace_rows = int((ROWS * chunks[is_split]).sum())
    return MLAWork(torch.from_numpy(items.astype(np.int32)).reshape(-1, ITEM_INTS),
                   torch.from_numpy(merges.astype(np.int32)).reshape(-1, MERGE_INTS), workspace_rows,
                   max(1, min(int(tile.size), num_sms)), chunk)


def _chunks(nblk: np.ndarray, chunk: int) -> np.ndarray:
    """Chunks of each tile for a chunk width (0: one each)."""
    return np.where(nblk > chunk, _ceil_div(nblk, max(chunk, 1)), 1) if chunk else np.ones_like(nblk)


def _estimate(nblk: np.ndarray, chunk: int, num_sms: int) -> float:
    """Time of the launch in KV-block times: the longest item or the even share of all work, whichever is
    longer, with ITEM_COST blocks per item (its Q load and pipeline fill) and MERGE_COST per merged chunk."""
    if not chunk:  # one item per tile
        return max(int(nblk.max()) + ITEM_COST, (int(nblk.sum()) + ITEM_COST * nblk.size) / num_sms)
    chunks = _chunks(nblk, chunk)
    sizes = _ceil_div(nblk, chunks)
    merged = int(chunks[chunks > 1].sum())
    longest = int(sizes.max()) + ITEM_COST
    share = (int((sizes * chunks).sum()) + ITEM_COST * int(chunks.sum()) + MERGE_COST * merged) / num_sms
    return max(longest, share) + (MERGE_COST if merged else 0)


def _choose_chunk(nblk: np.ndarray, num_sms: int, capacity_rows: int) -> int:
    """KV blocks per split chunk (0: no split): the candidate of the lowest estimate that fits the workspace."""
    total, longest = int(nblk.sum()), int(nblk.max())
    chunk = max(MIN_CHUNK_BLOCKS, -(-total // num_sms))
    if chunk >= longest:  # no candidate splits a tile (the usual large decode batch)
        return 0
    best, best_time = 0, _estimate(nblk, 0, num_sms)
    while chunk < longest:
        chunks = _chunks(nblk, chunk)
        if int((ROWS * chunks[chunks > 1]).sum()) <= capacity_rows:
            time = _estimate(nblk, chunk, num_sms)
            if time < 0.95 * best_time:  # a split must win clearly: its merge is a second launch
                best, best_time = chunk, time
        chunk *= 2
    return best


def graph_item_capacity(total_q: int, batch: int, num_heads: int, num_sms: int) -> tuple[int, int]:
    """(items, merges) a work list of ``batch`` requests and ``total_q`` query tokens can need, whatever their
    lengths: what a CUDA-graph plan sizes its fixed arrays and its captured launch by.

    Tiles: each request's rows round up to whole tiles, so at most ``ceil(total_q * num_heads / 64) + batch``.
    A split chunk is at least ``ceil(total blocks / num_sms)`` blocks wide (``_choose_chunk``'s smallest
    candidate), so splitting adds at most ``num_sms`` items; at most one merge per tile."""
    tiles = -(-total_q * num_heads // ROWS) + batch
    return tiles + num_sms, max(1, tiles)


def padded(work: MLAWork, items: int, merges: int, request: int) -> MLAWork:
    """``work`` with ``items`` work items and ``merges`` merges: the extra ones are of ``request``, which must be
    one with no query rows (a CUDA-graph plan appends such a sentinel request), so the kernel skips them."""
    if work.num_items > items or work.num_merges > merges:
        raise RuntimeError(f"the work list needs {work.num_items} items and {work.num_merges} merges; the capacity "
                           f"is {items} and {merges}")
    extra_items = torch.zeros(items - work.num_items, ITEM_INTS, dtype=torch.int32)
    extra_items[:, 0], extra_items[:, 4] = request, -1
    extra_merges = torch.zeros(merges - work.num_merges, MERGE_INTS, dtype=torch.int32)
    extra_merges[:, 0] = request
    return MLAWork(torch.cat([work.items, extra_items]), torch.cat([work.merges, extra_merges]), work.workspace_rows,
                   work.grid, work.chunk_blocks)

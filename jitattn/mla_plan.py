"""Work items of the dedicated MLA kernel (``jitattn/families/mla.py``), on the host. Pure: no torch device work.

Request r has ``qo_len * num_heads`` rows (query token, head; head fastest), cut into tiles of 64
rows. A tile sees KV blocks of 64 latent tokens up to the last visible key of its last row
(``causal``: bottom-right). When the tiles alone would leave SMs idle, each tile's blocks are cut
into chunks (split-KV); the chunks of a tile write partial states that a merge kernel combines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .families.mla import ITEM_INTS, KV_BLOCK, MERGE_INTS, ROWS

MIN_CHUNK_BLOCKS = 4  # a split chunk covers at least this many KV blocks (256 tokens): its fixed cost amortised
ITEM_COST = 2         # fixed cost of an item in KV-block times (the Q load, the first block's latency, the epilogue)
MERGE_COST = 1        # cost of merging one chunk's partial state, in KV-block times (and once for the launch)


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


def _tiles(qo_lens: list[int], kv_lens: list[int], num_heads: int, causal: bool) -> list[tuple[int, int, int]]:
    """(request, first row, KV blocks) of every tile."""
    tiles = []
    for r, (qo_len, kv_len) in enumerate(zip(qo_lens, kv_lens)):
        rows = qo_len * num_heads
        for row0 in range(0, rows, ROWS):
            last_token = min(qo_len - 1, (row0 + ROWS - 1) // num_heads)
            kv_end = min(kv_len, kv_len - qo_len + last_token + 1) if causal else kv_len
            tiles.append((r, row0, -(-max(kv_end, 0) // KV_BLOCK)))
    return tiles


def plan_work(qo_lens: list[int], kv_lens: list[int], num_heads: int, causal: bool, num_sms: int,
              workspace_capacity_rows: int, split: bool = True) -> MLAWork:
    """The work list for a batch (``qo_lens``, ``kv_lens`` per request) on a GPU of ``num_sms`` SMs.

    ``workspace_capacity_rows``: partial rows the workspace holds; chunks widen until the split fits
    (no split at all needs none). ``split=False`` never splits (one item per tile).
    """
    if num_heads < 1 or num_sms < 1:
        raise ValueError(f"num_heads={num_heads}, num_sms={num_sms} must be >= 1")
    tiles = _tiles(qo_lens, kv_lens, num_heads, causal)
    chunk = _choose_chunk(tiles, num_sms, workspace_capacity_rows) if split and tiles else 0
    items: list[tuple[int, ...]] = []
    merges: list[tuple[int, int, int, int]] = []
    part_row = 0
    for r, row0, nblk in tiles:
        if chunk and nblk > chunk:
            chunks = -(-nblk // chunk)
            size = -(-nblk // chunks)  # the tile's chunks balanced: sizes differ by at most one block
            merges.append((r, row0, chunks, part_row))
            for c in range(chunks):
                items.append((r, row0, c * size, min(nblk, (c + 1) * size), part_row + ROWS * c, 0, 0, 0))
            part_row += ROWS * chunks
        else:
            items.append((r, row0, 0, nblk, -1, 0, 0, 0))
    items.sort(key=lambda it: it[2] - it[3])  # heaviest first (stable: request order among equals)
    items_t = torch.tensor(items, dtype=torch.int32).reshape(-1, ITEM_INTS)
    merges_t = torch.tensor(merges, dtype=torch.int32).reshape(-1, MERGE_INTS)
    return MLAWork(items_t, merges_t, part_row, max(1, min(len(items), num_sms)), chunk if merges else 0)


def _partial_rows(tiles: list[tuple[int, int, int]], chunk: int) -> int:
    return sum(ROWS * -(-n // chunk) for _, _, n in tiles if n > chunk)


def _estimate(tiles: list[tuple[int, int, int]], chunk: int, num_sms: int) -> float:
    """Time of the launch in KV-block times: the longest item or the even share of all work, whichever is
    longer, with ITEM_COST blocks per item (its Q load and pipeline fill) and MERGE_COST per merged chunk."""
    sizes = []
    merged = 0
    for _, _, n in tiles:
        chunks = -(-n // chunk) if chunk and n > chunk else 1
        sizes += [-(-n // chunks)] * chunks
        merged += chunks if chunks > 1 else 0
    longest = max(sizes) + ITEM_COST
    share = (sum(sizes) + ITEM_COST * len(sizes) + MERGE_COST * merged) / num_sms
    return max(longest, share) + (MERGE_COST if merged else 0)


def _choose_chunk(tiles: list[tuple[int, int, int]], num_sms: int, capacity_rows: int) -> int:
    """KV blocks per split chunk (0: no split): the candidate of the lowest estimate that fits the workspace."""
    total = sum(n for _, _, n in tiles)
    longest = max(n for _, _, n in tiles)
    best, best_time = 0, _estimate(tiles, 0, num_sms)
    chunk = max(MIN_CHUNK_BLOCKS, -(-total // num_sms))
    while chunk < longest:
        if _partial_rows(tiles, chunk) <= capacity_rows:
            time = _estimate(tiles, chunk, num_sms)
            if time < 0.95 * best_time:  # a split must win clearly: its merge is a second launch
                best, best_time = chunk, time
        chunk *= 2
    return best

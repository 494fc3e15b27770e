"""Block-sparse attention masks as page tables (pure functions over host arrays).

A block-sparse pattern is a batch of paged-prefill requests: each block row is a request whose
queries are the rows of that block row and whose KV is the selected column blocks, gathered in the
order the pattern lists them. The KV tensor is viewed as pages of ``page_size`` tokens; a column
block is a run of whole pages, so nothing is copied and the gather is the page table.

- ``bsr_page_table``: FlashInfer's block-sparse row (BSR) format (``indptr``, ``indices``, ``M``,
  ``N``, ``R``, ``C``). The page size is ``gcd(C, N)``: every column block (a partial last one when
  ``C`` does not divide ``N`` included) is then whole pages, and every page is full.
- ``bsr_packed_mask``: a per-block mask ``[nnz, R, C]`` as the bit-packed per-request custom mask
  the paged prefill kernels read (each block row's ``[rows, selected columns]`` bits, row-major).
- ``variable_page_table``: FlashInfer's variable-block-size pattern (``block_mask_map``,
  ``block_row_sz``, ``block_col_sz``, one per kv head) over page size 1; request ``(head, block
  row)`` reads token ``head * kv_len + column`` of the kv heads laid end to end.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..masks import host_mask
from .checks import check_tensor
from .options import positive_int

_INT32_MAX = 2**31 - 1
_MASK_CHUNK = 1 << 22  # mask elements placed per step (bounds the index arrays' memory)


@dataclass(frozen=True)
class SparsePageTable:
    """A block-sparse pattern as one paged-prefill batch (host int32 tensors)."""

    qo_indptr: torch.Tensor  # [requests + 1]
    kv_indptr: torch.Tensor  # [requests + 1], in pages
    kv_indices: torch.Tensor  # [pages]
    last_page_len: torch.Tensor  # [requests]
    page_size: int
    num_pages: int  # pages in the KV view (the pool)


def _int_array(name: str, tensor, ndim: int) -> np.ndarray:
    """``tensor`` (an integer torch.Tensor on any device) as a host int64 array of ``ndim`` dimensions."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be an integer torch.Tensor, got {type(tensor).__name__}")
    if tensor.is_floating_point() or tensor.is_complex() or tensor.dtype == torch.bool:
        raise TypeError(f"{name} has dtype {str(tensor.dtype).removeprefix('torch.')}; it must be an integer "
                        "tensor (int32)")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    _check_has_data(name, tensor)
    return tensor.detach().to("cpu").to(torch.int64).numpy()


def _check_has_data(name: str, tensor: torch.Tensor) -> None:
    if tensor.is_meta:
        raise ValueError(f"{name} is on the meta device, which holds no data; pass it on the host or on the "
                         "CUDA device")


def _check_int32(name: str, highest: int) -> None:
    if highest > _INT32_MAX:
        raise ValueError(f"{name} exceeds int32 ({highest}): the pattern is too large for one plan")


def _as_int32(name: str, values: np.ndarray) -> torch.Tensor:
    if values.size:
        _check_int32(name, int(values.max()))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32))


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``concat(arange(s, s + n) for s, n in zip(starts, lengths))``, without a Python loop."""
    total = int(lengths.sum())
    offsets = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + offsets


@dataclass(frozen=True)
class BsrGeometry:
    """A checked BSR pattern: the block row and width of each stored block, the requests' shapes."""

    rows_of_block: np.ndarray  # int64 [nnz]: the block row of each stored block
    width_of_block: np.ndarray  # int64 [nnz]: its number of columns (C, or N's remainder for the last)
    col_start_of_block: np.ndarray  # int64 [nnz]: its first column in its block row's gathered KV
    qo_lens: np.ndarray  # int64 [MB]: rows of each block row (R, the last one M's remainder)
    kv_lens: np.ndarray  # int64 [MB]: gathered columns of each block row
    indices: np.ndarray  # int64 [nnz]


def check_bsr(indptr, indices, M, N, R, C) -> BsrGeometry:
    """Validate a BSR pattern: ``MB = ceil(M / R)`` block rows, ``NB = ceil(N / C)`` block columns,
    ``indptr`` of MB + 1 offsets from 0, non-decreasing, ending at ``len(indices)``; each index in
    ``[0, NB)``, at most once per block row."""
    M, N, R, C = (positive_int(v, n) for n, v in (("M", M), ("N", N), ("R", R), ("C", C)))
    num_block_rows, num_block_cols = -(-M // R), -(-N // C)
    ptr, idx = _int_array("indptr", indptr, 1), _int_array("indices", indices, 1)
    if ptr.size != num_block_rows + 1:
        raise ValueError(f"indptr has {ptr.size} entries; M={M} rows in blocks of R={R} make ceil(M / R) = "
                         f"{num_block_rows} block rows, so indptr needs {num_block_rows + 1}")
    steps = np.diff(ptr)
    if ptr[0] != 0 or (steps < 0).any():
        raise ValueError("indptr must start at 0 and never decrease (block row i's blocks are "
                         "indices[indptr[i]:indptr[i + 1]])")
    if ptr[-1] != idx.size:
        raise ValueError(f"indptr[-1] = {int(ptr[-1])} but indices has {idx.size} entries; they must agree (nnz)")
    bad = (idx < 0) | (idx >= num_block_cols)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"indices[{i}] = {int(idx[i])} is out of range: N={N} columns in blocks of C={C} make "
                         f"{num_block_cols} block columns, so indices must lie in [0, {num_block_cols})")
    rows = np.repeat(np.arange(num_block_rows, dtype=np.int64), steps)
    keys = np.sort(rows * num_block_cols + idx)
    repeated = np.flatnonzero(keys[1:] == keys[:-1])
    if repeated.size:
        key = int(keys[repeated[0]])
        raise ValueError(f"block row {key // num_block_cols} lists column block {key % num_block_cols} twice; "
                         "each block may appear at most once")
    widths = np.full(num_block_cols, C, dtype=np.int64)
    widths[-1] = N - (num_block_cols - 1) * C
    width = widths[idx]
    kv_lens = np.bincount(rows, weights=width, minlength=num_block_rows).astype(np.int64)
    row_first_col = np.cumsum(kv_lens) - kv_lens
    col_start = np.cumsum(width) - width - row_first_col[rows]
    qo_lens = np.minimum(R, M - R * np.arange(num_block_rows, dtype=np.int64))
    return BsrGeometry(rows, width, col_start, qo_lens, kv_lens, idx)


def bsr_page_table(geometry: BsrGeometry, M: int, N: int, R: int, C: int) -> SparsePageTable:
    """The paged-prefill batch of a checked BSR pattern: block row i is request i."""
    page_size = math.gcd(C, N)
    pages_per_block = geometry.width_of_block // page_size
    pages_per_row = np.bincount(geometry.rows_of_block, weights=pages_per_block,
                                minlength=geometry.qo_lens.size).astype(np.int64)
    kv_indptr = np.concatenate([[0], np.cumsum(pages_per_row)])
    kv_indices = _ranges(geometry.indices * (C // page_size), pages_per_block)
    qo_indptr = np.minimum(np.arange(geometry.qo_lens.size + 1, dtype=np.int64) * R, M)
    last_page_len = np.where(pages_per_row > 0, page_size, 0)
    return SparsePageTable(_as_int32("qo_indptr", qo_indptr), _as_int32("kv_indptr", kv_indptr),
                           _as_int32("kv_indices", kv_indices), _as_int32("last_page_len", last_page_len),
                           page_size, N // page_size)


def _block_row_mask_bytes(geometry: BsrGeometry) -> np.ndarray:
    """Bytes of each block row's bit-packed [rows, its blocks x C] mask (each starting on a byte)."""
    return (geometry.qo_lens * geometry.kv_lens + 7) // 8


def check_bsr_packed_mask(packed_mask, geometry: BsrGeometry) -> None:
    """``packed_mask`` (the caller's, bit-packed as :func:`bsr_packed_mask` packs) of the bytes ``geometry`` reads."""
    check_tensor("packed_mask", packed_mask, ndim=1, dtypes=(torch.uint8,))
    expected = int(_block_row_mask_bytes(geometry).sum())
    if packed_mask.numel() != expected:
        raise ValueError(f"packed_mask has {packed_mask.numel()} bytes; expected {expected}: each block row's "
                         "[rows, its blocks x C] bits of mask [nnz, R, C], packed little-endian and starting on a "
                         "byte (or pass mask and let plan() pack it)")


def bsr_packed_mask(mask, geometry: BsrGeometry, R: int, C: int) -> torch.Tensor:
    """FlashInfer's per-block mask ``[nnz, R, C]`` (True: attend) bit-packed per block row, as the paged
    prefill kernels read a custom mask: block row i's ``[qo_len_i, kv_len_i]`` bits row-major (columns in
    the order its blocks are listed), little-endian, each block row starting on a byte. Rows past ``M``
    and columns past ``N`` of the last blocks are not read."""
    nnz = geometry.indices.size
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
        got = str(mask.dtype).removeprefix("torch.") if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise TypeError(f"mask must be a bool torch.Tensor [nnz, R, C] (True: attend), got {got}; or pass "
                        "packed_mask")
    if tuple(mask.shape) != (nnz, R, C):
        raise ValueError(f"mask has shape {tuple(mask.shape)}; expected [nnz, R, C] = {(nnz, R, C)}")
    request_bytes = _block_row_mask_bytes(geometry)
    first_bit = (np.cumsum(request_bytes) - request_bytes) * 8
    bits = torch.zeros(int(request_bytes.sum()) * 8, dtype=torch.bool)
    host = host_mask("mask", mask)
    row = torch.arange(R, dtype=torch.int64)[None, :, None]
    col = torch.arange(C, dtype=torch.int64)[None, None, :]
    step = max(1, _MASK_CHUNK // (R * C))
    for start in range(0, nnz, step):
        blocks = slice(start, min(nnz, start + step))
        rows_of = geometry.rows_of_block[blocks]
        qo = torch.from_numpy(geometry.qo_lens[rows_of])[:, None, None]
        kv = torch.from_numpy(geometry.kv_lens[rows_of])[:, None, None]
        base = torch.from_numpy(first_bit[rows_of] + geometry.col_start_of_block[blocks])[:, None, None]
        width = torch.from_numpy(geometry.width_of_block[blocks])[:, None, None]
        inside = (row < qo) & (col < width)
        target = base + row * kv + col
        bits[target[inside]] = host[blocks][inside]
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def convert_bsr_mask_layout(mask: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    """FlashInfer's helper: a BSR mask ``[nnz, R, C]`` as its flattened per-block-row layout ``[nnz * R * C]``
    (block row i's blocks side by side: ``[R, blocks_i * C]`` row-major, block rows concatenated)."""
    if not isinstance(mask, torch.Tensor) or mask.dim() != 3:
        raise ValueError("mask must be a [nnz, R, C] tensor")
    nnz, rows, cols = mask.shape
    ptr = _int_array("indptr", indptr, 1)
    if ptr.size < 1 or ptr[0] != 0 or ptr[-1] != nnz or (np.diff(ptr) < 0).any():
        raise ValueError(f"indptr must run from 0 to nnz = {nnz} without decreasing")
    counts = np.diff(ptr)
    block_row = np.repeat(np.arange(counts.size), counts)
    slot = np.arange(nnz) - ptr[block_row]  # position of the block within its block row
    width = torch.from_numpy(counts[block_row] * cols)[:, None, None]
    base = torch.from_numpy(ptr[block_row] * rows * cols + slot * cols)[:, None, None]
    target = base + torch.arange(rows)[None, :, None] * width + torch.arange(cols)[None, None, :]
    flat = torch.empty(nnz * rows * cols, dtype=mask.dtype, device=mask.device)
    flat[target.reshape(-1).to(mask.device)] = mask.reshape(-1)
    return flat


@dataclass(frozen=True)
class VariableGeometry:
    """A checked variable-block-size pattern's shape."""

    qo_len: int  # rows of every kv head's pattern
    kv_len: int  # columns of every kv head's pattern


def variable_page_table(block_mask_map, block_row_sz, block_col_sz,
                        num_kv_heads: int) -> tuple[SparsePageTable, VariableGeometry]:
    """The paged-prefill batch (page size 1, one kv head) of FlashInfer's per-kv-head variable pattern.

    ``block_mask_map`` bool ``[H, MB, NB]``, ``block_row_sz`` ``[H, MB]``, ``block_col_sz`` ``[H, NB]``
    (every head's sizes sum to the same ``qo_len`` / ``kv_len``). Request ``h * MB + r`` holds rows
    ``h * qo_len + row`` of the heads' queries laid end to end and the selected columns of kv head h in
    column order, as tokens ``h * kv_len + column``."""
    if not isinstance(block_mask_map, torch.Tensor) or block_mask_map.dim() != 3:
        raise ValueError("block_mask_map must be a bool tensor [num_kv_heads, MB, NB]")
    if block_mask_map.dtype != torch.bool:
        raise TypeError(f"block_mask_map has dtype {str(block_mask_map.dtype).removeprefix('torch.')}; pass a "
                        "bool tensor (True: the block is attended)")
    _check_has_data("block_mask_map", block_mask_map)
    heads, mb, nb = block_mask_map.shape
    rows, cols = _int_array("block_row_sz", block_row_sz, 2), _int_array("block_col_sz", block_col_sz, 2)
    if heads != num_kv_heads or rows.shape != (heads, mb) or cols.shape != (heads, nb):
        raise ValueError(f"block_mask_map {tuple(block_mask_map.shape)}, block_row_sz {rows.shape} and "
                         f"block_col_sz {cols.shape} must be [num_kv_heads, MB, NB], [num_kv_heads, MB] and "
                         f"[num_kv_heads, NB] with num_kv_heads={num_kv_heads}")
    for name, sizes in (("block_row_sz", rows), ("block_col_sz", cols)):
        if sizes.size and sizes.min() < 0:
            raise ValueError(f"{name} has a negative block size ({int(sizes.min())})")
        totals = sizes.sum(axis=1)
        if heads and (totals != totals[0]).any():
            raise ValueError(f"{name} sums to {totals.tolist()} over the kv heads; every head's blocks must "
                             "cover the same length")
    qo_len = int(rows.sum(axis=1)[0]) if heads else 0
    kv_len = int(cols.sum(axis=1)[0]) if heads else 0
    head, row, col = (t.numpy() for t in block_mask_map.detach().to("cpu").nonzero(as_tuple=True))
    request = head * mb + row
    lengths = cols[head, col]
    col_first = np.cumsum(cols, axis=1) - cols
    # (before the per-token arrays below, which a pattern past int32 would make huge)
    _check_int32("kv_indices", heads * kv_len - 1)
    _check_int32("kv_indptr", int(lengths.sum()))
    kv_indices = _ranges(head * kv_len + col_first[head, col], lengths)
    tokens = np.bincount(request, weights=lengths, minlength=heads * mb).astype(np.int64)
    table = SparsePageTable(
        _as_int32("qo_indptr", np.concatenate([[0], np.cumsum(rows.reshape(-1))])),
        _as_int32("kv_indptr", np.concatenate([[0], np.cumsum(tokens)])), _as_int32("kv_indices", kv_indices),
        _as_int32("last_page_len", (tokens > 0).astype(np.int64)), 1, heads * kv_len)
    return table, VariableGeometry(qo_len, kv_len)

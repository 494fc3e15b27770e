"""Host-side planning: page-table checks, lengths and the split-KV schedule.

Pure functions over host tensors/lists, so they are unit-tested on their own.
Wrappers call them once per ``plan()``; ``run()`` then only launches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PagedIndex:
    """A validated page table, on the host."""

    indptr: torch.Tensor  # int32 [batch + 1]
    indices: torch.Tensor  # int32 [>= indptr[-1]]
    last_page_len: torch.Tensor  # int32 [batch]
    page_size: int
    kv_lens: tuple[int, ...]
    max_page_index: int  # -1 when no page is referenced

    @property
    def batch_size(self) -> int:
        return len(self.kv_lens)


def to_host_int32(name: str, tensor: torch.Tensor, ndim: int = 1) -> torch.Tensor:
    """A host copy of an int32 index tensor (one device->host copy if it is on a GPU)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32, got {type(tensor).__name__}")
    if tensor.dtype != torch.int32:
        raise TypeError(f"{name} has dtype {tensor.dtype}; index arrays must be int32 (use .int())")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(tensor.shape)}")
    if tensor.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{name} is on the {tensor.device} device, which holds no data; pass index arrays "
                         "on the host (fast path) or on the CUDA device")
    return tensor.detach().to("cpu").contiguous()


def to_host_int32_many(names: tuple[str, ...], tensors: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """Host copies of several 1-D int32 index tensors; those on one GPU come back in a single copy.

    Serving engines pass page tables on the device: one device->host transfer (one
    synchronisation) per ``plan()`` instead of one per array.
    """
    on_device = [t for t in tensors if isinstance(t, torch.Tensor) and t.device.type == "cuda"]
    if len(on_device) > 1 and len({t.device for t in on_device}) == 1 and all(
        t.dtype == torch.int32 and t.dim() == 1 for t in tensors
    ):
        return joined_to_host([t.detach().to(on_device[0].device) for t in tensors])
    return [to_host_int32(name, t) for name, t in zip(names, tensors)]


def joined_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Host copies of same-device 1-D tensors through one concatenated transfer."""
    joined = torch.cat(tensors).to("cpu")
    return [part.contiguous() for part in joined.split([t.numel() for t in tensors])]


def check_indptr(name: str, indptr: torch.Tensor) -> torch.Tensor:
    """A host copy of an int32 indptr: at least one entry, starting at 0, non-decreasing."""
    host = to_host_int32(name, indptr)
    _check_indptr_values(name, host)
    return host


def _check_indptr_values(name: str, host) -> None:
    """``host``: a 1-D int32 host tensor or numpy array."""
    host = host.numpy() if isinstance(host, torch.Tensor) else host
    if host.size < 1:
        raise ValueError(f"{name} must have batch_size + 1 >= 1 entries")
    if host[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {int(host[0])}")
    steps = np.diff(host)
    if steps.size and steps.min() < 0:
        r = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"{name} must be non-decreasing; {name}[{r + 1}] < {name}[{r}]")


def check_page_table(
    indptr: torch.Tensor | None, indices: torch.Tensor | None, last_page_len: torch.Tensor | None, page_size: int,
    *, num_pages: int | None = None, names: tuple[str, str, str] = ("indptr", "indices", "last_page_len"),
) -> int:
    """The page-table rules, checked on the arrays given (host int32 tensors; None: not known here).

    One rule set for attention plans, appends and cascade levels: ``indptr`` starts at 0 and
    never decreases; its last entry is at most ``len(indices)``; the referenced page indices
    are ``>= 0`` (and ``< num_pages`` when the pool size is given); ``last_page_len`` has one
    entry per request and lies in ``[1, page_size]`` for a request with pages (it is not read
    for a request without). Returns the highest referenced page (-1 when none or unknown).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be a positive int")
    highest = -1
    if indptr is None:
        return highest
    # numpy views of the host tensors: reductions over a 64k-page table take ~10 us there, while
    # torch's parallel int reductions cost 100s of us on some hosts.
    indptr_np = indptr.numpy()
    _check_indptr_values(names[0], indptr_np)
    batch = indptr_np.size - 1
    if last_page_len is not None and last_page_len.numel() != batch:
        raise ValueError(f"{names[2]} has {last_page_len.numel()} entries; expected batch_size = {batch} "
                         f"(len({names[0]}) - 1)")
    total_pages = int(indptr_np[-1])
    if indices is not None:
        if total_pages > indices.numel():
            raise ValueError(f"{names[0]}[-1] = {total_pages} exceeds len({names[1]}) = {indices.numel()}")
        used = indices.numpy()[:total_pages]
        lowest, highest = (int(used.min()), int(used.max())) if total_pages else (0, -1)
        if lowest < 0:
            i = int(np.flatnonzero(used < 0)[0])
            raise ValueError(f"{names[1]}[{i}] = {int(used[i])} is a negative page index")
        if num_pages is not None and highest >= num_pages:
            i = int(np.flatnonzero(used >= num_pages)[0])
            raise IndexError(f"{names[1]}[{i}] = {int(used[i])} references a page past the end of the kv cache "
                             f"(it has {num_pages} pages)")
    if last_page_len is not None and batch:
        pages = np.diff(indptr_np)
        last = last_page_len.numpy()
        bad = (pages > 0) & ((last < 1) | (last > page_size))
        if bad.any():
            r = int(np.flatnonzero(bad)[0])
            raise ValueError(
                f"{names[2]}[{r}] = {int(last[r])} is out of range: a request with pages needs 1 <= "
                f"last_page_len <= page_size ({page_size})"
            )
    return highest


def check_paged_index(
    indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor, page_size: int,
    *, names: tuple[str, str, str] = ("indptr", "indices", "last_page_len"),
) -> PagedIndex:
    """Validate a page table (``check_page_table``'s rules) and compute each request's KV length.

    kv_len = (num_pages - 1) * page_size + last_page_len, and 0 for a request with no pages.
    The arrays may be on the host or the device (copied to the host once).
    """
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be a positive int")
    indptr_h, indices_h, last_h = to_host_int32_many(names, (indptr, indices, last_page_len))
    highest = check_page_table(indptr_h, indices_h, last_h, page_size, names=names)
    num_pages = np.diff(indptr_h.numpy()).astype(np.int64)
    kv_lens = np.where(num_pages > 0, (num_pages - 1) * page_size + last_h.numpy(), 0).tolist()
    return PagedIndex(
        indptr=indptr_h, indices=indices_h, last_page_len=last_h, page_size=page_size,
        kv_lens=tuple(kv_lens), max_page_index=highest,
    )


def check_page_pool(index: PagedIndex, num_pages_in_cache: int, indices_name: str = "indices") -> None:
    """Refuse page indices past the end of the KV pool."""
    if index.max_page_index >= num_pages_in_cache:
        raise ValueError(
            f"{indices_name} references page {index.max_page_index} but the kv cache has only "
            f"{num_pages_in_cache} pages"
        )


@dataclass(frozen=True)
class SplitPlan:
    """How each request's KV is cut into chunks processed in parallel."""

    kv_chunk_size: int  # tokens per chunk; 0 = no split
    split_indptr: tuple[int, ...]  # first chunk index of each request; len batch + 1

    @property
    def num_chunks(self) -> int:
        return self.split_indptr[-1]


def plan_decode_split(
    kv_lens: tuple[int, ...], *, num_kv_heads: int, num_sms: int, page_size: int,
    fixed_split_size: int | None = None, disable_split_kv: bool = False, min_chunk_tokens: int = 256,
    blocks_per_sm: int = 2,
) -> SplitPlan:
    """Choose the split-KV chunk size for a decode batch.

    A block processes one (chunk, kv head). Balance the work: the chunk length
    is the total KV work divided over ``blocks_per_sm`` blocks per SM, so a
    single long request is cut to fill every SM and a long request among many
    short ones (a skewed batch) is cut to the others' scale. A batch whose
    longest request is under 1.5 balanced chunks already keeps the SMs busy
    and is not split: there the partial outputs, the merge and the short tail
    chunks cost more than the split evens out (H200, b32 x 4096: 157 us split
    vs 138 us whole). Chunks are never shorter than ``min_chunk_tokens`` and
    end on page boundaries. ``fixed_split_size`` (in pages) forces the chunk
    length, which makes every request's result independent of the rest of the
    batch.
    """
    batch = len(kv_lens)
    no_split = SplitPlan(0, tuple(range(batch + 1)))
    if disable_split_kv or batch == 0 or max(kv_lens) == 0:
        return no_split
    if fixed_split_size is not None:
        if fixed_split_size < 1:
            raise ValueError(f"fixed_split_size={fixed_split_size} must be >= 1 (pages per chunk)")
        chunk = fixed_split_size * page_size
    else:
        balanced = math.ceil(sum(kv_lens) * num_kv_heads / (blocks_per_sm * num_sms))
        chunk = math.ceil(max(min_chunk_tokens, balanced) / page_size) * page_size
        if 2 * max(kv_lens) < 3 * chunk:
            return no_split
    indptr = [0]
    for kv_len in kv_lens:
        indptr.append(indptr[-1] + max(1, math.ceil(kv_len / chunk)))
    return SplitPlan(chunk, tuple(indptr))


def max_decode_chunks(
    max_batch: int, max_kv_tokens: int, *, num_kv_heads: int, num_sms: int, page_size: int,
    fixed_split_size: int | None = None, min_chunk_tokens: int = 256, blocks_per_sm: int = 2,
) -> int:
    """An upper bound on ``plan_decode_split(...).num_chunks`` over every batch within the limits."""
    if fixed_split_size is not None:
        chunk = fixed_split_size * page_size
    else:
        # chunk >= total * H / (blocks_per_sm * SMs), so sum(ceil(len / chunk)) <= blocks_per_sm * SMs / H + batch
        chunk = max(min_chunk_tokens, 1)
        return max_batch + min(math.ceil(blocks_per_sm * num_sms / max(1, num_kv_heads)),
                               math.ceil(max_kv_tokens / chunk))
    return max_batch + math.ceil(max_kv_tokens / chunk)


def split_workspace_bytes(num_chunks: int, num_qo_heads: int, head_dim_vo: int) -> int:
    """Bytes of float workspace a split plan needs: fp32 partial o and lse per chunk and head."""
    return num_chunks * num_qo_heads * (head_dim_vo + 1) * 4


def packed_mask_indptr(qo_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
    """Byte offset of each request's bit-packed qo_len x kv_len mask (each starts on a byte)."""
    sizes = [(q * k + 7) // 8 for q, k in zip(qo_lens, kv_lens)]
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return torch.tensor(out, dtype=torch.int32)


def segment_packbits(custom_mask: torch.Tensor, qo_lens: list[int], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack FlashInfer's flattened boolean mask per request, bit i of a request at byte i//8, bit i%8.

    Returns (packed uint8, mask_indptr int32 in bytes).
    """
    mask = custom_mask.detach().to("cpu").reshape(-1)
    if mask.dtype != torch.bool:
        raise TypeError(f"custom_mask has dtype {mask.dtype}; pass a bool mask (or packed_custom_mask as uint8)")
    expected = sum(q * k for q, k in zip(qo_lens, kv_lens))
    if mask.numel() != expected:
        raise ValueError(
            f"custom_mask has {mask.numel()} elements; the requests' qo_len*kv_len sum to {expected} "
            "(flattened row-major per request, concatenated)"
        )
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    chunks, offset = [], 0
    for q, k in zip(qo_lens, kv_lens):
        bits = mask[offset: offset + q * k]
        offset += q * k
        padded = torch.zeros((bits.numel() + 7) // 8 * 8, dtype=torch.uint8)
        padded[: bits.numel()] = bits.to(torch.uint8)
        chunks.append((padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8) if padded.numel() else padded)
    packed = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return packed, packed_mask_indptr(qo_lens, kv_lens)


def cascade_level_chunks(
    kv_lens: tuple[int, ...], *, num_kv_heads: int, num_sms: int, page_size: int,
    fixed_split_size: int | None = None, min_chunk_tokens: int = 256, blocks_per_sm: int = 2,
) -> int:
    """How many chunks to cut each node's KV of one shared cascade level into (1 = no split).

    A shared level has few nodes (often one) whose KV is long: without a split
    it keeps only ``nodes * num_kv_heads`` blocks busy. ``fixed_split_size``
    caps a chunk at that many pages.
    """
    if not kv_lens or max(kv_lens) == 0:
        return 1
    longest_pages = max((n + page_size - 1) // page_size for n in kv_lens)
    if fixed_split_size is not None:
        if fixed_split_size < 1:
            raise ValueError(f"fixed_split_size={fixed_split_size} must be >= 1 (pages per chunk)")
        return max(1, math.ceil(longest_pages / fixed_split_size))
    blocks = len(kv_lens) * num_kv_heads
    wanted = math.ceil(blocks_per_sm * num_sms / blocks)
    limit = max(1, max(kv_lens) // min_chunk_tokens)
    return max(1, min(wanted, limit, longest_pages))


def split_level_page_table(qo_indptr: torch.Tensor, index: PagedIndex, num_chunks: int) -> tuple[torch.Tensor, PagedIndex]:
    """The page table of a level whose nodes are each cut into ``num_chunks`` chunks.

    The expanded batch is chunk-major: request ``c * nodes + r`` is chunk c of
    node r, and its queries are rows ``c * total_q + qo_indptr[r] ...`` of the
    queries repeated ``num_chunks`` times, so the partial outputs reshape to
    ``[num_chunks, total_q, ...]`` for an LSE merge. Chunk boundaries fall on
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
            per_chunk = math.ceil(num_pages / num_chunks) if num_pages else 0
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
                         kv_lens=tuple(kv_lens), max_page_index=index.max_page_index)
    return torch.tensor(new_qo, dtype=i32), chunked


def multi_item_mask(
    qo_lens: list[int], kv_lens: list[int], prefix_len: torch.Tensor, token_pos_in_items: torch.Tensor,
    token_pos_in_items_len: int,
) -> torch.Tensor:
    """FlashInfer's multi-item scoring as a flattened bool custom mask (True = attend).

    A request's sequence is a shared prefix of ``prefix_len[r]`` tokens followed by items,
    each item a delimiter and its tokens; ``token_pos_in_items`` gives every token after the
    prefix its position in its item (0 for a delimiter), request r's values starting at
    ``r * token_pos_in_items_len``. The query at sequence position p (bottom-right aligned)
    sees key j when ``j <= p`` and: p is in the prefix, or j is in the prefix, or j lies in
    p's own item (``p - pos < j``). A delimiter after the prefix so sees only the prefix, and
    no item sees an earlier one.
    """
    prefix = prefix_len.detach().to("cpu").to(torch.int64).reshape(-1)
    positions = token_pos_in_items.detach().to("cpu").to(torch.int64).reshape(-1)
    if prefix.numel() != len(qo_lens):
        raise ValueError(f"prefix_len_ptr has {prefix.numel()} entries; expected one per request ({len(qo_lens)})")
    stride = int(token_pos_in_items_len)
    if len(qo_lens) > 1 and stride <= 0:
        raise ValueError("token_pos_in_items_len must give each request's (zero-padded) length of "
                         "token_pos_in_items_ptr when the batch has more than one request")
    masks = []
    for r, (q, k) in enumerate(zip(qo_lens, kv_lens)):
        p_len = int(prefix[r])
        pos_q = torch.arange(q, dtype=torch.int64) + (k - q)  # sequence position of each query
        j = torch.arange(k, dtype=torch.int64)
        offset = torch.clamp(pos_q - p_len, min=0) + r * stride
        if (pos_q >= p_len).any() and int(offset[pos_q >= p_len].max()) >= positions.numel():
            raise ValueError(
                f"request {r}: token_pos_in_items_ptr has {positions.numel()} entries, but the request's tokens after "
                f"its prefix need index {int(offset.max())} (r * token_pos_in_items_len + position - prefix_len)"
            )
        in_item = torch.where(pos_q >= p_len, positions[torch.clamp(offset, max=max(positions.numel() - 1, 0))]
                              if positions.numel() else torch.zeros_like(pos_q), 0)
        causal = j[None, :] <= pos_q[:, None]
        same_item = (pos_q[:, None] - in_item[:, None]) < j[None, :]
        visible = causal & ((pos_q[:, None] < p_len) | (j[None, :] < p_len) | same_item)
        masks.append(visible.reshape(-1))
    return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)

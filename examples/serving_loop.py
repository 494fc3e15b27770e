"""A tiny serving loop: a shared system prompt, prefill, then decode steps with cascade.

What a serving engine does each step, with jitattn's FlashInfer-compatible API:

1. write the new tokens' K/V into the paged cache (``append_paged_kv_cache``);
2. ``plan()`` once per step (host index tensors: no device sync);
3. ``run()`` once per layer.

The requests share a page-aligned system prompt, so decode also runs as two-level cascade
attention (the shared prefix once for everyone, each request's own pages separately) and is
checked against flat paged decode and the float reference. Runs on the GPU when one is
visible, else on the cpu target:

    python3 examples/serving_loop.py
"""

from __future__ import annotations

import torch

import jitattn
from jitattn import reference

NUM_LAYERS, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE = 2, 8, 2, 64, 16
DTYPE = torch.float16


class PagedRequests:
    """Page bookkeeping: a free list, a shared prefix, and each request's own pages."""

    def __init__(self, num_pages: int, prefix_pages: int, num_requests: int) -> None:
        self.free = list(range(num_pages))
        self.prefix = [self.free.pop() for _ in range(prefix_pages)]
        self.own: list[list[int]] = [[] for _ in range(num_requests)]
        self.own_len = [0] * num_requests

    def grow(self, request: int, new_tokens: int) -> None:
        self.own_len[request] += new_tokens
        while len(self.own[request]) * PAGE_SIZE < self.own_len[request]:
            self.own[request].append(self.free.pop())

    def table(self, with_prefix: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(indptr, indices, last_page_len) of the requests' own pages, optionally after the shared prefix."""
        rows = [(self.prefix if with_prefix else []) + pages for pages in self.own]
        indptr = torch.tensor([0] + torch.tensor([len(r) for r in rows]).cumsum(0).tolist(), dtype=torch.int32)
        indices = torch.tensor([p for r in rows for p in r], dtype=torch.int32)
        last = torch.tensor([(n - 1) % PAGE_SIZE + 1 for n in self.own_len], dtype=torch.int32)
        return indptr, indices, last


def append(cache: torch.Tensor, pages: PagedRequests, new_lens: list[int], device: str) -> None:
    """Write random K/V for ``new_lens[r]`` new tokens of each request (a model would write real ones)."""
    append_indptr = torch.tensor([0] + torch.tensor(new_lens).cumsum(0).tolist(), dtype=torch.int32)
    indptr, indices, last = pages.table(with_prefix=False)
    seq_lens = jitattn.get_seq_lens(indptr, last, PAGE_SIZE)
    batch_indices, positions = jitattn.get_batch_indices_positions(append_indptr, seq_lens, sum(new_lens))
    k = torch.randn(sum(new_lens), NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn(sum(new_lens), NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    jitattn.append_paged_kv_cache(k, v, batch_indices.to(device), positions.to(device), cache, indices.to(device),
                                  indptr.to(device), last.to(device))


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    num_requests, prefix_tokens, prompt_lens = 4, 4 * PAGE_SIZE, [5, 17, 1, 30]
    pages = PagedRequests(num_pages=64, prefix_pages=prefix_tokens // PAGE_SIZE, num_requests=num_requests)
    caches = [torch.randn(64, 2, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
              for _ in range(NUM_LAYERS)]  # the shared prefix pages hold the system prompt's K/V
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    prefill = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace)
    decode = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace)
    cascade = jitattn.MultiLevelCascadeAttentionWrapper(2, workspace)
    worst_error = 0.0

    for step in range(4):
        new_lens = prompt_lens if step == 0 else [1] * num_requests
        for r, n in enumerate(new_lens):
            pages.grow(r, n)
        for cache in caches:
            append(cache, pages, new_lens, device)
        flat = pages.table(with_prefix=True)
        if step == 0:  # prefill: each prompt attends causally to the system prompt and itself
            qo_indptr = torch.tensor([0] + torch.tensor(new_lens).cumsum(0).tolist(), dtype=torch.int32)
            prefill.plan(qo_indptr, *flat, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, causal=True,
                         q_data_type=DTYPE)
            for cache in caches:
                q = torch.randn(sum(new_lens), NUM_QO_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
                expected, _ = reference.batch_prefill_paged(q, cache, qo_indptr, *flat, causal=True)
                out = prefill.run(q, cache)
                worst_error = max(worst_error, (out.float().cpu() - expected.float().cpu()).abs().max().item())
            continue
        own = pages.table(with_prefix=False)
        decode.plan(*flat, NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, q_data_type=DTYPE)
        prefix = (torch.tensor([0, len(pages.prefix)], dtype=torch.int32), torch.tensor(pages.prefix, dtype=torch.int32),
                  torch.tensor([PAGE_SIZE], dtype=torch.int32))
        cascade.plan([torch.tensor([0, num_requests], dtype=torch.int32), torch.arange(num_requests + 1, dtype=torch.int32)],
                     [prefix[0], own[0]], [prefix[1], own[1]], [prefix[2], own[2]],
                     NUM_QO_HEADS, NUM_KV_HEADS, HEAD_DIM, PAGE_SIZE, q_data_type=DTYPE)
        for cache in caches:  # one run per layer, one plan per step
            q = torch.randn(num_requests, NUM_QO_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
            out_flat = decode.run(q, cache)
            out_cascade = cascade.run(q, cache)
            expected, _ = reference.batch_decode_paged(q, cache, *flat)
            for out in (out_flat, out_cascade):
                worst_error = max(worst_error, (out.float().cpu() - expected.float().cpu()).abs().max().item())
        print(f"step {step}: kv lengths {[prefix_tokens + n for n in pages.own_len]}")
    print(f"device={device} max abs error (prefill, flat and cascade decode vs float64 reference): "
          f"{worst_error:.2e}")
    assert worst_error < 1e-2, "decode output differs from the reference"


if __name__ == "__main__":
    main()

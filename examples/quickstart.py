"""Quickstart: batched decode over a paged KV cache, checked against the float reference.

Runs on the GPU when one is visible, else on the cpu target:

    python3 examples/quickstart.py
"""

from __future__ import annotations

import torch

import jitattn
from jitattn import reference


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    num_qo_heads, num_kv_heads, head_dim, page_size = 32, 8, 128, 16
    kv_lens = [1, 300, 2048, 77]

    # A page table handing out pages of one pool in random order.
    pages_per_request = [(n + page_size - 1) // page_size for n in kv_lens]
    num_pages = sum(pages_per_request)
    kv_indices = torch.randperm(num_pages, dtype=torch.int32)
    kv_indptr = torch.tensor([0] + torch.tensor(pages_per_request).cumsum(0).tolist(), dtype=torch.int32)
    kv_last_page_len = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    paged_kv_cache = torch.randn(num_pages, 2, page_size, num_kv_heads, head_dim, dtype=torch.bfloat16,
                                 device=device)
    q = torch.randn(len(kv_lens), num_qo_heads, head_dim, dtype=torch.bfloat16, device=device)

    workspace = torch.empty(64 << 20, dtype=torch.uint8, device=device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(kv_indptr, kv_indices, kv_last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                 q_data_type=torch.bfloat16)  # once per batch (compiles on first use)
    out, lse = wrapper.run(q, paged_kv_cache, return_lse=True)  # once per layer

    expected, expected_lse = reference.batch_decode_paged(q, paged_kv_cache, kv_indptr, kv_indices, kv_last_page_len)
    error = (out.float().cpu() - expected.float().cpu()).abs().max().item()
    print(f"device={device} out={tuple(out.shape)} max abs error vs float64 reference: {error:.2e}")
    assert error < 2e-2, "decode output differs from the reference"


if __name__ == "__main__":
    main()

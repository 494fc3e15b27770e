"""A few small launches of the sm90 prefill tier for compute-sanitizer (memcheck / racecheck):

    python3 tools/sanitize_sm90.py            # builds the specs (once)
    JITATTN_ASSERT_NO_COMPILE=1 compute-sanitizer --tool memcheck python3 tools/sanitize_sm90.py
"""

from __future__ import annotations

import torch

import jitattn

CASES = [  # head_dim, hq, hkv, dtype, causal, qo_lens, kv_lens, window_left, logits_soft_cap
    (64, 4, 2, torch.float16, True, [70, 1, 0, 200], [90, 5, 3, 200], -1, None),
    (128, 8, 2, torch.bfloat16, False, [130, 7], [77, 300], -1, None),
    (256, 4, 4, torch.bfloat16, True, [65], [129], -1, None),
    (128, 8, 2, torch.bfloat16, True, [300, 1, 0], [700, 500, 3], 40, 30.0),  # blocks skipped before the window
    (64, 4, 4, torch.float16, False, [200, 9], [600, 9], 100, None),
    (256, 8, 4, torch.bfloat16, True, [100], [400], 70, 20.0),
]

for d, hq, hkv, dtype, causal, qo_lens, kv_lens, window, cap in CASES:
    g = torch.Generator().manual_seed(d)
    q = torch.randn(sum(qo_lens), hq, d, generator=g).to(dtype).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype).cuda()
    v = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dtype).cuda()
    indptr = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(indptr(qo_lens), indptr(kv_lens), hq, hkv, d, causal=causal, window_left=window, logits_soft_cap=cap,
           q_data_type=dtype)
    out, lse = w.run(q, k, v, return_lse=True)
    torch.cuda.synchronize()
    print(d, dtype, causal, window, cap, "finite:", bool(torch.isfinite(out).all()))

# Paged KV (cp.async gathers), page sizes 1 / 16, and query rows shared by two chunks (q_row_period).
from jitattn.runtime.batch import share_queries  # noqa: E402

for d, hq, hkv, dtype, causal, page, shared, qo_lens, kv_lens in [
    (128, 8, 2, torch.bfloat16, True, 16, False, [70, 1, 0, 200], [90, 5, 3, 200]),
    (64, 4, 4, torch.float16, False, 1, False, [130, 7], [77, 300]),
    (128, 8, 2, torch.bfloat16, False, 16, True, [60, 60], [100, 33]),
]:
    g = torch.Generator().manual_seed(d + page)
    pages = [(n + page - 1) // page for n in kv_lens]
    pool = sum(pages) + 2
    cache = torch.randn(pool, 2, page, hkv, d, generator=g).to(dtype).cuda()
    indptr = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)  # noqa: E731
    indices = torch.randperm(pool, generator=g)[:sum(pages)].to(torch.int32)
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
    w = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), "NHD")
    w.plan(indptr(qo_lens), indptr(pages), indices, last, hq, hkv, d, page, causal=causal, q_data_type=dtype)
    q_rows = qo_lens[0] if shared else sum(qo_lens)
    if shared:
        share_queries(w._plan, q_rows)
    q = torch.randn(q_rows, hq, d, generator=g).to(dtype).cuda()
    out, lse = w.run(q, cache, return_lse=True)
    torch.cuda.synchronize()
    print("paged", d, dtype, causal, page, "shared q" if shared else "", "finite:", bool(torch.isfinite(out).all()))

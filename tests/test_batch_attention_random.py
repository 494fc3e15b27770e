"""BatchAttention over seeded random mixed batches (decode rows, speculative and chunked-prefill rows, whole prompts,
requests without KV, in random order; pages of 1 / 8 / 16, both layouts, GQA groups 1 / 4 / 7, causal or not)
against the float reference: every row's out and lse."""

from __future__ import annotations

import random

import pytest
import torch

import jitattn
from jitattn import reference

from attention_cases import assert_close_lse, assert_close_out, devices, random_paged_batch

HEADS = [(8, 2, 64), (4, 4, 128), (7, 1, 64)]  # (qo heads, kv heads, head dim)


def _case(seed: int):
    rng = random.Random(seed)
    rows = []
    for _ in range(rng.randint(1, 12)):
        qo = rng.choice([1, 1, 1, 2, 4, 17, 70])
        kv = 0 if rng.random() < 0.1 else rng.randint(qo if rng.random() < 0.8 else 1, 300)
        rows.append((qo, kv))
    return (rows, rng.choice(HEADS), rng.choice([torch.bfloat16, torch.float16]), rng.choice([1, 8, 16]),
            rng.choice(["NHD", "HND"]), rng.random() < 0.5)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(12))
def test_random_mixed_batches_match_the_reference(device: str, seed: int) -> None:
    rows, (hq, hkv, d), dtype, page, layout, causal = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = random_paged_batch([kv for _, kv in rows], hkv, d, page, dtype, layout=layout, device=device,
                               generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor([qo for qo, _ in rows]).cumsum(0).tolist(), dtype=torch.int32)
    kv_len_arr = torch.tensor([kv for _, kv in rows], dtype=torch.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchAttention(kv_layout=layout, device=device)
    wrapper.plan(qo_indptr.to(device), batch.kv_indptr.to(device), batch.kv_indices.to(device), kv_len_arr.to(device),
                 hq, hkv, d, d, page, causal=causal, q_data_type=dtype, kv_data_type=dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    wrapper.run(q, batch.cache, out, lse)
    expected_o, expected_lse = reference.batch_prefill_paged(
        q.cpu(), batch.cache.cpu(), qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        kv_layout=layout, causal=causal)
    assert_close_out(out, expected_o, dtype)
    assert_close_lse(lse, expected_lse)

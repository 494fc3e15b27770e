"""The paged prefill wrapper over seeded random batches long enough to cross the kernels' query tiles, KV blocks and
pages (up to ~400 queries over ~1200 keys a request, empty requests, qo_len > kv_len), each with a random draw of
the variant axes (head dims 64 / 128 / 256, GQA, dtypes, pages of 1 / 16 / 64, both layouts, causal, a sliding
window, a soft cap, ALiBi), against the float reference: every row's out and lse."""

from __future__ import annotations

import random

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_lse, assert_close_out, devices, random_paged_batch

HEADS = [(8, 2, 64), (8, 2, 128), (4, 4, 128), (4, 2, 256)]  # (qo heads, kv heads, head dim)
SEEDS = range(16)


def _case(seed: int) -> dict:
    rng = random.Random(seed)
    qo_lens = [0 if rng.random() < 0.1 else rng.choice([1, rng.randint(2, 130), rng.randint(131, 400)])
               for _ in range(rng.randint(1, 4))]
    kv_lens = [q + rng.randint(0, 800) if rng.random() < 0.85 else rng.randint(0, q) for q in qo_lens]
    hq, hkv, d = rng.choice(HEADS)
    return dict(qo_lens=qo_lens, kv_lens=kv_lens, hq=hq, hkv=hkv, d=d,
                dtype=rng.choice([torch.bfloat16, torch.float16]), page=rng.choice([1, 16, 64]),
                layout=rng.choice(["NHD", "HND"]), causal=rng.random() < 0.6,
                window=rng.choice([-1, -1, rng.randint(0, 300)]), cap=rng.choice([None, None, 30.0]),
                pos=rng.choice(["NONE", "NONE", "ALIBI"]))


def _spec(c: dict):
    return attention_spec(Op.PREFILL, Target.CUDA, q_dtype=c["dtype"], kv_dtype=c["dtype"], o_dtype=c["dtype"],
                          head_dim_qk=c["d"], head_dim_vo=c["d"], num_qo_heads=c["hq"], num_kv_heads=c["hkv"],
                          pos_encoding=PosEncoding.parse(c["pos"].lower(), "pos"), use_sliding_window=c["window"] >= 0,
                          use_logits_soft_cap=c["cap"] is not None,
                          mask_mode=MaskMode.CAUSAL if c["causal"] else MaskMode.NONE,
                          kv_layout=KVLayout.parse(c["layout"], "layout"), kv_storage=KVStorage.PAGED)


GPU_SPECS = [_spec(_case(seed)) for seed in SEEDS]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", SEEDS)
def test_random_batches_match_the_reference(device: str, seed: int) -> None:
    c = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    batch = random_paged_batch(c["kv_lens"], c["hkv"], c["d"], c["page"], c["dtype"], c["layout"], device=device,
                               generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor(c["qo_lens"]).cumsum(0).tolist(), dtype=torch.int32)
    total = int(qo_indptr[-1])
    q = torch.randn(total, c["hq"], c["d"], generator=gen).to(c["dtype"]).to(device)
    options = dict(causal=c["causal"], pos_encoding_mode=c["pos"], window_left=c["window"], logits_soft_cap=c["cap"])
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=device),
                                                          c["layout"])
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, c["hq"], c["hkv"], c["d"],
                 c["page"], q_data_type=c["dtype"], **options)
    out = torch.full((total, c["hq"], c["d"]), float("nan"), dtype=c["dtype"], device=device)
    lse = torch.full((total, c["hq"]), float("nan"), device=device)
    wrapper.run(q, batch.cache, out=out, lse=lse)
    ref_o, ref_lse = reference.batch_prefill_paged(q.cpu(), batch.cache.cpu(), qo_indptr, batch.kv_indptr,
                                                   batch.kv_indices, batch.kv_last_page_len, kv_layout=c["layout"],
                                                   **options)
    assert_close_out(out, ref_o, c["dtype"])
    assert_close_lse(lse, ref_lse)

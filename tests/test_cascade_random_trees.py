"""MultiLevelCascadeAttentionWrapper over seeded random prefix trees (1-5 levels, each level's nodes refining the one
above, empty nodes, pages of 1 / 4 / 16 in random order, one or several queries per request, causal or not, split
shared levels) against the float reference over each request's concatenated KV: out and lse."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

import jitattn
from jitattn import reference

from attention_cases import assert_close_lse, assert_close_out, cascade_level, devices

HQ, HKV, D, DTYPE = 8, 2, 64, torch.float16


def _tree(rng: random.Random, batch: int, levels: int) -> list[list[tuple[int, int]]]:
    """Each shared level's nodes as (first, end) request ranges, each range inside one node of the level above."""
    tree, above = [], [(0, batch)]
    for _ in range(levels - 1):
        nodes = []
        for first, end in above:
            cuts = sorted(rng.sample(range(first + 1, end), rng.randint(0, min(2, end - first - 1))))
            nodes += list(zip([first, *cuts], [*cuts, end]))
        tree.append(nodes)
        above = nodes
    return tree


def _case(seed: int):
    rng = random.Random(seed)
    batch, levels = rng.randint(1, 7), rng.randint(1, 5)
    causal, decode = rng.random() < 0.4, rng.random() < 0.5  # decode: one query each (the decode kernel's level)
    qo_lens = [1 if decode and not causal else rng.randint(1, 4) for _ in range(batch)]
    tree = _tree(rng, batch, levels)
    shared_lens = [[0 if rng.random() < 0.2 else rng.randint(1, 300) for _ in nodes] for nodes in tree]
    own_lens = [n + rng.randint(0 if causal else 1, 90) for n in qo_lens]  # causal: the own level covers the diagonal
    return qo_lens, causal, tree, shared_lens, own_lens, rng.choice([1, 4, 16]), rng.choice([None, None, 1, 2])


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(16))
def test_random_trees_equal_attention_over_the_concatenated_kv(device: str, seed: int) -> None:
    qo_lens, causal, tree, shared_lens, own_lens, page, split = _case(seed)
    gen = torch.Generator().manual_seed(seed)
    pages = sum(-(-n // page) for lens in [*shared_lens, own_lens] for n in lens) + 8
    pool = torch.randperm(pages, generator=gen).tolist()
    cache = torch.randn(pages, 2, page, HKV, D, generator=gen).to(DTYPE).to(device)
    level_tables = [cascade_level(lens, pool, page) for lens in [*shared_lens, own_lens]]
    q_cum = [0, *itertools.accumulate(qo_lens)]
    qo_arr = [torch.tensor([0] + [q_cum[end] for _, end in nodes], dtype=torch.int32) for nodes in tree]
    qo_arr.append(torch.tensor(q_cum, dtype=torch.int32))
    q = torch.randn(q_cum[-1], HQ, D, generator=gen).to(DTYPE).to(device)

    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(len(qo_arr), torch.empty(8 << 20, dtype=torch.uint8,
                                                                                 device=device))
    wrapper.plan(qo_arr, *[[t[i] for t in level_tables] for i in range(3)], HQ, HKV, D, page, causal=causal,
                 q_data_type=DTYPE, fixed_split_size=split)
    out, lse = wrapper.run(q, cache, return_lse=True)

    ragged = [reference.paged_kv_to_ragged(cache, *t) for t in level_tables]
    expected_out, expected_lse = [], []
    for r in range(len(qo_lens)):
        nodes = [next(i for i, (first, end) in enumerate(level) if first <= r < end) for level in tree] + [r]
        parts = [(k[ix[n]:ix[n + 1]], v[ix[n]:ix[n + 1]]) for (k, v, ix), n in zip(ragged, nodes)]
        o, s = reference.single_attention(q[q_cum[r]:q_cum[r + 1]], torch.cat([p[0] for p in parts]),
                                          torch.cat([p[1] for p in parts]), causal=causal)
        expected_out.append(o)
        expected_lse.append(s)
    # each level's state is rounded to fp16 before the merge: two roundings
    assert_close_out(out, torch.cat(expected_out), torch.bfloat16)
    assert_close_lse(lse, torch.cat(expected_lse))

"""Regressions found in review (cpu target; each failed before its fix).

- A cascade plan keeps its state buffers while their layout holds (a graph captured around run()
  writes and merges them; FlashInfer's protocol re-plans before every replay).
- Under CUDA graphs and in batch-invariant mode a causal decode level stays causal: its kernel and
  its split must not depend on the companions' query counts.
- A wrapper that once ran with sinks can still plan a custom variant.
- A graph-mode decode wrapper whose fixed buffers are larger than the batch launches over the batch.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

import jitattn
from jitattn import AttentionVariant

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_batch_invariant import D, HQ, _cascade, _random_kv  # noqa: E402

H, HK, DIM, PAGE = 8, 2, 64, 16


def _i32(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _graph_cascade() -> jitattn.MultiLevelCascadeAttentionWrapper:
    bufs = dict(qo_indptr_buf_arr=[torch.zeros(8, dtype=torch.int32) for _ in range(2)],
                paged_kv_indptr_buf_arr=[torch.zeros(8, dtype=torch.int32) for _ in range(2)],
                paged_kv_indices_buf_arr=[torch.zeros(64, dtype=torch.int32) for _ in range(2)],
                paged_kv_last_page_len_buf_arr=[torch.zeros(8, dtype=torch.int32) for _ in range(2)])
    return jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 22, dtype=torch.uint8), use_cuda_graph=True,
                                                     **bufs)


def _levels(qo_last_level: torch.Tensor) -> tuple:
    return ([_i32(0, int(qo_last_level[-1])), qo_last_level], [_i32(0, 2), _i32(0, 1, 2)], [_i32(0, 1), _i32(2, 3)],
            [_i32(16), _i32(5, 7)], H, HK, DIM, PAGE)


def test_cascade_states_keep_their_address_across_plans_of_one_layout() -> None:
    wrapper = _graph_cascade()
    addresses = set()
    for _ in range(3):
        wrapper.plan(*_levels(_i32(0, 1, 2)), causal=True, q_data_type=torch.float16)
        addresses.add((wrapper._states.v.data_ptr(), wrapper._states.s.data_ptr()))
    assert len(addresses) == 1


def test_graph_cascade_keeps_the_causal_kernel_whatever_the_query_counts() -> None:
    wrapper = _graph_cascade()
    wrapper.plan(*_levels(_i32(0, 1, 2)), causal=True, q_data_type=torch.float16)  # one query each
    decode_mode = wrapper._wrappers[1]._plan.options.mask_mode
    wrapper.plan(*_levels(_i32(0, 1, 3)), causal=True, q_data_type=torch.float16)  # two queries in request 1
    assert decode_mode == wrapper._wrappers[1]._plan.options.mask_mode


def test_batch_invariant_cascade_decode_request_ignores_a_multi_query_companion() -> None:
    dtype, rng, gen = torch.float16, random.Random(1), torch.Generator().manual_seed(2)
    prefix = _random_kv(300, dtype, "cpu", gen)
    target = (torch.randn(1, HQ, D, generator=gen).to(dtype), _random_kv(2500, dtype, "cpu", gen))  # > one chunk
    sharer = (torch.randn(2, HQ, D, generator=gen).to(dtype), _random_kv(40, dtype, "cpu", gen))
    alone = _cascade("cpu", prefix, target, [], [], rng, None)
    mixed = _cascade("cpu", prefix, target, [sharer], [], rng, None)
    assert torch.equal(alone[0], mixed[0]) and torch.equal(alone[1], mixed[1])


def test_a_wrapper_that_ran_with_sinks_can_plan_a_variant() -> None:
    ramp = AttentionVariant("kramp", key_transform="k * (1.0f + 0.01f * float(kv_idx % 7)) - 0.05f * float(kv_head)")
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8))
    cache = torch.randn(4, 2, PAGE, HK, DIM, dtype=torch.float16)
    q = torch.randn(1, H, DIM, dtype=torch.float16)
    wrapper.plan(_i32(0, 2), _i32(0, 1), _i32(9), H, HK, DIM, PAGE, q_data_type=torch.float16)
    wrapper.run(q, cache, sinks=torch.zeros(H))
    wrapper.plan(_i32(0, 2), _i32(0, 1), _i32(9), H, HK, DIM, PAGE, q_data_type=torch.float16, variant=ramp)
    assert wrapper.run(q, cache).shape == (1, H, DIM)


def test_graph_decode_with_buffers_larger_than_the_batch_launches_over_the_batch() -> None:
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 22, dtype=torch.uint8), use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(9, dtype=torch.int32),
        paged_kv_indices_buffer=torch.zeros(64, dtype=torch.int32), paged_kv_last_page_len_buffer=torch.zeros(8, dtype=torch.int32))
    cache = torch.randn(4, 2, PAGE, HK, DIM, dtype=torch.float16)
    q = torch.randn(2, H, DIM, dtype=torch.float16)
    for batch_invariant in (False, True):
        wrapper.plan(_i32(0, 1, 2), _i32(0, 1), _i32(9, 5), H, HK, DIM, PAGE, q_data_type=torch.float16,
                     batch_invariant=batch_invariant)
        assert wrapper._plan.launch.params.batch_size == 2
        plain = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8))
        plain.plan(_i32(0, 1, 2), _i32(0, 1), _i32(9, 5), H, HK, DIM, PAGE, q_data_type=torch.float16)
        assert torch.equal(wrapper.run(q, cache), plain.run(q, cache))

"""Regressions found in review (cpu target; each failed before its fix).

- A cascade plan keeps its state buffers while their layout holds (a graph captured around run()
  writes and merges them; FlashInfer's protocol re-plans before every replay).
- Under CUDA graphs a last level's kernel follows the batch shape (one query per node when total_q
  equals the node count), and in batch-invariant mode a causal decode level stays causal: a kernel
  and a split must not depend on the companions' query counts.
- A wrapper that once ran with sinks can still plan a custom variant.
- A graph-mode decode wrapper whose fixed buffers are larger than the batch launches over the batch.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

import jitattn
from jitattn import AttentionVariant, reference

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


def test_graph_cascade_keeps_its_kernels_for_a_batch_shape() -> None:
    """Under graphs the last level's kernel follows the batch shape (captured), never the lengths: one query
    per request (total_q == nodes) runs on the decode kernel in every plan of that shape; a shape with more
    queries keeps the causal prefill kernel."""
    wrapper = _graph_cascade()
    wrapper.plan(*_levels(_i32(0, 1, 2)), causal=True, q_data_type=torch.float16)  # one query each
    decoder = wrapper._launches[-1][0]
    assert isinstance(decoder, jitattn.BatchDecodeWithPagedKVCacheWrapper)
    wrapper.plan(*_levels(_i32(0, 1, 2)), causal=True, q_data_type=torch.float16)
    assert wrapper._launches[-1][0] is decoder
    wrapper.plan(*_levels(_i32(0, 1, 3)), causal=True, q_data_type=torch.float16)  # two queries in request 1
    causal_mode = wrapper._wrappers[1]._plan.options.mask_mode
    assert wrapper._launches[-1][0] is wrapper._wrappers[1] and causal_mode.value == "causal"
    wrapper.plan(*_levels(_i32(0, 2, 3)), causal=True, q_data_type=torch.float16)  # the same shape, other counts
    assert wrapper._launches[-1][0] is wrapper._wrappers[1]
    assert wrapper._wrappers[1]._plan.options.mask_mode == causal_mode


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


# -- review of the decode-kernel last level of a cascade and the staged split-KV merge -------------

def _two_level_decode_case(workspace_bytes: int, unique: list[int]):
    from attention_cases import cascade_level

    gen = torch.Generator().manual_seed(31)
    pool = torch.randperm(600, generator=gen).tolist()
    cache = torch.randn(600, 2, PAGE, HK, DIM, generator=gen).half()
    levels = [cascade_level(level, pool, PAGE) for level in ([40], unique)]
    b = len(unique)
    q = torch.randn(b, H, DIM, generator=gen).half()
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(workspace_bytes, dtype=torch.uint8))
    args = ([_i32(0, b), torch.arange(b + 1, dtype=torch.int32)], [lv[0] for lv in levels], [lv[1] for lv in levels],
            [lv[2] for lv in levels], H, HK, DIM, PAGE)
    ragged = [reference.paged_kv_to_ragged(cache, *lv) for lv in levels]
    expected = []
    for r in range(b):
        parts = [(k[i[n]:i[n + 1]], v[i[n]:i[n + 1]]) for (k, v, i), n in zip(ragged, (0, r))]
        o, _ = reference.single_attention(q[r:r + 1], torch.cat([p[0] for p in parts]),
                                          torch.cat([p[1] for p in parts]))
        expected.append(o)
    return wrapper, args, q, cache, torch.cat(expected)


def test_cascade_decode_level_whose_split_does_not_fit_the_workspace_runs_whole() -> None:
    wrapper, args, q, cache, expected = _two_level_decode_case(4096, [64 * PAGE, 60 * PAGE + 3])
    wrapper.plan(*args, q_data_type=torch.float16, fixed_split_size=4)  # 16 chunks per request would need 66 KB
    assert isinstance(wrapper._launches[-1][0], jitattn.BatchDecodeWithPagedKVCacheWrapper)
    torch.testing.assert_close(wrapper.run(q, cache).float(), expected.float(), atol=4e-3, rtol=4e-3)


def test_a_cascade_plan_refused_by_its_first_checks_leaves_no_plan() -> None:
    """Refused before any level is planned (a window, a level count, a flag), the plan leaves none either: the
    last batch's plan must not run on this batch's tensors."""
    wrapper, args, q, cache, _ = _two_level_decode_case(1 << 22, [30, 70])
    for bad in (dict(window_left=5), dict(causal="yes"), dict(use_fp16_qk_reduction="yes")):
        wrapper.plan(*args, q_data_type=torch.float16)
        wrapper.run(q, cache)
        try:
            wrapper.plan(*args, q_data_type=torch.float16, **bad)
        except (ValueError, TypeError):
            pass
        else:
            raise AssertionError(f"{bad} was accepted")
        try:
            wrapper.run(q, cache)
        except RuntimeError as e:
            assert "without a plan" in str(e)
        else:
            raise AssertionError(f"run() after a plan refused for {bad} ran the previous plan")


def test_a_failed_cascade_plan_leaves_the_wrapper_unplanned() -> None:
    wrapper, args, q, cache, _ = _two_level_decode_case(1 << 22, [30, 70])
    wrapper.plan(*args, q_data_type=torch.float16)
    wrapper.run(q, cache)
    bad = list(args)
    bad[3] = [args[3][0], _i32(3, 99)]  # last_page_len 99 > page_size: refused while planning the last level
    try:
        wrapper.plan(*bad, q_data_type=torch.float16)
    except ValueError:
        pass
    else:
        raise AssertionError("the bad page table was accepted")
    try:
        wrapper.run(q, cache)
    except RuntimeError as e:
        assert "without a plan" in str(e)
    else:
        raise AssertionError("run() after a failed plan() ran the previous plan's launches")


def test_staged_split_merge_only_in_blocks_of_whole_warps() -> None:
    from jitattn.kernels.decode import cuda_layout
    from jitattn.spec import VariantSpec

    seen = set()
    for hd in (64, 96, 128, 256):
        for g in (1, 2, 4, 5, 7, 8, 17, 20, 25, 32):
            spec = VariantSpec(op="decode", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16",
                               head_dim_qk=hd, head_dim_vo=hd, group_size=g, pos_encoding="none",
                               use_sliding_window=False, use_logits_soft_cap=False, kv_layout="nhd",
                               kv_storage="paged")
            layout = cuda_layout(spec)
            whole = layout["kNT"] % 32 == 0
            seen.add(whole)
            assert (layout["kMergeStageFloats"] > 0) == whole, (hd, g, layout["kNT"])
            assert layout["kMergeStageFloats"] * 4 + 8 * g <= layout["kSmemBytes"]
    assert seen == {True, False}, "the sweep must include blocks that are not whole warps"


def test_cascade_workspace_size_covers_the_decode_level_split() -> None:
    unique = [64 * PAGE, 60 * PAGE + 3]
    probe = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1, dtype=torch.uint8))
    float_bytes, _ = probe.workspace_size(len(unique), len(unique), 40 + sum(unique), H, HK, DIM, PAGE,
                                          fixed_split_size=4)
    assert float_bytes > 4096, "the decode level's split partials need float workspace"
    wrapper, args, q, cache, expected = _two_level_decode_case(float_bytes, unique)
    wrapper.plan(*args, q_data_type=torch.float16, fixed_split_size=4)
    assert wrapper._launches[-1][0]._plan.split.kv_chunk_size > 0, "sized by workspace_size, the level splits"
    torch.testing.assert_close(wrapper.run(q, cache).float(), expected.float(), atol=4e-3, rtol=4e-3)


def test_graph_mode_plans_keep_the_buffer_address_of_an_empty_page_table() -> None:
    """A use_cuda_graph plan of no pages points the launch at its fixed kv_indices buffer all the same: a run()
    captured then must read the pages later plans write there (an empty view's address is 0)."""
    bufs = dict(qo_indptr_buf=torch.empty(3, dtype=torch.int32), paged_kv_indptr_buf=torch.empty(3, dtype=torch.int32),
                paged_kv_indices_buf=torch.empty(16, dtype=torch.int32),
                paged_kv_last_page_len_buf=torch.empty(2, dtype=torch.int32))
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD",
                                                          use_cuda_graph=True, **bufs)
    pointers = []
    for pages in ([0, 0], [2, 1]):
        indptr = torch.tensor([0, pages[0], sum(pages)], dtype=torch.int32)
        wrapper.plan(_i32(0, 1, 2), indptr, torch.arange(sum(pages), dtype=torch.int32), _i32(16, 16), H, HK, DIM,
                     PAGE, q_data_type=torch.float16)
        pointers.append(wrapper._plan.launch.params.kv_indices)
    assert pointers == [bufs["paged_kv_indices_buf"].data_ptr()] * 2


def test_launches_carry_the_tensors_row_extents() -> None:
    """q_rows / kv_rows (the sm90 tier's tensor-map extents, instead of the allocation's range, which an
    allocator mapping memory in chunks reports as one chunk): q's rows and k's rows (pages when paged)."""
    q = torch.randn(7, H, DIM, dtype=torch.float16)
    cache = torch.randn(5, 2, PAGE, HK, DIM, dtype=torch.float16)
    paged = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    paged.plan(_i32(0, 3, 7), _i32(0, 1, 3), _i32(4, 0, 2), _i32(9, 16), H, HK, DIM, PAGE, q_data_type=torch.float16)
    paged.run(q, cache)
    assert (paged._plan.launch.params.q_rows, paged._plan.launch.params.kv_rows) == (7, 5)
    k = torch.randn(HK, 40, DIM, dtype=torch.float16)  # HND: [heads, tokens, dim]
    ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "HND")
    ragged.plan(_i32(0, 3, 7), _i32(0, 30, 40), H, HK, DIM, q_data_type=torch.float16)
    ragged.run(q, k, k.clone())
    assert (ragged._plan.launch.params.q_rows, ragged._plan.launch.params.kv_rows) == (7, 40)


def test_decode_layout_page_ids_in_shared_memory() -> None:
    """The item's page ids take TUNING["page_ids"] ints of shared memory beside the stage tables (0 keeps
    none: every tile reads the page table), without costing a pipeline stage at the default."""
    from jitattn.kernels.decode import cuda_layout
    from jitattn.spec import VariantSpec

    spec = VariantSpec(op="decode", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", head_dim_qk=128,
                       head_dim_vo=128, group_size=4, pos_encoding="none", use_sliding_window=False,
                       use_logits_soft_cap=False, kv_layout="nhd", kv_storage="paged")
    with_ids, without = cuda_layout(spec), cuda_layout(spec, {"page_ids": 0})
    assert with_ids["kPageIds"] == 1024 and with_ids["kIdsPerThread"] == 1024 // with_ids["kNT"]
    assert without["kPageIds"] == 0 and without["kIdsPerThread"] == 1  # no zero-length array in the kernel
    assert with_ids["kStages"] == without["kStages"] == 3
    assert with_ids["kSmemBytes"] - without["kSmemBytes"] == 1024 * 4
    assert 2 * (with_ids["kSmemBytes"] + 1024) <= 227 << 10  # still two resident blocks


@pytest.mark.parametrize("head_dim, kv_dtype, page_ids, tuning", [
    (128, "bf16", 1024, None), (64, "bf16", 0, None), (96, "f16", 0, None), (256, "bf16", 1024, None),
    (128, "e4m3", 1024, None), (64, "e4m3", 1024, None), (64, "bf16", 1024, {"page_ids": 1024}),
    (72, "bf16", 1024, None),  # the CUDA-core path (head dim 72): unchanged
])
def test_decode_keeps_page_ids_in_shared_memory_but_at_16_bit_d64_and_d96(head_dim, kv_dtype, page_ids,
                                                                          tuning) -> None:
    """Tensor-core decode of 16-bit KV at head dims 64 and 96 reads each stage's page ids from the page table
    (measured faster there); an explicit ``page_ids`` tuning wins (tools/decode_tunings.py relies on it)."""
    from jitattn.kernels.decode import cuda_layout
    from jitattn.spec import VariantSpec

    q = "f16" if kv_dtype == "f16" else "bf16"
    spec = VariantSpec(op="decode", target="cuda", q_dtype=q, kv_dtype=kv_dtype, o_dtype=q, head_dim_qk=head_dim,
                       head_dim_vo=head_dim, group_size=4, pos_encoding="none", use_sliding_window=False,
                       use_logits_soft_cap=False, kv_layout="nhd", kv_storage="paged")
    layout = cuda_layout(spec, tuning)
    assert layout["kMma"] == (head_dim != 72) and layout["kPageIds"] == page_ids

"""MultiLevelCascadeAttentionWrapper: a 3-level prefix tree equals plain attention over the concatenated KV."""

from __future__ import annotations

import pytest
import torch

import jitattn
from jitattn import reference

from attention_cases import assert_close_out, cascade_level, devices

PAGE = 16


def _two_level_expected(q, cache, levels, **options):
    """Per request r (one query each): the reference over the shared node's KV then r's own, out and lse;
    ``options``: single_attention's (logits_soft_cap, k_scale, v_scale)."""
    ragged = [reference.paged_kv_to_ragged(cache, *lv) for lv in levels]
    outs, lses = [], []
    for r in range(q.shape[0]):
        parts = [(k[i[n]:i[n + 1]], v[i[n]:i[n + 1]]) for (k, v, i), n in zip(ragged, (0, r))]
        keys, values = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        o, l = reference.single_attention(q[r:r + 1], keys, values, **options)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fixed_split_size", [None, 1, 2], ids=["auto", "split1", "split2"])
@pytest.mark.parametrize("qo_lens,causal", [([1, 1, 1, 1], False), ([2, 1, 3, 2], True)], ids=["decode", "prefill"])
def test_three_level_cascade_equals_flat_attention(device: str, qo_lens: list[int], causal: bool,
                                                   fixed_split_size: int | None) -> None:
    gen = torch.Generator().manual_seed(11)
    hq, hkv, d, dtype = 8, 2, 64, torch.float16
    shared, nodes, unique = [37], [20, 16], [5, 3, 9, 4]
    node_of = [0, 0, 1, 1]
    pool = torch.randperm(64, generator=gen).tolist()
    cache = torch.randn(64, 2, PAGE, hkv, d, generator=gen).to(dtype).to(device)
    levels = [cascade_level(level, pool, PAGE) for level in (shared, nodes, unique)]
    total_q = sum(qo_lens)
    qo_cum = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    node_q = [sum(q for q, n in zip(qo_lens, node_of) if n == i) for i in range(2)]
    qo_arr = [torch.tensor([0, total_q], dtype=torch.int32),
              torch.tensor([0, node_q[0], node_q[0] + node_q[1]], dtype=torch.int32), qo_cum]
    q = torch.randn(total_q, hq, d, generator=gen).to(dtype).to(device)

    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(3, torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(qo_arr, [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels],
                 hq, hkv, d, PAGE, causal=causal, q_data_type=dtype, fixed_split_size=fixed_split_size)
    if fixed_split_size is not None:
        assert wrapper._level_chunks[0] > 1, "the shared prefix level (3 pages) must be split"
    if causal:
        assert wrapper._level_chunks[2] == 1, "a causal level is never split"
    # Decode (one query per request): the two shared levels are one prefill launch, the last level
    # runs on the decode kernel; a causal level with several queries per request keeps its own launch.
    assert len(wrapper._launches) == (3 if causal else 2)
    if not causal:
        assert isinstance(wrapper._launches[-1][0], jitattn.BatchDecodeWithPagedKVCacheWrapper)
    out = wrapper.run(q, cache)

    # Reference: each request's KV is its prefix, its node's KV and its own tail, concatenated.
    ragged = [reference.paged_kv_to_ragged(cache, *lv) for lv in levels]

    def tokens(level: int, node: int) -> tuple[torch.Tensor, torch.Tensor]:
        k, v, indptr = ragged[level]
        return k[indptr[node]:indptr[node + 1]], v[indptr[node]:indptr[node + 1]]

    expected = []
    for r in range(4):
        parts = [tokens(0, 0), tokens(1, node_of[r]), tokens(2, r)]
        k = torch.cat([p[0] for p in parts])
        v = torch.cat([p[1] for p in parts])
        o, _ = reference.single_attention(q[qo_cum[r]:qo_cum[r + 1]], k, v, causal=causal)
        expected.append(o)
    # Each level's output is rounded to fp16 before the merge: allow two roundings.
    assert_close_out(out, torch.cat(expected), torch.bfloat16)
    torch.testing.assert_close(out.float().cpu(), torch.cat(expected).float().cpu(), atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("soft_cap,with_sinks", [(None, False), (2.0, True)], ids=["plain", "softcap_sinks"])
def test_decode_last_level_runs_on_the_decode_kernel(device: str, soft_cap: float | None, with_sinks: bool) -> None:
    """Two levels, one query per request: the shared prefix on the prefill kernel (split into chunks), each
    request's own pages on the decode kernel (an empty tail included), merged; equals attention over the
    concatenated KV, lse too."""
    gen = torch.Generator().manual_seed(23)
    hq, hkv, d, dtype = 8, 2, 128, torch.bfloat16
    shared, unique = [300], [0, 17, 200, 1, 64]
    pool = torch.randperm(80, generator=gen).tolist()
    cache = torch.randn(80, 2, PAGE, hkv, d, generator=gen).to(dtype).to(device)
    levels = [cascade_level(level, pool, PAGE) for level in (shared, unique)]
    b = len(unique)
    q = (torch.randn(b, hq, d, generator=gen) * 3).to(dtype).to(device)  # logits of a few units: the cap bites
    sinks = (torch.randn(hq, generator=gen) * 2).to(device) if with_sinks else None
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8, device=device))
    wrapper.plan([torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
                 [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                 q_data_type=dtype, logits_soft_cap=soft_cap, fixed_split_size=4)
    assert wrapper._level_chunks[0] > 1 and isinstance(wrapper._launches[-1][0], jitattn.BatchDecodeWithPagedKVCacheWrapper)
    out, lse = wrapper.run(q, cache, return_lse=True, sinks=sinks)
    expected_o, expected_lse = _two_level_expected(q, cache, levels, logits_soft_cap=soft_cap)
    if with_sinks:  # the keys' lse stays: sinks change the output only
        expected_o = reference.apply_sinks(expected_o, expected_lse, sinks)
    assert_close_out(out, expected_o, dtype)
    torch.testing.assert_close(lse.float().cpu(), expected_lse.float().cpu(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("device", devices())
def test_decode_last_level_with_an_fp8_cache_and_scales(device: str) -> None:
    """The decode-kernel last level and the prefill-kernel shared level dequantize with the same k/v scales."""
    gen = torch.Generator().manual_seed(29)
    hq, hkv, d, dtype = 8, 2, 128, torch.bfloat16
    k_scale, v_scale = 0.5, 1.75
    pool = torch.randperm(40, generator=gen).tolist()
    cache = torch.randn(40, 2, PAGE, hkv, d, generator=gen).to(torch.float8_e4m3fn).to(device)
    levels = [cascade_level(level, pool, PAGE) for level in ([100], [33, 0, 70])]
    q = torch.randn(3, hq, d, generator=gen).to(dtype).to(device)
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8, device=device))
    wrapper.plan([torch.tensor([0, 3], dtype=torch.int32), torch.arange(4, dtype=torch.int32)],
                 [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                 q_data_type=dtype, kv_data_type=torch.float8_e4m3fn)
    assert isinstance(wrapper._launches[-1][0], jitattn.BatchDecodeWithPagedKVCacheWrapper)
    out = wrapper.run(q, cache, k_scale=k_scale, v_scale=v_scale)
    assert_close_out(out, _two_level_expected(q, cache, levels, k_scale=k_scale, v_scale=v_scale)[0], dtype)


def test_cascade_refuses_position_dependent_features() -> None:
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(1, torch.empty(1 << 20, dtype=torch.uint8))
    z = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="RoPE"):
        wrapper.plan([torch.tensor([0, 1], dtype=torch.int32)], [torch.tensor([0, 1], dtype=torch.int32)], [z],
                     [torch.tensor([1], dtype=torch.int32)], 4, 4, 64, 16, pos_encoding_mode="ROPE_LLAMA")


def test_cascade_refuses_a_level_whose_arrays_disagree_on_its_nodes() -> None:
    i32 = dict(dtype=torch.int32)
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"level 1: qo_indptr_arr\[1\] has 5 nodes but paged_kv_indptr_arr\[1\] has 4"):
        wrapper.plan([torch.tensor([0, 5], **i32), torch.arange(6, **i32)],
                     [torch.tensor([0, 1], **i32), torch.arange(5, **i32)],
                     [torch.tensor([0], **i32), torch.arange(1, 5, **i32)],
                     [torch.tensor([16], **i32), torch.full((4,), 3, **i32)], 8, 2, 64, 16, q_data_type=torch.float16)
    with pytest.raises(ValueError, match=r"paged_kv_last_page_len\[1\]\[0\] = 0 is out of range"):  # names its level
        wrapper.plan([torch.tensor([0, 2], **i32), torch.tensor([0, 1, 2], **i32)],
                     [torch.tensor([0, 1], **i32), torch.tensor([0, 1, 2], **i32)],
                     [torch.tensor([0], **i32), torch.tensor([1, 2], **i32)],
                     [torch.tensor([3], **i32), torch.tensor([0, 2], **i32)], 4, 2, 64, 4, q_data_type=torch.float32)



@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("flag", ["no", 2, None])
def test_return_lse_must_be_a_bool_whatever_the_levels(levels: int, flag) -> None:
    """return_lse="no" (truthy) or None was taken for its truthiness on a plan of several levels, while a one-level
    plan refused it."""
    i32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    tables = [(i32([0, 3]), i32([0, 2]), i32([0, 1]), i32([5])),  # a shared node of 2 pages, then 2 own nodes
              (i32([0, 1, 3]), i32([0, 1, 2]), i32([2, 3]), i32([3, 2]))][-levels:]
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(levels, torch.empty(8 << 20, dtype=torch.uint8))
    wrapper.plan(*(list(t) for t in zip(*tables)), 4, 2, 64, 5, q_data_type=torch.float16)
    q, cache = torch.randn(3, 4, 64).half(), torch.randn(20, 2, 5, 2, 64).half()
    assert isinstance(wrapper.run(q, cache, return_lse=1), tuple)
    with pytest.raises(TypeError, match=f"return_lse={flag!r} must be True or False"):
        wrapper.run(q, cache, return_lse=flag)

@pytest.mark.parametrize("device", devices())
def test_repeated_runs_return_fresh_outputs_and_check_each_query(device: str) -> None:
    """The per-layer path (checks once per signature, the merged lse in scratch unless asked for): each run()
    gives a new output of its own q, the lse only when asked, and a q the plan cannot take is still refused."""
    gen = torch.Generator().manual_seed(31)
    hq, hkv, d, dtype = 4, 2, 64, torch.float16
    pool = torch.randperm(30, generator=gen).tolist()
    cache = torch.randn(30, 2, PAGE, hkv, d, generator=gen).to(dtype).to(device)
    levels = [cascade_level(level, pool, PAGE) for level in ([70], [5, 20, 0])]
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8, device=device))
    wrapper.plan([torch.tensor([0, 3], dtype=torch.int32), torch.arange(4, dtype=torch.int32)],
                 [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                 q_data_type=dtype, fixed_split_size=2)
    assert wrapper._states is not None, "the case must merge several states"
    queries = [torch.randn(3, hq, d, generator=gen).to(dtype).to(device) for _ in range(3)]
    first = wrapper.run(queries[0], cache)
    out1, lse1 = wrapper.run(queries[1], cache, return_lse=True)
    out2, lse2 = wrapper.run(queries[2], cache, return_lse=True)
    again = wrapper.run(queries[0], cache)
    assert first.data_ptr() != again.data_ptr() and lse1.data_ptr() != lse2.data_ptr()
    torch.testing.assert_close(first, again, atol=0, rtol=0)
    ragged = [reference.paged_kv_to_ragged(cache, *lv) for lv in levels]
    for q, out, lse in ((queries[0], first, None), (queries[1], out1, lse1), (queries[2], out2, lse2)):
        for r in range(3):
            parts = [(k[i[n]:i[n + 1]], v[i[n]:i[n + 1]]) for (k, v, i), n in zip(ragged, (0, r))]
            o, l = reference.single_attention(q[r:r + 1], torch.cat([p[0] for p in parts]),
                                              torch.cat([p[1] for p in parts]))
            assert_close_out(out[r:r + 1], o, dtype)
            if lse is not None:
                torch.testing.assert_close(lse[r:r + 1].float().cpu(), l.float().cpu(), atol=2e-3, rtol=2e-3)
    with pytest.raises(TypeError, match="dtype"):
        wrapper.run(queries[0].to(torch.bfloat16), cache)
    with pytest.raises(ValueError, match="shape"):
        wrapper.run(queries[0][:2], cache)


def _launch_fingerprint(wrapper: jitattn.MultiLevelCascadeAttentionWrapper) -> tuple:
    """What a captured run() keeps: every launch's kernel, device arrays and sizes, and the state buffers."""
    parts = []
    for level_wrapper, states in wrapper._launches:
        p = level_wrapper._plan.launch.params
        parts.append((level_wrapper._plan.module, states, p.qo_indptr, p.kv_indptr, p.kv_indices, p.kv_last_page_len,
                      p.split_indptr, p.batch_size, p.kv_chunk_size, p.q_row_period, p.causal, p.prior_v, p.prior_lse,
                      p.prior_rows))
    return tuple(parts), wrapper._states.v.data_ptr(), wrapper._states.s.data_ptr()


@pytest.mark.parametrize("device", devices())
def test_graph_mode_cascade_replans_a_shape_into_the_same_launches(device: str, monkeypatch) -> None:
    """use_cuda_graph=True: the shared level is cut into a chunk count fixed by the batch shape and the last
    level (one query per request) runs on a decode wrapper of its own; every plan of the shape, whatever the
    lengths (an empty prefix and empty tails included), keeps every launch's memory and sizes -- what a
    captured run() replays -- and gives plain attention over the concatenated KV."""
    monkeypatch.setattr(jitattn.ops.cascade, "num_workers", lambda device: 64)  # SMs to fill: the level is split
    gen = torch.Generator().manual_seed(37)
    hq, hkv, d, dtype, b = 8, 2, 64, torch.float16, 4
    i32 = dict(dtype=torch.int32, device=device)
    bufs = dict(qo_indptr_buf_arr=[torch.empty(2, **i32), torch.empty(b + 1, **i32)],
                paged_kv_indptr_buf_arr=[torch.empty(2, **i32), torch.empty(b + 1, **i32)],
                paged_kv_indices_buf_arr=[torch.empty(40, **i32), torch.empty(40, **i32)],
                paged_kv_last_page_len_buf_arr=[torch.empty(1, **i32), torch.empty(b, **i32)])
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8, device=device),
                                                        use_cuda_graph=True, **bufs)
    cache = torch.randn(80, 2, PAGE, hkv, d, generator=gen).to(dtype).to(device)
    q = torch.randn(b, hq, d, generator=gen).to(dtype).to(device)
    first = None
    for shared, unique in (([300], [5, 40, 0, 17]), ([0], [1, 2, 3, 100]), ([33], [60, 0, 0, 9]), ([600], [16] * b)):
        pool = torch.randperm(80, generator=gen).tolist()
        levels = [cascade_level(level, pool, PAGE) for level in (shared, unique)]
        wrapper.plan([torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
                     [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                     q_data_type=dtype)
        assert wrapper._level_chunks[0] > 1 and isinstance(wrapper._launches[-1][0],
                                                           jitattn.BatchDecodeWithPagedKVCacheWrapper)
        fingerprint = _launch_fingerprint(wrapper)
        first = first or fingerprint
        assert fingerprint == first, "a plan of the same shape changed what a captured run() reads"
        out, lse = wrapper.run(q, cache, return_lse=True)
        ragged = [reference.paged_kv_to_ragged(cache, *lv) for lv in levels]
        for r in range(b):
            parts = [(k[i[n]:i[n + 1]], v[i[n]:i[n + 1]]) for (k, v, i), n in zip(ragged, (0, r))]
            o, l = reference.single_attention(q[r:r + 1], torch.cat([p[0] for p in parts]),
                                              torch.cat([p[1] for p in parts]))
            assert_close_out(out[r:r + 1], o, dtype)
            torch.testing.assert_close(lse[r:r + 1].float().cpu(), l.float().cpu(), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("seed", range(6))
def test_the_per_layer_path_gives_the_general_paths_bits(device: str, seed: int) -> None:
    """run()'s per-layer path (levels launched through run_plan, the merged lse in scratch) against the general
    path (each level wrapper's run(), then merge_states) on random 2- and 3-level trees: bitwise equal."""
    import random

    from jitattn.runtime.merge import merge_states

    rng, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hq, hkv, d, dtype = 8, 2, 64, torch.float16
    levels_n = rng.choice([2, 3])
    b = rng.randint(1, 6)
    qo_lens = [rng.choice([1, 1, 2, 5]) for _ in range(b)]
    causal = rng.random() < 0.5 and max(qo_lens) > 1
    pool = torch.randperm(200, generator=gen).tolist()
    cache = torch.randn(200, 2, PAGE, hkv, d, generator=gen).to(dtype).to(device)
    if levels_n == 2:
        trees = [[rng.randint(0, 300)], [n + rng.randint(0, 120) for n in qo_lens]]  # causal: kv_len >= qo_len
        qo_arr = [torch.tensor([0, sum(qo_lens)], dtype=torch.int32)]
    else:
        split = rng.randint(0, b)
        trees = [[rng.randint(0, 300)], [rng.randint(0, 80), rng.randint(0, 80)],
                 [n + rng.randint(0, 60) for n in qo_lens]]
        qo_arr = [torch.tensor([0, sum(qo_lens)], dtype=torch.int32),
                  torch.tensor([0, sum(qo_lens[:split]), sum(qo_lens)], dtype=torch.int32)]
    qo_arr.append(torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32))
    levels = [cascade_level(level, pool, PAGE) for level in trees]
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(levels_n, torch.empty(8 << 20, dtype=torch.uint8,
                                                                              device=device))
    wrapper.plan(qo_arr, [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d,
                 PAGE, causal=causal, q_data_type=dtype, fixed_split_size=rng.choice([None, 2]))
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).to(device)
    fast_out, fast_lse = wrapper.run(q, cache, return_lse=True)
    if wrapper._states is None:  # one state: both paths are the level's own run()
        return
    for (level_wrapper, _), (out, lse) in zip(wrapper._launches, wrapper._states.levels):
        level_wrapper.run(q, cache, out=out, lse=lse)
    general_out, general_lse = merge_states(wrapper._states.v, wrapper._states.s)
    if wrapper._fused_states:  # cuda, decode-kernel last level: it merged the states itself, unrounded
        assert_close_out(fast_out, general_out, dtype)
        torch.testing.assert_close(fast_lse, general_lse, atol=1e-4, rtol=1e-5)
    else:
        assert torch.equal(fast_out, general_out) and torch.equal(fast_lse, general_lse)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the in-kernel merge is the cuda decode kernel's")
@pytest.mark.parametrize("shared,unique,split", [([300], [0, 17, 200, 1, 64], 4), ([0], [5, 0, 40], 2),
                                                  ([700], [3000, 0, 5000, 2], 8), ([64], [0, 0], None)],
                         ids=["short_tails", "empty_prefix", "split_tails", "empty_tails"])
def test_decode_last_level_merges_the_earlier_states_in_kernel(shared, unique, split) -> None:
    """cuda: the last level's decode kernel merges the shared level's chunk states into its own result (no
    merge kernel), in its direct write and in its split-KV merge (long tails); poisoned state buffers of
    its own row prove it writes the output itself. Then a run with sinks takes the merge kernel again, and
    a run without them fuses again."""
    gen = torch.Generator().manual_seed(29)
    hq, hkv, d, dtype = 8, 2, 128, torch.bfloat16
    pool = torch.randperm(800, generator=gen).tolist()
    cache = torch.randn(800, 2, PAGE, hkv, d, generator=gen).to(dtype).cuda()
    levels = [cascade_level(level, pool, PAGE) for level in (shared, unique)]
    b = len(unique)
    q = (torch.randn(b, hq, d, generator=gen) * 2).to(dtype).cuda()
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan([torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
                 [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                 q_data_type=dtype, fixed_split_size=split)
    assert isinstance(wrapper._launches[-1][0], jitattn.BatchDecodeWithPagedKVCacheWrapper)
    if wrapper._states is None:
        pytest.skip("one state: nothing to merge")
    assert wrapper._fused_states == sum(states for _, states in wrapper._launches[:-1])
    if split == 8:
        assert wrapper._launches[-1][0]._plan.split.kv_chunk_size, "the long tails should split"
    own_out, own_lse = wrapper._states.levels[-1]
    own_out.fill_(float("nan"))
    own_lse.fill_(float("nan"))
    expected_o, expected_lse = _two_level_expected(q, cache, levels)
    out = wrapper.run(q, cache)
    assert_close_out(out, expected_o, dtype)
    out, lse = wrapper.run(q, cache, return_lse=True)
    assert_close_out(out, expected_o, dtype)
    torch.testing.assert_close(lse.float().cpu(), expected_lse.float().cpu(), atol=2e-3, rtol=2e-3)
    sinks = torch.randn(hq, generator=gen).cuda()
    out = wrapper.run(q, cache, sinks=sinks)
    assert wrapper._launches[-1][0]._plan.launch.params.prior_states == 0
    assert_close_out(out, reference.apply_sinks(expected_o, expected_lse, sinks), dtype)
    out = wrapper.run(q, cache)
    assert_close_out(out, expected_o, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="programmatic dependent launch is cuda's")
def test_dependent_decode_level_reads_the_shared_states_only_once_written() -> None:
    """sm_90 and later: the decode level is a programmatic dependent of the shared level's launch (its blocks
    start as that launch's finish) and reads the shared states only after waiting for it. With the state
    buffers poisoned before every run and a shared level far longer than the tails (the decode blocks are done
    loading while it runs), each run matches the reference, and a launch that is not a dependent gives the
    same bits."""
    gen = torch.Generator().manual_seed(53)
    hq, hkv, d, dtype, b = 32, 8, 128, torch.bfloat16, 48
    pages = 8192 // PAGE + b * 2
    pool = torch.randperm(pages, generator=gen).tolist()
    cache = torch.randn(pages, 2, PAGE, hkv, d, generator=gen).to(dtype).cuda()
    levels = [cascade_level(level, pool, PAGE) for level in ([8192], [1 + 7 * r % 29 for r in range(b)])]
    q = torch.randn(b, hq, d, generator=gen).to(dtype).cuda()
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan([torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
                 [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                 q_data_type=dtype)
    assert wrapper._fused_states > 0
    assert wrapper._dependent_decode == (torch.cuda.get_device_capability() >= (9, 0))
    expected = _two_level_expected(q, cache, levels)[0]
    outs = []
    for _ in range(3):
        wrapper._states.values.fill_(float("nan"))
        wrapper._states.lses.fill_(float("nan"))
        outs.append(wrapper.run(q, cache))
        assert_close_out(outs[-1], expected, dtype)
    wrapper._dependent_decode = False
    assert torch.equal(wrapper.run(q, cache), outs[0])
    assert all(torch.equal(out, outs[0]) for out in outs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs")
def test_fused_cascade_replays_in_a_cuda_graph_after_a_replan() -> None:
    """use_cuda_graph=True, decode-kernel last level merging the shared level's states: run() captured once,
    then every plan of the shape (other lengths) replays into the right result."""
    gen = torch.Generator().manual_seed(41)
    hq, hkv, d, dtype, b = 8, 2, 128, torch.bfloat16, 4
    i32 = dict(dtype=torch.int32, device="cuda")
    bufs = dict(qo_indptr_buf_arr=[torch.empty(2, **i32), torch.empty(b + 1, **i32)],
                paged_kv_indptr_buf_arr=[torch.empty(2, **i32), torch.empty(b + 1, **i32)],
                paged_kv_indices_buf_arr=[torch.empty(100, **i32), torch.empty(100, **i32)],
                paged_kv_last_page_len_buf_arr=[torch.empty(1, **i32), torch.empty(b, **i32)])
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(64 << 20, dtype=torch.uint8, device="cuda"),
                                                        use_cuda_graph=True, **bufs)
    cache = torch.randn(200, 2, PAGE, hkv, d, generator=gen).to(dtype).cuda()
    q = torch.randn(b, hq, d, generator=gen).to(dtype).cuda()
    graph, out = None, None
    for shared, unique in (([900], [5, 40, 0, 17]), ([33], [60, 0, 300, 9]), ([1500], [16] * b)):
        pool = torch.randperm(200, generator=gen).tolist()
        levels = [cascade_level(level, pool, PAGE) for level in (shared, unique)]
        wrapper.plan([torch.tensor([0, b], dtype=torch.int32), torch.arange(b + 1, dtype=torch.int32)],
                     [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                     q_data_type=dtype)
        if graph is None:
            assert wrapper._fused_states > 0
            wrapper.run(q, cache)  # loads the modules outside the capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = wrapper.run(q, cache)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_out(out, _two_level_expected(q, cache, levels)[0], dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["decode", "prefill"])
def test_auto_split_shared_level_in_whole_kv_blocks(causal: bool, monkeypatch) -> None:
    """The planner's own split of a shared level (nodes of unequal length, one empty) into whole 128-token
    chunks, on a device of 64 workers so the split happens: the result equals plain attention."""
    from jitattn.kv_split import cascade_chunk_pages

    monkeypatch.setattr("jitattn.ops.cascade.num_workers", lambda device: 64)
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, dtype = 4, 2, 64, torch.float32
    shared, node_of = [3000, 0, 700], [0, 0, 1, 2, 2, 2]
    # causal: a request's new tokens are in its tail (kv_len >= qo_len); decode: one tail is empty
    tails, qo_lens = ([5, 1, 9, 16, 2, 33], [2, 1, 3, 1, 2, 1]) if causal else ([5, 0, 9, 16, 1, 33], [1] * 6)
    pool = torch.randperm(512, generator=gen).tolist()
    cache = torch.randn(512, 2, PAGE, hkv, d, generator=gen).to(dtype)
    levels = [cascade_level(lens, pool, PAGE) for lens in (shared, tails)]
    qo_cum = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    node_q = [sum(q for q, n in zip(qo_lens, node_of) if n == i) for i in range(len(shared))]
    qo_arr = [torch.tensor([0] + torch.tensor(node_q).cumsum(0).tolist(), dtype=torch.int32), qo_cum]
    q = torch.randn(int(qo_cum[-1]), hq, d, generator=gen).to(dtype)

    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(qo_arr, [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels],
                 hq, hkv, d, PAGE, causal=causal, q_data_type=dtype)
    from jitattn.kv_split import cascade_level_chunks

    wanted = cascade_level_chunks(tuple(shared), num_kv_heads=hkv, num_sms=64, page_size=PAGE,
                                  query_tiles=len(shared))
    assert wrapper._level_chunks[0] == cascade_chunk_pages(-(-3000 // PAGE), wanted, PAGE)[0] > 1
    out = wrapper.run(q, cache)

    ragged = [reference.paged_kv_to_ragged(cache, *lv) for lv in levels]
    expected = []
    for r in range(len(qo_lens)):
        parts = []
        for level, node in ((0, node_of[r]), (1, r)):
            k, v, indptr = ragged[level]
            parts.append((k[indptr[node]:indptr[node + 1]], v[indptr[node]:indptr[node + 1]]))
        k, v = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        o, _ = reference.single_attention(q[qo_cum[r]:qo_cum[r + 1]], k, v, causal=causal)
        expected.append(o)
    torch.testing.assert_close(out, torch.cat(expected), atol=2e-5, rtol=2e-5)


def test_per_level_buffers_are_one_per_level() -> None:
    """A short *_buf_arr list raised a bare IndexError, none at all the level wrappers' argument names, and a
    reset_workspace_buffer list of the wrong length was taken."""
    ws, i32 = torch.empty(1 << 20, dtype=torch.uint8), dict(dtype=torch.int32)
    one = [torch.empty(3, **i32)]
    with pytest.raises(ValueError, match=r"qo_indptr_buf_arr has 1 entries; .* one entry per level \(num_levels=2\)"):
        jitattn.MultiLevelCascadeAttentionWrapper(2, ws, use_cuda_graph=True, qo_indptr_buf_arr=one,
                                                  paged_kv_indptr_buf_arr=one, paged_kv_indices_buf_arr=one,
                                                  paged_kv_last_page_len_buf_arr=one)
    with pytest.raises(ValueError, match="use_cuda_graph=True needs qo_indptr_buf_arr, paged_kv_indptr_buf_arr"):
        jitattn.MultiLevelCascadeAttentionWrapper(2, ws, use_cuda_graph=True)
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, ws)
    with pytest.raises(ValueError, match="int_workspace_buffers has 3 entries"):
        wrapper.reset_workspace_buffer(ws, [torch.empty(8, dtype=torch.uint8)] * 3)
    wrapper.reset_workspace_buffer(ws, [torch.empty(8, dtype=torch.uint8)] * 2)


def test_shared_prefix_decode_before_begin_forward_names_itself() -> None:
    """It named the inner decode wrapper's run() and plan(), after running the shared part."""
    wrapper = jitattn.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match=r"BatchDecodeWithSharedPrefixPagedKVCacheWrapper.forward\(\) called "
                                           r"without a plan: call begin_forward\(\)"):
        wrapper.forward(torch.randn(2, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64),
                        torch.randn(4, 2, 3, 2, 64))


def test_shared_prefix_decode_checks_dtypes_against_its_plan() -> None:
    """A q or shared k/v of another dtype than begin_forward's data_type was reported as a kv / q mismatch inside the
    shared part's prefill, naming neither the tensor nor data_type."""
    wrapper = jitattn.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper.begin_forward(i32(0, 1, 2), i32(0, 1), i32(3, 3), 4, 2, 64, 3, data_type=torch.float32)
    q, k, v, cache = torch.randn(2, 4, 64), torch.randn(7, 2, 64), torch.randn(7, 2, 64), torch.randn(4, 2, 3, 2, 64)
    with pytest.raises(TypeError, match="q has dtype bfloat16 but the plan has data_type=float32"):
        wrapper.forward(q.bfloat16(), k, v, cache)
    with pytest.raises(TypeError, match="v_shared has dtype bfloat16 but the plan has data_type=float32"):
        wrapper.forward(q, k, v.bfloat16(), cache)
    assert wrapper.forward(q, k, v, cache).shape == q.shape


def test_decode_levels_check_their_page_table_once(monkeypatch) -> None:
    """The shared-prefix wrapper's and a cascade's decode level's page tables are checked in their own names and
    handed to the decode wrapper checked (plan_checked): the decode wrapper's own check never runs for them, and
    the outputs are those of attention over the pages."""
    import jitattn.ops.decode as decode_module

    def unexpected(*args, **kwargs):
        raise AssertionError("the decode wrapper checked a page table already checked")

    monkeypatch.setattr(decode_module, "check_paged_index", unexpected)
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d = 4, 2, 64
    pool = torch.randperm(40, generator=gen).tolist()
    cache = torch.randn(40, 2, PAGE, hkv, d, generator=gen)
    levels = [cascade_level(level, pool, PAGE) for level in ([40], [3, 0, 21])]
    q = torch.randn(3, hq, d, generator=gen)
    ws = torch.empty(8 << 20, dtype=torch.uint8)
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, ws)
    wrapper.plan([torch.tensor([0, 3], dtype=torch.int32), torch.arange(4, dtype=torch.int32)],
                 [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], hq, hkv, d, PAGE,
                 q_data_type=torch.float32)
    assert isinstance(wrapper._launches[-1][0], jitattn.BatchDecodeWithPagedKVCacheWrapper)
    expected, _ = _two_level_expected(q, cache, levels)
    assert_close_out(wrapper.run(q, cache), expected, torch.float32)
    shared = jitattn.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws)
    shared.begin_forward(*levels[1], hq, hkv, d, PAGE, data_type=torch.float32)
    k_shared, v_shared = torch.randn(2, 9, hkv, d, generator=gen).unbind(0)
    k_own, v_own, own = reference.paged_kv_to_ragged(cache, *levels[1])
    expected = torch.cat([reference.single_attention(
        q[r:r + 1], torch.cat([k_shared, k_own[own[r]:own[r + 1]]]), torch.cat([v_shared, v_own[own[r]:own[r + 1]]]))[0]
        for r in range(3)])
    assert_close_out(shared.forward(q, k_shared, v_shared, cache), expected, torch.float32)
    with pytest.raises(AssertionError, match="already checked"):  # the patch is the one plan() calls
        jitattn.BatchDecodeWithPagedKVCacheWrapper(ws).plan(*levels[1], hq, hkv, d, PAGE)

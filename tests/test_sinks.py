"""Attention sinks (gpt-oss): every wrapper and single-request function against the float reference.

A sink logit s_h per query head joins the softmax denominator without a value. The LSE returned is
the keys' alone; the output is scaled once, at the final write, by e^lse / (e^lse + e^s_h). Split-KV
chunks and cascade levels merge without the sink, so split, unsplit and cascade plans must all agree
with ``reference.apply_sinks`` over the plain reference, and a request with no keys gives 0.
"""

from __future__ import annotations

import math

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec, merge_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec
from jitattn.spec_text import parse_spec_text

from attention_cases import (
    assert_close_lse, assert_close_out, cascade_level, devices, random_paged_batch, stable_seed,
)

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
PAGE = 16

# (head_dim, qo_heads, kv_heads, dtype, window_left, logits_soft_cap, pos)
DECODE_CASES = {
    "d64_g4_bf16": (64, 8, 2, bf16, -1, None, "NONE"),          # tensor-core path on cuda
    "d128_g8_f16_window": (128, 16, 2, f16, 127, None, "NONE"),  # gpt-oss shape, its sliding window
    "d64_mha_f16_softcap": (64, 4, 4, f16, -1, 30.0, "NONE"),
    "d72_g2_bf16_rope": (72, 4, 2, bf16, -1, None, "ROPE_LLAMA"),  # CUDA-core path on cuda
    "d64_g4_f32": (64, 8, 2, f32, 99, None, "NONE"),            # cpu only
}
DECODE_KV_LENS = [1, 300, 0, 77, 1000, 16]
PREFILL_CASES = {
    "d64_g4_bf16_causal": (64, 8, 2, bf16, -1, None, "NONE"),
    "d64_g8_f16_causal_window": (64, 16, 2, f16, 24, None, "NONE"),
    "d128_mha_bf16_causal_softcap": (128, 4, 4, bf16, -1, 50.0, "NONE"),
    "d64_g4_f32_causal_window": (64, 8, 2, f32, 9, None, "NONE"),  # cpu only
}
PREFILL_LENS = [(5, 40), (1, 1), (17, 17), (0, 9), (33, 100)]  # (qo_len, kv_len)


def _pos(name: str) -> PosEncoding:
    return PosEncoding.parse(name.lower().replace("rope_llama", "rope"), "pos")


def _sink_spec(op: Op, case, storage: KVStorage, mask: MaskMode) -> VariantSpec:
    d, hq, hkv, dtype, window, cap, pos = case
    return attention_spec(
        op, Target.CUDA, q_dtype=dtype, kv_dtype=dtype, o_dtype=dtype, head_dim_qk=d, head_dim_vo=d,
        num_qo_heads=hq, num_kv_heads=hkv, pos_encoding=_pos(pos), use_sliding_window=window >= 0,
        use_logits_soft_cap=cap is not None, mask_mode=mask if op is Op.PREFILL else None,
        kv_layout=KVLayout.NHD, kv_storage=storage,
    ).replace(use_sinks=True)


GPU_SPECS = (
    [_sink_spec(Op.DECODE, c, KVStorage.PAGED, MaskMode.NONE) for c in DECODE_CASES.values() if c[3] != f32]
    + [_sink_spec(Op.PREFILL, c, s, MaskMode.CAUSAL) for c in PREFILL_CASES.values() if c[3] != f32
       for s in (KVStorage.PAGED, KVStorage.RAGGED)]
    + [_sink_spec(Op.PREFILL, (64, 8, 2, f16, -1, None, "NONE"), KVStorage.PAGED, m)
       for m in (MaskMode.NONE, MaskMode.CAUSAL)]
    + [_sink_spec(Op.DECODE, (64, 8, 2, f16, 100, None, "NONE"), KVStorage.PAGED, MaskMode.NONE),  # single decode
       _sink_spec(Op.PREFILL, (64, 8, 2, f16, 10, None, "NONE"), KVStorage.PAGED, MaskMode.CAUSAL)]  # single prefill
    + [merge_spec(Target.CUDA, f16, True), merge_spec(Target.CUDA, bf16, True)]
)
GPU_SPECS += [spec.replace(use_sinks=False) for spec in GPU_SPECS]  # the plain twins the tests also run


def _sinks(num_heads: int, gen: torch.Generator, device: str) -> torch.Tensor:
    # Large enough to matter against lse ~ log(kv_len): from "sink dominates" to "sink negligible".
    return (torch.randn(num_heads, generator=gen) * 3 + 2).to(device)


def _skip_f32_on_cuda(device: str, dtype: torch.dtype) -> None:
    if device == "cuda" and dtype == f32:
        pytest.skip("f32 queries run on the cpu target only")


# -- the reference itself --------------------------------------------------------------------------

def test_reference_sinks_equal_a_softmax_with_a_value_free_sink_column() -> None:
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(s, generator=gen, dtype=torch.float64) for s in ((6, 4, 32), (9, 2, 32), (9, 2, 32)))
    sinks = torch.randn(4, generator=gen) * 2
    o, lse = reference.single_attention(q, k, v, causal=True)
    got = reference.apply_sinks(o, lse, sinks)
    # By hand: logits [q, heads, keys] plus one column per head holding s_h, whose value row is 0.
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    logits = torch.einsum("qhd,khd->hqk", q, kk) / math.sqrt(32)
    pos = torch.arange(9)[None, :] <= (9 - 6 + torch.arange(6))[:, None]
    logits = logits.masked_fill(~pos, float("-inf"))
    with_sink = torch.cat([logits, sinks.double()[:, None, None].expand(4, 6, 1)], dim=-1)
    weights = torch.softmax(with_sink, dim=-1)[..., :9]
    expected = torch.einsum("hqk,khd->qhd", weights, vv)
    torch.testing.assert_close(got.double(), expected, atol=1e-6, rtol=1e-6)
    empty = reference.apply_sinks(torch.zeros(1, 4, 32), torch.full((1, 4), float("-inf")), sinks)
    assert torch.equal(empty, torch.zeros(1, 4, 32)), "no keys: the output stays 0"


# -- decode ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("split", ["unsplit", "split1", "split4", "auto"])
@pytest.mark.parametrize("case_id", list(DECODE_CASES))
def test_batch_decode_with_sinks_matches_reference(case_id: str, split: str, device: str) -> None:
    d, hq, hkv, dtype, window, cap, pos = DECODE_CASES[case_id]
    _skip_f32_on_cuda(device, dtype)
    gen = torch.Generator().manual_seed(stable_seed(case_id, split))
    batch = random_paged_batch(DECODE_KV_LENS, hkv, d, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(len(DECODE_KV_LENS), hq, d, generator=gen).to(dtype).to(device)
    sinks = _sinks(hq, gen, device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=device))
    split_args = {"unsplit": dict(disable_split_kv=True), "split1": dict(fixed_split_size=1),
                  "split4": dict(fixed_split_size=4), "auto": {}}[split]
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, PAGE,
                 pos_encoding_mode=pos, window_left=window, logits_soft_cap=cap, q_data_type=dtype, **split_args)
    if split.startswith("split"):
        assert wrapper._plan.split.num_chunks > len(DECODE_KV_LENS), "the plan must split the long requests"
    out = torch.full((len(DECODE_KV_LENS), hq, d), float("nan"), dtype=dtype, device=device)
    lse = torch.full((len(DECODE_KV_LENS), hq), float("nan"), device=device)
    wrapper.run(q, batch.cache, out=out, lse=lse, sinks=sinks)
    ref_o, ref_lse = reference.batch_decode_paged(
        q, batch.cache, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, pos_encoding_mode=pos,
        window_left=window, logits_soft_cap=cap)
    assert_close_out(out, reference.apply_sinks(ref_o, ref_lse, sinks), dtype)
    assert_close_lse(lse, ref_lse)  # the keys' lse, without the sink
    assert torch.all(out[2] == 0), "a request with no keys gives 0"
    # The same plan without sinks still runs the plain kernel (the sink build is a twin of it).
    plain = wrapper.run(q, batch.cache)
    assert_close_out(plain, ref_o, dtype)


@pytest.mark.parametrize("device", devices())
def test_single_decode_with_sinks(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d = 8, 2, 64
    for kv_len in (0, 1, 600):
        k = torch.randn(kv_len, hkv, d, generator=gen).to(f16).to(device)
        v = torch.randn(kv_len, hkv, d, generator=gen).to(f16).to(device)
        q = torch.randn(hq, d, generator=gen).to(f16).to(device)
        sinks = _sinks(hq, gen, device)
        out, lse = jitattn.single_decode_with_kv_cache(q, k, v, window_left=100, return_lse=True, sinks=sinks)
        ref_o, ref_lse = reference.single_attention(q[None], k, v, window_left=100)
        assert_close_out(out[None], reference.apply_sinks(ref_o, ref_lse, sinks), f16)
        assert_close_lse(lse[None], ref_lse)
        if kv_len == 0:
            assert torch.all(out == 0)


# -- prefill ---------------------------------------------------------------------------------------

def _prefill_batch(gen: torch.Generator, hq: int, hkv: int, d: int, dtype: torch.dtype, device: str):
    qo_lens = [q for q, _ in PREFILL_LENS]
    kv_lens = [k for _, k in PREFILL_LENS]
    batch = random_paged_batch(kv_lens, hkv, d, PAGE, dtype, device=device, generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).to(device)
    return batch, qo_indptr, q


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(PREFILL_CASES))
def test_paged_prefill_with_sinks_matches_reference(case_id: str, device: str) -> None:
    d, hq, hkv, dtype, window, cap, pos = PREFILL_CASES[case_id]
    _skip_f32_on_cuda(device, dtype)
    gen = torch.Generator().manual_seed(stable_seed(case_id))
    batch, qo_indptr, q = _prefill_batch(gen, hq, hkv, d, dtype, device)
    sinks = _sinks(hq, gen, device)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, PAGE,
                 causal=True, window_left=window, logits_soft_cap=cap, q_data_type=dtype)
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=dtype, device=device)
    lse = torch.full((q.shape[0], hq), float("nan"), device=device)
    wrapper.run(q, batch.cache, out=out, lse=lse, sinks=sinks)
    ref_o, ref_lse = reference.batch_prefill_paged(
        q, batch.cache, qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, causal=True,
        window_left=window, logits_soft_cap=cap)
    assert_close_out(out, reference.apply_sinks(ref_o, ref_lse, sinks), dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(PREFILL_CASES))
def test_ragged_prefill_with_sinks_matches_reference(case_id: str, device: str) -> None:
    d, hq, hkv, dtype, window, cap, pos = PREFILL_CASES[case_id]
    _skip_f32_on_cuda(device, dtype)
    gen = torch.Generator().manual_seed(stable_seed(case_id) + 1)
    qo_lens = [q for q, _ in PREFILL_LENS]
    kv_lens = [k for _, k in PREFILL_LENS]
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype).to(device)
    sinks = _sinks(hq, gen, device)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=True, window_left=window, logits_soft_cap=cap,
                 q_data_type=dtype)
    out, lse = wrapper.run(q, k, v, sinks=sinks, return_lse=True)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, qo_indptr, kv_indptr, causal=True,
                                                      window_left=window, logits_soft_cap=cap)
    assert_close_out(out, reference.apply_sinks(ref_o, ref_lse, sinks), dtype)
    assert_close_lse(lse, ref_lse)
    assert torch.all(out[qo_indptr[3]:qo_indptr[4]] == 0) or qo_lens[3] == 0


@pytest.mark.parametrize("device", devices())
def test_single_prefill_and_sink_wrapper(device: str) -> None:
    """single_prefill_with_kv_cache(sinks=) and FlashInfer's BatchAttentionWithAttentionSinkWrapper spelling."""
    gen = torch.Generator().manual_seed(8)
    hq, hkv, d, dtype = 8, 2, 64, f16
    q = torch.randn(12, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(30, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(30, hkv, d, generator=gen).to(dtype).to(device)
    sinks = _sinks(hq, gen, device)
    out = jitattn.single_prefill_with_kv_cache(q, k, v, causal=True, window_left=10, sinks=sinks)
    ref_o, ref_lse = reference.single_attention(q, k, v, causal=True, window_left=10)
    assert_close_out(out, reference.apply_sinks(ref_o, ref_lse, sinks), dtype)

    batch, qo_indptr, q2 = _prefill_batch(gen, hq, hkv, d, dtype, device)
    wrapper = jitattn.BatchAttentionWithAttentionSinkWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device), kv_layout="NHD", q_data_type=dtype,
        kv_data_type=dtype, head_dim_qk=d, head_dim_vo=d, window_left=12)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, PAGE,
                 causal=True, window_left=12, q_data_type=dtype, kv_data_type=dtype)
    assert wrapper._plan.sink_launch is not None, "the sink wrapper loads its kernel at plan time"
    scale = 0.9 / math.sqrt(d)
    got = wrapper.run(q2, batch.cache, sinks, scale)  # FlashInfer's run(q, kv, sink, sm_scale)
    ref_o, ref_lse = reference.batch_prefill_paged(
        q2, batch.cache, qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, causal=True,
        window_left=12, sm_scale=scale)
    assert_close_out(got, reference.apply_sinks(ref_o, ref_lse, sinks), dtype)
    with pytest.raises(TypeError, match="needs the sinks"):
        wrapper.run(q2, batch.cache)
    got, got_lse = wrapper.run_return_lse(q2, batch.cache, sinks, scale)  # the same arguments (it took no sink)
    assert_close_out(got, reference.apply_sinks(ref_o, ref_lse, sinks), dtype)
    assert_close_lse(got_lse, ref_lse)  # the keys' own lse


@pytest.mark.parametrize("route", ["rope_first", "fp8_upcast"])
def test_sink_wrapper_runs_the_routes_its_plan_took(route: str) -> None:
    """Its run() went straight to the launch, skipping the RoPE-first rotation and the fp8 upcast's gather the plan
    had chosen (both auto on Hopper): "too many values to unpack"."""
    gen = torch.Generator().manual_seed(9)
    hq, hkv, d = 4, 2, 64
    kv_dtype = torch.float8_e4m3fn if route == "fp8_upcast" else f16
    batch, qo_indptr, q = _prefill_batch(gen, hq, hkv, d, f16, "cpu")
    cache = batch.cache.to(kv_dtype)
    sinks = _sinks(hq, gen, "cpu")
    options = dict(pos_encoding_mode="ROPE_LLAMA", rope_first=True) if route == "rope_first" else dict(
        kv_data_type=kv_dtype, fp8_upcast=True)
    wrapper = jitattn.BatchAttentionWithAttentionSinkWrapper(torch.empty(1 << 20, dtype=torch.uint8),
                                                             q_data_type=f16, kv_data_type=kv_dtype, head_dim_qk=d,
                                                             head_dim_vo=d)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, PAGE, causal=True,
                 q_data_type=f16, **options)
    ref_o, ref_lse = reference.batch_prefill_paged(
        q, cache, qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, causal=True,
        pos_encoding_mode=options.get("pos_encoding_mode", "NONE"))
    assert_close_out(wrapper.run(q, cache, sinks), reference.apply_sinks(ref_o, ref_lse, sinks), f16)


# -- cascade ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_levels", [1, 2, 3])
@pytest.mark.parametrize("fixed_split_size", [None, 1])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_cascade_with_sinks_matches_flat_reference(device: str, num_levels: int, fixed_split_size: int | None,
                                                   batch_invariant: bool) -> None:
    gen = torch.Generator().manual_seed(21 + num_levels)
    hq, hkv, d, dtype = 8, 2, 64, f16
    qo_lens, node_of = [2, 1, 3, 2], [0, 0, 1, 1]
    pool = torch.randperm(64, generator=gen).tolist()
    cache = torch.randn(64, 2, PAGE, hkv, d, generator=gen).to(dtype).to(device)
    all_levels = [cascade_level(nodes, pool, PAGE) for nodes in ([37], [20, 16], [5, 3, 9, 4])]
    total_q = sum(qo_lens)
    qo_cum = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    node_q = [sum(q for q, n in zip(qo_lens, node_of) if n == i) for i in range(2)]
    all_qo = [torch.tensor([0, total_q], dtype=torch.int32),
              torch.tensor([0, node_q[0], node_q[0] + node_q[1]], dtype=torch.int32), qo_cum]
    # 1 level: the shared prefix alone; 2: prefix + own tail; 3: prefix, node, own tail.
    chosen = {1: [0], 2: [0, 2], 3: [0, 1, 2]}[num_levels]
    levels, qo_arr = [all_levels[i] for i in chosen], [all_qo[i] for i in chosen]
    q = torch.randn(total_q, hq, d, generator=gen).to(dtype).to(device)
    sinks = _sinks(hq, gen, device)
    causal = num_levels > 1  # causal applies to the last level: each request's own tail
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(num_levels,
                                                        torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(qo_arr, [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels],
                 hq, hkv, d, PAGE, causal=causal, q_data_type=dtype, fixed_split_size=fixed_split_size,
                 batch_invariant=batch_invariant)
    out, lse = wrapper.run(q, cache, sinks=sinks, return_lse=True)

    ragged = [reference.paged_kv_to_ragged(cache, *lv) for lv in levels]
    expected_o, expected_lse = [], []
    for r in range(4):
        node = {0: 0, 1: node_of[r], 2: r}
        ks, vs = [], []
        for level, k_v in zip(chosen, ragged):
            k, v, indptr = k_v
            i = node[level]
            ks.append(k[indptr[i]:indptr[i + 1]])
            vs.append(v[indptr[i]:indptr[i + 1]])
        o, s = reference.single_attention(q[qo_cum[r]:qo_cum[r + 1]], torch.cat(ks), torch.cat(vs),
                                          causal=causal)
        expected_o.append(o)
        expected_lse.append(s)
    ref_o, ref_lse = torch.cat(expected_o), torch.cat(expected_lse)
    # Each level's state is rounded to fp16 before the merge: allow two roundings.
    torch.testing.assert_close(out.float().cpu(), reference.apply_sinks(ref_o, ref_lse, sinks).cpu(),
                               atol=3e-3, rtol=3e-3)
    assert_close_lse(lse, ref_lse)


# -- what the argument must be ---------------------------------------------------------------------

def _planned_decode(gen: torch.Generator):
    """(batch, q, wrapper): a decode wrapper planned over two requests of 5 and 30 keys, 8 / 2 heads, f16."""
    batch = random_paged_batch([5, 30], 2, 64, PAGE, f16, generator=gen)
    q = torch.randn(2, 8, 64, generator=gen).to(f16)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, PAGE, q_data_type=f16)
    return batch, q, wrapper


def test_sinks_argument_is_checked() -> None:
    gen = torch.Generator().manual_seed(2)
    batch, q, wrapper = _planned_decode(gen)
    with pytest.raises(ValueError, match="float32"):
        wrapper.run(q, batch.cache, sinks=torch.zeros(8, dtype=f16))
    with pytest.raises(ValueError, match=r"\[num_qo_heads\] = \[8\]"):
        wrapper.run(q, batch.cache, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match="contiguous"):
        wrapper.run(q, batch.cache, sinks=torch.zeros(16)[::2])
    with pytest.raises(TypeError, match="torch.Tensor"):
        wrapper.run(q, batch.cache, sinks=[0.0] * 8)


def test_sink_wrapper_constructor_pos_encoding_is_the_plans_default() -> None:
    """FlashInfer's constructor takes pos_encoding_mode; a plan() without one runs it (it was passed on as the spec's
    lowercase word, which plan() refuses since it takes FlashInfer's names only)."""
    gen = torch.Generator().manual_seed(5)
    batch, qo_indptr, q = _prefill_batch(gen, 4, 2, 64, f16, "cpu")
    sinks = _sinks(4, gen, "cpu")
    table = (qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 4, 2, 64, PAGE)
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    by_default = jitattn.BatchAttentionWithAttentionSinkWrapper(ws, pos_encoding_mode="ROPE_LLAMA", head_dim_qk=64,
                                                               head_dim_vo=64)
    by_default.plan(*table, q_data_type=f16)
    explicit = jitattn.BatchAttentionWithAttentionSinkWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    explicit.plan(*table, pos_encoding_mode="ROPE_LLAMA", q_data_type=f16)
    assert torch.equal(by_default.run(q, batch.cache, sinks), explicit.run(q, batch.cache, sinks))


def test_sinks_inside_out_or_lse_are_refused() -> None:
    """sinks that share memory with out or lse were accepted and read after the kernel had written there."""
    gen = torch.Generator().manual_seed(3)
    batch, q, wrapper = _planned_decode(gen)
    lse = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"lse shares memory with sinks"):
        wrapper.run(q, batch.cache, sinks=lse[0], lse=lse, return_lse=True)
    out = torch.zeros(2, 8, 64, dtype=f16)
    with pytest.raises(ValueError, match=r"out shares memory with sinks"):
        wrapper.run(q, batch.cache, sinks=out.view(-1)[:16].view(torch.float32), out=out)
    assert torch.all(out == 0), "a refused run() wrote nothing"
    wrapper.run(q, batch.cache, sinks=torch.randn(8), out=out, lse=lse, return_lse=True)  # apart: taken


def test_cascade_sinks_are_checked_before_any_level_runs(monkeypatch) -> None:
    """The cascade's merge applies the sinks: a bad one is refused under the wrapper's name before a level runs."""
    gen = torch.Generator().manual_seed(4)
    pool = torch.randperm(16, generator=gen).tolist()
    levels = [cascade_level(nodes, pool, PAGE) for nodes in ([37], [5, 9])]
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan([torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)],
                 [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels], 8, 2, 64, PAGE,
                 q_data_type=f16)
    q, cache = torch.randn(2, 8, 64).to(f16), torch.randn(16, 2, PAGE, 2, 64).to(f16)
    launched = []
    monkeypatch.setattr(jitattn.BatchPrefillWithPagedKVCacheWrapper, "run", lambda *a, **k: launched.append(a))
    monkeypatch.setattr(jitattn.BatchPrefillWithPagedKVCacheWrapper, "run_planned", lambda *a, **k: launched.append(a))
    for bad, match in ((torch.zeros(3), r"MultiLevelCascadeAttentionWrapper.run\(\): sinks has shape \(3,\)"),
                       (torch.zeros(8, dtype=f16), r"MultiLevelCascadeAttentionWrapper.run\(\): sinks has dtype")):
        with pytest.raises(ValueError, match=match):
            wrapper.run(q, cache, sinks=bad)
    assert not launched


def test_sinks_with_a_custom_variant_are_refused() -> None:
    variant = jitattn.AttentionVariant(name="scaled", logits_transform="logits * 0.5f")
    with pytest.raises(ValueError, match="use_sinks with a custom variant"):
        VariantSpec(op="decode", target="cpu", q_dtype="f16", kv_dtype="f16", o_dtype="f16", variant=variant,
                    use_sinks=True)
    gen = torch.Generator().manual_seed(6)
    batch = random_paged_batch([5, 30], 2, 64, PAGE, f16, generator=gen)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, PAGE, q_data_type=f16,
                 variant=variant)
    with pytest.raises(ValueError, match="sinks=.*custom variant"):
        wrapper.run(torch.randn(2, 8, 64).to(f16), batch.cache, sinks=torch.zeros(8))


def test_sink_spec_names_and_keys() -> None:
    plain = parse_spec_text("decode_paged_cuda_bf16_hd64_g8_swa_nhd")
    sink = parse_spec_text("decode_paged_cuda_bf16_hd64_g8_swa_nhd_sink")
    assert sink == plain.replace(use_sinks=True) and sink.uri.endswith("_sink")
    assert sink.kernel_name == "jitattn_decode_paged_bf16_hd64_g8_swa_nhd_sink"
    assert "use_sinks" not in plain.to_dict(), "a spec without sinks keeps its canonical form (and cache key)"
    assert VariantSpec.from_dict(sink.to_dict()) == sink
    assert parse_spec_text("op=merge,target=cpu,o_dtype=f16,use_sinks=1").use_sinks
    with pytest.raises(ValueError, match="use_sinks is for attention and merge"):
        VariantSpec(op="append", target="cpu", kv_dtype="f16", use_sinks=True)


def test_after_a_run_with_sinks_later_plans_prepare_the_sink_launch() -> None:
    """So that a run() captured into a CUDA graph after a re-plan loads nothing (the first run is eager)."""
    gen = torch.Generator().manual_seed(4)
    batch = random_paged_batch([5, 30], 2, 64, PAGE, f16, generator=gen)
    q = torch.randn(2, 8, 64, generator=gen).to(f16)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    args = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, PAGE)
    wrapper.plan(*args, q_data_type=f16)
    assert wrapper._plan.sink_launch is None, "no sink build is loaded before sinks are asked for"
    first = wrapper.run(q, batch.cache, sinks=torch.ones(8))
    wrapper.plan(*args, q_data_type=f16)
    assert wrapper._plan.sink_launch is not None
    assert torch.equal(wrapper.run(q, batch.cache, sinks=torch.ones(8)), first)


@pytest.mark.parametrize("sm_scale,error,match", [
    ("0.1", TypeError, r"sm_scale='0\.1' must be a number, not a string"),
    ([0.1], TypeError, r"sm_scale=\[0\.1\] must be a number"),
    (1e300, ValueError, r"sm_scale=1e\+300 must be a positive finite number within float32's normal range"),
    (1e-300, ValueError, r"sm_scale=1e-300 must be a positive finite number within float32's normal range"),
    (float("nan"), ValueError, "sm_scale=nan must be a positive finite number"),
    (-0.1, ValueError, r"sm_scale=-0\.1 must be a positive finite number"),
    (3e38, ValueError, r"sm_scale=3e\+38 is too far from the planned sm_scale"),
], ids=["string", "list", "huge", "tiny", "nan", "negative", "ratio_out_of_range"])
def test_sink_wrapper_checks_its_positional_sm_scale(sm_scale, error: type, match: str) -> None:
    """``run(q, kv, sinks, sm_scale)``: sm_scale's own errors, as plan()'s (never one naming q_scale)."""
    gen = torch.Generator().manual_seed(9)
    batch, qo_indptr, q = _prefill_batch(gen, 8, 2, 64, f16, "cpu")
    wrapper = jitattn.BatchAttentionWithAttentionSinkWrapper(
        torch.empty(128 << 20, dtype=torch.uint8), kv_layout="NHD", q_data_type=f16, kv_data_type=f16,
        head_dim_qk=64, head_dim_vo=64)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, PAGE, causal=True,
                 q_data_type=f16, kv_data_type=f16)
    with pytest.raises(error, match=match):
        wrapper.run(q, batch.cache, _sinks(8, gen, "cpu"), sm_scale)


def test_a_sink_wrapper_plan_that_raises_leaves_no_plan() -> None:
    """Its plan() loads the sink build after the paged plan; when that raises (a custom variant has no sink
    build), no plan is left, as after any refused plan()."""
    wrapper = jitattn.BatchAttentionWithAttentionSinkWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    table = (i32(0, 3), i32(0, 2), i32(0, 1), i32(3), 2, 2, 64, 4)
    gate = jitattn.AttentionVariant("sinkgate", output_transform="out * 0.5f")
    with pytest.raises(Exception, match="variant"):
        wrapper.plan(*table, q_data_type=torch.float32, kv_data_type=torch.float32, variant=gate)
    assert wrapper._plan is None and wrapper._plan_call == {}
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(torch.randn(3, 2, 64), torch.randn(2, 2, 4, 2, 64), torch.zeros(2))


@pytest.mark.parametrize("argument,value,error,match", [
    ("head_dim_qk", -5, ValueError, "head_dim_qk=-5 must be a positive int"),
    ("window_left", "a", TypeError, "window_left='a' must be an int"),
    ("q_data_type", "int8", ValueError, "q_data_type='int8' is not supported"),
])
def test_sink_wrapper_constructor_checks_the_arguments_flashinfer_builds_from(argument, value, error, match) -> None:
    """FlashInfer builds its kernel from these; plan() takes them here, and they were not read at all."""
    with pytest.raises(error, match=match):
        jitattn.BatchAttentionWithAttentionSinkWrapper(torch.empty(1 << 20, dtype=torch.uint8), **{argument: value})

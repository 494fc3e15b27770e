"""GPU checks of the sm90 (Hopper) cuda prefill tier beyond the shared prefill tests: many tiles and
KV blocks per request, GQA, rows that see no key, NaN in memory a tile reads past a request's keys
(the next request's V, the allocation's tail), strided q and head-major k/v views, and agreement
with the sm80 tier on the same inputs. Skipped on GPUs other than sm_90."""

from __future__ import annotations

import pytest
import torch

import jitattn
import jitattn.jit
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.kernels import prefill_sm90
from jitattn.jit import render
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_lse, assert_close_out, random_paged_batch

pytestmark = pytest.mark.gpu

bf16, f16 = torch.bfloat16, torch.float16

# (head_dim, qo heads, kv heads, dtype, causal, qo_lens, kv_lens)
CASES = {
    "d128_g4_bf16_causal_tiles": (128, 16, 4, bf16, True, [1000, 1, 129, 0, 300, 64], [1000, 700, 129, 5, 401, 64]),
    "d128_g4_bf16_full": (128, 16, 4, bf16, False, [513, 7, 256], [77, 1300, 0]),
    "d64_mha_f16_causal": (64, 4, 4, f16, True, [700, 33], [900, 33]),
    "d64_g8_bf16_full": (64, 8, 1, bf16, False, [130, 2], [257, 1000]),
    "d256_g2_bf16_causal": (256, 8, 4, bf16, True, [300, 70], [300, 200]),
    "d256_mha_f16_full": (256, 2, 2, f16, False, [129], [191]),
    "d128_g3_f16_causal_unpacked": (128, 6, 2, f16, True, [300, 5], [310, 900]),  # 3 does not divide 128
    "d128_g4_bf16_causal_short_queries": (128, 8, 2, bf16, True, [16, 3, 16, 1], [4096, 100, 16, 1]),
}


# head_dim_qk 192 with head_dim_vo 128 (DeepSeek's MLA prefill over ragged KV): (qk, vo, qo heads, kv heads, dtype,
# causal, qo_lens, kv_lens)
ASYMMETRIC = {
    "dqk192_dvo128_mha_bf16_causal": (192, 128, 4, 4, bf16, True, [1000, 1, 129, 0, 300], [1000, 700, 129, 5, 401]),
    "dqk192_dvo128_g2_f16_full": (192, 128, 4, 2, f16, False, [513, 7, 64], [77, 1300, 0]),  # packed: group 2
}


def _spec(d, hq, hkv, dtype, causal, dvo=None):
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=dtype, kv_dtype=dtype, o_dtype=dtype, head_dim_qk=d, head_dim_vo=dvo or d,
        num_qo_heads=hq, num_kv_heads=hkv, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
        use_logits_soft_cap=False, mask_mode=MaskMode.CAUSAL if causal else MaskMode.NONE, kv_layout=KVLayout.NHD,
        kv_storage=KVStorage.RAGGED,
    )


GPU_SPECS = [_spec(*c[:5]) for c in CASES.values()] + [_spec(d, hq, hkv, dtype, causal, dvo)
                                                        for d, dvo, hq, hkv, dtype, causal, *_ in ASYMMETRIC.values()]


@pytest.fixture(autouse=True)
def _hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 prefill tier needs an sm_90 GPU")


def _indptr(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _run(q, k, v, qo_lens, kv_lens, causal):
    hq, d, dvo = q.shape[1], q.shape[2], v.shape[2]
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), hq, k.shape[1], d, head_dim_vo=dvo, causal=causal,
                 q_data_type=q.dtype, kv_data_type=k.dtype)
    out = torch.full((q.shape[0], hq, dvo), float("nan"), dtype=q.dtype, device="cuda")
    lse = torch.full((q.shape[0], hq), float("nan"), device="cuda")
    wrapper.run(q, k, v, out=out, lse=lse)
    return out, lse


def _inputs(case_id, d, hq, hkv, dtype, qo_lens, kv_lens):
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype).cuda()
    return q, k, v


@pytest.mark.parametrize("case_id", list(CASES))
def test_sm90_tier_matches_reference(case_id):
    d, hq, hkv, dtype, causal, qo_lens, kv_lens = CASES[case_id]
    assert "sm90 tier" in render(_spec(d, hq, hkv, dtype, causal))["kernel.cu"]
    q, k, v = _inputs(case_id, d, hq, hkv, dtype, qo_lens, kv_lens)
    out, lse = _run(q, k, v, qo_lens, kv_lens, causal)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=causal)
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("case_id", list(ASYMMETRIC))
def test_sm90_dqk192_dvo128_matches_reference_and_the_sm80_tier(case_id, monkeypatch, fresh_registry):
    d, dvo, hq, hkv, dtype, causal, qo_lens, kv_lens = ASYMMETRIC[case_id]
    assert "sm90 tier" in render(_spec(d, hq, hkv, dtype, causal, dvo))["kernel.cu"]
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype).cuda()
    v = torch.randn(sum(kv_lens), hkv, dvo, generator=gen).to(dtype).cuda()
    out, lse = _run(q, k, v, qo_lens, kv_lens, causal)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=causal)
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)
    monkeypatch.setenv("JITATTN_PREFILL_TIER", "sm80")
    jitattn.jit._registry.clear()
    assert "sm90 tier" not in render(_spec(d, hq, hkv, dtype, causal, dvo))["kernel.cu"]
    out80, lse80 = _run(q, k, v, qo_lens, kv_lens, causal)
    assert_close_out(out, out80.float(), dtype)
    assert_close_lse(lse, lse80)


def test_sm90_nan_past_the_keys_never_reaches_the_output():
    """A block reaching past a request's keys reads the next request's rows and, for the last
    request, the allocation's tail: NaN there must not leak (V rows are zeroed, scores masked)."""
    d, hq, hkv, dtype = 128, 8, 2, bf16
    qo_lens, kv_lens = [50, 70], [60, 90]
    gen = torch.Generator().manual_seed(17)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).cuda()
    n = sum(kv_lens)
    k_buf = torch.full((n + 300, hkv, d), float("nan"), dtype=dtype, device="cuda")
    v_buf = torch.full((n + 300, hkv, d), float("nan"), dtype=dtype, device="cuda")
    k_buf[:n] = torch.randn(n, hkv, d, generator=gen).to(dtype).cuda()
    v_buf[:n] = torch.randn(n, hkv, d, generator=gen).to(dtype).cuda()
    k_buf[kv_lens[0]:kv_lens[0] + 5] = float("nan")  # request 1's first keys and values: only it sees them
    v_buf[kv_lens[0]:kv_lens[0] + 5] = float("nan")
    k, v = k_buf[:n], v_buf[:n]
    for causal in (True, False):
        out, lse = _run(q, k, v, qo_lens, kv_lens, causal)
        ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=causal)
        assert torch.isfinite(out[:qo_lens[0]].float()).all() and torch.isfinite(lse[:qo_lens[0]]).all()
        assert torch.equal(torch.isnan(out), torch.isnan(ref_o))
        assert_close_out(out[:qo_lens[0]], ref_o[:qo_lens[0]], dtype)


@pytest.mark.parametrize("q_head_major", [False, True])
def test_sm90_strided_q_and_head_major_kv(q_head_major):
    d, hq, hkv, dtype = 64, 8, 2, f16
    qo_lens, kv_lens = [200, 33], [333, 40]
    gen = torch.Generator().manual_seed(5)
    if q_head_major:  # the GQA-packed Q box then lands head-major in shared memory
        q = torch.randn(hq, sum(qo_lens), d, generator=gen).to(dtype).cuda().transpose(0, 1)
    else:
        q_big = torch.randn(sum(qo_lens), hq, d + 64, generator=gen).to(dtype).cuda()
        q = q_big[:, :, 32:32 + d]                 # token stride hq * (d + 64), head stride d + 64
    k = torch.randn(hkv, sum(kv_lens), d, generator=gen).to(dtype).cuda().transpose(0, 1)  # head-major view
    v = torch.randn(hkv, sum(kv_lens), d, generator=gen).to(dtype).cuda().transpose(0, 1)
    assert k.stride(1) > k.stride(0)
    out, lse = _run(q, k, v, qo_lens, kv_lens, True)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)


# Uneven requests: many more items (tile, head) than SMs, of very different weights, and empty
# virtual tiles between them.
WORK_CASE = (128, 16, 4, bf16, True, [3000, 1, 700, 129, 0, 2000, 64, 5], [3000, 900, 700, 4000, 5, 2100, 64, 5])


def test_sm90_dynamic_and_static_orders_give_the_same_bits():
    """Blocks take items from a per-stream counter; on the per-thread default stream (no counter
    slot) they walk the static order. One block computes a whole tile either way: the same bits."""
    d, hq, hkv, dtype, causal, qo_lens, kv_lens = WORK_CASE
    q, k, v = _inputs("orders", d, hq, hkv, dtype, qo_lens, kv_lens)
    out_dynamic, lse_dynamic = _run(q, k, v, qo_lens, kv_lens, causal)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(2)):  # 2 == cudaStreamPerThread
        out_static, lse_static = _run(q, k, v, qo_lens, kv_lens, causal)
        torch.cuda.current_stream().synchronize()
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=causal)
    assert_close_out(out_dynamic, ref_o, dtype)
    assert_close_lse(lse_dynamic, ref_lse)
    assert torch.equal(out_dynamic, out_static) and torch.equal(lse_dynamic, lse_static)


def test_sm90_launches_take_a_work_slot_per_stream():
    """The dynamic order is the one that runs: a launch on an ordinary stream takes a work slot (>= 0), the
    same one every time; another stream another slot; the per-thread default stream none (-1: static)."""
    import ctypes

    module = jitattn.jit.load(_spec(128, 16, 4, bf16, True))
    slot_of = module._lib.jitattn_work_slot
    slot_of.argtypes, slot_of.restype = [ctypes.c_void_p], ctypes.c_int
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    a, b = slot_of(s1.cuda_stream), slot_of(s2.cuda_stream)
    assert a >= 0 and b >= 0 and a != b
    assert slot_of(s1.cuda_stream) == a and slot_of(torch.cuda.current_stream().cuda_stream) >= 0
    assert slot_of(2) == -1  # cudaStreamPerThread


def test_sm90_concurrent_streams_keep_their_own_counters():
    """Launches on two streams with no sync between them overlap on the GPU; each takes its own counter
    slot, so each covers all of its items (a shared counter would split the items between them)."""
    d, hq, hkv, dtype = 128, 16, 4, bf16
    shapes = [([3000, 700], [3000, 4000]), ([2500, 9], [2600, 3000])]
    inputs = [_inputs(f"concurrent{i}", d, hq, hkv, dtype, *shape) for i, shape in enumerate(shapes)]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for _ in range(3):
        torch.cuda.synchronize()
        results = []
        for stream, (q, k, v), (qo_lens, kv_lens) in zip(streams, inputs, shapes):
            with torch.cuda.stream(stream):
                results.append(_run(q, k, v, qo_lens, kv_lens, True))
        torch.cuda.synchronize()
        for (out, lse), (q, k, v), (qo_lens, kv_lens) in zip(results, inputs, shapes):
            ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
            assert_close_out(out, ref_o, dtype)
            assert_close_lse(lse, ref_lse)


def test_sm90_work_counter_starts_from_zero_every_launch():
    """The last block of a launch resets its counter slot: launches with different item counts back
    to back on one stream, and alternating with a second stream, each cover every item (a counter left
    at the previous launch's count would leave the poisoned output in place)."""
    d, hq, hkv, dtype = 128, 8, 2, bf16
    shapes = [([2000, 3], [2100, 3]), ([1], [9000]), ([700, 700, 700], [700, 800, 900]), ([1], [9000])]
    other = torch.cuda.Stream()
    for i, (qo_lens, kv_lens) in enumerate(shapes * 2):
        q, k, v = _inputs(f"reset{i}", d, hq, hkv, dtype, qo_lens, kv_lens)
        torch.cuda.synchronize()
        with torch.cuda.stream(other if i % 3 == 2 else torch.cuda.current_stream()):
            out, lse = _run(q, k, v, qo_lens, kv_lens, True)
        torch.cuda.synchronize()
        ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
        assert_close_out(out, ref_o, dtype)
        assert_close_lse(lse, ref_lse)


def test_sm90_graph_replays_and_eager_launches_interleave():
    """A launch captured into a CUDA graph takes a counter slot of its own: replays of the graph
    (after a re-plan to another item count) interleaved with eager launches on the capturing stream
    are all complete."""
    d, hq, hkv, dtype = 128, 8, 2, bf16
    qo_lens, kv_lens = [900, 40], [1000, 3000]
    q, k, v = _inputs("graph", d, hq, hkv, dtype, qo_lens, kv_lens)
    bufs = dict(qo_indptr_buf=torch.empty(3, dtype=torch.int32, device="cuda"),
                kv_indptr_buf=torch.empty(3, dtype=torch.int32, device="cuda"))
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True, **bufs)
    wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), hq, hkv, d, causal=True, q_data_type=dtype)
    out = torch.empty(q.shape[0], hq, d, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        wrapper.run(q, k, v, out=out)  # loads the module outside the capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            wrapper.run(q, k, v, out=out)
    qo_lens, kv_lens = [470, 470], [3000, 1000]  # same row count, other tiles
    wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), hq, hkv, d, causal=True, q_data_type=dtype)
    ref_o, _ = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
    with torch.cuda.stream(stream):
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            stream.synchronize()
            assert_close_out(out, ref_o, dtype)
            eager, _ = _run(q, k, v, qo_lens, kv_lens, True)
            stream.synchronize()
            assert_close_out(eager, ref_o, dtype)


def test_sm90_traced_build_is_exact_and_its_stamps_ordered(monkeypatch, fresh_registry):
    """SM90_TUNING trace=1 (tools/trace_prefill.py): the traced kernel gives the reference's result, and each
    block's stamps of its first item come in phase order (start, item decoded, queries in, first K block in,
    first S, last P V, stored, block end) with its KV block count and item count filled in."""
    import ctypes

    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "trace", 1)
    jitattn.jit._registry.clear()
    d, hq, hkv, dtype, causal, qo_lens, kv_lens = CASES["d128_g4_bf16_causal_tiles"]
    q, k, v = _inputs("trace", d, hq, hkv, dtype, qo_lens, kv_lens)
    lib = ctypes.CDLL(str(jitattn.load(_spec(d, hq, hkv, dtype, causal)).path))
    assert lib.jitattn_prefill_trace_clear() == 0
    out, lse = _run(q, k, v, qo_lens, kv_lens, causal)
    torch.cuda.synchronize()
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=causal)
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)
    buf = (ctypes.c_uint64 * (1024 * 12))()
    assert lib.jitattn_prefill_trace(ctypes.byref(buf)) == 1024
    stamps = torch.tensor(list(buf), dtype=torch.int64).view(1024, 12)
    ran = stamps[stamps[:, 7] > 0]
    assert len(ran) > 0
    phases = ran[:, [0, 1, 3, 4, 5, 6, 7, 10]]
    assert bool((phases[:, 1:] >= phases[:, :-1]).all()), "stamps out of phase order"
    assert bool((ran[:, 2] >= ran[:, 1]).all()), "the first K block issued before the item was decoded"
    assert bool((ran[:, 8] >= 1).all()) and bool((ran[:, 11] >= 1).all())


def test_sm90_and_sm80_tiers_agree(monkeypatch, fresh_registry):
    d, hq, hkv, dtype, causal, qo_lens, kv_lens = CASES["d128_g4_bf16_causal_tiles"]
    q, k, v = _inputs("agree", d, hq, hkv, dtype, qo_lens, kv_lens)
    results = {}
    for tier in ("sm90", "sm80"):
        monkeypatch.setenv("JITATTN_PREFILL_TIER", tier)
        jitattn.jit._registry.clear()
        spec = _spec(d, hq, hkv, dtype, causal)
        assert ("sm90 tier" in render(spec)["kernel.cu"]) == (tier == "sm90")
        results[tier] = _run(q, k, v, qo_lens, kv_lens, causal)
    assert_close_out(results["sm90"][0], results["sm80"][0].float(), dtype)
    assert_close_lse(results["sm90"][1], results["sm80"][1])


@pytest.mark.parametrize("tier", ["sm90", "sm80"])
def test_queries_of_every_magnitude(tier, monkeypatch, fresh_registry):
    """Query heads scaled 0, 1e-30 .. 1e5 (logits to ~1e6: one-hot rows; the range the fused exponent keeps exact is
    README's "Logit range"), on both tiers: the reference's output and LSE, no inf or NaN."""
    d, hq, hkv, dtype, causal, qo_lens, kv_lens = CASES["d128_g4_bf16_causal_short_queries"]
    q, k, v = _inputs("magnitude", d, hq, hkv, dtype, qo_lens, kv_lens)
    factors = torch.tensor([0.0, 1e-30, 1e-3, 1.0, 30.0, 3e3, 3e4, 1e5])
    q = (q.float() * factors.cuda()[None, :, None]).to(dtype)
    monkeypatch.setenv("JITATTN_PREFILL_TIER", tier)
    jitattn.jit._registry.clear()
    assert ("sm90 tier" in render(_spec(d, hq, hkv, dtype, causal))["kernel.cu"]) == (tier == "sm90")
    out, lse = _run(q, k, v, qo_lens, kv_lens, causal)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=causal)
    assert bool(out.isfinite().all()) and bool(lse.isfinite().all())
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)


# ---- paged KV (cp.async gathers) and repeated query rows (q_row_period) ----------------------

# (head_dim, qo heads, kv heads, dtype, causal, page_size, layout, cache format, qo_lens, kv_lens)
PAGED_CASES = {
    "d128_g4_bf16_causal_p16_nhd": (128, 16, 4, bf16, True, 16, "NHD", "5d", [1000, 1, 129, 0, 300, 64],
                                    [1000, 700, 129, 5, 401, 64]),
    "d128_g4_bf16_full_p1_hnd_tuple": (128, 8, 2, bf16, False, 1, "HND", "tuple4", [513, 7, 256], [77, 1300, 0]),
    "d64_mha_f16_causal_p64_hnd": (64, 4, 4, f16, True, 64, "HND", "5d", [700, 33, 5], [900, 33, 200]),
    "d64_g8_bf16_full_p16_tuple": (64, 8, 1, bf16, False, 16, "NHD", "tuple4", [130, 2], [257, 1000]),
    "d256_g2_bf16_causal_p16_hnd": (256, 8, 4, bf16, True, 16, "HND", "5d", [300, 70], [300, 200]),
    "d256_mha_f16_full_p64": (256, 2, 2, f16, False, 64, "NHD", "5d", [129], [191]),
    "d128_g3_f16_causal_p16_unpacked": (128, 6, 2, f16, True, 16, "NHD", "5d", [300, 5], [310, 900]),
    "d128_g4_bf16_causal_p64_short_queries": (128, 8, 2, bf16, True, 64, "NHD", "5d", [16, 3, 16, 1],
                                              [4096, 100, 16, 1]),
    "d128_g4_bf16_causal_p8_nhd": (128, 8, 2, bf16, True, 8, "NHD", "5d", [300, 9], [700, 9]),  # 22 boxes a stage
    "d128_g4_f16_full_p16_hnd_tuple": (128, 8, 2, f16, False, 16, "HND", "tuple4", [200, 3], [333, 600]),
}


def _paged_spec(d, hq, hkv, dtype, causal, layout):
    return _spec(d, hq, hkv, dtype, causal).replace(kv_storage=KVStorage.PAGED,
                                                    kv_layout=KVLayout.parse(layout, "layout"))


GPU_SPECS += [_paged_spec(*c[:5], c[6]) for c in PAGED_CASES.values()]


def _poisoned_paged_batch(case_id, d, hkv, dtype, page, layout, fmt, kv_lens):
    """A random paged batch whose unreferenced pages and slots past each last page's length are NaN."""
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)) + 1)
    batch = random_paged_batch(kv_lens, hkv, d, page, dtype, layout, fmt, "cuda", generator=gen, spare_pages=5)
    used = set(batch.kv_indices.tolist())
    caches = batch.cache if isinstance(batch.cache, tuple) else (batch.cache,)
    slot_dim = {("5d", "NHD"): 2, ("5d", "HND"): 3, ("tuple4", "NHD"): 1, ("tuple4", "HND"): 2}[fmt, layout]
    for cache in caches:
        for page_id in range(cache.shape[0]):
            if page_id not in used:
                cache[page_id] = float("nan")
        for r, n in enumerate(kv_lens):
            if n == 0:
                continue
            last_page = int(batch.kv_indices[int(batch.kv_indptr[r + 1]) - 1])
            tail = cache[last_page].narrow(slot_dim - 1, int(batch.kv_last_page_len[r]),
                                           page - int(batch.kv_last_page_len[r]))
            tail.fill_(float("nan"))
    return batch


def _paged_wrapper(qo_lens, batch, layout, page, hq, hkv, d, dtype, causal):
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(_indptr(qo_lens), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page,
                 causal=causal, q_data_type=dtype, kv_data_type=dtype)
    return wrapper


@pytest.mark.parametrize("case_id", list(PAGED_CASES))
def test_sm90_paged_matches_reference(case_id):
    d, hq, hkv, dtype, causal, page, layout, fmt, qo_lens, kv_lens = PAGED_CASES[case_id]
    assert "sm90 tier" in render(_paged_spec(d, hq, hkv, dtype, causal, layout))["kernel.cu"]
    batch = _poisoned_paged_batch(case_id, d, hkv, dtype, page, layout, fmt, kv_lens)
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).cuda()
    wrapper = _paged_wrapper(qo_lens, batch, layout, page, hq, hkv, d, dtype, causal)
    out = torch.full((q.shape[0], hq, d), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((q.shape[0], hq), float("nan"), device="cuda")
    wrapper.run(q, batch.cache, out=out, lse=lse)
    ref_o, ref_lse = reference.batch_prefill_paged(q, batch.cache, _indptr(qo_lens), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len, kv_layout=layout, causal=causal)
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("case_id", ["d128_g4_bf16_full_p1_hnd_tuple", "d128_g4_bf16_causal_p16_nhd"],
                         ids=["gathers", "paged_tma"])
def test_sm90_paged_dynamic_and_static_orders_give_the_same_bits(case_id):
    """Paged KV: the whole producer warpgroup reads each item from the ring (gathers, or TMA boxes from
    every producer warp); the dynamic order gives the static order's bits."""
    d, hq, hkv, dtype, causal, page, layout, fmt, qo_lens, kv_lens = PAGED_CASES[case_id]
    batch = _poisoned_paged_batch(case_id, d, hkv, dtype, page, layout, fmt, kv_lens)
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)) + 1)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype).cuda()
    wrapper = _paged_wrapper(qo_lens, batch, layout, page, hq, hkv, d, dtype, causal)
    dynamic_out, dynamic_lse = wrapper.run(q, batch.cache, return_lse=True)
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(2)):  # 2 == cudaStreamPerThread: no slot, static order
        static_out, static_lse = wrapper.run(q, batch.cache, return_lse=True)
        torch.cuda.current_stream().synchronize()
    ref_o, ref_lse = reference.batch_prefill_paged(q, batch.cache, _indptr(qo_lens), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len, kv_layout=layout, causal=causal)
    assert_close_out(dynamic_out, ref_o, dtype)
    assert torch.equal(dynamic_out, static_out) and torch.equal(dynamic_lse, static_lse)


# Paged cases whose page size a KV block holds in whole 8-row swizzle atoms take the TMA path (paged_tma);
# three of them (each builds two tunings) against the gathers: NHD 5-d, HND 5-d, HND (k, v) tuple.
TMA_CASES = ["d128_g4_bf16_causal_p8_nhd", "d64_mha_f16_causal_p64_hnd", "d128_g4_f16_full_p16_hnd_tuple"]
assert all(PAGED_CASES[c][5] % 8 == 0 and prefill_sm90.SM90_PAGED_KV_BLOCK[PAGED_CASES[c][0]] % PAGED_CASES[c][5] == 0
           for c in TMA_CASES)


@pytest.mark.parametrize("case_id", TMA_CASES)
def test_sm90_paged_tma_gives_the_gathers_bits(case_id, monkeypatch, fresh_registry):
    """The same batch with paged_tma 2 (TMA demanded: an error where the launch would gather) and 0 (the
    cp.async gathers): both land the same bytes in the same swizzled stage, so the outputs are bitwise equal."""
    d, hq, hkv, dtype, causal, page, layout, fmt, qo_lens, kv_lens = PAGED_CASES[case_id]
    batch = _poisoned_paged_batch(case_id, d, hkv, dtype, page, layout, fmt, kv_lens)
    q = torch.randn(sum(qo_lens), hq, d, generator=torch.Generator().manual_seed(11)).to(dtype).cuda()
    results = {}
    for mode in (2, 0):
        monkeypatch.setitem(prefill_sm90.SM90_TUNING, "paged_tma", mode)
        jitattn.jit._registry.clear()
        wrapper = _paged_wrapper(qo_lens, batch, layout, page, hq, hkv, d, dtype, causal)
        results[mode] = wrapper.run(q, batch.cache, return_lse=True)
    assert torch.equal(results[2][0], results[0][0]) and torch.equal(results[2][1], results[0][1])


def test_sm90_and_sm80_tiers_agree_paged(monkeypatch, fresh_registry):
    case_id = "d128_g4_bf16_causal_p16_nhd"
    d, hq, hkv, dtype, causal, page, layout, fmt, qo_lens, kv_lens = PAGED_CASES[case_id]
    batch = _poisoned_paged_batch(case_id, d, hkv, dtype, page, layout, fmt, kv_lens)
    q = torch.randn(sum(qo_lens), hq, d, generator=torch.Generator().manual_seed(3)).to(dtype).cuda()
    results = {}
    for tier in ("sm90", "sm80"):
        monkeypatch.setenv("JITATTN_PREFILL_TIER", tier)
        jitattn.jit._registry.clear()
        assert ("sm90 tier" in render(_paged_spec(d, hq, hkv, dtype, causal, layout))["kernel.cu"]) == (tier == "sm90")
        wrapper = _paged_wrapper(qo_lens, batch, layout, page, hq, hkv, d, dtype, causal)
        results[tier] = wrapper.run(q, batch.cache, return_lse=True)
    assert_close_out(results["sm90"][0], results["sm80"][0].float(), dtype)
    assert_close_lse(results["sm90"][1], results["sm80"][1])


# (head_dim, qo heads, kv heads, dtype, causal, storage, layout, q head-major): query rows shared by 3
# chunks; the specs are those of the cases above.
SHARED_Q_CASES = {
    "d128_g4_bf16_paged_hnd_full": (128, 16, 4, bf16, False, KVStorage.PAGED, "HND", False),
    "d128_g4_bf16_paged_causal_q_head_major": (128, 8, 2, bf16, True, KVStorage.PAGED, "NHD", True),
    "d64_mha_f16_paged_hnd_causal_q_head_major": (64, 4, 4, f16, True, KVStorage.PAGED, "HND", True),
    "d256_g2_bf16_ragged_causal": (256, 8, 4, bf16, True, KVStorage.RAGGED, "NHD", False),
}


@pytest.mark.parametrize("case_id", list(SHARED_Q_CASES))
def test_sm90_shared_query_rows(case_id):
    """q_row_period (a cascade level cut into chunks): output row t reads q row t % q_rows."""
    from jitattn.runtime.batch import share_queries

    d, hq, hkv, dtype, causal, storage, layout, q_head_major = SHARED_Q_CASES[case_id]
    q_rows, page = 150, 16
    kv_lens = [500, 150, 177] if causal else [500, 37, 0]  # bottom-right causal: kv_len >= qo_len
    qo_lens = [q_rows] * len(kv_lens)
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    if q_head_major:
        q = torch.randn(hq, q_rows, d, generator=gen).to(dtype).cuda().transpose(0, 1)
    else:
        q = torch.randn(q_rows, hq, d, generator=gen).to(dtype).cuda()
    q_full = q.repeat(len(kv_lens), 1, 1)
    if storage is KVStorage.PAGED:
        batch = _poisoned_paged_batch(case_id, d, hkv, dtype, page, layout, "5d", kv_lens)
        wrapper = _paged_wrapper(qo_lens, batch, layout, page, hq, hkv, d, dtype, causal)
        kv_args = (batch.cache,)
        ref_o, ref_lse = reference.batch_prefill_paged(q_full, batch.cache, _indptr(qo_lens), batch.kv_indptr,
                                                       batch.kv_indices, batch.kv_last_page_len, kv_layout=layout,
                                                       causal=causal)
    else:
        k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype).cuda()
        v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype).cuda()
        wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
        wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), hq, hkv, d, causal=causal, q_data_type=dtype,
                     kv_data_type=dtype)
        kv_args = (k, v)
        ref_o, ref_lse = reference.batch_ragged_attention(q_full, k, v, _indptr(qo_lens), _indptr(kv_lens),
                                                          causal=causal)
    paged = storage is KVStorage.PAGED
    spec = _paged_spec(d, hq, hkv, dtype, causal, layout) if paged else _spec(d, hq, hkv, dtype, causal)
    assert "sm90 tier" in render(spec)["kernel.cu"]
    share_queries(wrapper._plan, q_rows)
    out = torch.full((q_full.shape[0], hq, d), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((q_full.shape[0], hq), float("nan"), device="cuda")
    wrapper.run(q, *kv_args, out=out, lse=lse)
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)


_EXPANDABLE_CHILD = r"""
import torch, jitattn
from jitattn import reference
gen = torch.Generator().manual_seed(0)
hq, hkv, d, page, n = 8, 2, 128, 16, 24000  # K/V ~100 MB each: many 20 MB chunks of expandable segments
q = torch.randn(300, hq, d, generator=gen).to(torch.bfloat16).cuda()
k = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16).cuda()
v = torch.randn(n, hkv, d, generator=gen).to(torch.bfloat16).cuda()
qo, kv = torch.tensor([0, 150, 300], dtype=torch.int32), torch.tensor([0, 12000, n], dtype=torch.int32)
w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
w.plan(qo, kv, hq, hkv, d, causal=True, q_data_type=torch.bfloat16)
out = w.run(q, k, v)
ref, _ = reference.batch_ragged_attention(q, k, v, qo, kv, causal=True)
err = (out.float() - ref.float()).abs().max().item()
print("max_err", err)
assert err < 3e-2, err
"""


def test_sm90_tensor_maps_cover_tensors_under_expandable_segments(tmp_path):
    """With PyTorch's expandable segments the driver reports one mapped chunk as a pointer's allocation;
    the tensor maps take the tensors' row counts instead, so keys past the first chunk are read (not zeros)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "child.py"
    script.write_text(_EXPANDABLE_CHILD)
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr

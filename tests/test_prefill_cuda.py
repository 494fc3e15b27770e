"""GPU-only checks of the cuda prefill kernel beyond the API tests: many query
tiles per request and many work items per block (the persistent grid), long
sequences, odd head dims and page sizes, RoPE at large positions, empty rows,
strided inputs, f32 output, CUDA-graph replay and refused misaligned inputs."""

from __future__ import annotations

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_lse, assert_close_out, random_paged_batch

pytestmark = pytest.mark.gpu

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
e4m3 = torch.float8_e4m3fn

# (dqk, dvo, hq, hkv, dtype, causal, pos, window, qo_lens, kv_lens)
RAGGED = {
    "d128_g4_bf16_causal_long": (128, 128, 8, 2, bf16, True, "NONE", -1, [300, 1, 129, 0, 64], [300, 700, 129, 5, 1000]),
    "d64_mha_f16_full": (64, 64, 4, 4, f16, False, "NONE", -1, [200, 33, 7], [77, 513, 0]),
    "d256_g8_bf16_causal": (256, 256, 16, 2, bf16, True, "NONE", -1, [70, 5], [140, 300]),
    "d40_g2_f16_causal": (40, 40, 4, 2, f16, True, "NONE", -1, [90, 257], [100, 257]),
    "d32_g16_bf16_window": (32, 32, 16, 1, bf16, True, "NONE", 37, [150, 9], [400, 9]),
    "d192x128_g1_bf16_full_window": (192, 128, 2, 2, bf16, False, "NONE", 50, [100], [260]),
    "d128_g4_bf16_rope_long_pos": (128, 128, 8, 2, bf16, True, "ROPE_LLAMA", -1, [96, 40], [3000, 1200]),
    "d64_g2_f16_rope": (64, 64, 4, 2, f16, True, "ROPE_LLAMA", -1, [130], [400]),
    "d72_g3_bf16_alibi_window": (72, 72, 6, 2, bf16, True, "ALIBI", 64, [200], [333]),
}


def _spec(dqk, dvo, hq, hkv, dtype, kv_dtype, mask: MaskMode, pos: str, window: int, storage: KVStorage,
          layout: str = "NHD", soft_cap: bool = False, o_dtype=None):
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=dtype, kv_dtype=kv_dtype, o_dtype=o_dtype or dtype, head_dim_qk=dqk,
        head_dim_vo=dvo, num_qo_heads=hq, num_kv_heads=hkv,
        pos_encoding=PosEncoding.parse(pos.lower().replace("rope_llama", "rope"), "pos"),
        use_sliding_window=window >= 0, use_logits_soft_cap=soft_cap, mask_mode=mask,
        kv_layout=KVLayout.parse(layout, "layout"), kv_storage=storage,
    )


GPU_SPECS = [
    _spec(c[0], c[1], c[2], c[3], c[4], c[4], MaskMode.CAUSAL if c[5] else MaskMode.NONE, c[6], c[7], KVStorage.RAGGED)
    for c in RAGGED.values()
]


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _ragged_run(q, k, v, qo_lens, kv_lens, **plan_kw):
    hq, dqk = q.shape[1], q.shape[2]
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), hq, k.shape[1], dqk, head_dim_vo=v.shape[2],
                 q_data_type=q.dtype, kv_data_type=k.dtype, **plan_kw)
    out = torch.full((q.shape[0], hq, v.shape[2]), float("nan"), dtype=plan_kw.get("o_data_type") or q.dtype,
                     device="cuda")
    lse = torch.full((q.shape[0], hq), float("nan"), device="cuda")
    wrapper.run(q, k, v, out=out, lse=lse)
    return wrapper, out, lse


@pytest.mark.parametrize("case_id", list(RAGGED))
def test_ragged_prefill_cuda(case_id: str) -> None:
    dqk, dvo, hq, hkv, dtype, causal, pos, window, qo_lens, kv_lens = RAGGED[case_id]
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    q = torch.randn(sum(qo_lens), hq, dqk, generator=gen).to(dtype).cuda()
    k = torch.randn(sum(kv_lens), hkv, dqk, generator=gen).to(dtype).cuda()
    v = torch.randn(sum(kv_lens), hkv, dvo, generator=gen).to(dtype).cuda()
    _, out, lse = _ragged_run(q, k, v, qo_lens, kv_lens, causal=causal, pos_encoding_mode=pos, window_left=window)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=causal,
                                                      pos_encoding_mode=pos, window_left=window)
    assert_close_out(out, ref_o, dtype)
    assert_close_lse(lse, ref_lse)


def test_many_requests_persistent_grid() -> None:
    """More work items than resident blocks, empty requests among them, one launch."""
    gen = torch.Generator().manual_seed(3)
    qo_lens = torch.randint(0, 300, (70,), generator=gen).tolist()
    qo_lens[5] = qo_lens[40] = 0
    kv_lens = [q + int(x) for q, x in zip(qo_lens, torch.randint(0, 200, (70,), generator=gen))]
    hq, hkv, d = 8, 2, 64
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(f16).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(f16).cuda()
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(f16).cuda()
    _, out, lse = _ragged_run(q, k, v, qo_lens, kv_lens, causal=True)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
    assert_close_out(out, ref_o, f16)
    assert_close_lse(lse, ref_lse)


GPU_SPECS.append(_spec(64, 64, 8, 2, f16, f16, MaskMode.CAUSAL, "NONE", -1, KVStorage.RAGGED))


@pytest.mark.parametrize("page_size,layout", [(1, "NHD"), (5, "HND"), (16, "NHD"), (128, "HND")])
def test_paged_page_sizes(page_size: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(page_size)
    qo_lens, kv_lens = [37, 1, 200], [100, 1, 260]
    hq, hkv, d = 8, 2, 128
    batch = random_paged_batch(kv_lens, hkv, d, page_size, bf16, layout, "5d", "cuda", generator=gen)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(bf16).cuda()
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), layout)
    wrapper.plan(_indptr(qo_lens), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page_size,
                 causal=True, window_left=70, q_data_type=bf16)
    out, lse = wrapper.run(q, batch.cache, return_lse=True)
    ref_o, ref_lse = reference.batch_prefill_paged(q, batch.cache, _indptr(qo_lens), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len, kv_layout=layout, causal=True, window_left=70)
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)


GPU_SPECS += [_spec(128, 128, 8, 2, bf16, bf16, MaskMode.CAUSAL, "NONE", 70, KVStorage.PAGED, layout)
              for layout in ("NHD", "HND")]


def test_fp8_kv_rope_long() -> None:
    gen = torch.Generator().manual_seed(8)
    qo_lens, kv_lens, page, hq, hkv, d = [64, 3], [900, 3], 16, 8, 2, 128
    batch = random_paged_batch(kv_lens, hkv, d, page, e4m3, "NHD", "5d", "cuda", generator=gen)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(bf16).cuda()
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page,
                 causal=True, pos_encoding_mode="ROPE_LLAMA", q_data_type=bf16, kv_data_type=e4m3)
    out, lse = wrapper.run(q, batch.cache, return_lse=True, k_scale=0.7, v_scale=1.3)
    ref_o, ref_lse = reference.batch_prefill_paged(q, batch.cache, _indptr(qo_lens), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len, causal=True, pos_encoding_mode="ROPE_LLAMA",
                                                   k_scale=0.7, v_scale=1.3)
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)


GPU_SPECS.append(_spec(128, 128, 8, 2, bf16, e4m3, MaskMode.CAUSAL, "ROPE_LLAMA", -1, KVStorage.PAGED))


def test_custom_mask_with_empty_rows() -> None:
    """Rows whose mask is all False give o = 0 and lse = -inf."""
    gen = torch.Generator().manual_seed(9)
    qo_lens, kv_lens, hq, hkv, d = [40, 70], [90, 70], 4, 4, 64
    masks = [torch.rand(qn, kn, generator=gen) > 0.7 for qn, kn in zip(qo_lens, kv_lens)]
    masks[0][3] = False
    masks[1][:9] = False
    flat = torch.cat([m.reshape(-1) for m in masks])
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(f16).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(f16).cuda()
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(f16).cuda()
    _, out, lse = _ragged_run(q, k, v, qo_lens, kv_lens, custom_mask=flat.cuda())
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), custom_mask=flat)
    assert_close_out(out, ref_o, f16)
    assert_close_lse(lse, ref_lse)
    assert torch.isinf(lse[3]).all() and (out[3] == 0).all()
    assert torch.isinf(lse[40:49]).all() and (out[40:49] == 0).all()


GPU_SPECS.append(_spec(64, 64, 4, 4, f16, f16, MaskMode.CUSTOM, "NONE", -1, KVStorage.RAGGED))


def test_strided_q_and_f32_output() -> None:
    gen = torch.Generator().manual_seed(10)
    qo_lens, kv_lens, hq, hkv, d = [33, 70], [50, 200], 8, 2, 128
    big = torch.randn(sum(qo_lens), hq, 2 * d, generator=gen).to(bf16).cuda()
    q = big[:, :, d:]  # token stride 2 * hq * d, head stride 2 * d
    kv = torch.randn(sum(kv_lens), 2 * hkv, d, generator=gen).to(bf16).cuda()
    k, v = kv[:, :hkv], kv[:, hkv:]
    _, out, lse = _ragged_run(q, k, v, qo_lens, kv_lens, causal=True, o_data_type=f32)
    assert out.dtype == f32
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
    torch.testing.assert_close(out.cpu(), ref_o.cpu(), atol=5e-3, rtol=5e-3)
    assert_close_lse(lse, ref_lse)


GPU_SPECS.append(_spec(128, 128, 8, 2, bf16, bf16, MaskMode.CAUSAL, "NONE", -1, KVStorage.RAGGED, o_dtype=f32))


def test_misaligned_rows_are_refused() -> None:
    hq, hkv, d = 4, 4, 64
    base = torch.randn(10, hq, d + 1).to(f16).cuda()
    q = base[:, :, 1:]  # last dim contiguous, rows on 2-byte boundaries
    k = torch.randn(10, hkv, d).to(f16).cuda()
    v = torch.randn(10, hkv, d).to(f16).cuda()
    with pytest.raises(Exception, match="16 bytes"):
        _ragged_run(q, k, v, [10], [10], causal=True)


GPU_SPECS.append(_spec(64, 64, 4, 4, f16, f16, MaskMode.CAUSAL, "NONE", -1, KVStorage.RAGGED))


@pytest.mark.parametrize("qo_lens, kv_lens", [([60, 60], [100, 70]), ([45, 30], [90, 80])],
                         ids=["same_totals", "fewer_rows"])
def test_cuda_graph_replay(qo_lens: list, kv_lens: list) -> None:
    """The persistent grid does not depend on the batch: a run captured for one plan replays
    correctly after a re-plan into the same buffers and on new data, with the same totals or with
    fewer query rows than the captured buffers hold (the rows past the plan's are not its output)."""
    gen = torch.Generator().manual_seed(12)
    hq, hkv, d = 8, 2, 64
    q = torch.randn(120, hq, d, generator=gen).to(f16).cuda()
    k = torch.randn(170, hkv, d, generator=gen).to(f16).cuda()
    v = torch.randn(170, hkv, d, generator=gen).to(f16).cuda()
    bufs = dict(qo_indptr_buf=torch.empty(3, dtype=torch.int32, device="cuda"),
                kv_indptr_buf=torch.empty(3, dtype=torch.int32, device="cuda"))
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True, **bufs)
    wrapper.plan(_indptr([100, 20]), _indptr([150, 20]), hq, hkv, d, causal=True, q_data_type=f16)
    out = torch.empty(120, hq, d, dtype=f16, device="cuda")
    wrapper.run(q, k, v, out=out)  # loads the module outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            wrapper.run(q, k, v, out=out)
    wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), hq, hkv, d, causal=True, q_data_type=f16)
    q.copy_(torch.randn(q.shape, generator=gen).to(f16))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    rows = sum(qo_lens)
    ref_o, _ = reference.batch_ragged_attention(q[:rows], k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
    assert_close_out(out[:rows], ref_o, f16)


def test_static_schedule_on_per_thread_stream() -> None:
    """On the per-thread default stream (one handle, many streams) the kernel takes its static
    work order instead of a scheduler slot; results are the same."""
    gen = torch.Generator().manual_seed(13)
    qo_lens, kv_lens, hq, hkv, d = [300, 17, 90], [300, 40, 700], 8, 2, 64
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(f16).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(f16).cuda()
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(f16).cuda()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.ExternalStream(2)):  # 2 == cudaStreamPerThread
        _, out, lse = _ragged_run(q, k, v, qo_lens, kv_lens, causal=True)
        torch.cuda.current_stream().synchronize()
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True)
    assert_close_out(out, ref_o, f16)
    assert_close_lse(lse, ref_lse)


if __name__ == "__main__":
    # A few small launches for compute-sanitizer (memcheck / racecheck):
    #   compute-sanitizer --tool racecheck python3 tests/test_prefill_cuda.py
    import sys

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    g = torch.Generator().manual_seed(0)
    for dtype, kvd, d, pos, causal, layout, page in ((bf16, bf16, 128, "NONE", True, "NHD", 16),
                                                      (bf16, e4m3, 128, "ROPE_LLAMA", True, "HND", 5),
                                                      (f16, f16, 72, "ALIBI", False, "NHD", 3)):
        qo_lens, kv_lens, hq, hkv = [70, 1, 0], [90, 5, 3], 8, 2
        batch = random_paged_batch(kv_lens, hkv, d, page, kvd, layout, "5d", "cuda", generator=g)
        q = torch.randn(sum(qo_lens), hq, d, generator=g).to(dtype).cuda()
        w = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), layout)
        w.plan(_indptr(qo_lens), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page,
               causal=causal, pos_encoding_mode=pos, window_left=40, q_data_type=dtype, kv_data_type=kvd)
        out, lse = w.run(q, batch.cache, return_lse=True)
        torch.cuda.synchronize()
        print(dtype, kvd, d, pos, "ok", bool(torch.isfinite(out).all()))


# Tiles that were refused for shared memory before the layout learnt narrower KV blocks
# (kCtaKV 16): head_dim 256 with bf16 hi + lo pairs, and head_dim 224 with fp8 staging.
def test_hd256_bf16_rope_window_f32_output() -> None:
    gen = torch.Generator().manual_seed(13)
    qo_lens, kv_lens, hq, hkv, d = [77, 1, 130], [300, 17, 130], 8, 2, 256
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(bf16).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(bf16).cuda()
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(bf16).cuda()
    _, out, lse = _ragged_run(q, k, v, qo_lens, kv_lens, causal=True, pos_encoding_mode="ROPE_LLAMA", window_left=45,
                              o_data_type=f32)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), causal=True,
                                                      pos_encoding_mode="ROPE_LLAMA", window_left=45)
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)


GPU_SPECS.append(_spec(256, 256, 8, 2, bf16, bf16, MaskMode.CAUSAL, "ROPE_LLAMA", 45, KVStorage.RAGGED, o_dtype=f32))


def test_hd224_fp8_rope_softcap_hnd_f32_output() -> None:
    gen = torch.Generator().manual_seed(14)
    qo_lens, kv_lens, page, hq, hkv, d = [50, 3, 100], [211, 3, 100], 16, 8, 2, 224
    batch = random_paged_batch(kv_lens, hkv, d, page, e4m3, "HND", "5d", "cuda", generator=gen)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(bf16).cuda()
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"), "HND")
    wrapper.plan(_indptr(qo_lens), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page,
                 causal=True, pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=30.0, q_data_type=bf16,
                 kv_data_type=e4m3, o_data_type=f32)
    out = torch.full((sum(qo_lens), hq, d), float("nan"), dtype=f32, device="cuda")
    lse = torch.full((sum(qo_lens), hq), float("nan"), device="cuda")
    wrapper.run(q, batch.cache, out=out, lse=lse, k_scale=0.8, v_scale=1.2)
    ref_o, ref_lse = reference.batch_prefill_paged(q, batch.cache, _indptr(qo_lens), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len, kv_layout="HND", causal=True,
                                                   pos_encoding_mode="ROPE_LLAMA", logits_soft_cap=30.0,
                                                   k_scale=0.8, v_scale=1.2)
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)


GPU_SPECS.append(_spec(224, 224, 8, 2, bf16, e4m3, MaskMode.CAUSAL, "ROPE_LLAMA", -1, KVStorage.PAGED, "HND",
                       soft_cap=True, o_dtype=f32))


def test_hd200_bf16_rope_custom_mask_narrow_kv_blocks() -> None:
    """A custom mask over blocks of 16 keys (hd 200, padded to 208 in shared memory), empty rows included."""
    gen = torch.Generator().manual_seed(15)
    qo_lens, kv_lens, hq, hkv, d = [37, 64], [101, 64], 4, 2, 200
    masks = [torch.rand(qn, kn, generator=gen) > 0.6 for qn, kn in zip(qo_lens, kv_lens)]
    masks[0][7] = False
    flat = torch.cat([m.reshape(-1) for m in masks])
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(bf16).cuda()
    k = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(bf16).cuda()
    v = torch.randn(sum(kv_lens), hkv, d, generator=gen).to(bf16).cuda()
    _, out, lse = _ragged_run(q, k, v, qo_lens, kv_lens, custom_mask=flat.cuda(), pos_encoding_mode="ROPE_LLAMA")
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(qo_lens), _indptr(kv_lens), custom_mask=flat,
                                                      pos_encoding_mode="ROPE_LLAMA")
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)
    assert torch.isinf(lse[7]).all() and (out[7] == 0).all()


GPU_SPECS.append(_spec(200, 200, 4, 2, bf16, bf16, MaskMode.CUSTOM, "ROPE_LLAMA", -1, KVStorage.RAGGED))


def test_a_captured_graph_takes_one_work_slot_per_stream_and_gives_it_back_when_destroyed() -> None:
    """The persistent prefill grids take items from a counter slot (``work_queue.cuh``, 256 per module): a stream
    keeps one for good; the launches captured from one stream into one graph share one, which the graph gives back
    when it is destroyed. One slot per captured launch, kept for good, ran out after a few 32-layer graphs of a
    serving engine, and every launch captured after that walked the static order (the shared cascade level
    took 152 us per layer instead of 84 on the H200)."""
    import ctypes

    from jitattn import jit

    spec = _spec(128, 128, 32, 8, torch.bfloat16, torch.bfloat16, MaskMode.NONE, "none", -1, KVStorage.PAGED)
    work_slot = ctypes.CDLL(str(jit.load(spec).path)).jitattn_work_slot
    work_slot.argtypes, work_slot.restype = [ctypes.c_void_p], ctypes.c_int
    eager = work_slot(torch.cuda.current_stream().cuda_stream)
    assert eager >= 0 and work_slot(torch.cuda.current_stream().cuda_stream) == eager, "a stream keeps its slot"
    x = torch.zeros(1, device="cuda")
    seen = set()
    for _ in range(300):  # more graphs than a module has slots
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            stream = torch.cuda.current_stream().cuda_stream
            first, again = work_slot(stream), work_slot(stream)
            x.add_(1)
        assert first >= 0 and first == again and first != eager, (first, again, eager)
        seen.add(first)
        del graph
        torch.cuda.synchronize()
    assert len(seen) < 256, "destroyed graphs give their slots back"
    live, slots = [], []
    for _ in range(2):  # two live graphs captured from one stream: a slot each (each may replay on any stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            slots.append(work_slot(torch.cuda.current_stream().cuda_stream))
            x.add_(1)
        live.append(graph)
    assert min(slots) >= 0 and slots[0] != slots[1] and eager not in slots, (slots, eager)

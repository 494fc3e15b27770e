"""BatchDecodeWithPagedKVCacheWrapper and single_decode_with_kv_cache against the float reference."""

from __future__ import annotations

import math
import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_lse, assert_close_out, devices, random_paged_batch, stable_seed

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

# Pairwise-style coverage: every head_dim, group size, dtype, layout, page size, feature appears.
# (head_dim, qo_heads, kv_heads, q dtype, kv dtype, layout, page, pos, window, softcap, sm_scale, kv format)
CASES = {
    "d64_mha_bf16_nhd_p16": (64, 4, 4, bf16, bf16, "NHD", 16, "NONE", -1, None, None, "5d"),
    "d72_g4_f16_hnd_p1_rope": (72, 8, 2, f16, f16, "HND", 1, "ROPE_LLAMA", -1, None, None, "5d"),
    "d80_g5_bf16_e4m3_p64_alibi": (80, 10, 2, bf16, e4m3, "NHD", 64, "ALIBI", -1, None, None, "tuple4"),
    "d96_g7_f16_e5m2_hnd_window_softcap": (96, 14, 2, f16, e5m2, "HND", 16, "NONE", 20, 30.0, None, "tuple4"),
    "d112_mqa_bf16_p1_tokens": (112, 6, 1, bf16, bf16, "NHD", 1, "NONE", -1, None, 0.05, "tuple3"),
    "d128_g4_bf16_rope_window_softcap_scale": (128, 16, 4, bf16, bf16, "NHD", 16, "ROPE_LLAMA", 33, 50.0, 0.1, "5d"),
    "d192_g2_f16_hnd_p64": (192, 4, 2, f16, f16, "HND", 64, "ALIBI", 7, None, None, "5d"),
    "d256_g2_bf16_softcap": (256, 4, 2, bf16, bf16, "NHD", 16, "NONE", -1, 50.0, None, "5d"),
    "d128_g4_f32": (128, 8, 2, f32, f32, "HND", 16, "ROPE_LLAMA", -1, None, None, "5d"),
    "d64_g4_f16_e4m3_hnd_rope": (64, 8, 2, f16, e4m3, "HND", 16, "ROPE_LLAMA", -1, None, None, "5d"),
    # Tiny head dims (the test models transformers builds): 8, 16, 24.
    "d8_g4_bf16_p16_rope": (8, 8, 2, bf16, bf16, "NHD", 16, "ROPE_LLAMA", -1, None, None, "5d"),
    "d16_mha_f16_hnd_p1_softcap": (16, 4, 4, f16, f16, "HND", 1, "NONE", 5, 20.0, None, "5d"),
    "d16_g8_bf16_e4m3_alibi": (16, 16, 2, bf16, e4m3, "NHD", 16, "ALIBI", -1, None, None, "tuple4"),
    "d24_g2_f16_p64_rope": (24, 4, 2, f16, f16, "NHD", 64, "ROPE_LLAMA", -1, None, 0.2, "5d"),
    "d16_g2_f32": (16, 4, 2, f32, f32, "NHD", 16, "NONE", -1, None, None, "5d"),
}
KV_LENS = [1, 17, 0, 100, 64, 3]


def _spec(case, target: Target):
    d, hq, hkv, qd, kvd, layout, page, pos, window, cap, scale, fmt = case
    return attention_spec(
        Op.DECODE, target, q_dtype=qd, kv_dtype=kvd, o_dtype=qd, head_dim_qk=d, head_dim_vo=d, num_qo_heads=hq,
        num_kv_heads=hkv, pos_encoding=PosEncoding.parse(pos.lower().replace("rope_llama", "rope"), "pos"),
        use_sliding_window=window >= 0, use_logits_soft_cap=cap is not None, mask_mode=MaskMode.NONE,
        kv_layout=KVLayout.parse(layout, "layout"), kv_storage=KVStorage.PAGED,
    )


GPU_SPECS = [_spec(c, Target.CUDA) for c in CASES.values() if c[3] != f32]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(CASES))
def test_batch_decode_matches_reference(case_id: str, device: str) -> None:
    d, hq, hkv, qd, kvd, layout, page, pos, window, cap, scale, fmt = CASES[case_id]
    if device == "cuda" and qd == f32:
        pytest.skip("f32 queries run on the cpu target only")
    gen = torch.Generator().manual_seed(stable_seed(case_id))
    batch = random_paged_batch(KV_LENS, hkv, d, page, kvd, layout, fmt, device, generator=gen)
    q = torch.randn(len(KV_LENS), hq, d, generator=gen).to(qd).to(device)
    k_scale, v_scale = (0.7, 1.3) if kvd in (e4m3, e5m2) else (None, None)
    workspace = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout=layout)
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page,
                 pos_encoding_mode=pos, window_left=window, logits_soft_cap=cap, q_data_type=qd,
                 kv_data_type=kvd, sm_scale=scale, rope_theta=5e3 if pos == "ROPE_LLAMA" else None)
    out = torch.full((len(KV_LENS), hq, d), float("nan"), dtype=qd, device=device)
    lse = torch.full((len(KV_LENS), hq), float("nan"), dtype=torch.float32, device=device)
    wrapper.run(q, batch.cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse)
    ref_o, ref_lse = reference.batch_decode_paged(
        q, batch.cache, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, kv_layout=layout,
        pos_encoding_mode=pos, window_left=window, logits_soft_cap=cap, sm_scale=scale,
        rope_theta=5e3 if pos == "ROPE_LLAMA" else None, k_scale=k_scale, v_scale=v_scale,
    )
    assert_close_out(out, ref_o, qd)
    assert_close_lse(lse, ref_lse)
    assert torch.all(out[2] == 0) and torch.all(torch.isneginf(lse[2])), "empty request must give 0 and -inf"


@pytest.mark.parametrize("device", devices())
def test_decode_return_lse_and_aliases(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    batch = random_paged_batch([5, 30], 2, 64, 16, bf16, device=device, generator=gen)
    q = torch.randn(2, 8, 64, generator=gen).to(bf16).to(device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.begin_forward(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16,
                          data_type=torch.bfloat16)
    out, lse = wrapper.forward_return_lse(q, batch.cache)
    plain = wrapper.forward(q, batch.cache)
    wrapper.end_forward()
    ref_o, ref_lse = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices,
                                                  batch.kv_last_page_len)
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)
    assert torch.equal(out, plain)


@pytest.mark.parametrize("device", devices())
def test_decode_q_from_fused_qkv_is_used_without_copy(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    batch = random_paged_batch([9, 40, 1], 2, 128, 16, bf16, device=device, generator=gen)
    qkv = torch.randn(3, 8 + 2 * 2, 128, generator=gen).to(bf16).to(device)
    q = qkv[:, :8]  # strided: row stride is 12 heads
    assert not q.is_contiguous()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 128, 16, q_data_type=bf16)
    launched = []
    prepared = wrapper._plan.launch
    real_launch = prepared.launch

    def spy(device_index, q_pointer, *args):  # what the kernel is handed
        launched.append(q_pointer)
        return real_launch(device_index, q_pointer, *args)

    prepared.launch = spy
    out = wrapper.run(q, batch.cache)
    assert launched == [q.data_ptr()], "q must reach the kernel as the caller's tensor, uncopied"
    assert (prepared.params.q_stride_n, prepared.params.q_stride_h) == q.stride()[:2], "with q's own strides"
    ref_o, _ = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    assert_close_out(out, ref_o, bf16)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_decode_matches_reference(device: str, layout: str) -> None:
    gen = torch.Generator().manual_seed(3)
    kv_len, hq, hkv, d = 77, 8, 2, 64
    q = torch.randn(hq, d, generator=gen).to(f16).to(device)
    k = torch.randn(kv_len, hkv, d, generator=gen).to(f16).to(device)
    v = torch.randn(kv_len, hkv, d, generator=gen).to(f16).to(device)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    out, lse = jitattn.single_decode_with_kv_cache(q, kk, vv, kv_layout=layout, logits_soft_cap=20.0,
                                                   return_lse=True)
    ref_o, ref_lse = reference.single_attention(q.unsqueeze(0), k, v, logits_soft_cap=20.0)
    assert_close_out(out, ref_o[0], f16)
    assert_close_lse(lse, ref_lse[0])


@pytest.mark.parametrize("device", devices())
def test_single_decode_q_scale_multiplies_sm_scale(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(*shape, generator=gen).to(f16).to(device) for shape in ((8, 64), (40, 2, 64), (40, 2, 64)))
    ref_o, _ = reference.single_attention(q.unsqueeze(0), k, v, sm_scale=64 ** -0.5 * 0.5)
    for q_scale in (0.5, torch.tensor(0.5)):
        assert_close_out(jitattn.single_decode_with_kv_cache(q, k, v, q_scale=q_scale), ref_o[0], f16)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fixed_split_size", [1, 3, 8])
def test_any_split_gives_the_same_answer_as_no_split(device: str, fixed_split_size: int) -> None:
    gen = torch.Generator().manual_seed(fixed_split_size)
    lens = [1, 100, 0, 700, 33]
    batch = random_paged_batch(lens, 2, 128, 16, bf16, device=device, generator=gen)
    q = torch.randn(len(lens), 8, 128, generator=gen).to(bf16).to(device)
    workspace = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    results = []
    for options in ({"disable_split_kv": True}, {"fixed_split_size": fixed_split_size}):
        wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace)
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 128, 16, q_data_type=bf16,
                     logits_soft_cap=30.0, **options)
        out = torch.full((len(lens), 8, 128), float("nan"), dtype=bf16, device=device)
        lse = torch.full((len(lens), 8), float("nan"), device=device)
        wrapper.run(q, batch.cache, out=out, lse=lse)
        results.append((out, lse))
    assert wrapper._plan.split.num_chunks > len(lens), "the fixed split size must actually split"
    ref_o, ref_lse = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices,
                                                  batch.kv_last_page_len, logits_soft_cap=30.0)
    for out, lse in results:
        assert_close_out(out, ref_o, bf16)
        assert_close_lse(lse, ref_lse)
    torch.testing.assert_close(results[0][0].float(), results[1][0].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("window_left", [100, 250])
@pytest.mark.parametrize("fast", [False, True], ids=["plan", "fast_decode_plan"])
def test_a_windowed_split_puts_every_chunk_on_window_tokens(device: str, window_left: int, fast: bool) -> None:
    """Under a sliding window the split plan cuts the tokens each request reads (ceil(min(kv_len, window_left + 1) /
    chunk) chunks) and the kernels count them from the window's first token (mid-page): exact, and each chunk's
    partial state (the float workspace's documented layout: o[chunks, H, D], then lse[chunks, H]) is the
    logsumexp over its own window tokens, the last chunk running to the end."""
    hq, hkv, d, page, pages = 8, 2, 64, 16, 3
    chunk = pages * page
    gen = torch.Generator().manual_seed(window_left)
    lens = [1, 100, 0, 700, 33, 1500, 250, 251]
    batch = random_paged_batch(lens, hkv, d, page, bf16, device=device, generator=gen)
    q = torch.randn(len(lens), hq, d, generator=gen).to(bf16).to(device)
    buf = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(buf)
    args = (hq, hkv, d, page)
    kw = dict(q_data_type=bf16, window_left=window_left, fixed_split_size=pages)
    if fast:
        jitattn.fast_decode_plan(wrapper, batch.kv_indptr.to(device), batch.kv_indices.to(device),
                                 batch.kv_last_page_len.to(device), *args, global_override_indptr_cpu=batch.kv_indptr,
                                 **kw)
    else:
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, *args, **kw)
    out = torch.full((len(lens), hq, d), float("nan"), dtype=bf16, device=device)
    lse = torch.full((len(lens), hq), float("nan"), device=device)
    wrapper.run(q, batch.cache, out=out, lse=lse)
    ref_o, ref_lse = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices,
                                                  batch.kv_last_page_len, window_left=window_left)
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)
    counts = [max(1, -(-min(n, window_left + 1) // chunk)) for n in lens]
    assert sum(c > 1 for c in counts) >= 3, "the window must leave requests of several chunks"
    total = sum(counts)
    ws_lse = buf[: total * hq * (d + 1) * 4].view(torch.float32).cpu()[total * hq * d:].view(total, hq)
    keys = batch.cache.cpu()[:, 0].double()  # [pages, page, H_kv, D] (NHD)
    qd, first = q.cpu().double(), 0
    for r, (n, c) in enumerate(zip(lens, counts)):
        if c > 1:
            ids = batch.kv_indices[batch.kv_indptr[r]:batch.kv_indptr[r + 1]].long().cpu()
            k = keys[ids].reshape(-1, hkv, d)[:n].repeat_interleave(hq // hkv, dim=1)  # [n, H, D]
            base = max(0, n - 1 - window_left)
            for i in range(c):
                lo, hi = base + i * chunk, n if i == c - 1 else base + (i + 1) * chunk
                want = torch.logsumexp(torch.einsum("hd,jhd->hj", qd[r], k[lo:hi]) / math.sqrt(d), dim=1)
                torch.testing.assert_close(ws_lse[first + i], want.float(), atol=2e-2, rtol=2e-2,
                                           msg=f"request {r} chunk {i}")
        first += c


def test_workspace_too_small_for_the_split_is_refused_at_plan() -> None:
    batch = random_paged_batch([700], 2, 128, 16, bf16)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1000, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"needs \d+ bytes of float workspace but the buffer has 1000"):
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 128, 16, q_data_type=bf16,
                     fixed_split_size=1)


def test_graph_mode_needs_fixed_buffers_and_uses_them() -> None:
    with pytest.raises(ValueError, match="paged_kv_indptr_buffer, paged_kv_indices_buffer"):
        jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), use_cuda_graph=True)
    with pytest.raises(ValueError, match="qo_indptr_buf, paged_kv_indptr_buf"):
        jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), use_cuda_graph=True)
    gen = torch.Generator().manual_seed(12)
    buffers = [torch.full((n,), -1, dtype=torch.int32) for n in (5, 64, 4)]
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8), use_cuda_graph=True, paged_kv_indptr_buffer=buffers[0],
        paged_kv_indices_buffer=buffers[1], paged_kv_last_page_len_buffer=buffers[2])
    assert wrapper.is_cuda_graph_enabled
    for lens in ([3, 40, 1, 17], [90, 2, 2, 30]):
        batch = random_paged_batch(lens, 2, 64, 16, f16, generator=gen)
        q = torch.randn(4, 8, 64, generator=gen).to(f16)
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16, q_data_type=f16)
        assert torch.equal(buffers[0], batch.kv_indptr), "the plan must live in the caller's buffers"
        expected, _ = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
        assert_close_out(wrapper.run(q, batch.cache), expected, f16)
    with pytest.raises(ValueError, match="keeps its batch size"):
        batch = random_paged_batch([3, 4], 2, 64, 16, f16, generator=gen)
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16, q_data_type=f16)
    small = jitattn.BatchDecodeWithPagedKVCacheWrapper(  # a batch beyond the caller's buffer names that buffer
        torch.empty(1 << 20, dtype=torch.uint8), use_cuda_graph=True, paged_kv_indptr_buffer=buffers[0][:3],
        paged_kv_indices_buffer=buffers[1], paged_kv_last_page_len_buffer=buffers[2])
    with pytest.raises(ValueError, match=r"kv_indptr buffer \(3 x torch.int32 on cpu\) cannot hold 5 x"):
        batch = random_paged_batch([3, 40, 1, 17], 2, 64, 16, f16, generator=gen)
        small.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16, q_data_type=f16)


def test_plan_owns_its_index_arrays_on_the_cpu_target() -> None:
    gen = torch.Generator().manual_seed(13)
    batch = random_paged_batch([30, 7], 2, 64, 16, f16, generator=gen)
    q = torch.randn(2, 8, 64, generator=gen).to(f16)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    indptr, indices, last = batch.kv_indptr.clone(), batch.kv_indices.clone(), batch.kv_last_page_len.clone()
    wrapper.plan(indptr, indices, last, 8, 2, 64, 16, q_data_type=f16)
    indices.fill_(0)  # the caller refills its buffers for the next batch before this one runs
    last.fill_(1)
    expected, _ = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices,
                                               batch.kv_last_page_len)
    assert_close_out(wrapper.run(q, batch.cache), expected, f16)

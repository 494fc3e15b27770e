"""Paged/ragged/single prefill wrappers against the float reference."""

from __future__ import annotations

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import (
    ROPE_FIRST_LSE_ATOL, assert_close_lse, assert_close_out, devices, random_paged_batch, stable_seed,
)

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2

# (head_dim_qk, head_dim_vo, qo_heads, kv_heads, q dtype, kv dtype, layout, page, mask, pos, window, softcap, sm_scale)
CASES = {
    "d64_g4_bf16_causal_p16": (64, 64, 8, 2, bf16, bf16, "NHD", 16, "causal", "NONE", -1, None, None),
    "d72_mha_f16_hnd_p1_none": (72, 72, 4, 4, f16, f16, "HND", 1, "none", "NONE", -1, None, None),
    "d80_g5_bf16_rope_causal_p64": (80, 80, 10, 2, bf16, bf16, "NHD", 64, "causal", "ROPE_LLAMA", -1, None, None),
    "d96_g7_f16_alibi_window": (96, 96, 7, 1, f16, f16, "NHD", 16, "causal", "ALIBI", 9, None, None),
    "d112_mqa_bf16_custom_mask": (112, 112, 3, 1, bf16, bf16, "HND", 16, "custom", "NONE", -1, None, None),
    "d128_g4_bf16_softcap_scale": (128, 128, 8, 2, bf16, bf16, "NHD", 16, "causal", "NONE", -1, 30.0, 0.07),
    "d192x128_g2_bf16_causal": (192, 128, 4, 2, bf16, bf16, "NHD", 16, "causal", "NONE", -1, None, None),
    "d256_g2_f16_packed_mask": (256, 256, 4, 2, f16, f16, "NHD", 16, "packed", "NONE", -1, None, None),
    "d128_g4_bf16_e4m3_causal": (128, 128, 8, 2, bf16, e4m3, "HND", 16, "causal", "ROPE_LLAMA", 12, None, None),
    "d64_g4_f16_e5m2_none": (64, 64, 8, 2, f16, e5m2, "NHD", 64, "none", "NONE", -1, 40.0, None),
    "d64_g2_f32_causal": (64, 64, 4, 2, f32, f32, "NHD", 16, "causal", "ALIBI", -1, None, None),
    # Tiny head dims (the test models transformers builds): 8, 16, 24.
    "d8_g4_bf16_rope_causal": (8, 8, 8, 2, bf16, bf16, "NHD", 16, "causal", "ROPE_LLAMA", -1, None, None),
    "d16_mha_f16_hnd_p1_custom": (16, 16, 4, 4, f16, f16, "HND", 1, "custom", "NONE", -1, 30.0, None),
    "d16_g2_bf16_e4m3_window": (16, 16, 4, 2, bf16, e4m3, "NHD", 16, "causal", "ALIBI", 6, None, None),
    "d24_g4_f16_packed_mask": (24, 24, 8, 2, f16, f16, "HND", 64, "packed", "ROPE_LLAMA", -1, None, 0.3),
    "d16_g2_f32_none": (16, 16, 4, 2, f32, f32, "NHD", 16, "none", "NONE", -1, None, None),
}
QO_LENS = [3, 1, 0, 17, 5]
KV_LENS = [10, 1, 0, 40, 5]


def _mask_mode(mask: str) -> MaskMode:
    return {"causal": MaskMode.CAUSAL, "none": MaskMode.NONE}.get(mask, MaskMode.CUSTOM)


def _spec(case, target: Target, storage: KVStorage):
    dqk, dvo, hq, hkv, qd, kvd, layout, page, mask, pos, window, cap, scale = case
    return attention_spec(
        Op.PREFILL, target, q_dtype=qd, kv_dtype=kvd, o_dtype=qd, head_dim_qk=dqk, head_dim_vo=dvo, num_qo_heads=hq,
        num_kv_heads=hkv, pos_encoding=PosEncoding.parse(pos.lower().replace("rope_llama", "rope"), "pos"),
        use_sliding_window=window >= 0, use_logits_soft_cap=cap is not None, mask_mode=_mask_mode(mask),
        kv_layout=KVLayout.parse(layout if storage is KVStorage.PAGED else "NHD", "layout"), kv_storage=storage,
    )


GPU_SPECS = [_spec(c, Target.CUDA, s) for c in CASES.values() if c[4] != f32
             for s in (KVStorage.PAGED, KVStorage.RAGGED)]


def _mask_args(mask: str, gen: torch.Generator, device: str):
    """(custom_mask, packed_custom_mask, bool flat mask for the reference)."""
    if mask not in ("custom", "packed"):
        return None, None, None
    flat = torch.rand(sum(q * k for q, k in zip(QO_LENS, KV_LENS)), generator=gen) > 0.4
    if mask == "custom":
        return flat.to(device), None, flat
    packed = torch.cat([reference.pack_custom_mask(seg) for seg in torch.split(flat, [q * k for q, k in zip(QO_LENS, KV_LENS)])
                        if seg.numel()])
    return None, packed.to(device), flat


def _qo_indptr() -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(QO_LENS).cumsum(0).tolist(), dtype=torch.int32)


def _common(case):
    dqk, dvo, hq, hkv, qd, kvd, layout, page, mask, pos, window, cap, scale = case
    plan_kw = dict(causal=mask == "causal", pos_encoding_mode=pos, window_left=window, logits_soft_cap=cap,
                   sm_scale=scale, q_data_type=qd, kv_data_type=kvd)
    ref_kw = dict(causal=mask == "causal", pos_encoding_mode=pos, window_left=window, logits_soft_cap=cap,
                  sm_scale=scale)
    return plan_kw, ref_kw


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(CASES))
def test_paged_prefill_matches_reference(case_id: str, device: str) -> None:
    dqk, dvo, hq, hkv, qd, kvd, layout, page, mask, pos, window, cap, scale = case = CASES[case_id]
    if device == "cuda" and qd == f32:
        pytest.skip("f32 queries run on the cpu target only")
    gen = torch.Generator().manual_seed(stable_seed(case_id))
    fmt = "5d" if dqk == dvo else "tuple4"
    batch = random_paged_batch(KV_LENS, hkv, dqk, page, kvd, layout, fmt, device, generator=gen, head_dim_vo=dvo)
    q = torch.randn(sum(QO_LENS), hq, dqk, generator=gen).to(qd).to(device)
    custom, packed, flat = _mask_args(mask, gen, device)
    k_scale, v_scale = (1.4, 0.6) if kvd in (e4m3, e5m2) else (None, None)
    plan_kw, ref_kw = _common(case)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device), layout)
    wrapper.plan(_qo_indptr(), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, dqk, page,
                 head_dim_vo=dvo, custom_mask=custom, packed_custom_mask=packed, **plan_kw)
    out = torch.full((sum(QO_LENS), hq, dvo), float("nan"), dtype=qd, device=device)
    lse = torch.full((sum(QO_LENS), hq), float("nan"), device=device)
    wrapper.run(q, batch.cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
    ref_o, ref_lse = reference.batch_prefill_paged(
        q, batch.cache, _qo_indptr(), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, kv_layout=layout,
        custom_mask=flat, k_scale=k_scale, v_scale=v_scale, **ref_kw,
    )
    assert_close_out(out, ref_o, qd)
    assert_close_lse(lse, ref_lse, atol=ROPE_FIRST_LSE_ATOL if device == "cuda" and pos == "ROPE_LLAMA" else 2e-3)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(CASES))
def test_ragged_prefill_matches_reference(case_id: str, device: str) -> None:
    dqk, dvo, hq, hkv, qd, kvd, layout, page, mask, pos, window, cap, scale = case = CASES[case_id]
    if device == "cuda" and qd == f32:
        pytest.skip("f32 queries run on the cpu target only")
    gen = torch.Generator().manual_seed(stable_seed(case_id) + 1)
    total_kv = sum(KV_LENS)
    # k/v as views into a fused kv tensor: strided tokens, no copies
    kv = torch.randn(total_kv, 2 * hkv, max(dqk, dvo), generator=gen).to(kvd).to(device)
    k, v = kv[:, :hkv, :dqk], kv[:, hkv:, :dvo]
    q = torch.randn(sum(QO_LENS), hq, dqk, generator=gen).to(qd).to(device)
    kv_indptr = torch.tensor([0] + torch.tensor(KV_LENS).cumsum(0).tolist(), dtype=torch.int32)
    custom, packed, flat = _mask_args(mask, gen, device)
    k_scale, v_scale = (1.4, 0.6) if kvd in (e4m3, e5m2) else (None, None)
    plan_kw, ref_kw = _common(case)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(_qo_indptr(), kv_indptr, hq, hkv, dqk, head_dim_vo=dvo, custom_mask=custom,
                 packed_custom_mask=packed, **plan_kw)
    out, lse = wrapper.run(q, k, v, return_lse=True, k_scale=k_scale, v_scale=v_scale)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _qo_indptr(), kv_indptr, custom_mask=flat,
                                                      k_scale=k_scale, v_scale=v_scale, **ref_kw)
    assert_close_out(out, ref_o, qd)
    assert_close_lse(lse, ref_lse, atol=ROPE_FIRST_LSE_ATOL if device == "cuda" and pos == "ROPE_LLAMA" else 2e-3)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, True])
def test_single_prefill_matches_reference(device: str, causal: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(9, 8, 128, generator=gen).to(bf16).to(device)
    k = torch.randn(30, 2, 128, generator=gen).to(bf16).to(device)
    v = torch.randn(30, 2, 128, generator=gen).to(bf16).to(device)
    out, lse = jitattn.single_prefill_with_kv_cache(q, k, v, causal=causal, window_left=11, return_lse=True)
    ref_o, ref_lse = reference.single_attention(q, k, v, causal=causal, window_left=11)
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("device", devices())
def test_single_prefill_calls_of_equal_shapes_each_attend_over_their_own_data(device: str) -> None:
    """Calls of equal shapes and options share a plan: each still reads its own q / k / v (fresh data, a KV of
    another length, other options, a 2-D mask between them), against the reference every time."""
    gen = torch.Generator().manual_seed(8)

    def call(kv_len: int, **kw):
        q = torch.randn(9, 8, 128, generator=gen).to(bf16).to(device)
        k, v = (torch.randn(kv_len, 2, 128, generator=gen).to(bf16).to(device) for _ in range(2))
        out = jitattn.single_prefill_with_kv_cache(q, k, v, **kw)
        mask = kw.pop("custom_mask", None)
        assert_close_out(out, reference.single_attention(q, k, v, custom_mask=None if mask is None else mask.cpu(),
                                                         **kw)[0], bf16)

    for kv_len, kw in [(30, dict(causal=True)), (30, dict(causal=True)), (47, dict(causal=True)),
                       (30, dict(causal=False, window_left=11)), (30, dict(custom_mask=torch.rand(9, 30) > 0.5)),
                       (30, dict(causal=True)), (47, dict(causal=True))]:
        if "custom_mask" in kw:
            kw["custom_mask"] = kw["custom_mask"].to(device)
        call(kv_len, **kw)


@pytest.mark.parametrize("option", ["sm_scale", "logits_soft_cap"])
def test_single_prefill_reads_a_tensor_option_on_every_call(option: str) -> None:
    """A 0-d tensor option filled anew between calls is read anew (a shared plan keyed by the tensor object would
    keep its first value: it hashes by identity)."""
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(5, 4, 64, generator=gen).half()
    k, v = (torch.randn(9, 2, 64, generator=gen).half() for _ in range(2))
    value = torch.tensor(0.1)
    jitattn.single_prefill_with_kv_cache(q, k, v, **{option: value})
    value.fill_(0.5)
    out = jitattn.single_prefill_with_kv_cache(q, k, v, **{option: value})
    assert_close_out(out, reference.single_attention(q, k, v, **{option: 0.5})[0], torch.float16)


@pytest.mark.parametrize("device", devices())
def test_single_prefill_from_two_threads_each_gets_its_own_result(device: str) -> None:
    """Threads calling with equal shapes at once: each result is its own inputs' (the shared plans are per thread)."""
    import threading

    gen = torch.Generator().manual_seed(9)
    inputs = [tuple(torch.randn(n, h, 64, generator=gen).to(bf16).to(device) for n, h in ((5, 4), (20, 2), (20, 2)))
              for _ in range(2)]
    expected = [reference.single_attention(*qkv, causal=True)[0] for qkv in inputs]
    failures = []

    def worker(i: int) -> None:
        for _ in range(20):
            out = jitattn.single_prefill_with_kv_cache(*inputs[i], causal=True)
            if not torch.allclose(out.float().cpu(), expected[i].float().cpu(), atol=3e-2, rtol=3e-2):
                failures.append(i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures


@pytest.mark.parametrize("device", devices())
def test_single_prefill_custom_mask_2d(device: str) -> None:
    gen = torch.Generator().manual_seed(6)
    q = torch.randn(5, 4, 64, generator=gen).to(f16).to(device)
    k = torch.randn(12, 4, 64, generator=gen).to(f16).to(device)
    v = torch.randn(12, 4, 64, generator=gen).to(f16).to(device)
    mask = torch.rand(5, 12, generator=gen) > 0.5
    out = jitattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.to(device), causal=True)
    ref_o, _ = reference.single_attention(q, k, v, custom_mask=mask)
    assert_close_out(out, ref_o, f16)


@pytest.mark.parametrize("device", devices())
def test_with_both_masks_given_the_packed_one_is_used(device: str) -> None:
    """FlashInfer's precedence (its single and batch prefill pack custom_mask only when packed_custom_mask is
    None): with both, the packed mask is the one applied."""
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(5, 4, 64, generator=gen).to(f16).to(device)
    k, v = (torch.randn(12, 4, 64, generator=gen).to(f16).to(device) for _ in range(2))
    mask = torch.rand(5, 12, generator=gen) > 0.5
    packed = reference.pack_custom_mask(mask.reshape(-1)).to(device)
    out = jitattn.single_prefill_with_kv_cache(q, k, v, custom_mask=(~mask).to(device), packed_custom_mask=packed)
    assert_close_out(out, reference.single_attention(q, k, v, custom_mask=mask)[0], f16)


@pytest.mark.parametrize("device", devices())
def test_a_planned_mask_has_room_for_the_kernels_aligned_word_reads(device: str) -> None:
    """The sm90 kernel reads a mask row in aligned 4-byte words; the last may reach 3 bytes past the mask (37 x 9
    bits: 42 bytes). The plan's copy on cuda is 4 zero bytes longer, so that word stays in its allocation
    (memcheck); the cpu kernel reads bytes."""
    gen = torch.Generator().manual_seed(9)
    mask = torch.rand(37 * 9, generator=gen) > 0.5
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    indptr = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
    wrapper.plan(indptr(37), indptr(9), 4, 4, 64, custom_mask=mask.to(device), q_data_type=f16)
    on_device = wrapper._plan.custom_mask
    room = on_device.untyped_storage().nbytes() - on_device.storage_offset()
    assert on_device.numel() == 42 and room == (46 if device == "cuda" else 42)
    assert torch.equal(on_device.cpu(), reference.pack_custom_mask(mask))


def test_single_prefill_names_k_and_v_that_disagree() -> None:
    """Its errors speak of k and v, not of the plan and pages it builds underneath."""
    q, k = torch.randn(5, 4, 64), torch.randn(9, 4, 64)
    with pytest.raises(ValueError, match="single_prefill_with_kv_cache: k has shape \\(9, 4, 64\\) but v \\(8, "):
        jitattn.single_prefill_with_kv_cache(q, k, k[:8])
    with pytest.raises(TypeError, match="single_prefill_with_kv_cache: k is torch.float32 but v is torch.float16"):
        jitattn.single_prefill_with_kv_cache(q, k, k.half())
    with pytest.raises(ValueError, match="single_decode_with_kv_cache: k has shape"):
        jitattn.single_decode_with_kv_cache(q[0], k, k[:, :2])


GPU_SPECS += [
    attention_spec(Op.PREFILL, Target.CUDA, q_dtype=bf16, kv_dtype=bf16, o_dtype=bf16, head_dim_qk=128,
                   head_dim_vo=128, num_qo_heads=8, num_kv_heads=2, pos_encoding=PosEncoding.NONE,
                   use_sliding_window=True, use_logits_soft_cap=False, mask_mode=m, kv_layout=KVLayout.NHD,
                   kv_storage=KVStorage.PAGED)
    for m in (MaskMode.NONE, MaskMode.CAUSAL)
] + [
    attention_spec(Op.PREFILL, Target.CUDA, q_dtype=f16, kv_dtype=f16, o_dtype=f16, head_dim_qk=64,
                   head_dim_vo=64, num_qo_heads=4, num_kv_heads=4, pos_encoding=PosEncoding.NONE,
                   use_sliding_window=False, use_logits_soft_cap=False, mask_mode=MaskMode.CUSTOM,
                   kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED)
]


@pytest.mark.gpu
def test_single_prefill_under_graph_capture_says_how_to_capture_a_prefill() -> None:
    """It plans on every call, which a replay would not repeat: refused with what to do instead."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    q = torch.randn(16, 4, 64, generator=gen, device="cuda", dtype=torch.float16)
    k, v = (torch.randn(16, 2, 64, generator=gen, device="cuda", dtype=torch.float16) for _ in range(2))
    eager = jitattn.single_prefill_with_kv_cache(q, k, v, causal=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="planned before it"):
        with torch.cuda.graph(graph):
            jitattn.single_prefill_with_kv_cache(q, k, v, causal=True)
    assert torch.equal(jitattn.single_prefill_with_kv_cache(q, k, v, causal=True), eager)  # eager calls still run

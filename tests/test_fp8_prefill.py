"""fp8 prefill: ``single_prefill_with_kv_cache`` with q, k and v in e4m3 / e5m2 and FlashInfer's ``scale_q`` /
``scale_k`` / ``scale_v`` (per tensor or per head) against the float reference of the dequantized values, its
output dtypes (16-bit, float32, fp8 saturating), its LSE in both conventions, and bad input refused
(``jitattn/runtime/fp8_prefill.py``)."""

from __future__ import annotations

import math

import pytest
import torch

import jitattn
import jitattn.flashinfer
from jitattn import reference

from attention_cases import assert_close_lse, devices, tolerance

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
QO_LEN, KV_LEN, DIM = 19, 45, 64

# (fp8 dtype, layout, query heads, kv heads, scales: "float" | "host" | "head", o_dtype, causal, window, soft cap)
CASES = {
    "e4m3_nhd_float_f32_causal": (e4m3, "NHD", 4, 4, "float", f32, True, -1, None),
    "e5m2_hnd_host_f16": (e5m2, "HND", 4, 2, "host", f16, False, -1, None),
    "e4m3_nhd_head_bf16_gqa_window": (e4m3, "NHD", 8, 2, "head", bf16, True, 9, None),
    "e4m3_hnd_head_f32_cap": (e4m3, "HND", 4, 1, "head", f32, False, -1, 20.0),
    "e5m2_nhd_float_fp8out": (e5m2, "NHD", 4, 2, "float", None, True, -1, None),
    "e4m3_nhd_head_fp8out": (e4m3, "NHD", 4, 4, "head", None, False, -1, None),
}


def _operands(case_id: str, device: str):
    dtype, layout, hq, hkv, kind, *_ = CASES[case_id]
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    q = torch.randn(QO_LEN, hq, DIM, generator=gen)
    k = torch.randn(KV_LEN, hkv, DIM, generator=gen)
    v = torch.randn(KV_LEN, hkv, DIM, generator=gen)
    if kind == "head":
        scales = [torch.rand(h, generator=gen) + 0.5 for h in (hq, hkv, hkv)]
    else:
        scales = [0.5 + torch.rand((), generator=gen).item() for _ in range(3)]
    fp8 = [x.to(dtype) for x in (q, k, v)]
    # the float reference of the dequantized values, NHD
    shaped = [s.view(1, -1, 1) if kind == "head" else s for s in scales]
    dequant = [x.double() * s for x, s in zip(fp8, shaped)]
    if layout == "HND":
        fp8[1], fp8[2] = fp8[1].transpose(0, 1).contiguous(), fp8[2].transpose(0, 1).contiguous()
    if kind == "host":
        given = [torch.tensor([s]) for s in scales]
    else:
        given = [s.to(device) for s in scales] if kind == "head" else scales
    return [x.to(device) for x in fp8], given, dequant


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(CASES))
def test_fp8_prefill_matches_reference(case_id: str, device: str) -> None:
    dtype, layout, _hq, _hkv, kind, o_dtype, causal, window, cap = CASES[case_id]
    (q, k, v), (sq, sk, sv), (dq, dk, dv) = _operands(case_id, device)
    out, lse = jitattn.single_prefill_with_kv_cache(
        q, k, v, scale_q=sq, scale_k=sk, scale_v=sv, o_dtype=o_dtype, kv_layout=layout, causal=causal,
        window_left=window, logits_soft_cap=cap, return_lse=True)
    ref_o, ref_lse = reference.single_attention(dq, dk, dv, causal=causal, window_left=window, logits_soft_cap=cap)
    assert out.dtype == (o_dtype or dtype) and out.shape == ref_o.shape and out.device.type == device
    actual = out.float().cpu()
    assert not torch.isnan(actual).any()
    # operands in bf16 when per-head scales are multiplied in (2^-9), and P in 16 bits on the GPU
    tol = tolerance(bf16 if kind == "head" or o_dtype in (None, f32) else o_dtype)
    if o_dtype is None:  # rounded to fp8: half a step of its 3 (e4m3) or 2 (e5m2) mantissa bits
        rtol = 2.0 ** -(4 if dtype == e4m3 else 3)
        torch.testing.assert_close(actual, ref_o.float(), atol=tol, rtol=rtol + tol)
    else:
        torch.testing.assert_close(actual, ref_o.float(), atol=tol, rtol=tol)
    assert_close_lse(lse, ref_lse, atol=2e-2 if kind == "head" else 2e-3)


@pytest.mark.parametrize("device", devices())
def test_fp8_prefill_flashinfer_lse_is_base2_and_out_fp8_by_default(device: str) -> None:
    (q, k, v), (sq, sk, sv), _ = _operands("e4m3_nhd_head_fp8out", device)
    native_out, native_lse = jitattn.single_prefill_with_kv_cache(q, k, v, sq, sk, sv, return_lse=True)
    out, lse = jitattn.flashinfer.prefill.single_prefill_with_kv_cache(q, k, v, sq, sk, sv, return_lse=True)
    assert out.dtype == e4m3 and torch.equal(out.view(torch.uint8), native_out.view(torch.uint8))
    torch.testing.assert_close(lse, native_lse / math.log(2.0))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("dtype", [e4m3, e5m2])
def test_fp8_output_saturates(dtype: torch.dtype, device: str) -> None:
    """An output beyond the fp8 dtype's range is its largest finite value (FA3's satfinite), never NaN / inf."""
    q = torch.randn(3, 2, DIM).to(dtype).to(device)
    k = torch.randn(8, 2, DIM).to(dtype).to(device)
    v = torch.full((8, 2, DIM), 2.0).to(dtype).to(device)
    v[:, 1] = -2.0
    big = torch.finfo(dtype).max
    out = jitattn.single_prefill_with_kv_cache(q, k, v, scale_v=big)  # every output 2 * big, or -2 * big
    assert out.dtype == dtype
    assert torch.equal(out.float().cpu()[:, 0], torch.full((3, DIM), big))
    assert torch.equal(out.float().cpu()[:, 1], torch.full((3, DIM), -big))


def test_device_scales_gather_the_tensor_scales_for_the_kernel() -> None:
    """The fp8 kernel's scales: floats (and one-element host tensors) stay scalars; tensors (one per head, or one
    value) go into one float32 array of q's heads, then k's, then v's (the kernel's head_scales), 1 elsewhere."""
    from jitattn.runtime.fp8_prefill import device_scales

    cpu = torch.device("cpu")
    assert device_scales(0.5, None, torch.tensor([2.0]), 4, 2, cpu) == ((0.5, None, torch.tensor([2.0])), None)
    scalars, heads = device_scales(torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.5, None, 4, 2, cpu)
    assert scalars == (1.0, 0.5, None)
    assert torch.equal(heads, torch.tensor([1.0, 2.0, 3.0, 4.0, 1.0, 1.0, 1.0, 1.0]))
    _, heads = device_scales(None, torch.tensor([5.0, 6.0], dtype=torch.float16), None, 4, 2, cpu)
    assert heads.dtype == torch.float32 and torch.equal(heads[4:6], torch.tensor([5.0, 6.0]))
    with pytest.raises(ValueError, match=r"one scale per head \(\[2\]\)"):
        device_scales(None, None, torch.ones(3), 4, 2, cpu)


def test_fp8_prefill_refuses_bad_input() -> None:
    q, k, v = (torch.randn(5, 4, DIM).to(e4m3) for _ in range(3))
    with pytest.raises(TypeError, match="k and v of its fp8 dtype"):
        jitattn.single_prefill_with_kv_cache(q, k.to(f16), v)
    with pytest.raises(TypeError, match="k and v of its fp8 dtype"):
        jitattn.single_prefill_with_kv_cache(q, k.float().to(e5m2), v)
    with pytest.raises(ValueError, match=r"one scale per head \(\[4\]\)"):
        jitattn.single_prefill_with_kv_cache(q, k, v, scale_q=torch.ones(3))
    with pytest.raises(ValueError, match="one scale per head"):
        jitattn.single_prefill_with_kv_cache(q, k, v, scale_k=torch.ones(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="positive finite"):
        jitattn.single_prefill_with_kv_cache(q, k, v, scale_v=-1.0)
    with pytest.raises(TypeError, match="o_dtype"):
        jitattn.single_prefill_with_kv_cache(q, k, v, o_dtype=torch.int32)
    with pytest.raises(ValueError, match="3 dimensions"):
        jitattn.single_prefill_with_kv_cache(q[0], k, v)
    with pytest.raises(TypeError, match="torch.Tensor"):
        jitattn.single_prefill_with_kv_cache(q, None, v)


# The sm90 fp8 kernel (q, k, v fp8 with per-tensor scales on an H100 / H200): P enters the P V GEMM as fp8 (3
# mantissa bits for e4m3, 2 for e5m2), so an output is within a few hundredths of the reference, and on average
# within a few thousandths (a wrong key order or scale would be off by O(1)); scores and LSE are fp32.
# (fp8 dtype, layout, qo_len, kv_len, query heads, kv heads, causal, window, soft cap, ALiBi, sinks, o_dtype,
#  scales: "float" | "head" (FlashInfer's per-head float32 tensors) | "one" (one-element tensors), on the device)
KERNEL_CASES = {
    "e4m3_causal_g4_tail": (e4m3, "NHD", 200, 333, 8, 2, True, -1, None, False, False, bf16, "float"),
    "e4m3_noncausal_g1_f16": (e4m3, "NHD", 130, 1000, 4, 4, False, -1, None, False, False, f16, "float"),
    "e5m2_causal_hnd_f32": (e5m2, "HND", 300, 300, 4, 1, True, -1, None, False, False, f32, "float"),
    "e4m3_window_cap_fp8out": (e4m3, "NHD", 256, 700, 8, 1, True, 100, 30.0, False, False, None, "float"),
    "e4m3_alibi_sinks": (e4m3, "NHD", 64, 512, 8, 8, True, -1, None, True, True, bf16, "float"),
    "e4m3_head_scales_g4": (e4m3, "NHD", 200, 333, 8, 2, True, -1, None, False, False, bf16, "head"),
    "e4m3_head_scales_cap_hnd": (e4m3, "HND", 100, 260, 4, 2, False, -1, 20.0, False, False, bf16, "head"),
    "e4m3_head_scales_alibi_g1": (e4m3, "NHD", 100, 260, 4, 4, True, -1, None, True, False, bf16, "head"),
    "e5m2_one_element_scales": (e5m2, "NHD", 129, 129, 8, 2, False, -1, None, False, False, f16, "one"),
}


def _kernel_spec(case_id: str):
    from jitattn.runtime.specs import attention_spec
    from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

    dtype, layout, _qo, _kv, hq, hkv, causal, window, cap, alibi, sinks, o_dtype, _kind = KERNEL_CASES[case_id]
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=dtype, kv_dtype=dtype, o_dtype=o_dtype or bf16, head_dim_qk=128,
        head_dim_vo=128, num_qo_heads=hq, num_kv_heads=hkv,
        pos_encoding=PosEncoding.ALIBI if alibi else PosEncoding.NONE,
        use_sliding_window=window >= 0, use_logits_soft_cap=bool(cap),
        mask_mode=MaskMode.CAUSAL if causal else MaskMode.NONE, kv_layout=KVLayout(layout.lower()),
        kv_storage=KVStorage.RAGGED).replace(use_sinks=sinks)


def _paged_spec(layout: str):
    """The kernel of test_fp8_paged_batch_on_the_fp8_kernel."""
    from jitattn.spec import KVStorage

    return _kernel_spec("e4m3_causal_g4_tail").replace(kv_storage=KVStorage.PAGED,
                                                       kv_layout=jitattn.spec.KVLayout(layout.lower()))


GPU_SPECS = [_kernel_spec(c) for c in KERNEL_CASES] + [_paged_spec("NHD"), _paged_spec("HND")]


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", list(KERNEL_CASES))
def test_fp8_kernel_matches_reference(case_id: str) -> None:
    from jitattn.ops.prefill_fp8 import fp8_kernel_runs

    dtype, layout, qo, kv, hq, hkv, causal, window, cap, alibi, sinks, o_dtype, kind = KERNEL_CASES[case_id]
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    q, k, v = (torch.randn(n, h, 128, generator=gen) for n, h in ((qo, hq), (kv, hkv), (kv, hkv)))
    if kind == "head":
        scales = [torch.rand(h, generator=gen) + 0.5 for h in (hq, hkv, hkv)]
    else:
        scales = [torch.tensor([s]) for s in (0.7, 1.3, 0.9)]
    fp8 = [x.to(dtype) for x in (q, k, v)]
    dequant = [x.double() * s.double().view(1, -1, 1) for x, s in zip(fp8, scales)]
    sq, sk, sv = (float(s) for s in scales) if kind == "float" else (s.cuda() for s in scales)
    if layout == "HND":
        fp8[1], fp8[2] = fp8[1].transpose(0, 1).contiguous(), fp8[2].transpose(0, 1).contiguous()
    qd, kd, vd = (x.cuda() for x in fp8)
    mode = "ALIBI" if alibi else "NONE"
    assert fp8_kernel_runs(qd, kd, vd, jitattn.spec.KVLayout(layout.lower()), None, None, causal, mode, window, cap)
    sink_values = torch.randn(hq, generator=gen).cuda() if sinks else None
    out, lse = jitattn.single_prefill_with_kv_cache(
        qd, kd, vd, scale_q=sq, scale_k=sk, scale_v=sv, o_dtype=o_dtype, kv_layout=layout, causal=causal,
        window_left=window, logits_soft_cap=cap, pos_encoding_mode=mode, return_lse=True, sinks=sink_values)
    ref_o, ref_lse = reference.single_attention(*dequant, causal=causal, window_left=window, logits_soft_cap=cap,
                                                pos_encoding_mode=mode)
    if sinks:
        ref_o = reference.apply_sinks(ref_o, ref_lse, sink_values.cpu())
    assert out.dtype == (o_dtype or dtype)
    actual = out.float().cpu()
    assert torch.isfinite(actual).all()
    error = (actual - ref_o.float()).abs()
    scale = ref_o.abs().max().item()
    assert error.max().item() < 0.06 * scale + 0.02, error.max().item()
    assert error.mean().item() < 0.01 * scale, error.mean().item()
    assert_close_lse(lse, ref_lse, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [e4m3, e5m2])
def test_fp8_kernel_routes_each_key_to_its_value(dtype: torch.dtype) -> None:
    """Query i matches only key pi(i) (one-hot q and k, a large sm_scale: P is 1 there, ~0 elsewhere) and key j's
    value is one-hot at column sigma(j), so row i's output is one-hot at sigma(pi(i)): any slip of the fp8 GEMMs'
    operand layouts or of V^T's key order puts it elsewhere, and the message names the rows and columns."""
    n, d = 256, 128  # two KV blocks
    rows = torch.arange(n)
    pi, sigma = (rows * 37 + 11) % n, (rows * 5 + 3) % d
    # keys j and j + 128 share column j % 128, told apart by their sign (q . k: 1 at pi(i), -1 or 0 elsewhere)
    k = torch.zeros(n, 1, d)
    k[rows, 0, rows % d] = torch.where(rows < d, 1.0, -1.0)
    q = torch.zeros(n, 1, d)
    q[rows, 0, pi % d] = torch.where(pi < d, 1.0, -1.0)
    v = torch.zeros(n, 1, d)
    v[rows, 0, sigma] = 1.0
    out = jitattn.single_prefill_with_kv_cache(*(x.to(dtype).cuda() for x in (q, k, v)), sm_scale=40.0,
                                               o_dtype=torch.float32).cpu()
    got, expected = out[:, 0].argmax(-1), sigma[pi]
    wrong = (got != expected).nonzero().flatten().tolist()
    assert not wrong, f"{len(wrong)} rows off: " + ", ".join(
        f"row {i}: key {int(pi[i])} -> column {int(got[i])} (expected {int(expected[i])})" for i in wrong[:8])
    torch.testing.assert_close(out[:, 0].max(-1).values, torch.ones(n), atol=0.02, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False])
def test_fp8_ragged_batch_on_the_fp8_kernel(causal: bool) -> None:
    """BatchPrefillWithRaggedKVCacheWrapper planned with fp8 q / kv and a 16-bit output runs the fp8 kernel over a
    batch of requests (tails mid-block, a request shorter than a block, a long one), each against the reference."""
    qo_lens, kv_lens = [37, 1, 300, 129], [200, 5, 700, 129]
    hq, hkv, d, dtype = 8, 2, 128, e4m3
    gen = torch.Generator().manual_seed(7 + causal)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype)
    k, v = (torch.randn(sum(kv_lens), hkv, d, generator=gen).to(dtype) for _ in range(2))
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], dtype=torch.int32)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(qo_indptr, kv_indptr, hq, hkv, d, causal=causal, q_data_type=dtype, kv_data_type=dtype,
                 o_data_type=bf16)
    assert wrapper.current_plan.q_dtype == dtype  # the fp8 spec, not a conversion
    out = torch.full((sum(qo_lens), hq, d), float("nan"), dtype=bf16, device="cuda")
    lse = torch.full((sum(qo_lens), hq), float("nan"), device="cuda")
    wrapper.run(q.cuda(), k.cuda(), v.cuda(), out=out, lse=lse, q_scale=0.8, k_scale=1.1, v_scale=0.6)
    for r in range(len(qo_lens)):
        qs, ks = slice(qo_indptr[r], qo_indptr[r + 1]), slice(kv_indptr[r], kv_indptr[r + 1])
        ref_o, ref_lse = reference.single_attention(q[qs].double() * 0.8, k[ks].double() * 1.1, v[ks].double() * 0.6,
                                                    causal=causal)
        error = (out[qs].float().cpu() - ref_o.float()).abs()
        scale = ref_o.abs().max().item()
        assert error.max().item() < 0.06 * scale + 0.02 and error.mean().item() < 0.01 * scale, r
        assert_close_lse(lse[qs], ref_lse, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size,layout", [(16, "NHD"), (64, "HND")])
def test_fp8_paged_batch_on_the_fp8_kernel(page_size: int, layout: str) -> None:
    """BatchPrefillWithPagedKVCacheWrapper planned with fp8 q / kv runs the fp8 kernel over pages (random page order,
    a last page part-filled, a request of one token), each request against the reference."""
    from attention_cases import random_paged_batch

    qo_lens, kv_lens = [100, 1, 250], [333, 7, 250]
    hq, hkv, d, dtype = 8, 2, 128, e4m3
    gen = torch.Generator().manual_seed(page_size)
    batch = random_paged_batch(kv_lens, hkv, d, page_size, dtype, layout, "5d", "cuda", generator=gen)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(dtype)
    qo_indptr = torch.tensor([0, *torch.tensor(qo_lens).cumsum(0).tolist()], dtype=torch.int32)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
                                                          layout)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page_size,
                 causal=True, q_data_type=dtype, kv_data_type=dtype, o_data_type=bf16)
    assert wrapper.current_plan.q_dtype == dtype
    out, lse = wrapper.run(q.cuda(), batch.cache, q_scale=0.8, k_scale=1.1, v_scale=0.6, return_lse=True)
    ref_o, ref_lse = reference.batch_prefill_paged(
        q.double() * 0.8, batch.cache, qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        kv_layout=layout, causal=True, k_scale=1.1, v_scale=0.6)
    error = (out.float().cpu() - ref_o.float()).abs()
    scale = ref_o.abs().max().item()
    assert error.max().item() < 0.06 * scale + 0.02 and error.mean().item() < 0.01 * scale
    assert_close_lse(lse, ref_lse, atol=5e-3)


@pytest.mark.gpu
def test_fp8_paged_refuses_pages_tma_cannot_load() -> None:
    """Pages of 1 token (or any size that is not a multiple of 8 dividing 128): a clear error, not a wrong result."""
    q = torch.randn(4, 4, 128).to(e4m3).cuda()
    cache = torch.randn(10, 2, 1, 4, 128).to(e4m3).cuda()
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device="cuda"))
    indptr = torch.tensor([0, 6], dtype=torch.int32)
    wrapper.plan(torch.tensor([0, 4], dtype=torch.int32), indptr, torch.arange(6, dtype=torch.int32),
                 torch.tensor([1], dtype=torch.int32), 4, 4, 128, 1, q_data_type=e4m3, kv_data_type=e4m3,
                 o_data_type=bf16)
    with pytest.raises(RuntimeError, match="loads whole pages by TMA"):
        wrapper.run(q, cache)


def test_an_fp8_plan_off_hopper_says_why() -> None:
    """A batch wrapper planned with fp8 q / kv where no fp8 kernel runs (the cpu target here) is refused at plan(),
    saying where it runs and what to pass instead."""
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    indptr = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="fp8 queries are only for op 'prefill' on target 'cuda'.*use f16 or bf16"):
        wrapper.plan(indptr, indptr, 4, 4, 128, q_data_type=e4m3, kv_data_type=e4m3, o_data_type=bf16)

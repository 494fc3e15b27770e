"""Prefill with ``ROPE_LLAMA`` applied before the kernel (``plan(rope_first=...)``, ``JITATTN_PREFILL_ROPE_FIRST``):
q and k rotated into f16 copies, then the kernel without RoPE. The same attention as the float reference (and as
RoPE inside the kernel) for the ragged and paged wrappers, both dtypes and layouts, masks, windows, soft caps,
queries before position 0 (qo_len > kv_len), an fp8 cache; the plan's kernel is the f16 one without RoPE; the knob;
torch.compile; bad input refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch._dynamo

import jitattn
from jitattn import reference
from jitattn.runtime.rope_first import cos_sin_table
from jitattn.spec import PosEncoding

from attention_cases import assert_close_lse, assert_close_out, devices, random_paged_batch

bf16, f16, e4m3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
QO_LENS = [3, 6, 0, 17, 5]
KV_LENS = [10, 4, 0, 40, 21]  # request 1: six queries over four keys (its first two queries sit before position 0)
HQ, HKV, DIM = 8, 2, 64

# (q dtype, kv dtype, layout, mask, window, soft cap, rope_scale, rope_theta)
RAGGED = {
    "bf16_nhd_causal": (bf16, bf16, "NHD", "causal", -1, None, None, None),
    "f16_hnd_noncausal_cap_scaled": (f16, f16, "HND", "none", -1, 30.0, 2.0, 5e5),
    "bf16_nhd_custom_window": (bf16, bf16, "NHD", "custom", 5, None, None, 1e6),
}
PAGED = {
    "bf16_hnd_causal_page4": (bf16, bf16, "HND", "causal", -1, None, None, None),
    "f16_nhd_custom_scaled_page16": (f16, f16, "NHD", "custom", 7, None, 4.0, None),
    "bf16_e4m3_nhd_noncausal_page1": (bf16, e4m3, "NHD", "none", -1, 20.0, None, None),
}


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)


def _mask(kind: str, gen: torch.Generator, device: str):
    if kind != "custom":
        return {}, None
    flat = torch.rand(sum(q * k for q, k in zip(QO_LENS, KV_LENS)), generator=gen) > 0.3
    return {"custom_mask": flat.to(device)}, flat


def _options(mask: str, window: int, cap, scale, theta) -> dict:
    return dict(causal=mask == "causal", window_left=window, logits_soft_cap=cap, pos_encoding_mode="ROPE_LLAMA",
                rope_scale=scale, rope_theta=theta)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(RAGGED))
def test_ragged_rope_first_matches_reference(case_id: str, device: str) -> None:
    qd, kvd, layout, mask, window, cap, scale, theta = RAGGED[case_id]
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    total_kv = sum(KV_LENS) + 3  # rows past the last request's are never read
    q = torch.randn(sum(QO_LENS), HQ, DIM, generator=gen).to(qd).to(device)
    k = torch.randn(total_kv, HKV, DIM, generator=gen).to(kvd).to(device)
    v = torch.randn(total_kv, HKV, DIM, generator=gen).to(kvd).to(device)
    mask_kw, flat = _mask(mask, gen, device)
    options = _options(mask, window, cap, scale, theta)
    qo, kv = _indptr(QO_LENS), _indptr(KV_LENS)
    expected, expected_lse = reference.batch_ragged_attention(q, k, v, qo, kv, custom_mask=flat, **options)
    k_in, v_in = (k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()) if layout == "HND" else (k, v)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                           layout)
    for first in (True, False):
        wrapper.plan(qo, kv, HQ, HKV, DIM, q_data_type=qd, kv_data_type=kvd, rope_first=first, **mask_kw, **options)
        plan = wrapper.current_plan
        assert (plan.scalars.pos_encoding is PosEncoding.NONE and plan.q_dtype == f16) == first
        out = torch.full((sum(QO_LENS), HQ, DIM), float("nan"), dtype=qd, device=device)
        lse = torch.full((sum(QO_LENS), HQ), float("nan"), device=device)
        wrapper.run(q, k_in, v_in, out=out, lse=lse)
        assert_close_out(out, expected, qd)
        assert_close_lse(lse, expected_lse)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(PAGED))
def test_paged_rope_first_matches_reference(case_id: str, device: str) -> None:
    qd, kvd, layout, mask, window, cap, scale, theta = PAGED[case_id]
    page = int(case_id.rsplit("page", 1)[1])
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    batch = random_paged_batch(KV_LENS, HKV, DIM, page, kvd, layout, "5d", device, generator=gen)
    q = torch.randn(sum(QO_LENS), HQ, DIM, generator=gen).to(qd).to(device)
    mask_kw, flat = _mask(mask, gen, device)
    options = _options(mask, window, cap, scale, theta)
    scales = dict(k_scale=1.3, v_scale=0.7) if kvd == e4m3 else {}
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device),
                                                          layout)
    wrapper.plan(_indptr(QO_LENS), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, DIM, page,
                 q_data_type=qd, kv_data_type=kvd, rope_first=True, **mask_kw, **options)
    plan = wrapper.current_plan
    assert plan.page_size is None and plan.scalars.pos_encoding is PosEncoding.NONE and plan.kv_dtype == f16
    out = torch.full((sum(QO_LENS), HQ, DIM), float("nan"), dtype=qd, device=device)
    lse = torch.full((sum(QO_LENS), HQ), float("nan"), device=device)
    wrapper.run(q, batch.cache, out=out, lse=lse, **scales)
    expected, expected_lse = reference.batch_prefill_paged(
        q, batch.cache, _indptr(QO_LENS), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        kv_layout=layout, custom_mask=flat, **options, **scales)
    assert_close_out(out, expected, qd)
    assert_close_lse(lse, expected_lse)
    # the next run reads the cache it is given, not the first call's copies
    other = random_paged_batch(KV_LENS, HKV, DIM, page, kvd, layout, "5d", device, generator=gen)
    assert not torch.equal(wrapper.run(q, other.cache, **scales), out)


@pytest.mark.parametrize("device", devices())
def test_rope_first_with_sinks_and_a_float32_output(device: str) -> None:
    """The rotated f16 operands feed a plan whose output is float32, with attention sinks: the reference's result."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(sum(QO_LENS), HQ, DIM, generator=gen).to(bf16).to(device)
    k, v = (torch.randn(sum(KV_LENS), HKV, DIM, generator=gen).to(bf16).to(device) for _ in range(2))
    sinks = (torch.randn(HQ, generator=gen) + 2.0).to(device)
    qo, kv = _indptr(QO_LENS), _indptr(KV_LENS)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(qo, kv, HQ, HKV, DIM, q_data_type=bf16, o_data_type=torch.float32, causal=True,
                 pos_encoding_mode="ROPE_LLAMA", rope_first=True)
    assert wrapper.current_plan.o_dtype == torch.float32 and wrapper.current_plan.q_dtype == f16
    out, lse = wrapper.run(q, k, v, sinks=sinks, return_lse=True)
    assert out.dtype == torch.float32
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, qo, kv, causal=True, pos_encoding_mode="ROPE_LLAMA")
    assert_close_out(out, reference.apply_sinks(ref_o, ref_lse, sinks.cpu()), bf16)
    assert_close_lse(lse, ref_lse)


def test_cos_sin_table_angles() -> None:
    table = cos_sin_table(9, 3, 8, 2.0, 100.0, torch.device("cpu"))
    assert table.shape == (9, 8) and table.dtype == torch.float32
    pos = torch.arange(9, dtype=torch.float64) - 3
    freq = 100.0 ** (-torch.arange(4, dtype=torch.float64) / 4) / 2.0
    torch.testing.assert_close(table.double(), torch.cat([torch.cos(pos[:, None] * freq), torch.sin(pos[:, None] * freq)], 1),
                               atol=1e-7, rtol=0)


def _plan_ragged(wrapper, **kw) -> None:
    wrapper.plan(_indptr(QO_LENS), _indptr(KV_LENS), HQ, HKV, DIM, q_data_type=bf16, causal=True,
                 pos_encoding_mode="ROPE_LLAMA", **kw)


def test_rope_first_knob_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    rope_in_kernel = lambda: wrapper.current_plan.scalars.pos_encoding is PosEncoding.ROPE_LLAMA  # noqa: E731
    monkeypatch.delenv("JITATTN_PREFILL_ROPE_FIRST", raising=False)
    _plan_ragged(wrapper)
    assert rope_in_kernel()  # the default is auto: where the kernel without RoPE is the Hopper tier's, not the cpu target
    monkeypatch.setenv("JITATTN_PREFILL_ROPE_FIRST", "on")
    _plan_ragged(wrapper)
    assert not rope_in_kernel()
    _plan_ragged(wrapper, rope_first=False)  # the argument wins over the knob
    assert rope_in_kernel()
    wrapper.plan(_indptr(QO_LENS), _indptr(KV_LENS), HQ, HKV, DIM, q_data_type=bf16, causal=True)  # no RoPE
    assert wrapper.current_plan.q_dtype == bf16
    monkeypatch.setenv("JITATTN_PREFILL_ROPE_FIRST", "sometimes")
    with pytest.raises(ValueError, match="JITATTN_PREFILL_ROPE_FIRST='sometimes'.*off, on, auto"):
        _plan_ragged(wrapper)


def test_rope_first_refuses_bad_input() -> None:
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(TypeError, match="rope_first='yes' must be True, False or None"):
        _plan_ragged(wrapper, rope_first="yes")
    _plan_ragged(wrapper, rope_first=True)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(sum(QO_LENS), HQ, DIM, generator=gen).to(bf16)
    k, v = (torch.randn(sum(KV_LENS), HKV, DIM, generator=gen).to(bf16) for _ in range(2))
    with pytest.raises(ValueError):  # a plan() that fails leaves neither a plan nor its rotation
        _plan_ragged(wrapper, rope_first=False, window_left=-7)
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q, k, v)
    _plan_ragged(wrapper, rope_first=True)
    ok = wrapper.run(q, k, v)
    expected, _ = reference.batch_ragged_attention(q, k, v, _indptr(QO_LENS), _indptr(KV_LENS), causal=True,
                                                   pos_encoding_mode="ROPE_LLAMA")
    assert_close_out(ok, expected, bf16)
    graphs = jitattn.BatchPrefillWithRaggedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8), use_cuda_graph=True, qo_indptr_buf=torch.empty(8, dtype=torch.int32),
        kv_indptr_buf=torch.empty(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        _plan_ragged(graphs, rope_first=True)
    _plan_ragged(graphs)  # unset: RoPE stays in the kernel under CUDA graphs
    assert graphs.current_plan.scalars.pos_encoding is PosEncoding.ROPE_LLAMA


def test_rope_first_compiles_fullgraph() -> None:
    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(5)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    _plan_ragged(wrapper, rope_first=True)
    q = torch.randn(sum(QO_LENS), HQ, DIM, generator=gen).to(bf16)
    k, v = (torch.randn(sum(KV_LENS), HKV, DIM, generator=gen).to(bf16) for _ in range(2))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(q, k, v):
        return wrapper.run(q, k, v, return_lse=True)

    out, lse = layer(q, k, v)
    expected, expected_lse = reference.batch_ragged_attention(q, k, v, _indptr(QO_LENS), _indptr(KV_LENS),
                                                              causal=True, pos_encoding_mode="ROPE_LLAMA")
    assert_close_out(out, expected, bf16)
    assert_close_lse(lse, expected_lse)
    torch._dynamo.reset()

"""Paged prefill over fp8 KV through a 16-bit ragged gather (``plan(fp8_upcast=...)``, ``JITATTN_PREFILL_FP8_UPCAST``):
the same attention as the reference (fp8 to f16 / bf16 is exact), from every cache format and layout; the plan's
kernel is the 16-bit ragged one; the knob's values; bad input refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.page_table import check_paged_index
from jitattn.runtime.kv_upcast import token_rows

from attention_cases import assert_close_lse, assert_close_out, devices, random_paged_batch

bf16, f16 = torch.bfloat16, torch.float16
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
QO_LENS = [3, 1, 0, 17, 5]
KV_LENS = [10, 1, 0, 40, 21]

# (q dtype, kv dtype, layout, cache format, page size, mask, window, soft cap, sinks)
CASES = {
    "bf16_e4m3_nhd_5d_causal_window": (bf16, e4m3, "NHD", "5d", 16, "causal", 7, None, False),
    "f16_e5m2_hnd_tuple4_custom_cap": (f16, e5m2, "HND", "tuple4", 4, "custom", -1, 30.0, False),
    "bf16_e4m3_nhd_tokens_sinks": (bf16, e4m3, "NHD", "tuple3", 1, "none", -1, None, True),
    "f16_e4m3_hnd_5d_packed": (f16, e4m3, "HND", "5d", 8, "packed", -1, None, False),
}


def _qo_indptr() -> torch.Tensor:
    return torch.tensor([0] + np.cumsum(QO_LENS).tolist(), dtype=torch.int32)


def _masks(kind: str, gen: torch.Generator, device: str):
    if kind not in ("custom", "packed"):
        return {}, None
    flat = torch.rand(sum(q * k for q, k in zip(QO_LENS, KV_LENS)), generator=gen) > 0.4
    if kind == "custom":
        return {"custom_mask": flat.to(device)}, flat
    segments = torch.split(flat, [q * k for q, k in zip(QO_LENS, KV_LENS)])
    packed = torch.cat([reference.pack_custom_mask(seg) for seg in segments if seg.numel()])
    return {"packed_custom_mask": packed.to(device)}, flat


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(CASES))
def test_fp8_upcast_matches_reference(case_id: str, device: str) -> None:
    qd, kvd, layout, fmt, page, mask, window, cap, sinks = CASES[case_id]
    hq, hkv, dim = 8, 2, 64
    gen = torch.Generator().manual_seed(sum(map(ord, case_id)))
    batch = random_paged_batch(KV_LENS, hkv, dim, page, kvd, layout, fmt, device, generator=gen)
    q = torch.randn(sum(QO_LENS), hq, dim, generator=gen).to(qd).to(device)
    mask_kw, flat = _masks(mask, gen, device)
    sink_values = (torch.randn(hq, generator=gen) + 2.0).to(device) if sinks else None
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace, layout)
    wrapper.plan(_qo_indptr(), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, dim, page,
                 causal=mask == "causal", window_left=window, logits_soft_cap=cap, q_data_type=qd, kv_data_type=kvd,
                 fp8_upcast=True, **mask_kw)
    plan = wrapper.current_plan
    assert plan.page_size is None and plan.kv_dtype == qd  # a plan of 16-bit ragged KV
    out = torch.full((sum(QO_LENS), hq, dim), float("nan"), dtype=qd, device=device)
    lse = torch.full((sum(QO_LENS), hq), float("nan"), device=device)
    wrapper.run(q, batch.cache, out=out, lse=lse, k_scale=1.3, v_scale=0.7, sinks=sink_values)
    ref_o, ref_lse = reference.batch_prefill_paged(
        q, batch.cache, _qo_indptr(), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, kv_layout=layout,
        custom_mask=flat, causal=mask == "causal", window_left=window, logits_soft_cap=cap, k_scale=1.3,
        v_scale=0.7)
    if sinks:
        ref_o = reference.apply_sinks(ref_o, ref_lse, sink_values.cpu())
    assert_close_out(out, ref_o, qd)
    assert_close_lse(lse, ref_lse)
    # a second run (the checked fast path) over other cache contents reads them, not the first call's
    other = random_paged_batch(KV_LENS, hkv, dim, page, kvd, layout, fmt, device, generator=gen)
    again = wrapper.run(q, other.cache, k_scale=1.3, v_scale=0.7, sinks=sink_values)
    assert not torch.equal(again, out)


def test_token_rows_walk_the_page_table() -> None:
    index = check_paged_index(torch.tensor([0, 2, 2, 5], dtype=torch.int32),
                              torch.tensor([7, 3, 9, 0, 4], dtype=torch.int32),
                              torch.tensor([1, 0, 3], dtype=torch.int32), 4)
    pages, slots = token_rows(index)
    expected = [(7, s) for s in range(4)] + [(3, 0)] + [(9, s) for s in range(4)] + [(0, s) for s in range(4)] + \
        [(4, s) for s in range(3)]
    assert list(zip(pages.tolist(), slots.tolist())) == expected


def _plan(wrapper, kvd, **kw) -> None:
    batch = random_paged_batch(KV_LENS, 2, 64, 16, kvd, generator=torch.Generator().manual_seed(1))
    wrapper.plan(_qo_indptr(), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16,
                 q_data_type=bf16, kv_data_type=kvd, **kw)
    return batch


def _storage(wrapper) -> str:
    return "paged" if wrapper.current_plan.page_size is not None else "ragged"


def test_fp8_upcast_knob_and_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    monkeypatch.delenv("JITATTN_PREFILL_FP8_UPCAST", raising=False)
    _plan(wrapper, e4m3)
    assert _storage(wrapper) == "paged"  # the default is auto: the Hopper tier only, not the cpu target
    monkeypatch.setenv("JITATTN_PREFILL_FP8_UPCAST", "on")
    _plan(wrapper, e4m3)
    assert _storage(wrapper) == "ragged"
    _plan(wrapper, e4m3, fp8_upcast=False)  # the argument wins over the knob
    assert _storage(wrapper) == "paged"
    _plan(wrapper, bf16)  # 16-bit KV: nothing to convert
    assert _storage(wrapper) == "paged"
    monkeypatch.setenv("JITATTN_PREFILL_FP8_UPCAST", "auto")  # the Hopper tier only: not the cpu target
    _plan(wrapper, e4m3)
    assert _storage(wrapper) == "paged"
    monkeypatch.setenv("JITATTN_PREFILL_FP8_UPCAST", "sometimes")
    with pytest.raises(ValueError, match="JITATTN_PREFILL_FP8_UPCAST='sometimes'.*off, on, auto"):
        _plan(wrapper, e4m3)


def test_fp8_upcast_refuses_bad_input() -> None:
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(TypeError, match="fp8_upcast='yes' must be True, False or None"):
        _plan(wrapper, e4m3, fp8_upcast="yes")
    batch = _plan(wrapper, e4m3, fp8_upcast=True)
    q = torch.randn(sum(QO_LENS), 8, 64).to(bf16)
    wrong = batch.cache.to(bf16)
    with pytest.raises(TypeError, match="kv cache dtype is torch.bfloat16.*kv_data_type"):
        wrapper.run(q, wrong)
    short = batch.cache[: int(batch.kv_indices.max())]  # the pool without the highest page the table names
    with pytest.raises(ValueError, match="page"):
        wrapper.run(q, short)
    with pytest.raises(ValueError):  # a plan() that fails leaves neither a plan nor its gather
        _plan(wrapper, e4m3, fp8_upcast=False, window_left=-7)
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q, batch.cache)
    batch = _plan(wrapper, e4m3, fp8_upcast=True)
    ok = wrapper.run(q, batch.cache)
    assert not torch.isnan(ok.float()).any()
    graphs = jitattn.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8), use_cuda_graph=True, qo_indptr_buf=torch.empty(8, dtype=torch.int32),
        paged_kv_indptr_buf=torch.empty(8, dtype=torch.int32), paged_kv_indices_buf=torch.empty(64, dtype=torch.int32),
        paged_kv_last_page_len_buf=torch.empty(8, dtype=torch.int32))
    with pytest.raises(ValueError, match="use_cuda_graph=True"):
        _plan(graphs, e4m3, fp8_upcast=True)

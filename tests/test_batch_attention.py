"""BatchAttention: one plan/run over a mixed batch (decode, chunked prefill, prefill, empty KV) against the
float reference; its conventions (kv_len_arr, the returned lse, the soft cap) and refusals."""

from __future__ import annotations

import math

import pytest
import torch

import jitattn
import jitattn.flashinfer as fi
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_lse, assert_close_out, devices, random_paged_batch

bf16, f16 = torch.bfloat16, torch.float16
LOG2E = 1.0 / math.log(2.0)

# (qo_len, kv_len) per request: decode rows, a speculative step, a chunk of a long prefill, a whole prompt,
# a request without KV.
MIXED = [(1, 40), (1, 7), (3, 25), (17, 60), (1, 1), (9, 9), (2, 0)]

# id: (qo_heads, kv_heads, head_dim, dtype, page_size, layout, causal, soft cap, v_scale)
CASES = {
    "g4_bf16_p16_nhd_causal": (8, 2, 64, bf16, 16, "NHD", True, None, None),
    "mha_f16_p1_hnd": (4, 4, 64, f16, 1, "HND", False, None, None),
    "g2_f16_p8_hnd_causal_softcap_vscale": (4, 2, 128, f16, 8, "HND", True, 20.0, 2.0),
    "g7_bf16_p16_nhd": (7, 1, 64, bf16, 16, "NHD", False, None, 0.5),
}
GPU_SPECS = [
    attention_spec(Op.PREFILL, Target.CUDA, q_dtype=c[3], kv_dtype=c[3], o_dtype=c[3], head_dim_qk=c[2],
                   head_dim_vo=c[2], num_qo_heads=c[0], num_kv_heads=c[1], pos_encoding=PosEncoding.NONE,
                   use_sliding_window=False, use_logits_soft_cap=c[7] is not None,
                   mask_mode=MaskMode.CAUSAL if c[6] else MaskMode.NONE, kv_layout=KVLayout.parse(c[5], "layout"),
                   kv_storage=KVStorage.PAGED)
    for c in CASES.values()
]


def _batch(case, device: str, gen: torch.Generator):
    hq, hkv, d, dtype, page, layout, *_ = case
    batch = random_paged_batch([k for _, k in MIXED], hkv, d, page, dtype, layout=layout, device=device,
                               generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor([q for q, _ in MIXED]).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, generator=gen).to(dtype).to(device)
    kv_len_arr = torch.tensor([k for _, k in MIXED], dtype=torch.int32)
    return batch, qo_indptr, kv_len_arr, q


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(CASES))
def test_mixed_batch_matches_reference(case_id: str, device: str) -> None:
    case = CASES[case_id]
    hq, hkv, d, dtype, page, layout, causal, cap, v_scale = case
    gen = torch.Generator().manual_seed(list(CASES).index(case_id))
    batch, qo_indptr, kv_len_arr, q = _batch(case, device, gen)
    wrapper = jitattn.BatchAttention(kv_layout=layout, device=device)
    wrapper.plan(qo_indptr.to(device), batch.kv_indptr.to(device), batch.kv_indices.to(device), kv_len_arr.to(device),
                 hq, hkv, d, d, page, causal=causal, logits_soft_cap=cap, q_data_type=dtype, kv_data_type=dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=device)
    result = wrapper.run(q, batch.cache, out, lse, v_scale=v_scale, logits_soft_cap=cap or 0.0)
    assert result[0] is out and result[1] is lse
    cache = tuple(t.cpu() for t in batch.cache) if isinstance(batch.cache, tuple) else batch.cache.cpu()
    expected_o, expected_lse = reference.batch_prefill_paged(
        q.cpu(), cache, qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, kv_layout=layout,
        causal=causal, logits_soft_cap=cap, v_scale=v_scale)
    assert_close_out(out, expected_o, dtype)
    assert_close_lse(lse, expected_lse)
    assert torch.isneginf(lse[-2:]).all(), "the request without KV sees no key"
    fresh_out, fresh_lse = wrapper.run(q, batch.cache, v_scale=v_scale)  # outputs allocated; the planned cap
    assert torch.equal(fresh_out, out) and torch.equal(fresh_lse, lse)


# Batches whose decode rows (one query over some KV, run by the decode wrapper) are contiguous -- the parts write
# views of out / lse -- or are all of the batch.
SPLITS = {
    "prefill_then_decode": [(33, 33), (1, 20), (1, 9), (1, 48)],
    "decode_then_prefill": [(1, 17), (1, 64), (4, 30), (2, 0)],
    "all_decode": [(1, 5), (1, 70), (1, 16)],
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("split", list(SPLITS))
def test_decode_rows_on_the_decode_kernels_write_their_rows(split: str, device: str) -> None:
    hq, hkv, d, dtype, page, layout = 8, 2, 64, bf16, 16, "NHD"
    lens = SPLITS[split]
    gen = torch.Generator().manual_seed(41 + list(SPLITS).index(split))
    batch = random_paged_batch([k for _, k in lens], hkv, d, page, dtype, layout=layout, device=device, generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor([q for q, _ in lens]).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchAttention(kv_layout=layout, device=device)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, torch.tensor([k for _, k in lens], dtype=torch.int32),
                 hq, hkv, d, d, page, causal=True, q_data_type=dtype, kv_data_type=dtype)
    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"), device=device)
    result = wrapper.run(q, batch.cache, out, lse)
    assert result[0] is out and result[1] is lse
    expected_o, expected_lse = reference.batch_prefill_paged(
        q.cpu(), batch.cache.cpu(), qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        kv_layout=layout, causal=True)
    assert_close_out(out, expected_o, dtype)
    assert_close_lse(lse, expected_lse)
    with pytest.raises(ValueError, match="q has shape"):
        wrapper.run(q[1:], batch.cache)
    with pytest.raises(ValueError, match="out has shape"):
        wrapper.run(q, batch.cache, out[1:])


@pytest.mark.parametrize("device", devices())
def test_many_long_decode_rows_get_a_workspace_their_split_fits(device: str, monkeypatch) -> None:
    """The decode part's workspace is sized for its whole KV (not its longest request's): 20 decodes of 1024
    tokens over one KV head, cut into several chunks each (16 workers on the cpu target; the SMs on cuda)."""
    if device == "cpu":
        monkeypatch.setattr(torch, "get_num_threads", lambda: 16)  # as many workers as the split that failed
    hq, hkv, d, dtype, page = 1, 1, 64, bf16, 1
    lens = [(1, 1024)] * 20 + [(5, 50)]
    gen = torch.Generator().manual_seed(43)
    batch = random_paged_batch([k for _, k in lens], hkv, d, page, dtype, layout="NHD", device=device, generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor([q for q, _ in lens]).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(int(qo_indptr[-1]), hq, d, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchAttention(kv_layout="NHD", device=device)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, torch.tensor([k for _, k in lens], dtype=torch.int32),
                 hq, hkv, d, d, page, causal=True, q_data_type=dtype, kv_data_type=dtype)
    out, lse = wrapper.run(q, batch.cache)
    expected_o, expected_lse = reference.batch_prefill_paged(
        q.cpu(), batch.cache.cpu(), qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        causal=True)
    assert_close_out(out, expected_o, dtype)
    assert_close_lse(lse, expected_lse)


@pytest.mark.parametrize("device", devices())
def test_strided_query_and_flashinfer_namespace_base2_lse(device: str) -> None:
    """A query sliced from a wider tensor (FlashInfer's chunked-q test) is read in place; ``jitattn.flashinfer``'s
    BatchAttention returns the same output with the LSE in base 2."""
    case = CASES["g4_bf16_p16_nhd_causal"]
    hq, hkv, d, dtype, page, layout, causal, _, _ = case
    gen = torch.Generator().manual_seed(31)
    batch, qo_indptr, kv_len_arr, q = _batch(case, device, gen)
    wide = torch.randn(q.shape[0], hq, 2 * d, generator=gen).to(dtype).to(device)
    q = torch.chunk(wide, 2, dim=-1)[0]
    results = []
    for module in (jitattn, fi):
        wrapper = module.BatchAttention(kv_layout=layout, device=device)
        wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, kv_len_arr, hq, hkv, d, d, page, causal=causal)
        results.append(wrapper.run(q, batch.cache))
    expected_o, expected_lse = reference.batch_prefill_paged(
        q.cpu(), batch.cache.cpu(), qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
        causal=causal)
    (out, lse), (fi_out, fi_lse) = results
    assert_close_out(out, expected_o, dtype)
    assert_close_lse(lse, expected_lse)
    assert torch.equal(fi_out, out)
    assert_close_lse(fi_lse, lse * LOG2E, atol=1e-5)
    assert jitattn.attention.BatchAttention is jitattn.BatchAttention and fi.attention.BatchAttention is fi.BatchAttention



@pytest.mark.parametrize("lens", [
    [(1, 40), (5, 20), (1, 7), (3, 3)],  # decode and prefill rows interleaved: the parts gather and scatter
    [(1, 40), (1, 7), (5, 20), (3, 3)],  # each part's rows one run: slices of out
    [(1, 40), (1, 7)],  # decode only
    [(5, 20), (3, 3)],  # prefill only
], ids=["interleaved", "contiguous_parts", "decode_only", "prefill_only"])
def test_out_and_lse_strided_in_their_last_dimension_are_filled_whatever_the_batch(lens) -> None:
    """out / lse views with a stride in their last dimension: filled (through the parts' own buffers) for every
    arrangement of the batch, not accepted for some and refused for others."""
    hq, hkv, d, page = 4, 2, 64, 16
    gen = torch.Generator().manual_seed(7)
    batch = random_paged_batch([k for _, k in lens], hkv, d, page, bf16, layout="NHD", generator=gen)
    qo_indptr = torch.tensor([0] + torch.tensor([q for q, _ in lens]).cumsum(0).tolist(), dtype=torch.int32)
    rows = int(qo_indptr[-1])
    q = torch.randn(rows, hq, d, generator=gen).to(bf16)
    wrapper = jitattn.BatchAttention(kv_layout="NHD", device="cpu")
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, torch.tensor([k for _, k in lens], dtype=torch.int32),
                 hq, hkv, d, d, page, causal=True)
    out = torch.full((rows, hq, 2 * d), float("nan"), dtype=bf16)[..., ::2]
    lse = torch.full((rows, 2 * hq), float("nan"))[:, ::2]
    got_out, got_lse = wrapper.run(q, batch.cache, out=out, lse=lse)
    assert got_out.data_ptr() == out.data_ptr() and got_lse.data_ptr() == lse.data_ptr()
    expected_o, expected_lse = reference.batch_prefill_paged(
        q, batch.cache, qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, causal=True)
    assert_close_out(out, expected_o, bf16)
    assert_close_lse(lse, expected_lse)

def test_plan_and_run_refuse_bad_input() -> None:
    wrapper = jitattn.BatchAttention(device="cpu")
    indptr, indices = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    qo = torch.tensor([0, 1, 4], dtype=torch.int32)
    q, cache = torch.randn(4, 4, 64).to(bf16), torch.randn(3, 2, 16, 2, 64).to(bf16)
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q, cache)
    with pytest.raises(ValueError, match=r"kv_len_arr\[0\] = 10 tokens fill 1 pages of 16, but kv_indptr gives "
                                         r"request 0 2 pages"):
        wrapper.plan(qo, indptr, indices, torch.tensor([10, 5], dtype=torch.int32), 4, 2, 64, 64, 16)
    with pytest.raises(ValueError, match="qo_indptr has 3 entries, but kv_len_arr gives 3 requests"):
        wrapper.plan(qo, indptr, indices, torch.tensor([20, 5, 1], dtype=torch.int32), 4, 2, 64, 64, 16)
    with pytest.raises(ValueError, match=r"^kv_indices\[2\] = -9 is a negative page index"):  # the batch's position
        wrapper.plan(qo, indptr, torch.tensor([0, 1, -9], dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32),
                     4, 2, 64, 64, 16)
    with pytest.raises(NotImplementedError, match="use_profiler"):
        wrapper.plan(qo, indptr, indices, torch.tensor([20, 5], dtype=torch.int32), 4, 2, 64, 64, 16, use_profiler=True)
    wrapper.plan(qo, indptr, indices, torch.tensor([20, 5], dtype=torch.int32), 4, 2, 64, 64, 16,
                 q_data_type=None)  # None: the signature's default, bf16 (as kv_data_type's)
    with pytest.raises(ValueError, match="logits_soft_cap=50.0.*no cap"):
        wrapper.run(q, cache, logits_soft_cap=50.0)
    with pytest.raises(NotImplementedError, match="profiler_buffer"):
        wrapper.run(q, cache, profiler_buffer=torch.empty(8))
    with pytest.raises(ValueError, match="q has shape"):
        wrapper.run(q[:3], cache)
    out, lse = wrapper.run(q, cache)
    assert out.shape == (4, 4, 64) and lse.shape == (4, 4) and out.dtype == bf16
    with pytest.raises(ValueError, match="not a device"):
        jitattn.BatchAttention(device="gpu0")


def test_q_data_type_none_takes_a_float32_caches_dtype() -> None:
    """``q_data_type=None`` takes the KV's dtype when it is 16- or 32-bit (it took bf16 beside a float32 cache, and
    the plan then refused the dtypes the caller never chose)."""
    wrapper = jitattn.BatchAttention(device="cpu")
    indptr, indices = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)
    qo, kv_len = torch.tensor([0, 1, 4], dtype=torch.int32), torch.tensor([20, 5], dtype=torch.int32)
    wrapper.plan(qo, indptr, indices, kv_len, 4, 2, 64, 64, 16, q_data_type=None, kv_data_type=torch.float32)
    gen = torch.Generator().manual_seed(7)
    q, cache = torch.randn(4, 4, 64, generator=gen), torch.randn(3, 2, 16, 2, 64, generator=gen)
    out, lse = wrapper.run(q, cache)
    expected_o, expected_lse = reference.batch_prefill_paged(
        q, cache, qo, indptr, indices, torch.tensor([4, 5], dtype=torch.int32))
    assert out.dtype == torch.float32
    assert_close_out(out, expected_o, torch.float32)
    assert_close_lse(lse, expected_lse)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error of a machine without a GPU")
def test_run_errors_from_a_part_name_batch_attention_and_the_part() -> None:
    """An error raised by the part's wrapper named that wrapper and its own arguments (indices), not the call the
    user made (2026-12-06 sweep)."""
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper = jitattn.BatchAttention(device="cpu")
    wrapper.plan(i32(0, 1, 6), i32(0, 2, 4), i32(0, 1, 2, 99), i32(20, 30), 4, 2, 64, 64, 16)
    q, cache = torch.randn(6, 4, 64, dtype=torch.bfloat16), torch.randn(40, 2, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"^BatchAttention\.run\(\), the prefill part .*references page 99 but the "
                                         "kv cache has only 40 pages"):
        wrapper.run(q, cache)


def test_default_cuda_device_without_a_gpu_says_how_to_use_the_cpu() -> None:
    with pytest.raises(RuntimeError, match="device='cpu'"):
        jitattn.BatchAttention()


def _planned_mixed(logits_soft_cap: float | None = None):
    """A wrapper planned over MIXED (its decode rows 0, 1 and 22 are not contiguous: both parts gather and
    scatter their rows), and the q / cache to run."""
    case = CASES["g4_bf16_p16_nhd_causal"]
    batch, qo_indptr, kv_len_arr, q = _batch(case, "cpu", torch.Generator().manual_seed(43))
    wrapper = jitattn.BatchAttention(device="cpu")
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, kv_len_arr, case[0], case[1], case[2], case[2],
                 case[4], causal=True, logits_soft_cap=logits_soft_cap)
    return wrapper, q, batch.cache


@pytest.mark.parametrize("name,dtype", [("out", torch.float32), ("out", torch.int16), ("lse", bf16),
                                        ("lse", torch.float64)])
def test_mixed_batch_refuses_an_out_or_lse_of_another_dtype_before_writing(name: str, dtype) -> None:
    wrapper, q, cache = _planned_mixed()
    rows, heads, dim = q.shape
    out = torch.full((rows, heads, dim), 7.0, dtype=dtype if name == "out" else bf16)
    lse = torch.full((rows, heads), 7.0, dtype=dtype if name == "lse" else torch.float32)
    with pytest.raises(TypeError, match=f"^{name} has dtype {str(dtype).removeprefix('torch.')}"):
        wrapper.run(q, cache, out=out, lse=lse)
    assert torch.all(out == 7) and torch.all(lse == 7), "a refused run() wrote no output"


@pytest.mark.parametrize("overlap", ["lse_in_out", "out_is_q", "lse_in_cache"])
def test_mixed_batch_refuses_outputs_over_each_other_or_the_inputs(overlap: str) -> None:
    """Parts whose rows are not contiguous compute into buffers of their own and scatter: the overlap of the
    caller's out / lse with each other or with q / the cache is checked before that (it gave wrong results)."""
    wrapper, q, cache = _planned_mixed()
    rows, heads, dim = q.shape
    out, lse = torch.full((rows, heads, dim), 7.0, dtype=bf16), torch.full((rows, heads), 7.0)
    if overlap == "lse_in_out":
        lse = out.view(-1)[: 2 * rows * heads].view(torch.float32).view(rows, heads)  # out's first bytes
        match = "out and lse share memory"
    elif overlap == "out_is_q":
        out, match = q, "out shares memory with q"
    else:  # the planned bf16 cache's first bytes as a float32 lse
        lse = cache.view(-1)[: 2 * rows * heads].view(torch.float32).view(rows, heads)
        match = "lse shares memory with the kv cache"
    before = (q.clone(), cache.clone())
    with pytest.raises(ValueError, match=rf"^BatchAttention\.run\(\): {match}"):
        wrapper.run(q, cache, out=out, lse=lse)
    assert torch.equal(q, before[0]) and torch.equal(cache, before[1]), "a refused run() wrote nothing"


def test_plan_reads_longer_index_buffers_up_to_kv_len_arrs_batch() -> None:
    """As FlashInfer's: the batch is kv_len_arr's, and qo_indptr / kv_indptr (fixed buffers sized for the largest
    batch) may be longer."""
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    q, cache = torch.randn(4, 4, 64).to(bf16), torch.randn(3, 2, 16, 2, 64).to(bf16)
    exact = jitattn.BatchAttention(device="cpu")
    exact.plan(i32(0, 1, 4), i32(0, 2, 3), i32(0, 1, 2), i32(20, 5), 4, 2, 64, 64, 16)
    longer = jitattn.BatchAttention(device="cpu")
    longer.plan(i32(0, 1, 4, 4, 4, 4), i32(0, 2, 3, 3, 3), i32(0, 1, 2, 0, 0), i32(20, 5), 4, 2, 64, 64, 16)
    for a, b in zip(exact.run(q, cache), longer.run(q, cache)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match=r"^qo_indptr has 2 entries, but kv_len_arr gives 2 requests, which need 3"):
        longer.plan(i32(0, 1), i32(0, 2, 3), i32(0, 1, 2), i32(20, 5), 4, 2, 64, 64, 16)


@pytest.mark.parametrize("name", ["out", "lse"])
@pytest.mark.parametrize("batch_kind", ["mixed", "all_prefill", "all_decode"])
def test_run_refuses_an_out_or_lse_that_is_not_a_tensor(batch_kind: str, name: str) -> None:
    if batch_kind == "mixed":
        wrapper, q, cache = _planned_mixed()
    else:
        qo = torch.tensor([0, 2, 4] if batch_kind == "all_prefill" else [0, 1, 2], dtype=torch.int32)
        wrapper = jitattn.BatchAttention(device="cpu")
        wrapper.plan(qo, torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
                     torch.tensor([20, 5], dtype=torch.int32), 4, 2, 64, 64, 16)
        q, cache = torch.randn(int(qo[-1]), 4, 64).to(bf16), torch.randn(3, 2, 16, 2, 64).to(bf16)
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
        wrapper.run(q, cache, **{name: [0.0]})


@pytest.mark.parametrize("planned", [None, 20.0], ids=["no_cap", "cap_20"])
@pytest.mark.parametrize("cap,error", [(float("nan"), ValueError), (-3.0, ValueError), (float("inf"), ValueError),
                                       (5.0, ValueError), ("20", TypeError), ([20.0], TypeError)],
                         ids=["nan", "negative", "inf", "another", "string", "list"])
def test_run_soft_cap_must_be_zero_or_the_planned_one(planned: float | None, cap, error: type) -> None:
    wrapper, q, cache = _planned_mixed(logits_soft_cap=planned)
    with pytest.raises(error, match="logits_soft_cap="):
        wrapper.run(q, cache, logits_soft_cap=cap)
    expected, _ = wrapper.run(q, cache)
    for same in (0, 0.0, None, planned or 0.0):
        assert torch.equal(wrapper.run(q, cache, logits_soft_cap=same)[0], expected)

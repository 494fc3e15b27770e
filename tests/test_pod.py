"""POD wrappers: a chunked-prefill batch's prefill part and decode part against the float reference,
return shapes (with and without LSE, base 2 in ``jitattn.flashinfer``), refusals."""

from __future__ import annotations

import functools
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
PAGE = 16
HQ, HKV, D = 8, 2, 64
DECODE_KV = [33, 1, 70, 16]


def _spec(op: Op, dtype, mask: MaskMode, layout: str, storage: KVStorage):
    return attention_spec(op, Target.CUDA, q_dtype=dtype, kv_dtype=dtype, o_dtype=dtype, head_dim_qk=D, head_dim_vo=D,
                          num_qo_heads=HQ, num_kv_heads=HKV, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
                          use_logits_soft_cap=False, mask_mode=mask, kv_layout=KVLayout.parse(layout, "layout"),
                          kv_storage=storage)


GPU_SPECS = [_spec(Op.PREFILL, dt, m, lay, KVStorage.PAGED) for dt in (f16, bf16) for lay in ("NHD", "HND")
             for m in (MaskMode.NONE, MaskMode.CAUSAL, MaskMode.CUSTOM)]
GPU_SPECS += [_spec(Op.DECODE, dt, MaskMode.NONE, lay, KVStorage.PAGED) for dt in (f16, bf16) for lay in ("NHD", "HND")]


def _cpu(cache):
    return tuple(t.cpu() for t in cache) if isinstance(cache, tuple) else cache.cpu()


def _decode_batch(layout: str, dtype, device: str, gen: torch.Generator):
    batch = random_paged_batch(DECODE_KV, HKV, D, PAGE, dtype, layout=layout, device=device, generator=gen)
    q = torch.randn(len(DECODE_KV), HQ, D, generator=gen).to(dtype).to(device)
    return batch, q


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("layout,layout_p,dtype,prefill_mask,return_lse", [
    ("NHD", "NHD", f16, "causal", (False, False)),
    ("HND", "NHD", bf16, "none", (True, True)),
    ("NHD", "HND", bf16, "custom", (True, False)),
    ("HND", "HND", f16, "causal", (False, True)),
], ids=["nhd_f16_causal", "hnd_bf16_lse", "prefill_hnd_custom_mask_lse_p", "hnd_f16_causal_lse_d"])
def test_pod_prefill_and_decode_parts_match_reference(device: str, layout: str, layout_p: str, dtype, prefill_mask: str,
                                                      return_lse: tuple[bool, bool]) -> None:
    gen = torch.Generator().manual_seed(17)
    batch, q_d = _decode_batch(layout, dtype, device, gen)
    qo_len, kv_len = 13, 30
    q_p = torch.randn(qo_len, HQ, D, generator=gen).to(dtype).to(device)
    shape = (kv_len, HKV, D) if layout_p == "NHD" else (HKV, kv_len, D)
    k_p, v_p = (torch.randn(shape, generator=gen).to(dtype).to(device) for _ in range(2))
    mask = torch.rand(qo_len, kv_len, generator=gen) > 0.4 if prefill_mask == "custom" else None
    wrapper = jitattn.PODWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device), layout)
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type=dtype)
    result = wrapper.run(q_p, k_p, v_p, q_d, batch.cache, custom_mask_p=None if mask is None else mask.to(device),
                         causal_p=prefill_mask == "causal", kv_layout_p=layout_p, return_lse_p=return_lse[0],
                         return_lse_d=return_lse[1], v_scale=1.5)
    nhd = (lambda t: t) if layout_p == "NHD" else (lambda t: t.transpose(0, 1))
    exp_p = reference.single_attention(q_p.cpu(), nhd(k_p).cpu(), nhd(v_p).cpu(), causal=prefill_mask == "causal",
                                       custom_mask=mask)
    exp_d = reference.batch_decode_paged(q_d.cpu(), _cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                         batch.kv_last_page_len, kv_layout=layout, v_scale=1.5)
    if any(return_lse):
        (out_p, out_d), (lse_p, lse_d) = result
        for asked, lse, expected in zip(return_lse, (lse_p, lse_d), (exp_p[1], exp_d[1])):
            if asked:
                assert_close_lse(lse, expected)
            else:
                assert lse is None
    else:
        out_p, out_d = result
    assert_close_out(out_p, exp_p[0], dtype)
    assert_close_out(out_d, exp_d[0], dtype)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("decode_queries", [1, 2], ids=["decode_kernel", "two_queries_per_decode_request"])
@pytest.mark.parametrize("causal_p,masked", [(True, False), (False, False), (False, True)],
                         ids=["causal", "none", "custom_mask"])
def test_batch_pod_matches_reference(device: str, decode_queries: int, causal_p: bool, masked: bool) -> None:
    gen = torch.Generator().manual_seed(19)
    dtype, layout = f16, "NHD"
    qo_p, kv_p = [5, 0, 12], [20, 3, 12]
    prefill = random_paged_batch(kv_p, HKV, D, PAGE, dtype, layout=layout, device=device, generator=gen)
    decode, _ = _decode_batch(layout, dtype, device, gen)
    qo_indptr_p = torch.tensor([0] + torch.tensor(qo_p).cumsum(0).tolist(), dtype=torch.int32)
    qo_indptr_d = torch.arange(len(DECODE_KV) + 1, dtype=torch.int32) * decode_queries
    q_p = torch.randn(sum(qo_p), HQ, D, generator=gen).to(dtype).to(device)
    q_d = torch.randn(len(DECODE_KV) * decode_queries, HQ, D, generator=gen).to(dtype).to(device)
    mask = torch.rand(sum(q * k for q, k in zip(qo_p, kv_p)), generator=gen) > 0.4 if masked else None
    wrapper = jitattn.BatchPODWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device), layout)
    wrapper.plan(qo_indptr_p, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len, qo_indptr_d,
                 decode.kv_indptr, decode.kv_indices, decode.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type=dtype)
    exp_p = reference.batch_prefill_paged(q_p.cpu(), _cpu(prefill.cache), qo_indptr_p, prefill.kv_indptr,
                                          prefill.kv_indices, prefill.kv_last_page_len, causal=causal_p,
                                          custom_mask=mask)
    exp_d = reference.batch_prefill_paged(q_d.cpu(), _cpu(decode.cache), qo_indptr_d, decode.kv_indptr,
                                          decode.kv_indices, decode.kv_last_page_len, k_scale=0.5)
    for _ in range(2):  # the second run reuses the prefill part's plan (or plans the mask again)
        (out_p, out_d), (lse_p, lse_d) = wrapper.run(q_p, prefill.cache, q_d, decode.cache, causal_p=causal_p,
                                                     custom_mask_p=None if mask is None else mask.to(device),
                                                     k_scale=0.5, return_lse=True)
        assert_close_out(out_p, exp_p[0], dtype)
        assert_close_lse(lse_p, exp_p[1])
        assert_close_out(out_d, exp_d[0], dtype)
        assert_close_lse(lse_d, exp_d[1])
    out_p, out_d = wrapper.run(q_p, prefill.cache, q_d, decode.cache, causal_p=not causal_p)
    flipped = reference.batch_prefill_paged(q_p.cpu(), _cpu(prefill.cache), qo_indptr_p, prefill.kv_indptr,
                                            prefill.kv_indices, prefill.kv_last_page_len, causal=not causal_p)
    assert_close_out(out_p, flipped[0], dtype)


def test_flashinfer_namespace_returns_base2_lse() -> None:
    gen = torch.Generator().manual_seed(23)
    batch, q_d = _decode_batch("NHD", f16, "cpu", gen)
    q_p, k_p, v_p = (torch.randn(n, h, D, generator=gen).to(f16) for n, h in ((6, HQ), (9, HKV), (9, HKV)))
    results = []
    for module in (jitattn, fi):
        wrapper = module.PODWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8))
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
        results.append(wrapper.run(q_p, k_p, v_p, q_d, batch.cache, causal_p=True, return_lse_p=True,
                                   return_lse_d=True))
    (native_out, native_lse), (fi_out, fi_lse) = results
    assert all(torch.equal(a, b) for a, b in zip(native_out, fi_out))
    for a, b in zip(native_lse, fi_lse):
        assert_close_lse(b, a * LOG2E, atol=1e-5)
    assert fi.pod.BatchPODWithPagedKVCacheWrapper is fi.BatchPODWithPagedKVCacheWrapper


def test_pod_refuses_bad_input() -> None:
    workspace = torch.empty(8 << 20, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(29)
    batch, q_d = _decode_batch("NHD", f16, "cpu", gen)
    q_p, k_p = torch.randn(4, HQ, D).half(), torch.randn(6, HKV, D).half()
    with pytest.raises(NotImplementedError, match="jit_args"):
        jitattn.PODWithPagedKVCacheWrapper(workspace, jit_args=["x"])
    for cls in (jitattn.PODWithPagedKVCacheWrapper, jitattn.BatchPODWithPagedKVCacheWrapper):
        with pytest.raises(TypeError, match=f"^{cls.__name__}: float_workspace_buffer must be a torch.Tensor"):
            cls(None)
    wrapper = jitattn.PODWithPagedKVCacheWrapper(workspace)
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q_p, k_p, k_p, q_d, batch.cache)
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, sm_scale=0.1)
    with pytest.raises(NotImplementedError, match="custom_mask_d"):
        wrapper.run(q_p, k_p, k_p, q_d, batch.cache, custom_mask_d=torch.ones(4, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"sm_scale_d=0\.2.*pass them to plan"):
        wrapper.run(q_p, k_p, k_p, q_d, batch.cache, sm_scale_d=0.2)
    with pytest.raises(ValueError, match="kv_layout_d='HND'"):
        wrapper.run(q_p, k_p, k_p, q_d, batch.cache, kv_layout_d="HND")
    out_p, out_d = wrapper.run(q_p, k_p, k_p, q_d, batch.cache, sm_scale_d=0.1, causal_d=True)  # the planned ones
    assert out_p.shape == q_p.shape and out_d.shape == q_d.shape
    batch_wrapper = jitattn.BatchPODWithPagedKVCacheWrapper(workspace)
    with pytest.raises(RuntimeError, match="without a plan"):
        batch_wrapper.run(q_p, batch.cache, q_d, batch.cache)
    with pytest.raises(ValueError, match="qo_indptr_p describes 2 prefill requests but kv_indptr_p 4"):
        batch_wrapper.plan(torch.tensor([0, 2, 4], dtype=torch.int32), batch.kv_indptr, batch.kv_indices,
                           batch.kv_last_page_len, torch.arange(5, dtype=torch.int32), batch.kv_indptr,
                           batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)


def _planned_batch_pod(qo_indptr_d: torch.Tensor | None = None):
    """A BatchPOD wrapper planned over two prefill requests and DECODE_KV's decode requests (cpu), its inputs."""
    gen = torch.Generator().manual_seed(31)
    prefill = random_paged_batch([20, 9], HKV, D, PAGE, f16, generator=gen)
    decode, q_d = _decode_batch("NHD", f16, "cpu", gen)
    qo_indptr_p = torch.tensor([0, 5, 12], dtype=torch.int32)
    wrapper = jitattn.BatchPODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8))
    wrapper.plan(qo_indptr_p, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len,
                 torch.arange(len(DECODE_KV) + 1, dtype=torch.int32) if qo_indptr_d is None else qo_indptr_d,
                 decode.kv_indptr, decode.kv_indices, decode.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type=f16)
    return wrapper, dict(q_p=torch.randn(12, HQ, D, generator=gen).half(), paged_kv_cache_p=prefill.cache, q_d=q_d,
                         paged_kv_cache_d=decode.cache)


@pytest.mark.parametrize("decode_requests", [2, 3, 5], ids=["fewer", "one_fewer", "more"])
def test_batch_pod_plan_refuses_a_qo_indptr_d_of_another_batch_size(decode_requests: int) -> None:
    """One query per decode request runs the decode kernel, which reads no qo_indptr_d: it must still describe
    the decode batch the kv index does."""
    with pytest.raises(ValueError, match=f"qo_indptr_d describes {decode_requests} decode requests but kv_indptr_d "
                                         f"{len(DECODE_KV)}"):
        _planned_batch_pod(torch.arange(decode_requests + 1, dtype=torch.int32))


@pytest.mark.parametrize("kv_indices_d,last_page_len_d,error,match", [
    ([1], [0], ValueError, r"^last_page_len_d\[0\] = 0 is out of range"),
    ([-1], [3], ValueError, r"^kv_indices_d\[0\] = -1 is a negative page index"),
    ([], [3], ValueError, r"^kv_indptr_d\[-1\] = 1 exceeds len\(kv_indices_d\) = 0"),
], ids=["last_page_len_d", "kv_indices_d_negative", "kv_indices_d_short"])
def test_batch_pod_plan_names_the_decode_page_table_as_the_caller_does(kv_indices_d, last_page_len_d, error, match):
    i32 = functools.partial(torch.tensor, dtype=torch.int32)
    wrapper = jitattn.BatchPODWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    with pytest.raises(error, match=match):
        wrapper.plan(i32([0, 3]), i32([0, 1]), i32([0]), i32([5]), i32([0, 1]), i32([0, 1]), i32(kv_indices_d),
                     i32(last_page_len_d), HQ, HKV, D, PAGE)


@pytest.mark.parametrize("change,error,match", [
    (dict(q_p=torch.randn(10, HQ, D).half()), ValueError, r"^q_p has shape \(10, 8, 64\); the plan expects \(12,"),
    (dict(q_d=torch.randn(3, HQ, D).half()), ValueError, r"^q_d has shape \(3, 8, 64\); the plan expects \(4,"),
    (dict(q_p=torch.randn(12, HQ, D)), TypeError, "^q_p has dtype float32"),
    (dict(q_d=torch.randn(4, HQ, D).bfloat16()), TypeError, "^q_d has dtype bfloat16"),
    (dict(paged_kv_cache_d=torch.zeros(2, 2, PAGE, HKV, D, dtype=f16)), ValueError,
     r"decode part \(q_d, paged_kv_cache_d, kv_indices_d\): indices references page"),
    (dict(custom_mask_p=torch.ones(10, dtype=torch.bool)), ValueError,
     r"prefill part's mask \(custom_mask_p, packed_custom_mask_p\): custom_mask has 10 elements"),
], ids=["q_p_rows", "q_d_rows", "q_p_dtype", "q_d_dtype", "kv_indices_d_past_the_cache", "custom_mask_p_size"])
def test_batch_pod_run_names_the_argument_that_is_wrong(change: dict, error: type, match: str) -> None:
    wrapper, inputs = _planned_batch_pod()
    with pytest.raises(error, match=match):
        wrapper.run(**{**inputs, **change})


@pytest.mark.parametrize("change,error,match", [
    (dict(q_d=torch.randn(3, HQ, D).half()), ValueError, r"^q_d has shape \(3, 8, 64\); the plan expects \(4,"),
    (dict(q_d=torch.randn(4, HQ, D)), TypeError, "^q_d has dtype float32"),
    (dict(q_p=torch.randn(4, D).half()), ValueError, "^q_p must have 3 dimensions"),
    (dict(paged_kv_cache_d=torch.zeros(2, 2, PAGE, HKV, D, dtype=f16)), ValueError,
     r"decode part \(q_d, paged_kv_cache_d, indices\): indices references page"),
], ids=["q_d_rows", "q_d_dtype", "q_p_2d", "indices_past_the_cache"])
def test_pod_run_names_the_argument_that_is_wrong(change: dict, error: type, match: str) -> None:
    gen = torch.Generator().manual_seed(37)
    batch, q_d = _decode_batch("NHD", f16, "cpu", gen)
    wrapper = jitattn.PODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
    inputs = dict(q_p=torch.randn(4, HQ, D).half(), k_p=torch.randn(6, HKV, D).half(),
                  v_p=torch.randn(6, HKV, D).half(), q_d=q_d, paged_kv_cache_d=batch.cache)
    with pytest.raises(error, match=match):
        wrapper.run(**{**inputs, **change})


@pytest.mark.parametrize("value", ["no", None, 2, torch.tensor(False)])
@pytest.mark.parametrize("flag", ["return_lse_p", "return_lse_d", "return_lse"])
def test_pod_return_lse_flags_must_be_bools(flag: str, value) -> None:
    if flag == "return_lse":
        wrapper, inputs = _planned_batch_pod()
    else:
        batch, q_d = _decode_batch("NHD", f16, "cpu", torch.Generator().manual_seed(41))
        wrapper = jitattn.PODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8))
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
        inputs = dict(q_p=torch.randn(4, HQ, D).half(), k_p=torch.randn(6, HKV, D).half(),
                      v_p=torch.randn(6, HKV, D).half(), q_d=q_d, paged_kv_cache_d=batch.cache)
    with pytest.raises(TypeError, match=f"{flag}=.* must be True or False"):
        wrapper.run(**inputs, **{flag: value})


def test_batch_pod_runs_the_planned_prefill_table_when_the_caller_reuses_its_arrays() -> None:
    """The prefill part is planned at run() (with its mask): it read the caller's host arrays then, so values written
    into them after plan() changed the result, and a grown kv_indptr_p read past the end of kv_indices_p."""
    gen = torch.Generator().manual_seed(43)
    prefill = random_paged_batch([20, 9], HKV, D, PAGE, f16, generator=gen, spare_pages=3)
    decode, q_d = _decode_batch("NHD", f16, "cpu", gen)
    arrays = [torch.tensor([0, 5, 12], dtype=torch.int32), prefill.kv_indptr.clone(), prefill.kv_indices.clone(),
              prefill.kv_last_page_len.clone()]
    inputs = dict(q_p=torch.randn(12, HQ, D, generator=gen).half(), paged_kv_cache_p=prefill.cache, q_d=q_d,
                  paged_kv_cache_d=decode.cache, causal_p=True)

    def planned(qo_p, kv_indptr_p, kv_indices_p, last_p):
        wrapper = jitattn.BatchPODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8))
        wrapper.plan(qo_p, kv_indptr_p, kv_indices_p, last_p, torch.arange(len(DECODE_KV) + 1, dtype=torch.int32),
                     decode.kv_indptr, decode.kv_indices, decode.kv_last_page_len, HQ, HKV, D, PAGE,
                     q_data_type=f16)
        return wrapper

    expected = planned(*[a.clone() for a in arrays]).run(**inputs)
    wrapper = planned(*arrays)
    arrays[2].copy_(arrays[2].flip(0))  # the caller's buffers, reused for the next batch
    arrays[1].copy_(torch.tensor([0, 3, 9], dtype=torch.int32))
    arrays[3].fill_(1)
    for got, want in zip(wrapper.run(**inputs), expected):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_pod_run_takes_decode_options_equal_to_the_planned_ones() -> None:
    """A run's decode option equal in effect to the plan's (the default scale written out) was refused."""
    batch, q_d = _decode_batch("NHD", f16, "cpu", torch.Generator().manual_seed(47))
    wrapper = jitattn.PODWithPagedKVCacheWrapper(torch.empty(128 << 20, dtype=torch.uint8))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
    inputs = dict(q_p=torch.randn(4, HQ, D).half(), k_p=torch.randn(6, HKV, D).half(),
                  v_p=torch.randn(6, HKV, D).half(), q_d=q_d, paged_kv_cache_d=batch.cache)
    expected = wrapper.run(**inputs)[1]
    same = wrapper.run(**inputs, sm_scale_d=1 / math.sqrt(D), rope_theta_d=1e4, rope_scale_d=1)[1]
    torch.testing.assert_close(same, expected, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"run\(sm_scale_d=0\.2\) differs from the plan"):
        wrapper.run(**inputs, sm_scale_d=0.2)
    with pytest.raises(ValueError, match=r"run\(pos_encoding_mode_d='ROPE_LLAMA'\) differs from the plan"):
        wrapper.run(**inputs, pos_encoding_mode_d="ROPE_LLAMA")
    with pytest.raises(ValueError, match=r"PODWithPagedKVCacheWrapper.run\(\), the kv_layout_d: kv_layout='XYZ'"):
        wrapper.run(**inputs, kv_layout_d="XYZ")

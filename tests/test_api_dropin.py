"""FlashInfer drop-in behaviour: the calls serving engines make, the older spellings, and the empty edges.

Every test runs on the cpu target and (marked ``gpu``) on cuda, against ``jitattn.reference``
with fresh random inputs; outputs the kernels must write are poisoned first.
"""

from __future__ import annotations

import functools

import pytest
import torch

import jitattn
from jitattn import reference

from attention_cases import assert_close_lse, assert_close_out, devices, random_paged_batch

PAGE = 16
HQ, HKV, D = 8, 2, 64


def _workspace(device: str) -> torch.Tensor:
    return torch.empty(16 << 20, dtype=torch.uint8, device=device)


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.float16


def _decode_reference(q, batch, **options):
    return reference.batch_decode_paged(q.cpu(), _cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                        batch.kv_last_page_len, **options)


def _cpu(cache):
    return tuple(t.cpu() for t in cache) if isinstance(cache, tuple) else cache.cpu()


# ---- fast_decode_plan -------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("kv_lens,fixed_split_size", [
    ([33, 1, 200, 64], None), ([700, 5, 0, 1000], 2), ([4000], None), ([0, 0], None),
], ids=["mixed", "split2", "long", "empty"])
@pytest.mark.parametrize("host_indptr", [True, False], ids=["override_cpu", "device_indptr"])
def test_fast_decode_plan_matches_plan(device: str, kv_lens: list[int], fixed_split_size: int | None,
                                       host_indptr: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    dtype = _dtype(device)
    batch = random_paged_batch(kv_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(len(kv_lens), HQ, D, generator=gen).to(dtype).to(device)
    tables = [t.to(device) for t in (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)]
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    plan = functools.partial(jitattn.fast_decode_plan, wrapper)  # as SGLang binds it
    plan(*tables, HQ, HKV, D, PAGE, q_data_type=dtype, fixed_split_size=fixed_split_size,
         global_override_indptr_cpu=batch.kv_indptr if host_indptr else None)
    out, lse = wrapper.run(q, batch.cache, out=torch.full_like(q, float("nan")), return_lse=True)
    ref_out, ref_lse = _decode_reference(q, batch)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)
    if fixed_split_size is not None:
        assert wrapper._plan.split.kv_chunk_size == fixed_split_size * PAGE


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fixed_split_size", [None, 3], ids=["planner", "split3"])
def test_fast_decode_plan_steps_reuse_the_launch_and_read_each_steps_tables(device: str,
                                                                             fixed_split_size: int | None) -> None:
    """A serving loop's steps: the same batch size and split re-point the last step's launch at the new
    page table (poisoned outputs, each step against the reference); another batch size fills a new one."""
    gen = torch.Generator().manual_seed(9)
    dtype = _dtype(device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    launches = []
    for kv_lens in ([90, 3, 40], [91, 4, 41], [92, 5, 42], [92, 5, 42, 7]):
        batch = random_paged_batch(kv_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
        q = torch.randn(len(kv_lens), HQ, D, generator=gen).to(dtype).to(device)
        tables = [t.to(device) for t in (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)]
        jitattn.fast_decode_plan(wrapper, *tables, HQ, HKV, D, PAGE, q_data_type=dtype,
                                 fixed_split_size=fixed_split_size, global_override_indptr_cpu=batch.kv_indptr)
        launches.append(wrapper._plan.launch)
        out, lse = wrapper.run(q, batch.cache, out=torch.full_like(q, float("nan")), return_lse=True)
        ref_out, ref_lse = _decode_reference(q, batch)
        assert_close_out(out, ref_out, dtype)
        assert_close_lse(lse, ref_lse)
    assert launches[0] is launches[1] is launches[2], "same batch and split: the launch is kept"
    assert launches[3] is not launches[2], "another batch size: a launch of its own"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("fixed_split_size", [None, 3], ids=["planner", "split3"])
def test_plan_steps_reuse_the_launch_and_read_each_steps_tables(device: str, fixed_split_size: int | None) -> None:
    """plan() keeps its launch as fast_decode_plan does: steps of one batch size and split (plan() and
    fast_decode_plan mixed) re-point it at each step's arrays, with what a cascade set on it cleared."""
    gen = torch.Generator().manual_seed(11)
    dtype = _dtype(device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    launches = []
    for step, kv_lens in enumerate(([90, 3, 40], [91, 4, 41], [92, 5, 42], [93, 6, 43], [92, 5, 42, 7])):
        batch = random_paged_batch(kv_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
        q = torch.randn(len(kv_lens), HQ, D, generator=gen).to(dtype).to(device)
        tables = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
        if step == 2:
            jitattn.fast_decode_plan(wrapper, *[t.to(device) for t in tables], HQ, HKV, D, PAGE, q_data_type=dtype,
                                     fixed_split_size=fixed_split_size, global_override_indptr_cpu=batch.kv_indptr)
        else:
            wrapper.plan(*tables, HQ, HKV, D, PAGE, q_data_type=dtype, fixed_split_size=fixed_split_size)
        launches.append(wrapper._plan.launch)
        assert launches[-1].params.prior_states == 0 and not launches[-1].params.prior_v
        out, lse = wrapper.run(q, batch.cache, out=torch.full_like(q, float("nan")), return_lse=True)
        ref_out, ref_lse = _decode_reference(q, batch)
        assert_close_out(out, ref_out, dtype)
        assert_close_lse(lse, ref_lse)
        launches[-1].params.prior_v, launches[-1].params.prior_states = 64, 1  # stale prior states: not carried over
    assert launches[0] is launches[1] is launches[2] is launches[3], "same batch and split: the launch is kept"
    assert launches[4] is not launches[3], "another batch size: a launch of its own"


@pytest.mark.parametrize("fast", [False, True], ids=["plan", "fast_decode_plan"])
def test_a_refused_graph_step_keeps_the_batch_guard_and_the_last_steps_arrays(fast: bool) -> None:
    """A use_cuda_graph wrapper's plan refused for a page table its fixed buffers cannot hold writes none of them
    (the current plan still reads its own tables), and the batch size of the captured launch stays guarded."""
    i32 = dict(dtype=torch.int32)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        _workspace("cpu"), use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(9, **i32),
        paged_kv_indices_buffer=torch.zeros(8, **i32), paged_kv_last_page_len_buffer=torch.zeros(8, **i32))

    def plan(pages_each: int, batch: int, **options) -> None:
        indptr = torch.arange(batch + 1, **i32) * pages_each
        tables = (indptr, torch.arange(batch * pages_each, **i32), torch.full((batch,), 3, **i32))
        if fast:
            jitattn.fast_decode_plan(wrapper, *tables, HQ, HKV, D, PAGE, q_data_type=torch.float32,
                                     global_override_indptr_cpu=indptr, **options)
        else:
            wrapper.plan(*tables, HQ, HKV, D, PAGE, q_data_type=torch.float32, **options)

    plan(2, 2)
    for options in ({}, {"logits_soft_cap": 30.0}):  # the launch reused, and a new one
        with pytest.raises(ValueError, match="kv_indices"):
            plan(5, 2, **options)  # 10 pages: the fixed indices buffer holds 8
        if wrapper._plan is not None:
            assert wrapper._plan.kv_indptr[:3].tolist() == [0, 2, 4], "the refused step wrote the current plan's arrays"
        with pytest.raises(ValueError, match="keeps its batch size"):
            plan(1, 3)


def test_a_graph_buffer_of_the_wrong_dtype_is_told_to_be_int32() -> None:
    i32, i64 = dict(dtype=torch.int32), dict(dtype=torch.int64)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        _workspace("cpu"), use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(9, **i64),
        paged_kv_indices_buffer=torch.zeros(8, **i32), paged_kv_last_page_len_buffer=torch.zeros(8, **i32))
    with pytest.raises(ValueError, match=r"kv_indptr buffer \(9 x torch.int64 on cpu\) cannot hold 3 x torch.int32 "
                                         r"on cpu; allocate it as torch.int32"):
        wrapper.plan(torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1], **i32), torch.tensor([1, 1], **i32),
                     HQ, HKV, D, PAGE, q_data_type=torch.float32)


@pytest.mark.parametrize("indptr,error,match", [
    (torch.tensor([0, 1]), TypeError, "indptr has dtype int64; expected one of int32"),
    ([0, 1], TypeError, "indptr must be a torch.Tensor"),
    (torch.tensor([[0, 1]], dtype=torch.int32), ValueError, "indptr must have 1 dimensions"),
])
def test_fast_decode_plan_names_the_bad_indptr(indptr, error, match) -> None:
    """Without global_override_indptr_cpu the error names indptr (the argument the caller passed), as plan()'s."""
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    i32 = dict(dtype=torch.int32)
    with pytest.raises(error, match=match):
        jitattn.fast_decode_plan(wrapper, indptr, torch.tensor([0], **i32), torch.tensor([3], **i32), HQ, HKV, D, PAGE,
                                 q_data_type=torch.float32)
    with pytest.raises(TypeError, match="global_override_indptr_cpu has dtype torch.int64"):
        jitattn.fast_decode_plan(wrapper, torch.tensor([0, 1], **i32), torch.tensor([0], **i32),
                                 torch.tensor([3], **i32), HQ, HKV, D, PAGE, q_data_type=torch.float32,
                                 global_override_indptr_cpu=torch.tensor([0, 1]))


def test_out_interleaved_with_q_in_one_buffer_is_taken() -> None:
    """q and out as two halves of one [batch, 2, heads, dim] buffer: their spans interleave, their elements do not
    (the aliasing check refuses only dense tensors that share bytes)."""
    gen = torch.Generator().manual_seed(11)
    batch = random_paged_batch([5, 20], HKV, D, PAGE, torch.float32, generator=gen)
    buffer = torch.randn(2, 2, HQ, D, generator=gen)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                 q_data_type=torch.float32)
    expected = wrapper.run(buffer[:, 0].clone(), batch.cache)
    out = wrapper.run(buffer[:, 0], batch.cache, out=buffer[:, 1])
    assert out.data_ptr() == buffer[:, 1].data_ptr() and torch.equal(out, expected)


@pytest.mark.parametrize("device", devices())
def test_fast_decode_plan_on_a_graph_wrapper_refills_its_buffers(device: str) -> None:
    gen = torch.Generator().manual_seed(4)
    dtype = _dtype(device)
    buffers = [torch.empty(n, dtype=torch.int32, device=device) for n in (5, 64, 4)]
    wrapper = jitattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(_workspace(device), *buffers)
    assert wrapper.is_cuda_graph_enabled
    for step, kv_lens in enumerate(([40, 3, 17, 90], [41, 4, 18, 91], [200, 1, 1, 33])):
        batch = random_paged_batch(kv_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
        q = torch.randn(4, HQ, D, generator=gen).to(dtype).to(device)
        jitattn.ops.decode.fast_decode_plan(wrapper, batch.kv_indptr.to(device), batch.kv_indices.to(device),
                                        batch.kv_last_page_len.to(device), HQ, HKV, D, PAGE, q_data_type=dtype,
                                        global_override_indptr_cpu=batch.kv_indptr)
        assert wrapper._plan.kv_indices.data_ptr() == buffers[1].data_ptr(), "graph mode reads the fixed buffers"
        out = wrapper.run(q, batch.cache)
        assert_close_out(out, _decode_reference(q, batch)[0], dtype)
    with pytest.raises(ValueError, match="batch size"):
        jitattn.fast_decode_plan(wrapper, batch.kv_indptr[:3], batch.kv_indices, batch.kv_last_page_len[:2],
                                 HQ, HKV, D, PAGE, q_data_type=dtype)


# ---- run_return_lse, forward, run() options -----------------------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_forward_options_replace_the_planned_ones(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    dtype = _dtype(device)
    batch = random_paged_batch([50, 7, 130], HKV, D, PAGE, dtype, device=device, generator=gen)
    q = (3 * torch.randn(3, HQ, D, generator=gen)).to(dtype).to(device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    wrapper.begin_forward(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                          q_data_type=dtype)
    plain = wrapper.forward(q, batch.cache)
    assert_close_out(plain, _decode_reference(q, batch)[0], dtype)
    capped, capped_lse = wrapper.forward_return_lse(q, batch.cache, logits_soft_cap=5.0, sm_scale=0.3, window_left=20)
    ref_out, ref_lse = _decode_reference(q, batch, logits_soft_cap=5.0, sm_scale=0.3, window_left=20)
    assert_close_out(capped, ref_out, dtype)
    assert_close_lse(capped_lse, ref_lse)
    assert wrapper._plan.scalars.logits_soft_cap == 5.0
    out, lse = wrapper.run_return_lse(q, batch.cache)
    assert_close_lse(lse, ref_lse)
    with pytest.raises(ValueError, match="window_left"):
        wrapper.run(q, batch.cache, window_left=100)
    with pytest.raises(ValueError, match="sm_scale=0.0"):  # refused: the batch stays planned as it was
        wrapper.forward(q, batch.cache, logits_soft_cap=5.0, sm_scale=0.0, window_left=20)
    assert torch.equal(wrapper.run(q, batch.cache), capped)


def test_a_failed_plan_leaves_no_plan_and_no_planned_options() -> None:
    """A plan() that raises leaves the wrapper without a plan, as every wrapper is after a refused plan: run() and
    forward() say so (the last batch's plan is not run on this batch's tensors), no option is reported as planned
    (vLLM reads _logits_soft_cap), and the next plan() serves as usual; for every wrapper that records its plan()
    arguments, fast_decode_plan included."""
    gen = torch.Generator().manual_seed(9)
    batch = random_paged_batch([50, 7], HKV, D, PAGE, torch.float32, generator=gen)
    q = torch.randn(2, HQ, D, generator=gen)
    bad_indptr = torch.tensor([0, 2, 1], dtype=torch.int32)
    decode = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    table = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
    for plan in (decode.plan, functools.partial(jitattn.fast_decode_plan, decode)):
        plan(*table, q_data_type=torch.float32, logits_soft_cap=0.25)
        with pytest.raises(ValueError, match="indptr|page"):
            plan(bad_indptr, *table[1:6], 0, q_data_type=torch.float32, logits_soft_cap=0.5, window_left=7)
        assert (decode._logits_soft_cap, decode._window_left) == (0.0, -1)
        for call in (lambda: decode.run(q, batch.cache), lambda: decode.forward(q, batch.cache, logits_soft_cap=0.5)):
            with pytest.raises(RuntimeError, match="without a plan"):
                call()
    decode.plan(*table, q_data_type=torch.float32)
    assert_close_out(decode.forward(q, batch.cache, logits_soft_cap=0.5),
                     _decode_reference(q, batch, logits_soft_cap=0.5)[0], torch.float32)

    qo_indptr = torch.tensor([0, 3, 4], dtype=torch.int32)
    k, v, kv_indptr = reference.paged_kv_to_ragged(batch.cache, batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
    ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace("cpu"))
    ragged.plan(qo_indptr, kv_indptr.int(), HQ, HKV, D, q_data_type=torch.float32)
    with pytest.raises(ValueError, match="kv_indptr"):
        ragged.plan(qo_indptr, bad_indptr, HQ, HKV, D, q_data_type=torch.float32, causal=True)
    qp = torch.randn(4, HQ, D, generator=gen)
    with pytest.raises(RuntimeError, match="without a plan"):
        ragged.run(qp, k, v)
    ragged.plan(qo_indptr, kv_indptr.int(), HQ, HKV, D, q_data_type=torch.float32)
    want = reference.batch_ragged_attention(qp, k, v, qo_indptr, kv_indptr, causal=True)[0]
    assert_close_out(ragged.forward(qp, k, v, causal=True), want, torch.float32)  # re-planned: causal


@pytest.mark.parametrize("device", devices())
def test_run_q_scale_multiplies_sm_scale(device: str) -> None:
    gen = torch.Generator().manual_seed(6)
    dtype = _dtype(device)
    batch = random_paged_batch([70, 9], HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(2, HQ, D, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type=dtype)
    out = wrapper.run(q, batch.cache, q_scale=2.5, enable_pdl=True)
    assert_close_out(out, _decode_reference(q, batch, sm_scale=2.5 / D ** 0.5)[0], dtype)
    assert_close_out(wrapper.run(q, batch.cache), _decode_reference(q, batch)[0], dtype)  # not sticky


@pytest.mark.parametrize("device", devices())
def test_prefill_wrappers_run_return_lse_and_forward(device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    dtype = _dtype(device)
    kv_lens = [20, 33, 6]
    qo_indptr = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    batch = random_paged_batch(kv_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(10, HQ, D, generator=gen).to(dtype).to(device)
    paged = jitattn.ops.prefill.BatchPrefillWithPagedKVCacheWrapper(_workspace(device))
    paged.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
               q_data_type=dtype)
    ref_out, ref_lse = reference.batch_prefill_paged(q.cpu(), _cpu(batch.cache), qo_indptr, batch.kv_indptr,
                                                     batch.kv_indices, batch.kv_last_page_len)
    out, lse = paged.run_return_lse(q, batch.cache)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)
    causal_out = paged.forward(q, batch.cache, causal=True)
    ref_causal = reference.batch_prefill_paged(q.cpu(), _cpu(batch.cache), qo_indptr, batch.kv_indptr,
                                               batch.kv_indices, batch.kv_last_page_len, causal=True)[0]
    assert_close_out(causal_out, ref_causal, dtype)

    k, v, kv_indptr = reference.paged_kv_to_ragged(_cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
    ragged = jitattn.ops.prefill.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device))
    ragged.plan(qo_indptr, kv_indptr.int(), HQ, HKV, D, q_data_type=dtype, causal=True)
    k, v = k.to(dtype).to(device), v.to(dtype).to(device)
    out, lse = ragged.forward_return_lse(q, k, v, causal=True)
    assert_close_out(out, ref_causal, dtype)
    assert_close_out(ragged.run_return_lse(q, k, v)[0], ref_causal, dtype)


@pytest.mark.parametrize("device", devices())
def test_ragged_kv_in_hnd_layout_equals_nhd(device: str) -> None:
    gen = torch.Generator().manual_seed(8)
    dtype = _dtype(device)
    qo_indptr = torch.tensor([0, 4, 9], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 30, 41], dtype=torch.int32)
    q = torch.randn(9, HQ, D, generator=gen).to(dtype).to(device)
    k = torch.randn(41, HKV, D, generator=gen).to(dtype).to(device)
    v = torch.randn(41, HKV, D, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device), kv_layout="HND")
    wrapper.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=True, q_data_type=dtype)
    out = wrapper.run(q, k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous())
    ref = reference.batch_ragged_attention(q.cpu(), k.cpu(), v.cpu(), qo_indptr, kv_indptr, causal=True)[0]
    assert_close_out(out, ref, dtype)


# ---- shared-prefix wrappers (FlashInfer's older cascade API) ------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_shared_prefix_decode_and_prefill_wrappers(device: str) -> None:
    gen = torch.Generator().manual_seed(9)
    dtype = _dtype(device)
    shared_len, unique = 45, [10, 3, 28]
    k_shared = torch.randn(shared_len, HKV, D, generator=gen).to(dtype).to(device)
    v_shared = torch.randn(shared_len, HKV, D, generator=gen).to(dtype).to(device)
    batch = random_paged_batch(unique, HKV, D, PAGE, dtype, device=device, generator=gen)
    k_u, v_u, u_indptr = reference.paged_kv_to_ragged(_cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                                      batch.kv_last_page_len)

    def full_kv(r: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = int(u_indptr[r]), int(u_indptr[r + 1])
        return torch.cat([k_shared.cpu(), k_u[lo:hi]]), torch.cat([v_shared.cpu(), v_u[lo:hi]])

    decode = jitattn.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(_workspace(device))
    decode.begin_forward(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                         data_type=dtype)
    q = torch.randn(3, HQ, D, generator=gen).to(dtype).to(device)
    out = decode.forward(q, k_shared, v_shared, batch.cache)
    for r in range(3):
        k, v = full_kv(r)
        assert_close_out(out[r:r + 1], reference.single_attention(q[r:r + 1].cpu(), k, v)[0], dtype)

    qo_indptr = torch.tensor([0, 2, 5, 6], dtype=torch.int32)
    prefill = jitattn.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(_workspace(device))
    prefill.begin_forward(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
    q = torch.randn(6, HQ, D, generator=gen).to(dtype).to(device)
    out = prefill.forward(q, k_shared, v_shared, batch.cache, causal=True)
    for r in range(3):
        k, v = full_kv(r)
        lo, hi = int(qo_indptr[r]), int(qo_indptr[r + 1])
        assert_close_out(out[lo:hi], reference.single_attention(q[lo:hi].cpu(), k, v, causal=True)[0], dtype)


# ---- semantics ---------------------------------------------------------------------------------------------


def test_data_type_fills_only_what_the_caller_did_not_give() -> None:
    from jitattn.runtime.options import resolve_dtypes

    assert resolve_dtypes(None, None, torch.bfloat16) == (torch.bfloat16, torch.bfloat16)
    assert resolve_dtypes(torch.float16, None, torch.float8_e4m3fn) == (torch.float16, torch.float8_e4m3fn)
    assert resolve_dtypes(None, torch.float16, torch.bfloat16) == (torch.bfloat16, torch.float16)
    assert resolve_dtypes(None, None, None) == (torch.float16, torch.float16)
    batch = random_paged_batch([20], HKV, D, PAGE, torch.float32)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                 data_type=torch.float8_e4m3fn, q_data_type=torch.float32)
    assert (wrapper._plan.q_dtype, wrapper._plan.kv_dtype) == (torch.float32, torch.float8_e4m3fn)
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, data_type="float32")
    assert (wrapper._plan.q_dtype, wrapper._plan.kv_dtype) == (torch.float32, torch.float32)


@pytest.mark.parametrize("device", devices())
def test_custom_mask_overrides_causal_even_when_qo_len_exceeds_kv_len(device: str) -> None:
    gen = torch.Generator().manual_seed(10)
    dtype = _dtype(device)
    q = torch.randn(7, HQ, D, generator=gen).to(dtype).to(device)
    k = torch.randn(4, HKV, D, generator=gen).to(dtype).to(device)
    v = torch.randn(4, HKV, D, generator=gen).to(dtype).to(device)
    mask = torch.rand(7, 4, generator=gen) > 0.4
    mask[:, 0] = True
    out = jitattn.single_prefill_with_kv_cache(q, k, v, custom_mask=mask.to(device), causal=True)
    ref = reference.single_attention(q.cpu(), k.cpu(), v.cpu(), custom_mask=mask)[0]
    assert_close_out(out, ref, dtype)


_TIERS = ["cpu", pytest.param("cuda-auto", marks=pytest.mark.gpu), pytest.param("cuda-sm80", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("where", _TIERS)
def test_causal_with_more_queries_than_keys_as_flashinfer(where: str, monkeypatch) -> None:
    """causal=True with qo_len > kv_len is computed, not refused (FlashInfer's ragged custom-mask test plans
    it): the first qo_len - kv_len queries see no key (o = 0, lse = -inf), the rest are bottom-right causal.
    On cuda both tiers (the sm90 tier takes these f16 d64 specs on a 9.0a arch list; sm80 forced)."""
    device = "cpu" if where == "cpu" else "cuda"
    if where == "cuda-sm80":
        monkeypatch.setenv("JITATTN_PREFILL_TIER", "sm80")
    gen = torch.Generator().manual_seed(13)
    dtype = _dtype(device)
    qo_lens, kv_lens = [5, 300, 7, 1, 130], [2, 200, 0, 1, 129]
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    batch = random_paged_batch(kv_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(sum(qo_lens), HQ, D, generator=gen).to(dtype).to(device)
    ref_out, ref_lse = reference.batch_prefill_paged(q.cpu(), _cpu(batch.cache), qo_indptr, batch.kv_indptr,
                                                     batch.kv_indices, batch.kv_last_page_len, causal=True)
    blind = torch.cat([torch.arange(lo, lo + max(qn - kn, 0)) for lo, qn, kn in
                       zip(qo_indptr[:-1].tolist(), qo_lens, kv_lens)])
    assert torch.isneginf(ref_lse[blind]).all() and torch.isfinite(ref_lse[~torch.isin(torch.arange(len(q)), blind)]).all()
    paged = jitattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(device))
    paged.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, causal=True,
               q_data_type=dtype)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((len(q), HQ), float("nan"), device=device)
    paged.run(q, batch.cache, out=out, lse=lse)
    assert (out[blind] == 0).all()
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)

    k, v, kv_indptr = reference.paged_kv_to_ragged(_cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
    ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device))
    ragged.plan(qo_indptr, kv_indptr.int(), HQ, HKV, D, causal=True, q_data_type=dtype)
    out, lse = ragged.run(q, k.to(dtype).to(device), v.to(dtype).to(device), return_lse=True)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)


def _multi_item_reference(q, k, v, prefix_len: int, item_lens: list[int]) -> torch.Tensor:
    """Each token after the prefix attends to the prefix and causally to its own item (delimiter first).

    Built per item from plain causal attention over [prefix, item], independent of the mask rule.
    """
    outs = [reference.single_attention(q[:prefix_len], k[:prefix_len], v[:prefix_len], causal=True)[0]]
    start = prefix_len
    for n in item_lens:
        # the delimiter (position 0 in its item) sees only the prefix; item tokens see the prefix and
        # the item's tokens from the first one after the delimiter up to themselves
        outs.append(reference.single_attention(q[start:start + 1], k[:prefix_len], v[:prefix_len])[0])
        if n:
            kk = torch.cat([k[:prefix_len], k[start + 1:start + 1 + n]])
            vv = torch.cat([v[:prefix_len], v[start + 1:start + 1 + n]])
            outs.append(reference.single_attention(q[start + 1:start + 1 + n], kk, vv, causal=True)[0])
        start += 1 + n
    return torch.cat(outs)


@pytest.mark.parametrize("device", devices())
def test_multi_item_scoring_attends_prefix_and_own_item(device: str) -> None:
    gen = torch.Generator().manual_seed(12)
    dtype = _dtype(device)
    requests = [(9, [3, 2, 4]), (5, [6, 1])]  # (prefix_len, item lengths); a delimiter precedes each item
    seq_lens = [p + sum(n + 1 for n in items) for p, items in requests]
    pad = max(s - p for s, (p, _) in zip(seq_lens, requests)) + 2
    positions = torch.zeros(len(requests) * pad, dtype=torch.int64)
    for r, (p, items) in enumerate(requests):
        pos = [t for n in items for t in range(n + 1)]
        positions[r * pad: r * pad + len(pos)] = torch.tensor(pos)
    batch = random_paged_batch(seq_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
    qo_indptr = torch.tensor([0, seq_lens[0], sum(seq_lens)], dtype=torch.int32)
    q = torch.randn(sum(seq_lens), HQ, D, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(device))
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                 causal=True, q_data_type=dtype, prefix_len_ptr=torch.tensor([p for p, _ in requests]).to(device),
                 token_pos_in_items_ptr=positions.to(torch.int16).to(device), token_pos_in_items_len=pad,
                 max_item_len_ptr=torch.tensor([4, 6], dtype=torch.int16))
    out = wrapper.run(q, batch.cache)
    k, v, kv_indptr = reference.paged_kv_to_ragged(_cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
    for r, (p, items) in enumerate(requests):
        lo, hi = int(qo_indptr[r]), int(qo_indptr[r + 1])
        klo, khi = int(kv_indptr[r]), int(kv_indptr[r + 1])
        ref = _multi_item_reference(q[lo:hi].cpu(), k[klo:khi], v[klo:khi], p, items)
        assert_close_out(out[lo:hi], ref, dtype)


@pytest.mark.parametrize("device", devices())
def test_multi_item_rows_past_the_tensors_end_are_its_zero_padding(device: str) -> None:
    """FlashInfer's batch-2 Hopper test passes token_pos_in_items_ptr (uint16) with the last request's row cut
    short: the entries past the tensor's end are the row's zero padding, so those tokens are delimiters (they see
    the prefix only). A row longer than token_pos_in_items_len is refused."""
    gen = torch.Generator().manual_seed(17)
    dtype = _dtype(device)
    # request 1: items [6, 1], then two tokens whose positions the tensor leaves off (= items of length 0)
    requests, given = [(9, [3, 2, 4]), (5, [6, 1, 0, 0])], [(9, [3, 2, 4]), (5, [6, 1])]
    seq_lens = [p + sum(n + 1 for n in items) for p, items in requests]
    pad = 14
    rows = [[t for n in items for t in range(n + 1)] for _, items in given]
    positions = torch.tensor(rows[0] + [0] * (pad - len(rows[0])) + rows[1], dtype=torch.int32)
    assert positions.numel() == pad + seq_lens[1] - 5 - 2
    batch = random_paged_batch(seq_lens, HKV, D, PAGE, dtype, device=device, generator=gen)
    qo_indptr = torch.tensor([0, seq_lens[0], sum(seq_lens)], dtype=torch.int32)
    q = torch.randn(sum(seq_lens), HQ, D, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(device))
    plan = dict(causal=True, q_data_type=dtype, prefix_len_ptr=torch.tensor([9, 5]).to(torch.uint32).to(device),
                token_pos_in_items_ptr=positions.to(torch.uint16).to(device), token_pos_in_items_len=pad)
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, **plan)
    out = wrapper.run(q, batch.cache)
    k, v, kv_indptr = reference.paged_kv_to_ragged(_cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
    for r, (p, items) in enumerate(requests):
        lo, hi = int(qo_indptr[r]), int(qo_indptr[r + 1])
        klo, khi = int(kv_indptr[r]), int(kv_indptr[r + 1])
        assert_close_out(out[lo:hi], _multi_item_reference(q[lo:hi].cpu(), k[klo:khi], v[klo:khi], p, items), dtype)
    with pytest.raises(ValueError, match="request 0 has 12 tokens after its prefix, but token_pos_in_items_len is 11"):
        wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     **{**plan, "token_pos_in_items_len": 11})


@pytest.mark.parametrize("call", [
    lambda w, b: w.plan(b.kv_indptr, b.kv_indices, b.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type="float32",
                        block_tables=torch.zeros(1, 2, dtype=torch.int32)),
    lambda w, b: w.plan(b.kv_indptr, b.kv_indices, b.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type="float32",
                        seq_lens=torch.tensor([20])),
], ids=["block_tables", "seq_lens"])
def test_unimplemented_decode_arguments_are_refused_by_name(call) -> None:
    batch = random_paged_batch([20], HKV, D, PAGE, torch.float32)
    with pytest.raises(NotImplementedError, match="block_tables|seq_lens"):
        call(jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu")), batch)


@pytest.mark.parametrize("argument", ["seq_lens", "seq_lens_q", "block_tables", "max_token_per_sequence",
                                      "max_sequence_kv"])
def test_unimplemented_prefill_arguments_are_refused_by_name(argument: str) -> None:
    batch = random_paged_batch([20], HKV, D, PAGE, torch.float32)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(_workspace("cpu"))
    with pytest.raises(NotImplementedError, match=argument):
        wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), batch.kv_indptr, batch.kv_indices,
                     batch.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type="float32", **{argument: 4})


def test_unimplemented_run_and_constructor_arguments_are_refused_by_name() -> None:
    # (sinks are implemented: tests/test_sinks.py)
    batch = random_paged_batch([20], HKV, D, PAGE, torch.float32)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type="float32")
    q = torch.randn(1, HQ, D)
    with pytest.raises(NotImplementedError, match="q_len_per_req"):
        wrapper.run(q, batch.cache, q_len_per_req=2)
    with pytest.raises(NotImplementedError, match="jit_args"):
        jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"), jit_args=["x"])
    with pytest.raises(NotImplementedError, match="jit_kwargs"):
        jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace("cpu"), jit_kwargs={"x": 1})
    with pytest.raises(NotImplementedError, match="per-head"):
        jitattn.single_prefill_with_kv_cache(torch.randn(2, HQ, D), torch.randn(5, HKV, D), torch.randn(5, HKV, D),
                                             scale_q=torch.ones(HQ))


@pytest.mark.parametrize("device", devices())
def test_single_prefill_scales_and_output_dtype(device: str) -> None:
    gen = torch.Generator().manual_seed(13)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    q = torch.randn(5, HQ, D, generator=gen).to(dtype).to(device)
    k = torch.randn(12, HKV, D, generator=gen).to(dtype).to(device)
    v = torch.randn(12, HKV, D, generator=gen).to(dtype).to(device)
    out, lse = jitattn.single_prefill_with_kv_cache_return_lse(
        q, k, v, scale_q=torch.tensor([0.5]), scale_k=2.0, scale_v=3.0, o_dtype=torch.float32, causal=True,
        backend="fa3")
    ref_out, ref_lse = reference.single_attention(q.cpu(), k.cpu(), v.cpu(), causal=True, sm_scale=1.0 / D ** 0.5,
                                                  v_scale=3.0)
    assert out.dtype == torch.float32
    assert_close_out(out, ref_out, torch.bfloat16 if device != "cpu" else torch.float32)
    assert_close_lse(lse, ref_lse)


# ---- edges: empty batches, empty pools, empty levels, kv_len 0, bad arguments -----------------------------


def _expect_empty(out: torch.Tensor, lse: torch.Tensor) -> None:
    assert torch.equal(out.float().cpu(), torch.zeros(out.shape)), "a request with no key must give 0"
    assert torch.isneginf(lse.cpu()).all(), "a request with no key must give lse -inf"


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case", ["no_requests", "all_kv_len_0", "pool_of_0_pages"])
def test_empty_decode_and_prefill_batches(device: str, case: str) -> None:
    dtype = _dtype(device)
    batch_size = 0 if case == "no_requests" else 3
    indptr = torch.zeros(batch_size + 1, dtype=torch.int32)
    indices = torch.zeros(0, dtype=torch.int32)
    last = torch.zeros(batch_size, dtype=torch.int32)
    pages = 0 if case == "pool_of_0_pages" else 4
    cache = torch.randn(pages, 2, PAGE, HKV, D).to(dtype).to(device)
    q = torch.randn(batch_size, HQ, D).to(dtype).to(device)

    decode = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    decode.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype)
    out, lse = decode.run(q, cache, out=torch.full_like(q, float("nan")), return_lse=True)
    assert out.shape == (batch_size, HQ, D)
    _expect_empty(out, lse)

    prefill = jitattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(device))
    qo_indptr = torch.arange(batch_size + 1, dtype=torch.int32) * 2
    prefill.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype, causal=False)
    q2 = torch.randn(2 * batch_size, HQ, D).to(dtype).to(device)
    out, lse = prefill.run(q2, cache, out=torch.full_like(q2, float("nan")), return_lse=True)
    _expect_empty(out, lse)


@pytest.mark.parametrize("device", devices())
def test_single_request_functions_with_kv_len_0(device: str) -> None:
    """No key: every query row gets output 0 and LSE -inf (poisoned outputs would show as NaN)."""
    dtype = _dtype(device)
    empty_nhd = torch.zeros(0, HKV, D, dtype=dtype, device=device)
    empty_hnd = torch.zeros(HKV, 0, D, dtype=dtype, device=device)
    calls = {
        "decode NHD": lambda: jitattn.single_decode_with_kv_cache(
            torch.randn(HQ, D).to(dtype).to(device), empty_nhd, empty_nhd, return_lse=True),
        "decode HND": lambda: jitattn.single_decode_with_kv_cache(
            torch.randn(HQ, D).to(dtype).to(device), empty_hnd, empty_hnd, kv_layout="HND", return_lse=True),
        "prefill NHD": lambda: jitattn.single_prefill_with_kv_cache(
            torch.randn(3, HQ, D).to(dtype).to(device), empty_nhd, empty_nhd, return_lse=True),
    }
    for what, call in calls.items():
        out, lse = call()
        assert out.shape[-2:] == (HQ, D) and lse.shape == out.shape[:-1], what
        assert torch.equal(out.float().cpu(), torch.zeros(out.shape)), f"{what}: a request with no key must give 0"
        assert torch.isneginf(lse.cpu()).all(), f"{what}: a request with no key must give lse -inf"


@pytest.mark.parametrize("device", devices())
def test_cascade_level_whose_nodes_are_all_empty(device: str) -> None:
    gen = torch.Generator().manual_seed(14)
    dtype = _dtype(device)
    batch = random_paged_batch([30, 12], HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(2, HQ, D, generator=gen).to(dtype).to(device)
    empty_level = (torch.tensor([0, 0], dtype=torch.int32), torch.zeros(0, dtype=torch.int32),
                   torch.zeros(1, dtype=torch.int32))
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, _workspace(device))
    wrapper.plan([torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)],
                 [empty_level[0], batch.kv_indptr], [empty_level[1], batch.kv_indices],
                 [empty_level[2], batch.kv_last_page_len], HQ, HKV, D, PAGE, q_data_type=dtype)
    out, lse = wrapper.run_return_lse(q, batch.cache)
    ref_out, ref_lse = _decode_reference(q, batch)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)
    # every level empty: 0 and -inf
    wrapper.plan([torch.tensor([0, 2], dtype=torch.int32)] * 2, [empty_level[0]] * 2, [empty_level[1]] * 2,
                 [empty_level[2]] * 2, HQ, HKV, D, PAGE, q_data_type=dtype)
    _expect_empty(*wrapper.run_return_lse(q, batch.cache))


def test_bad_head_dim_and_meta_indices_are_value_errors() -> None:
    batch = random_paged_batch([20], HKV, D, PAGE, torch.float32)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    for head_dim in (0, -8, 64.0):
        with pytest.raises(ValueError, match="head_dim"):
            wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, head_dim, PAGE,
                         q_data_type="float32")
    with pytest.raises(ValueError, match="head_dim_qk"):
        jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace("cpu")).plan(
            torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), HQ, HKV, 0)
    with pytest.raises(ValueError, match="meta"):
        wrapper.plan(batch.kv_indptr.to("meta"), batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     q_data_type="float32")


@pytest.mark.gpu
def test_misaligned_fp8_kv_views_are_refused_naming_the_fix() -> None:
    gen = torch.Generator().manual_seed(15)
    pool = torch.randn(6, 2, PAGE, HKV, D + 4, generator=gen).to(torch.float8_e4m3fn).cuda()
    k, v = pool[:, 0, :, :, :D], pool[:, 1, :, :, :D]  # rows of D + 4 bytes: not 16-byte aligned
    indptr, indices, last = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([1, 4], dtype=torch.int32),
                             torch.tensor([5], dtype=torch.int32))
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cuda"))
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.float16,
                 kv_data_type=torch.float8_e4m3fn)
    q = torch.randn(1, HQ, D, dtype=torch.float16, device="cuda")
    with pytest.raises(ValueError, match=r"contiguous\(\)"):
        wrapper.run(q, (k, v))
    out = wrapper.run(q, (k.contiguous(), v.contiguous()))
    ref = reference.batch_decode_paged(q.cpu(), (k.cpu(), v.cpu()), indptr, indices, last)[0]
    assert_close_out(out, ref, torch.float16)


def test_forward_after_fast_decode_plan_with_other_options_is_refused() -> None:
    batch = random_paged_batch([20, 5], HKV, D, PAGE, torch.float32)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    jitattn.fast_decode_plan(wrapper, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                             q_data_type="float32")
    q = torch.randn(2, HQ, D)
    assert_close_out(wrapper.forward(q, batch.cache), _decode_reference(q, batch)[0], torch.float32)
    with pytest.raises(ValueError, match="fast_decode_plan"):
        wrapper.forward(q, batch.cache, logits_soft_cap=10.0)


# ---- run(): checks once per signature, pointers every call ---------------------------------------------------


@pytest.mark.parametrize("device", devices())
def test_repeated_runs_follow_each_calls_tensors(device: str) -> None:
    """Same-signature calls skip the checks but must use each call's own cache, q, out and lse."""
    gen = torch.Generator().manual_seed(16)
    dtype = _dtype(device)
    batches = [random_paged_batch([40, 9, 70], HKV, D, PAGE, dtype, device=device, generator=gen) for _ in range(2)]
    b2 = batches[1]
    b2.kv_indptr, b2.kv_indices, b2.kv_last_page_len = (batches[0].kv_indptr, batches[0].kv_indices,
                                                        batches[0].kv_last_page_len)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
    b0 = batches[0]
    wrapper.plan(b0.kv_indptr, b0.kv_indices, b0.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type=dtype)
    wide = torch.full((3, HQ, 2 * D), float("nan"), dtype=dtype, device=device)
    for step in range(3):
        for batch in batches:
            q = torch.randn(3, HQ, D, generator=gen).to(dtype).to(device)
            ref_out, ref_lse = _decode_reference(q, batch)
            out, lse = wrapper.run(q, batch.cache, return_lse=True)  # fresh outputs
            assert_close_out(out, ref_out, dtype)
            assert_close_lse(lse, ref_lse)
            k, v = batch.cache[:, 0], batch.cache[:, 1]
            view = wide[..., D:] if step % 2 else wide[..., :D]  # a strided out, then another one
            result = wrapper.run(q, (k, v), out=view)
            assert result.data_ptr() == view.data_ptr()
            assert_close_out(view, ref_out, dtype)
    with pytest.raises(ValueError, match="out has shape"):
        wrapper.run(q, b0.cache, out=torch.empty(3, HQ, D + 8, dtype=dtype, device=device))
    with pytest.raises(TypeError, match="kv cache dtype"):
        wrapper.run(q, b0.cache.to(torch.bfloat16 if dtype != torch.bfloat16 else torch.float16))


def test_a_replaced_workspace_is_checked_again_before_the_next_run() -> None:
    batch = random_paged_batch([3000, 2500], HKV, D, PAGE, torch.float32)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace("cpu"))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type="float32",
                 fixed_split_size=4)
    q = torch.randn(2, HQ, D)
    wrapper.run(q, batch.cache)
    wrapper.reset_workspace_buffer(torch.empty(64, dtype=torch.uint8), None)
    with pytest.raises(ValueError, match="bytes of float workspace"):
        wrapper.run(q, batch.cache)

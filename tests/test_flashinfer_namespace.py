"""``jitattn.flashinfer``: FlashInfer's base-2 LSE at every edge, the native API untouched, ``install()``.

Every call of the namespace that returns an LSE (or writes a caller's ``lse`` buffer) is compared with the
same call of the native API on the same inputs: the outputs are equal and the LSE is the native one times
log2(e); the native one is checked against ``jitattn.reference`` (natural log) beside it, so the pair pins
both conventions. The merges take base-2 states and equal the native merges of the natural-log ones.
"""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch

import jitattn
import jitattn.flashinfer as fi
from jitattn import reference

from attention_cases import assert_close_lse, assert_close_out, cascade_level, devices, random_paged_batch

PAGE = 16
HQ, HKV, D = 8, 2, 64
LOG2E = 1.0 / math.log(2.0)


def _workspace(device: str) -> torch.Tensor:
    return torch.empty(16 << 20, dtype=torch.uint8, device=device)


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.float16


def _cpu(cache):
    return tuple(t.cpu() for t in cache) if isinstance(cache, tuple) else cache.cpu()


def _assert_base2_of(fi_result, native_result, ref_lse=None) -> None:
    """``fi_result`` = ``native_result`` with the LSE times log2(e) (and the native LSE = the reference's)."""
    (fi_out, fi_lse), (native_out, native_lse) = fi_result, native_result
    assert torch.equal(fi_out, native_out)
    torch.testing.assert_close(fi_lse, native_lse * LOG2E, atol=1e-5, rtol=1e-6)
    if ref_lse is not None:
        assert_close_lse(native_lse, ref_lse)
        assert_close_lse(fi_lse, ref_lse * LOG2E)


def _decode_case(device: str, gen: torch.Generator):
    dtype = _dtype(device)
    batch = random_paged_batch([20, 33, 1, 70], HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(4, HQ, D, generator=gen).to(dtype).to(device)
    ref = reference.batch_decode_paged(q.cpu(), _cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                       batch.kv_last_page_len)
    return dtype, batch, q, ref


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("call", ["run", "run_return_lse", "forward_return_lse", "lse_buffer", "both"])
def test_decode_wrapper_returns_base2_lse(device: str, call: str) -> None:
    gen = torch.Generator().manual_seed(1)
    dtype, batch, q, (ref_out, ref_lse) = _decode_case(device, gen)
    results = []
    for module in (fi, jitattn):
        wrapper = module.BatchDecodeWithPagedKVCacheWrapper(_workspace(device))
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     q_data_type=dtype, fixed_split_size=1)  # split-KV: the merged lse is the one converted
        if call == "run":
            results.append(wrapper.run(q, batch.cache, return_lse=True))
        elif call == "run_return_lse":
            results.append(wrapper.run_return_lse(q, batch.cache))
        elif call == "forward_return_lse":
            results.append(wrapper.forward_return_lse(q, batch.cache))
        else:  # the caller's lse buffer, poisoned: written in base 2 whether or not it is also returned
            lse = torch.full((4, HQ), 7777.0, device=device)
            out = wrapper.run(q, batch.cache, lse=lse, return_lse=call == "both")
            if call == "both":
                assert out[1] is lse
                out = out[0]
            results.append((out, lse))
    _assert_base2_of(*results, ref_lse)
    assert_close_out(results[0][0], ref_out, dtype)


@pytest.mark.parametrize("device", devices())
def test_single_decode_and_single_prefill_return_base2_lse(device: str) -> None:
    gen = torch.Generator().manual_seed(2)
    dtype = _dtype(device)
    q = torch.randn(HQ, D, generator=gen).to(dtype).to(device)
    k = torch.randn(50, HKV, D, generator=gen).to(dtype).to(device)
    v = torch.randn(50, HKV, D, generator=gen).to(dtype).to(device)
    ref_lse = reference.single_attention(q[None].cpu(), k.cpu(), v.cpu())[1][0]
    # return_lse passed by position too: the conversion follows the returned pair, not the keyword
    _assert_base2_of(fi.single_decode_with_kv_cache(q, k, v, "NHD", "NONE", False, None, None, None, -1, None, None,
                                                    None, None, True),
                     jitattn.single_decode_with_kv_cache(q, k, v, return_lse=True), ref_lse)
    assert isinstance(fi.single_decode_with_kv_cache(q, k, v), torch.Tensor)
    qp = torch.randn(9, HQ, D, generator=gen).to(dtype).to(device)
    ref_lse = reference.single_attention(qp.cpu(), k.cpu(), v.cpu(), causal=True)[1]
    _assert_base2_of(fi.single_prefill_with_kv_cache_return_lse(qp, k, v, causal=True),
                     jitattn.single_prefill_with_kv_cache(qp, k, v, causal=True, return_lse=True), ref_lse)
    _assert_base2_of(fi.single_prefill_with_kv_cache(qp, k, v, causal=True, return_lse=True),
                     jitattn.single_prefill_with_kv_cache_return_lse(qp, k, v, causal=True), ref_lse)


@pytest.mark.parametrize("device", devices())
def test_prefill_wrappers_return_base2_lse(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    dtype = _dtype(device)
    qo_indptr = torch.tensor([0, 3, 4, 10], dtype=torch.int32)
    batch = random_paged_batch([20, 33, 6], HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(10, HQ, D, generator=gen).to(dtype).to(device)
    ref_lse = reference.batch_prefill_paged(q.cpu(), _cpu(batch.cache), qo_indptr, batch.kv_indptr,
                                            batch.kv_indices, batch.kv_last_page_len, causal=True)[1]
    paged = []
    for module in (fi, jitattn):
        wrapper = module.BatchPrefillWithPagedKVCacheWrapper(_workspace(device))
        wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     causal=True, q_data_type=dtype)
        paged.append(wrapper)
    _assert_base2_of(paged[0].run(q, batch.cache, return_lse=True), paged[1].run_return_lse(q, batch.cache), ref_lse)
    _assert_base2_of(paged[0].run_return_lse(q, batch.cache), paged[1].run_return_lse(q, batch.cache), ref_lse)
    _assert_base2_of(paged[0].forward_return_lse(q, batch.cache, causal=True),
                     paged[1].forward_return_lse(q, batch.cache, causal=True), ref_lse)

    k, v, kv_indptr = reference.paged_kv_to_ragged(_cpu(batch.cache), batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
    k, v = k.to(dtype).to(device), v.to(dtype).to(device)
    ragged = []
    for module in (fi, jitattn):
        wrapper = module.BatchPrefillWithRaggedKVCacheWrapper(_workspace(device))
        wrapper.plan(qo_indptr, kv_indptr.int(), HQ, HKV, D, causal=True, q_data_type=dtype)
        ragged.append(wrapper)
    _assert_base2_of(ragged[0].run_return_lse(q, k, v), ragged[1].run_return_lse(q, k, v), ref_lse)
    _assert_base2_of(ragged[0].forward_return_lse(q, k, v, causal=True),
                     ragged[1].forward_return_lse(q, k, v, causal=True), ref_lse)
    lse = torch.full((10, HQ), 7777.0, device=device)
    out = ragged[0].run(q, k, v, lse=lse)
    _assert_base2_of((out, lse), ragged[1].run_return_lse(q, k, v), ref_lse)


@pytest.mark.parametrize("device", devices())
def test_multi_level_cascade_returns_base2_lse_on_every_run(device: str) -> None:
    """Two runs in a row: the lse the cascade returns may be a scratch buffer of the plan; converting it
    in place must not leak into the next run."""
    gen = torch.Generator().manual_seed(4)
    dtype = torch.float16
    pool = torch.randperm(40, generator=gen).tolist()
    cache = torch.randn(40, 2, PAGE, HKV, D, generator=gen).to(dtype).to(device)
    levels = [cascade_level(level, pool, PAGE) for level in ([70], [5, 30, 0])]
    qo_arr = [torch.tensor([0, 3], dtype=torch.int32), torch.arange(4, dtype=torch.int32)]
    q = torch.randn(3, HQ, D, generator=gen).to(dtype).to(device)
    wrappers = []
    for module in (fi, jitattn):
        wrapper = module.MultiLevelCascadeAttentionWrapper(2, _workspace(device))
        wrapper.plan(qo_arr, [lv[0] for lv in levels], [lv[1] for lv in levels], [lv[2] for lv in levels],
                     HQ, HKV, D, PAGE, q_data_type=dtype, fixed_split_size=2)
        wrappers.append(wrapper)
    native = wrappers[1].run(q, cache, return_lse=True)
    native = (native[0].clone(), native[1].clone())
    for _ in range(2):
        _assert_base2_of(wrappers[0].run(q, cache, return_lse=True), native)
    _assert_base2_of(wrappers[0].run_return_lse(q, cache), native)
    _assert_base2_of(wrappers[0].forward_return_lse(q, cache), native)


@pytest.mark.parametrize("device", devices())
def test_sink_wrapper_returns_flashinfers_lse_with_the_sink_in_it(device: str) -> None:
    """FlashInfer's sink variant takes its LSE of the normaliser with the sink in it: base 2 of (the keys' sum +
    e^sink); the native wrapper's is the keys' alone (natural log). Through the returned pair and an lse buffer."""
    gen = torch.Generator().manual_seed(5)
    dtype = torch.float16
    qo_indptr = torch.tensor([0, 5, 12], dtype=torch.int32)
    batch = random_paged_batch([30, 40], HKV, D, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(12, HQ, D, generator=gen).to(dtype).to(device)
    sinks = (torch.randn(HQ, generator=gen) * 3 + 2).to(device)
    results = []
    for module in (fi, jitattn):
        wrapper = module.BatchAttentionWithAttentionSinkWrapper(_workspace(device), q_data_type=dtype,
                                                                kv_data_type=dtype, head_dim_qk=D, head_dim_vo=D)
        wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     causal=True, q_data_type=dtype, kv_data_type=dtype)
        results.append(wrapper.run(q, batch.cache, sinks, return_lse=True))
        if module is fi:
            lse = torch.full((12, HQ), float("nan"), device=device)
            buffered = wrapper.run(q, batch.cache, sinks=sinks, lse=lse)
    (fi_out, fi_lse), (native_out, native_lse) = results
    assert torch.equal(fi_out, native_out) and torch.equal(buffered, fi_out)
    with_sink = torch.logaddexp(native_lse, sinks)  # natural log of (the keys' sum + e^sink), per head
    torch.testing.assert_close(fi_lse, with_sink * LOG2E, atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(lse, fi_lse, atol=1e-6, rtol=0)
    assert (fi_lse - native_lse * LOG2E).max() > 0.1  # the sink counted (these sinks are not negligible)


def _mla_case(device: str, gen: torch.Generator):
    from test_mla import CKV, KPE, SM_SCALE, _indptr, _latent_cache, _queries, _reference

    dtype = torch.bfloat16
    kv_lens, qo_lens, heads, page = [37, 1, 80], [1, 1, 1], 16, 16
    ckv, kpe, kv_indptr, kv_indices, kv_len_arr = _latent_cache(kv_lens, page, dtype, device, gen, joined=True)
    q_nope, q_pe = _queries(qo_lens, heads, dtype, device, gen)
    ref_lse = _reference(q_nope, q_pe, ckv, kpe, kv_indptr, kv_indices, qo_lens, kv_lens, causal=False)[1]
    plan = (_indptr(qo_lens), kv_indptr, kv_indices, kv_len_arr, heads, CKV, KPE, page, False, SM_SCALE, dtype, dtype)
    return plan, (q_nope, q_pe, ckv, kpe), ref_lse


@pytest.mark.parametrize("device", devices())
def test_mla_lse_is_base2_unless_return_lse_base_on_e(device: str) -> None:
    gen = torch.Generator().manual_seed(6)
    plan, tensors, ref_lse = _mla_case(device, gen)
    results = []
    for module in (fi, jitattn):
        wrapper = module.BatchMLAPagedAttentionWrapper(_workspace(device))
        wrapper.plan(*plan)
        results.append(wrapper)
    assert (results[0]._causal, results[0]._sm_scale, results[0]._page_size) == (plan[8], plan[9], plan[7])
    native = results[1].run(*tensors, return_lse=True)
    _assert_base2_of(results[0].run(*tensors, return_lse=True), native, ref_lse)
    _assert_base2_of(results[0].run_return_lse(*tensors), native)
    lse = torch.full_like(native[1], 7777.0)
    out = results[0].run(*tensors, None, lse)  # out and lse by position, as FlashInfer's signature allows
    _assert_base2_of((out, lse), native)
    on_e = results[0].run(*tensors, return_lse=True, return_lse_base_on_e=True)
    assert torch.equal(on_e[0], native[0]) and torch.equal(on_e[1], native[1])
    assert_close_lse(on_e[1], ref_lse)
    # the native API keeps the natural log whatever the flag says (documented)
    assert torch.equal(results[1].run(*tensors, return_lse=True, return_lse_base_on_e=False)[1], native[1])


# -- merges ----------------------------------------------------------------------------------------

def _states(gen: torch.Generator, device: str, *shape: int):
    v = torch.randn(*shape, D, generator=gen).to(device)
    s = (torch.randn(*shape, generator=gen) * 4).to(device)
    return v, s


@pytest.mark.parametrize("device", devices())
def test_merges_take_and_return_base2_lse(device: str) -> None:
    gen = torch.Generator().manual_seed(7)
    (v_a, s_a), (v_b, s_b) = _states(gen, device, 6, HQ), _states(gen, device, 6, HQ)
    s_b[2] = float("-inf")  # an empty state
    ln2 = math.log(2.0)
    v, s = fi.merge_state(v_a, s_a, v_b, s_b)
    v_nat, s_nat = jitattn.merge_state(v_a, s_a * ln2, v_b, s_b * ln2)
    torch.testing.assert_close(v, v_nat)
    torch.testing.assert_close(s, s_nat * LOG2E)
    # base 2 by hand: log2(2^a + 2^b)
    torch.testing.assert_close(s, torch.logaddexp2(s_a, s_b), atol=1e-5, rtol=1e-6)

    vs, ss = _states(gen, device, 6, 3, HQ)
    v, s = fi.merge_states(vs, ss)
    v_nat, s_nat = jitattn.merge_states(vs, ss * ln2)
    torch.testing.assert_close(v, v_nat)
    torch.testing.assert_close(s, s_nat * LOG2E)

    mask = torch.tensor([True, False, True, True, False, True], device=device)
    v_in, s_in = v_a.clone(), s_a.clone()
    fi.merge_state_in_place(v_in, s_in, v_b, s_b, mask)
    v_nat, s_nat = v_a.clone(), s_a * ln2
    jitattn.merge_state_in_place(v_nat, s_nat, v_b, s_b * ln2, mask)
    torch.testing.assert_close(v_in, v_nat)
    torch.testing.assert_close(s_in, s_nat * LOG2E)
    assert torch.equal(s_in[~mask], s_a[~mask]), "rows the mask leaves alone keep their exact bits"
    assert torch.equal(v_in[~mask], v_a[~mask])
    with pytest.raises(TypeError, match="s_b must be a float32 torch.Tensor"):
        fi.merge_state(v_a, s_a, v_b, [0.0])
    v_in, s_in = v_a.clone(), s_a[:1].expand_as(s_a)  # an s whose rows share memory: refused before v is written
    with pytest.raises(ValueError, match="^s .* has elements that share memory"):
        fi.merge_state_in_place(v_in, s_in, v_b, s_b)
    assert torch.equal(v_in, v_a)
    # LSEs of another float dtype are read as float32, as FlashInfer's merges read them; an in-place merge's own s
    # stays float32 (FlashInfer's would update a float32 copy and leave the caller's s as it was)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        v, s = fi.merge_state(v_a, s_a.to(dtype), v_b, s_b.to(dtype))
        v32, s32 = fi.merge_state(v_a, s_a.to(dtype).float(), v_b, s_b.to(dtype).float())
        assert s.dtype == torch.float32 and torch.equal(v, v32) and torch.equal(s, s32)
        assert torch.equal(fi.merge_states(vs, ss.to(dtype))[0], fi.merge_states(vs, ss.to(dtype).float())[0])
    with pytest.raises(TypeError, match="^s has dtype float16"):
        fi.merge_state_in_place(v_a.clone(), s_a.half(), v_b, s_b)
    with pytest.raises(TypeError, match="s_a has dtype int32"):
        fi.merge_state(v_a, s_a.int(), v_b, s_b)


# -- the namespace itself --------------------------------------------------------------------------

def test_native_api_keeps_the_natural_log() -> None:
    """The namespace's classes are subclasses; the native ones are not changed by importing it."""
    assert fi.BatchDecodeWithPagedKVCacheWrapper is not jitattn.BatchDecodeWithPagedKVCacheWrapper
    assert issubclass(fi.BatchDecodeWithPagedKVCacheWrapper, jitattn.BatchDecodeWithPagedKVCacheWrapper)
    assert issubclass(fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper, fi.BatchDecodeWithPagedKVCacheWrapper)
    assert issubclass(fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
                      jitattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper)
    assert jitattn.merge_state is not fi.merge_state
    assert fi.single_prefill_with_kv_cache_return_lse.keywords == {"return_lse": True}
    assert fi.single_prefill_with_kv_cache_return_lse.func is fi.single_prefill_with_kv_cache
    assert fi.__version__ == "0.5.3"  # the FlashInfer API it follows (engines compare flashinfer.__version__)


def test_install_maps_flashinfer_and_its_submodules(monkeypatch) -> None:
    for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    assert fi.install() is fi
    assert fi.install() is fi  # twice: a no-op
    try:
        import flashinfer
        from flashinfer.decode import BatchDecodeWithPagedKVCacheWrapper
        from flashinfer.mla import BatchMLAPagedAttentionWrapper

        assert flashinfer is fi and BatchDecodeWithPagedKVCacheWrapper is fi.BatchDecodeWithPagedKVCacheWrapper
        assert BatchMLAPagedAttentionWrapper is fi.BatchMLAPagedAttentionWrapper
        for sub in ("attention", "cascade", "decode", "mla", "page", "pod", "prefill", "rope", "sparse"):
            assert sys.modules[f"flashinfer.{sub}"] is getattr(fi, sub)
    finally:
        for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
            del sys.modules[name]


def test_install_over_an_imported_flashinfer_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    with pytest.raises(RuntimeError, match="already imported.*before anything imports flashinfer"):
        fi.install()
    assert sys.modules["flashinfer"] is not fi


def test_the_helpers_engines_import_from_flashinfer_decode(monkeypatch) -> None:
    """SGLang's and vLLM's FlashInfer backends import ``_get_range_buf`` and ``get_seq_lens`` from
    ``flashinfer.decode``; ``get_seq_lens`` is FlashInfer's arithmetic (a request without pages gets its
    last_page_len, the inputs' dtype kept), where ``jitattn.get_seq_lens`` gives the 0 tokens the kernels read."""
    for name in [n for n in sys.modules if n == "flashinfer" or n.startswith("flashinfer.")]:
        monkeypatch.delitem(sys.modules, name)
    fi.install()
    from flashinfer.decode import _get_range_buf, get_seq_lens

    assert torch.equal(_get_range_buf(5, torch.device("cpu")), torch.arange(5, dtype=torch.int32))
    assert _get_range_buf(0, "cpu").numel() == 0 and _get_range_buf(9, "cpu").tolist() == list(range(9))
    indptr, last = torch.tensor([0, 0, 2, 5], dtype=torch.int32), torch.tensor([5, 3, 16], dtype=torch.int32)
    assert get_seq_lens(indptr, last, 16).tolist() == [5, 19, 48]
    assert jitattn.get_seq_lens(indptr, last, 16).tolist() == [0, 19, 48]
    assert get_seq_lens(indptr.long(), last.long(), 16).dtype == torch.int64


def test_packbits_and_segment_packbits_are_numpys() -> None:
    np = pytest.importorskip("numpy")
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        n = int(torch.randint(0, 50, (1,), generator=gen))
        x = torch.randint(0, 2, (n,), generator=gen).bool()
        cuts = sorted(torch.randint(0, n + 1, (3,), generator=gen).tolist())
        indptr = torch.tensor([0, *cuts, n])
        for order in ("big", "little"):
            assert fi.packbits(x, order).tolist() == np.packbits(x.numpy(), bitorder=order).tolist()
            packed, new_indptr = fi.segment_packbits(x, indptr, order)
            for i in range(len(cuts) + 1):
                got = packed[new_indptr[i]:new_indptr[i + 1]].tolist()
                assert got == np.packbits(x[indptr[i]:indptr[i + 1]].numpy(), bitorder=order).tolist()
    for _ in range(20):  # many segments, empty ones among them, and segments of whole bytes
        lens = torch.randint(0, 40, (int(torch.randint(0, 30, (1,), generator=gen)),), generator=gen)
        lens[::3] = 0
        lens[1::5] = 16
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        x = torch.randint(0, 3, (int(indptr[-1]),), generator=gen, dtype=torch.int32)  # nonzero: a 1 bit
        for order in ("big", "little"):
            packed, new_indptr = fi.segment_packbits(x, indptr, order)
            want = [np.packbits(x[indptr[i]:indptr[i + 1]].numpy() != 0, bitorder=order) for i in range(len(lens))]
            assert packed.tolist() == [int(b) for w in want for b in w]
            assert new_indptr.tolist() == [0, *np.cumsum([len(w) for w in want]).tolist()]
    with pytest.raises(ValueError, match="indptr must start at 0"):
        fi.segment_packbits(torch.ones(4, dtype=torch.bool), torch.tensor([0, 5]))
    for indptr in (torch.tensor([0, 3], dtype=torch.complex64), torch.tensor([False, True]), torch.tensor([0.0, 3.0])):
        with pytest.raises(ValueError, match="indptr must be a 1-D integer tensor"):  # complex and bool were taken
            fi.segment_packbits(torch.ones(3), indptr)
    with pytest.raises(ValueError, match="bitorder"):
        fi.packbits(torch.ones(4, dtype=torch.bool), "middle")

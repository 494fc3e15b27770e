"""Bad inputs to the ops beside attention (shared-prefix and cascade wrappers, merges, appends, page helpers, MLA,
activations): each is refused with an error naming the argument and the fix, before anything is written; and the
inputs FlashInfer takes (a 1-D activation input) are taken."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import jitattn
from jitattn import flashinfer as fi
from jitattn import reference

HQ, HKV, D, P = 4, 2, 64, 4
DT = torch.float16


def _ws() -> torch.Tensor:
    return torch.empty(128 << 20, dtype=torch.uint8)


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---------------------------------------------------------------------------------------------------------------
# Shared-prefix wrappers: k_shared / v_shared against the plan and the wrapper's kv_layout

class SharedPrefixBatch:
    """Three decode requests over a 7-token shared prefix and their own pages."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(3)
        self.cache = torch.randn(16, 2, P, HKV, D, generator=g).to(DT)
        self.indptr, self.indices, self.last = _i32([0, 2, 3, 5]), _i32([0, 1, 2, 3, 4]), _i32([3, 4, 1])
        self.k_shared = torch.randn(7, HKV, D, generator=g).to(DT)
        self.v_shared = torch.randn(7, HKV, D, generator=g).to(DT)
        self.q = torch.randn(3, HQ, D, generator=g).to(DT)

    def wrapper(self, kind: str, kv_layout: str = "NHD"):
        if kind == "decode":
            w = jitattn.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(_ws(), kv_layout)
            w.begin_forward(self.indptr, self.indices, self.last, HQ, HKV, D, P, data_type=DT)
        else:
            w = jitattn.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(_ws(), kv_layout)
            w.begin_forward(_i32([0, 1, 2, 3]), self.indptr, self.indices, self.last, HQ, HKV, D, P)
        return w

    def reference(self) -> torch.Tensor:
        k, v, kv_indptr = reference.paged_kv_to_ragged(self.cache, self.indptr, self.indices, self.last)
        outs = []
        for r in range(3):
            keys = torch.cat([self.k_shared, k[kv_indptr[r]:kv_indptr[r + 1]]]).float()
            values = torch.cat([self.v_shared, v[kv_indptr[r]:kv_indptr[r + 1]]]).float()
            outs.append(reference.single_attention(self.q[r:r + 1].float(), keys, values)[0])
        return torch.cat(outs)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
@pytest.mark.parametrize("heads", [1, 4])
def test_shared_prefix_refuses_shared_kv_with_another_kv_head_count(kind, heads) -> None:
    batch = SharedPrefixBatch()
    k_shared = torch.randn(7, heads, D).to(DT)
    with pytest.raises(ValueError, match=f"k_shared has {heads} kv heads; the plan has num_kv_heads={HKV}"):
        batch.wrapper(kind).forward(batch.q, k_shared, k_shared.clone(), batch.cache)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_shared_prefix_names_k_and_v_shared_of_different_lengths(kind) -> None:
    batch = SharedPrefixBatch()
    with pytest.raises(ValueError, match="k_shared has 7 tokens but v_shared has 5"):
        batch.wrapper(kind).forward(batch.q, batch.k_shared, batch.v_shared[:5], batch.cache)


@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_shared_prefix_hnd_wrapper_names_the_layout_it_expects(kind) -> None:
    batch = SharedPrefixBatch()
    w = batch.wrapper(kind, "HND")
    hnd_cache = batch.cache.transpose(2, 3).contiguous()
    with pytest.raises(ValueError, match=r"does not fit kv_layout HND: this wrapper expects "
                                         r"\[num_kv_heads, kv_len, head_dim\]"):
        w.forward(batch.q, batch.k_shared, batch.v_shared, hnd_cache)
    # the same shared prefix in the HND shape is taken, and gives the NHD wrapper's result
    out = w.forward(batch.q, batch.k_shared.transpose(0, 1).contiguous(), batch.v_shared.transpose(0, 1).contiguous(),
                    hnd_cache)
    torch.testing.assert_close(out.float(), batch.reference(), atol=2e-3, rtol=2e-3)


def test_shared_prefix_prefill_keeps_its_page_table_at_begin_forward_and_checks_it_there() -> None:
    """begin_forward() keeps host copies (forward() plans them: the caller may refill its arrays meanwhile) and
    refuses a bad page table or head counts at once; forward() names a missing q or cache."""
    batch = SharedPrefixBatch()
    indptr, indices = batch.indptr.clone(), batch.indices.clone()
    w = jitattn.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(_ws())
    w.begin_forward(_i32([0, 1, 2, 3]), indptr, indices, batch.last, HQ, HKV, D, P)
    indices[:] = _i32([9, 8, 7, 6, 5])  # the caller's next batch
    out = w.forward(batch.q, batch.k_shared, batch.v_shared, batch.cache)
    torch.testing.assert_close(out.float(), batch.reference(), atol=2e-3, rtol=2e-3)
    with pytest.raises(ValueError, match="paged_kv_indices"):
        w.begin_forward(_i32([0, 1, 2, 3]), batch.indptr, _i32([0, 1, -2, 3, 4]), batch.last, HQ, HKV, D, P)
    with pytest.raises(RuntimeError, match="before begin_forward"):  # the refused batch left no plan
        w.forward(batch.q, batch.k_shared, batch.v_shared, batch.cache)
    with pytest.raises(ValueError, match="num_qo_heads=5 must be a multiple of num_kv_heads=2"):
        w.begin_forward(_i32([0, 1, 2, 3]), batch.indptr, batch.indices, batch.last, 5, HKV, D, P)
    with pytest.raises(ValueError, match="qo_indptr describes 2 requests but paged_kv_indptr 3"):
        w.begin_forward(_i32([0, 1, 2]), batch.indptr, batch.indices, batch.last, HQ, HKV, D, P)
    w.begin_forward(_i32([0, 1, 2, 3]), batch.indptr, batch.indices, batch.last, HQ, HKV, D, P)
    with pytest.raises(TypeError, match="q must be a torch.Tensor, got NoneType"):
        w.forward(None, batch.k_shared, batch.v_shared, batch.cache)
    with pytest.raises(TypeError, match="unique_kv_cache must be a torch.Tensor, got NoneType"):
        w.forward(batch.q, batch.k_shared, batch.v_shared, None)
    # a refused option leaves the next forward() working (it ran into an unplanned inner wrapper)
    with pytest.raises(ValueError, match="sm_scale=0.0"):
        w.forward(batch.q, batch.k_shared, batch.v_shared, batch.cache, sm_scale=0.0)
    out = w.forward(batch.q, batch.k_shared, batch.v_shared, batch.cache)
    torch.testing.assert_close(out.float(), batch.reference(), atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------------------------
# Merges

def test_flashinfer_merge_state_in_place_refuses_an_integer_lse_and_writes_nothing() -> None:
    v, v_other = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    s, s_other = torch.randint(0, 3, (4, 2), dtype=torch.int32), torch.randn(4, 2)
    v_before, s_before = v.clone(), s.clone()
    with pytest.raises(TypeError, match="s has dtype int32; expected one of float32"):
        fi.merge_state_in_place(v, s, v_other, s_other)
    assert torch.equal(v, v_before) and torch.equal(s, s_before)
    with pytest.raises(TypeError, match="s_other has dtype int64; expected one of float32"):
        fi.merge_state_in_place(v, torch.randn(4, 2), v_other, s_other.long())
    assert torch.equal(v, v_before)


def test_flashinfer_merge_state_and_merge_states_refuse_integer_lse() -> None:
    v = torch.randn(4, 2, 8)
    s_int = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match="s_a has dtype int32; expected one of float32"):
        fi.merge_state(v, s_int, v, torch.zeros(4, 2))
    with pytest.raises(TypeError, match="s_b has dtype int32; expected one of float32"):
        fi.merge_state(v, torch.zeros(4, 2), v, s_int)
    with pytest.raises(TypeError, match="s has dtype int32; expected one of float32"):
        fi.merge_states(torch.randn(4, 3, 2, 8), torch.zeros(4, 3, 2, dtype=torch.int32))


@pytest.mark.parametrize("merge_states", [jitattn.merge_states, fi.merge_states])
def test_merge_states_refuses_non_tensors_with_a_type_error(merge_states) -> None:
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):
        merge_states([[0.0]], torch.zeros(1, 1, 1))
    with pytest.raises(TypeError, match="v must be a torch.Tensor, got list"):
        jitattn.merge_states([[0.0]], [[0.0]])
    with pytest.raises(TypeError, match="s must be a torch.Tensor, got list"):
        jitattn.merge_states(torch.zeros(1, 1, 1, 8), [[0.0]])


# ---------------------------------------------------------------------------------------------------------------
# MLA append: both halves checked before either cache is written

class MlaAppend:
    """Two requests (7 and 2 tokens after the append) over pages 0-2 of a 6-page cache; 3 tokens appended."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(4)
        self.kv_indptr, self.kv_indices, self.kv_last = _i32([0, 2, 3]), _i32([0, 1, 2]), _i32([3, 2])
        self.batch_indices, self.positions = _i32([0, 0, 1]), _i32([5, 6, 1])
        self.ckv, self.kpe = torch.randn(3, 16, generator=g), torch.randn(3, 8, generator=g)
        self.ckv_cache, self.kpe_cache = torch.zeros(6, P, 16), torch.zeros(6, P, 8)

    def run(self, **changes) -> None:
        args = dict(append_ckv=self.ckv, append_kpe=self.kpe, batch_indices=self.batch_indices,
                    positions=self.positions, ckv_cache=self.ckv_cache, kpe_cache=self.kpe_cache,
                    kv_indices=self.kv_indices, kv_indptr=self.kv_indptr, kv_last_page_len=self.kv_last)
        args.update(changes)
        jitattn.append_paged_mla_kv_cache(**args)


def test_mla_append_writes_both_caches() -> None:
    case = MlaAppend()
    case.run()
    assert torch.equal(case.ckv_cache[1, 1], case.ckv[0]) and torch.equal(case.ckv_cache[1, 2], case.ckv[1])
    assert torch.equal(case.ckv_cache[2, 1], case.ckv[2]) and torch.equal(case.kpe_cache[2, 1], case.kpe[2])
    assert int((case.ckv_cache != 0).any(-1).sum()) == 3 and int((case.kpe_cache != 0).any(-1).sum()) == 3


@pytest.mark.parametrize("change, error, message", [
    (lambda c: dict(append_kpe=c.kpe[:2]), ValueError, "append_kpe has 2 rows but append_ckv has 3"),
    (lambda c: dict(append_kpe=c.kpe.double()), TypeError, "append_kpe has dtype float64; use float32"),
    (lambda c: dict(kpe_cache=torch.zeros(6, 2, 8)), ValueError, "ckv_cache and kpe_cache differ in page_size"),
    (lambda c: dict(kpe_cache=torch.zeros(5, P, 8)), ValueError, "ckv_cache and kpe_cache differ in page count"),
    (lambda c: dict(kpe_cache=torch.zeros(1, P, 8).expand(6, P, 8)), ValueError, "kpe_cache .* share memory"),
    (lambda c: dict(kpe_cache=torch.zeros(6, P, 8, dtype=torch.int32)), TypeError, "kpe_cache has dtype int32"),
], ids=["kpe-rows", "kpe-dtype", "kpe-page-size", "kpe-page-count", "kpe-expanded", "kpe-cache-dtype"])
def test_mla_append_refused_kpe_leaves_the_ckv_cache_unchanged(change, error, message) -> None:
    case = MlaAppend()
    with pytest.raises(error, match=message):
        case.run(**change(case))
    assert not case.ckv_cache.any() and not case.kpe_cache.any()


def test_mla_append_refuses_caches_that_share_memory_and_takes_disjoint_columns_of_one_buffer() -> None:
    """kpe columns overlapping the ckv ones were written over the latent values, silently (2026-12-06 sweep);
    SGLang's layout, both cut from one 24-wide buffer, shares no element."""
    case = MlaAppend()
    buf = torch.zeros(6, P, 24)
    with pytest.raises(ValueError, match="ckv_cache and kpe_cache share memory"):
        case.run(ckv_cache=buf[..., :16], kpe_cache=buf[..., 12:20])
    with pytest.raises(ValueError, match="ckv_cache and kpe_cache share memory"):
        case.run(ckv_cache=buf[..., :8], kpe_cache=buf[..., :8], append_ckv=case.ckv[:, :8])
    assert not buf.any()
    case.run(ckv_cache=buf[..., :16], kpe_cache=buf[..., 16:])
    assert torch.equal(buf[1, 1, :16], case.ckv[0]) and torch.equal(buf[2, 1, 16:], case.kpe[2])


@pytest.mark.parametrize("source, cache", [("kpe", "ckv"), ("ckv", "kpe"), ("ckv", "ckv"), ("kpe", "kpe")])
def test_mla_append_refuses_a_source_in_either_cache(source: str, cache: str) -> None:
    """append_kpe inside ckv_cache was read after the ckv write had overwritten it (a wrong kpe, silently); each
    source is checked against both caches, by this function's argument names."""
    case = MlaAppend()
    caches = {"ckv": case.ckv_cache, "kpe": case.kpe_cache}
    width = {"ckv": 16, "kpe": 8}[source]
    caches[cache][4:].view(-1)[: 3 * width] = torch.randn(3 * width)
    inside = caches[cache][4:].view(-1)[: 3 * width].view(3, width)  # pages 4-5: not written by this append
    before = (case.ckv_cache.clone(), case.kpe_cache.clone())
    with pytest.raises(ValueError, match=rf"^append_{source} lies in {cache}_cache's memory"):
        case.run(**{f"append_{source}": inside})
    assert torch.equal(case.ckv_cache, before[0]) and torch.equal(case.kpe_cache, before[1])


@pytest.mark.parametrize("change, message", [
    (lambda c: dict(batch_indices=_i32([0, 0, 1, 1])),
     r"batch_indices has 4 entries; expected nnz=3 \(append_ckv's rows\)"),
    (lambda c: dict(positions=_i32([5, 6])), r"positions has 2 entries; expected nnz=3 \(append_ckv's rows\)"),
    (lambda c: dict(ckv_cache=c.kpe_cache, kpe_cache=c.ckv_cache), r"append_ckv has shape \(3, 16\); expected .* to "
                                                                   r"match ckv_cache .* swapped\?"),
    (lambda c: dict(kv_indptr=_i32([0, 2])), r"kv_indptr has 2 entries \(1 request\) but kv_last_page_len has 2"),
], ids=["batch-indices", "positions", "swapped-caches", "short-indptr"])
def test_mla_append_errors_name_its_own_arguments(change, message) -> None:
    case = MlaAppend()
    with pytest.raises(ValueError, match=message):
        case.run(**change(case))
    assert not case.ckv_cache.any() and not case.kpe_cache.any()


# ---------------------------------------------------------------------------------------------------------------
# append_paged_kv_cache / get_seq_lens: the page table's arrays

def test_append_names_a_kv_indptr_too_short_for_kv_last_page_len() -> None:
    cache = torch.zeros(6, 2, P, HKV, 8)
    with pytest.raises(ValueError, match=r"kv_indptr has 2 entries \(1 request\) but kv_last_page_len has 2 "
                                         r"entries \(2 requests\)"):
        jitattn.append_paged_kv_cache(torch.randn(3, HKV, 8), torch.randn(3, HKV, 8), _i32([0, 0, 1]),
                                      _i32([5, 6, 1]), cache, _i32([0, 1, 2]), _i32([0, 2]), _i32([3, 2]))
    assert not cache.any()


@pytest.mark.parametrize("kv_indptr, last, message", [
    ([0, 2, 3], [0, 2], r"kv_last_page_len\[0\] = 0 is out of range: a request with pages needs 1 <= "
                        r"last_page_len <= page_size \(4\)"),
    ([0, 2, 3], [3, 5], r"kv_last_page_len\[1\] = 5 is out of range"),
    ([0, 2, 3], [-1, 2], r"kv_last_page_len\[0\] = -1 is out of range"),
    ([0, 3, 2], [3, 2], r"kv_indptr must be non-decreasing; kv_indptr\[2\] < kv_indptr\[1\]"),
    ([1, 2, 3], [3, 2], r"kv_indptr\[0\] must be 0, got 1"),
], ids=["last-0", "last-over-page-size", "last-negative", "non-monotone", "indptr-start"])
def test_get_seq_lens_refuses_the_host_page_tables_plan_refuses(kv_indptr, last, message) -> None:
    with pytest.raises(ValueError, match=message):
        jitattn.get_seq_lens(_i32(kv_indptr), _i32(last), P)
    with pytest.raises(ValueError, match=message.replace("kv_", "")):  # plan()'s own message, its own names
        jitattn.BatchDecodeWithPagedKVCacheWrapper(_ws()).plan(
            _i32(kv_indptr), _i32([0, 1, 2]), _i32(last), HQ, HKV, D, P, data_type=DT)


def test_get_seq_lens_takes_the_arrays_flashinfer_takes() -> None:
    # a request without pages may have any last_page_len; a longer last_page_len buffer is read up to the batch
    assert jitattn.get_seq_lens(_i32([0, 2, 2, 3]), _i32([3, 0, 4, 99]), P).tolist() == [7, 0, 4]
    assert jitattn.get_seq_lens(torch.tensor([0, 2, 3]), torch.tensor([3, 2]), P).tolist() == [7, 2]  # int64


def test_int64_lengths_past_int32_are_refused_not_wrapped() -> None:
    """int64 host arrays are taken (as FlashInfer takes them); lengths past 2^31 wrapped around in the int32 result
    (2026-12-06 sweep: get_seq_lens gave 17 for 2^33 + 17 tokens)."""
    with pytest.raises(ValueError, match=r"lengths .* span \[8589934609, 8589934609\], which the int32 results "
                                         "cannot hold"):
        jitattn.get_seq_lens(torch.tensor([0, 2**31 + 5]), torch.tensor([1]), P)
    with pytest.raises(ValueError, match=r"seq_lens span \[8589934592, 8589934592\], which the int32"):
        jitattn.get_batch_indices_positions(torch.tensor([0, 2]), torch.tensor([2**33]), 2)


@pytest.mark.parametrize("kv_indptr, last, dtype, span", [
    ([0, 2**28], [16], torch.int32, "4294967296, 4294967296"),  # past int32: wrapped to 0
    ([0, 200], [3], torch.uint8, "3187, 3187"),  # past uint8: wrapped to 115
    ([0, 1, 1], [2, -7], torch.int32, "-7, 2"),  # a request without pages gets its (negative) last_page_len
])
def test_flashinfer_get_seq_lens_refuses_lengths_its_dtype_cannot_hold(kv_indptr, last, dtype, span) -> None:
    """The namespace's get_seq_lens (FlashInfer's arithmetic, in the inputs' dtype) returned the wrapped or
    negative lengths."""
    with pytest.raises(ValueError, match=rf"span \[{span}\], which the {str(dtype)[6:]} results cannot hold"):
        fi.get_seq_lens(torch.tensor(kv_indptr, dtype=dtype), torch.tensor(last, dtype=dtype), 16)
    assert fi.get_seq_lens(_i32([0, 1, 1]), _i32([2, 3]), 4).tolist() == [2, 3]  # a padding row: its last_page_len


# ---------------------------------------------------------------------------------------------------------------
# MultiLevelCascadeAttentionWrapper.run: no out= / lse=

@pytest.mark.parametrize("wrapper_class", [jitattn.MultiLevelCascadeAttentionWrapper,
                                           fi.MultiLevelCascadeAttentionWrapper])
@pytest.mark.parametrize("keyword", ["out", "lse"])
def test_cascade_run_refuses_out_and_lse_buffers(wrapper_class, keyword) -> None:
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(8, 2, P, HKV, D, generator=g).to(DT)
    q = torch.randn(3, HQ, D, generator=g).to(DT)
    w = wrapper_class(2, _ws())
    w.plan([_i32([0, 3]), _i32([0, 1, 2, 3])], [_i32([0, 2]), _i32([0, 1, 2, 3])], [_i32([0, 1]), _i32([2, 3, 4])],
           [_i32([1]), _i32([4, 3, 2])], HQ, HKV, D, P, q_data_type=DT)
    buffer = torch.zeros(3, HQ, D, dtype=DT) if keyword == "out" else torch.zeros(3, HQ)
    with pytest.raises(TypeError, match="run\\(\\) takes no out= or lse= .*return_lse=True"):
        w.run(q, cache, **{keyword: buffer})
    assert not buffer.any()
    assert w.run(q, cache).shape == (3, HQ, D)  # the plan is intact


@pytest.mark.parametrize("q", [None, "q", [[1.0]]])
def test_cascade_run_names_itself_for_a_query_that_is_not_a_tensor(q) -> None:
    cache = torch.randn(8, 2, P, HKV, D, generator=torch.Generator().manual_seed(3)).to(DT)
    w = jitattn.MultiLevelCascadeAttentionWrapper(2, _ws())
    w.plan([_i32([0, 3]), _i32([0, 1, 2, 3])], [_i32([0, 2]), _i32([0, 1, 2, 3])], [_i32([0, 1]), _i32([2, 3, 4])],
           [_i32([1]), _i32([4, 3, 2])], HQ, HKV, D, P, q_data_type=DT)
    with pytest.raises(TypeError, match=r"^MultiLevelCascadeAttentionWrapper\.run\(\): q must be a torch\.Tensor"):
        w.run(q, cache)


def test_out_sharing_memory_with_v_is_refused_after_a_run_with_another_out() -> None:
    """The address checks hold on every call, not only when out's shape changes: a first run with a separate out
    buffer of the same shape must not let a second run write over the v it reads."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(8, HQ, D, generator=g).to(DT)
    k = torch.randn(12, HKV, D, generator=g).to(DT)
    store = torch.randn(8 * HQ * D, generator=g).to(DT)
    out, v = store.view(8, HQ, D), store[:12 * HKV * D].view(12, HKV, D)
    w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_ws())
    w.plan(_i32([0, 5, 8]), _i32([0, 7, 12]), HQ, HKV, D, q_data_type=DT)
    w.run(q, k, v.clone(), out=torch.empty(8, HQ, D, dtype=DT))
    before = store.clone()
    with pytest.raises(ValueError, match="out shares memory with v"):
        w.run(q, k, v, out=out)
    assert torch.equal(store, before)


# ---------------------------------------------------------------------------------------------------------------
# MLA run: return_lse is a bool

def test_mla_run_refuses_a_non_bool_return_lse() -> None:
    ckv_dim, kpe_dim, heads, page_size = 512, 64, 16, 16
    g = torch.Generator().manual_seed(0)
    ckv_cache, kpe_cache = torch.randn(3, page_size, ckv_dim, generator=g), torch.randn(3, page_size, kpe_dim)
    q_nope, q_pe = torch.randn(2, heads, ckv_dim, generator=g), torch.randn(2, heads, kpe_dim, generator=g)
    w = jitattn.BatchMLAPagedAttentionWrapper(_ws())
    w.plan(_i32([0, 1, 2]), _i32([0, 1, 3]), _i32([0, 1, 2]), _i32([5, 20]), heads, ckv_dim, kpe_dim, page_size,
           False, 1 / math.sqrt(192), torch.float32, torch.float32)
    for bad in ("yes", "False", None, 2):
        with pytest.raises(TypeError, match=f"return_lse={bad!r} must be True or False"):
            w.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=bad)
    out, lse = w.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True)
    assert isinstance(w.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=False), torch.Tensor)
    assert out.shape == (2, heads, ckv_dim) and lse.shape == (2, heads)
    # jitattn.flashinfer's base-2 LSE unless return_lse_base_on_e: a string would pick the base by its truthiness
    fw = fi.BatchMLAPagedAttentionWrapper(_ws())
    fw.plan(_i32([0, 1, 2]), _i32([0, 1, 3]), _i32([0, 1, 2]), _i32([5, 20]), heads, ckv_dim, kpe_dim, page_size,
            False, 1 / math.sqrt(192), torch.float32, torch.float32)
    with pytest.raises(TypeError, match="return_lse_base_on_e='False' must be True or False"):
        fw.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True, return_lse_base_on_e="False")
    base2 = fw.run(q_nope, q_pe, ckv_cache, kpe_cache, return_lse=True)[1]
    torch.testing.assert_close(base2, lse / math.log(2))


# ---------------------------------------------------------------------------------------------------------------
# Activations: [..., 2 * d], 1-D included

ACTIVATIONS = {
    "silu_and_mul": lambda a: F.silu(a),
    "gelu_and_mul": lambda a: F.gelu(a),
    "gelu_tanh_and_mul": lambda a: F.gelu(a, approximate="tanh"),
}


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_activations_take_a_1d_input_and_out(name, dtype) -> None:
    fn = getattr(jitattn, name)
    x = torch.randn(16, generator=torch.Generator().manual_seed(5)).to(dtype)
    want = (ACTIVATIONS[name](x[:8].float()) * x[8:].float()).to(dtype)
    got = fn(x)
    assert got.shape == (8,) and got.dtype == dtype
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    out = torch.empty(8, dtype=dtype)
    assert fn(x, out=out) is out
    torch.testing.assert_close(out, want, atol=1e-3, rtol=1e-3)
    assert torch.equal(getattr(fi, name)(x), got)
    with pytest.raises(ValueError, match=r"out has shape \(1, 8\); expected \(8,\)"):
        fn(x, out=torch.empty(1, 8, dtype=dtype))
    with pytest.raises(ValueError, match="last dimension must be even"):
        fn(x[:15])
    with pytest.raises(ValueError, match="input is 0-d"):
        fn(torch.tensor(1.0, dtype=dtype))


# ---------------------------------------------------------------------------------------------------------------
# Sizes and head counts given before any array

def test_workspace_size_refuses_limits_that_are_not_counts() -> None:
    """workspace_size() of the decode, prefill and cascade wrappers: a negative, fractional, string or zero limit is
    named (it returned byte counts of nothing, float bytes, or a ZeroDivisionError)."""
    decode = jitattn.BatchDecodeWithPagedKVCacheWrapper(_ws())
    prefill = jitattn.BatchPrefillWithPagedKVCacheWrapper(_ws())
    cascade = jitattn.MultiLevelCascadeAttentionWrapper(2, _ws())
    assert decode.workspace_size(8, 1000, HQ, HKV, D, P)[1] > 0 and prefill.workspace_size(8, 8, 0, HQ, HKV, D, P)
    for args, message in (((-1, 100, HQ, HKV, D, P), "max_batch_size=-1 must be an int >= 1"),
                          ((4.5, 100, HQ, HKV, D, P), "max_batch_size=4.5 must be an int >= 1"),
                          (("4", 100, HQ, HKV, D, P), "max_batch_size='4' must be an int >= 1"),
                          ((4, -1, HQ, HKV, D, P), "max_kv_tokens=-1 must be an int >= 0"),
                          ((4, 100, HQ, 0, D, P), "num_kv_heads=0 must be an int >= 1"),
                          ((4, 100, HQ, HKV, D, 0), "page_size=0 must be an int >= 1")):
        with pytest.raises(ValueError, match=message):
            decode.workspace_size(*args)
    with pytest.raises(ValueError, match="page_size=0 must be an int >= 1"):
        cascade.workspace_size(4, 8, 100, HQ, HKV, D, 0)
    with pytest.raises(ValueError, match="head_dim_vo=0 must be an int >= 1"):
        prefill.workspace_size(4, 8, 100, HQ, HKV, D, P, 0)


@pytest.mark.parametrize("name", ["num_qo_heads", "head_dim_vo"])
def test_batch_attention_names_a_missing_head_count(name) -> None:
    args = dict(num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D, head_dim_vo=D, page_size=P)
    args[name] = None
    attention = jitattn.BatchAttention(device="cpu")
    with pytest.raises((TypeError, ValueError), match=f"{name}=None"):
        attention.plan(_i32([0, 1, 2]), _i32([0, 1, 2]), _i32([0, 1]), _i32([3, 4]), args["num_qo_heads"],
                       args["num_kv_heads"], args["head_dim_qk"], args["head_dim_vo"], args["page_size"])


@pytest.mark.parametrize("make", [
    lambda flag: jitattn.BatchDecodeWithPagedKVCacheWrapper(_ws(), "NHD", use_cuda_graph=flag),
    lambda flag: jitattn.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD", use_cuda_graph=flag),
    lambda flag: jitattn.BatchMLAPagedAttentionWrapper(_ws(), use_cuda_graph=flag),
    lambda flag: jitattn.MultiLevelCascadeAttentionWrapper(2, _ws(), "NHD", use_cuda_graph=flag),
], ids=["decode", "prefill", "mla", "cascade"])
def test_use_cuda_graph_is_a_boolean(make) -> None:
    """A string such as "False" is truthy: it asked for the fixed buffers instead of being refused by name."""
    with pytest.raises(TypeError, match="use_cuda_graph='False' must be True or False"):
        make("False")
    make(False)


def test_append_into_a_cache_of_the_other_layout_suggests_kv_layout() -> None:
    cache = torch.zeros(8, 2, P, HKV, D, dtype=DT)  # NHD: heads after the page's slots
    k = torch.randn(5, HKV, D).to(DT)
    with pytest.raises(ValueError, match=r"append_key has shape \(5, 2, 64\); expected .* \(5, 4, 64\) .* read as "
                                         r"kv_layout=HND .* pass kv_layout='NHD'"):
        jitattn.append_paged_kv_cache(k, k.clone(), _i32([0, 0, 0, 1, 1]), _i32([0, 1, 2, 0, 1]), cache,
                                      _i32([0, 1, 2, 3]), _i32([0, 1, 2]), _i32([3, 2]), kv_layout="HND")
    assert not cache.any(), "a refused append wrote nothing"


def test_append_refuses_a_position_past_the_requests_length() -> None:
    """A position inside the request's pages but at or past its length (kv_last_page_len counts the appended
    tokens) was written where attention never reads."""
    cache = torch.zeros(8, 2, P, HKV, D, dtype=DT)
    k = torch.randn(5, HKV, D).to(DT)
    args = (_i32([0, 1, 2, 3]), _i32([0, 2, 3]), _i32([2, 4]))  # request 0: 2 pages, 6 tokens; request 1: 4
    with pytest.raises(IndexError, match=r"positions\[2\]=7 is past request 0's length 6 \(kv_indptr and "
                                         "kv_last_page_len, which count the appended tokens too\\)"):
        jitattn.append_paged_kv_cache(k, k.clone(), _i32([0, 0, 0, 1, 1]), _i32([4, 5, 7, 2, 3]), cache, *args)
    assert not cache.any(), "a refused append wrote nothing"
    jitattn.append_paged_kv_cache(k, k.clone(), _i32([0, 0, 0, 1, 1]), _i32([3, 4, 5, 2, 3]), cache, *args)
    assert cache.any()

"""MLA (DeepSeek-style latent attention) against the float64 reference.

- ``BatchMLAPagedAttentionWrapper``: decode (one query per request), speculative multi-token decode
  (2-8 queries, causal) and chunked prefill over a paged latent cache; num_heads 16/64/128, page_size
  1/16/64, lengths including 0; an fp8 e4m3 latent cache with scales; ckv/kpe as slices of one buffer;
  NaN propagation; the empty batch; CUDA-graph buffers, capture and replay; the plan/run error rules.
- ``append_paged_mla_kv_cache`` (bf16/f32 and a saturating fp8 cache).
- Non-absorbed MLA prefill (qk 192 / vo 128, num_kv_heads == num_heads) through the ragged wrapper.

cpu tests use small sizes; the ``gpu`` twins (``devices()``) run the same checks on cuda.
"""

from __future__ import annotations

import math

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.ops.mla import latent_keys
from jitattn.reference.paged import to_cache_dtype

from attention_cases import assert_close_lse, assert_close_out, devices, tolerance

CKV, KPE = 512, 64
SM_SCALE = 1.0 / math.sqrt(192)
QK_NOPE, QK_ROPE, V_HEAD = 128, 64, 128  # non-absorbed prefill: qk 192, vo 128
e4m3 = torch.float8_e4m3fn
POISON = 7777.0


def _gpu_specs() -> list:
    from jitattn.runtime.specs import attention_spec
    from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

    def spec(heads, kv_heads, qk, vo, kv_dtype, mask, storage):
        return attention_spec(Op.PREFILL, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=kv_dtype,
                              o_dtype=torch.bfloat16, head_dim_qk=qk, head_dim_vo=vo, num_qo_heads=heads,
                              num_kv_heads=kv_heads, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
                              use_logits_soft_cap=False, mask_mode=mask, kv_layout=KVLayout.NHD, kv_storage=storage)

    masks = (MaskMode.NONE, MaskMode.CAUSAL)
    latent = [spec(heads, 1, CKV + KPE, CKV, kv, mask, KVStorage.PAGED)
              for heads in (16, 64, 128) for kv in (torch.bfloat16, e4m3) for mask in masks]
    ragged = [spec(heads, heads, QK_NOPE + QK_ROPE, V_HEAD, torch.bfloat16, mask, KVStorage.RAGGED)
              for heads in (16, 128) for mask in masks]
    return latent + ragged


GPU_SPECS = _gpu_specs()


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def _latent_cache(kv_lens: list[int], page_size: int, dtype: torch.dtype, device: str, gen: torch.Generator,
                  joined: bool, spare_pages: int = 2):
    """(ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len_arr): pages handed out in random order."""
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages_per)
    pool = total + spare_pages
    values = torch.randn(pool, page_size, CKV + KPE, generator=gen)
    if dtype == e4m3:
        values = values * 2  # use more of the fp8 range
    buffer = values.to(dtype).to(device)
    if joined:
        ckv, kpe = buffer[..., :CKV], buffer[..., CKV:]
    else:
        ckv, kpe = buffer[..., :CKV].contiguous(), buffer[..., CKV:].contiguous()
    indices = torch.randperm(pool, generator=gen)[:total].to(torch.int32)
    return ckv, kpe, _indptr(pages_per), indices, torch.tensor(kv_lens, dtype=torch.int32)


def _request_kv(ckv, kpe, indptr, indices, kv_len: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One request's keys ``[kv_len, 1, 576]`` and values ``[kv_len, 1, 512]`` in float32 (exact for every dtype)."""
    pages = indices[int(indptr[r]): int(indptr[r + 1])].long()
    ckv_rows = ckv.cpu().float()[pages].reshape(-1, CKV)[:kv_len]
    kpe_rows = kpe.cpu().float()[pages].reshape(-1, KPE)[:kv_len]
    return torch.cat([ckv_rows, kpe_rows], dim=-1).unsqueeze(1), ckv_rows.unsqueeze(1)  # one latent head


def _queries(qo_lens: list[int], num_heads: int, dtype: torch.dtype, device: str, gen: torch.Generator):
    q_nope = torch.randn(sum(qo_lens), num_heads, CKV, generator=gen).to(dtype).to(device)
    q_pe = torch.randn(sum(qo_lens), num_heads, KPE, generator=gen).to(dtype).to(device)
    return q_nope, q_pe


def _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal, k_scale=None, v_scale=None):
    """float32 (out, lse) of the whole batch, request by request."""
    outs, lses = [], []
    qo_indptr = _indptr(qo_lens)
    ckv, kpe = ckv.cpu().float(), kpe.cpu().float()  # once: _request_kv's conversions are then no-ops
    for r, kv_len in enumerate(kv_lens):
        lo, hi = int(qo_indptr[r]), int(qo_indptr[r + 1])
        keys, values = _request_kv(ckv, kpe, indptr, indices, kv_len, r)
        q = torch.cat([q_nope[lo:hi], q_pe[lo:hi]], dim=-1).cpu()
        o, lse = reference.single_attention(q, keys, values, causal=causal, sm_scale=SM_SCALE, k_scale=k_scale,
                                            v_scale=v_scale)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _wrapper(device: str, **kw) -> jitattn.BatchMLAPagedAttentionWrapper:
    return jitattn.BatchMLAPagedAttentionWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=device), **kw)


def _poisoned(shape, dtype, device) -> torch.Tensor:
    return torch.full(shape, POISON, dtype=dtype, device=device)


_MODES = {  # (kv_lens, qo_lens, causal)
    "decode": ([37, 0, 130, 5], [1, 1, 1, 1], False),
    "speculative": ([37, 9, 130, 8], [2, 8, 4, 3], True),
    "chunked_prefill": ([37, 9, 130, 5], [20, 9, 64, 5], True),
}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_heads", [16, 64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", list(_MODES))
def test_mla_matches_the_reference(device: str, num_heads: int, page_size: int, mode: str) -> None:
    if device == "cuda" and (num_heads, page_size) not in ((16, 16), (128, 1), (128, 64), (64, 16)):
        pytest.skip("a representative subset on the GPU")
    gen = torch.Generator().manual_seed(num_heads * 7 + page_size)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_lens, qo_lens, causal = _MODES[mode]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, page_size, dtype, device, gen, joined=mode != "speculative")
    q_nope, q_pe = _queries(qo_lens, num_heads, dtype, device, gen)
    wrapper = _wrapper(device)
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, num_heads, CKV, KPE, page_size, causal, SM_SCALE, dtype,
                 dtype)
    out = _poisoned((sum(qo_lens), num_heads, CKV), dtype, device)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=out, return_lse=True)
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("causal", [False, True])
def test_mla_kv_len_zero_gives_zero_and_minus_inf(device: str, causal: bool) -> None:
    """A request with no KV (and, causal, no query either) next to ones with KV: o = 0, lse = -inf exactly."""
    gen = torch.Generator().manual_seed(11 + causal)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_lens, qo_lens = ([0, 20, 0, 3], [0, 2, 0, 1]) if causal else ([0, 20, 0, 3], [1, 2, 3, 1])
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, dtype, device, gen, joined=True)
    q_nope, q_pe = _queries(qo_lens, 16, dtype, device, gen)
    wrapper = _wrapper(device)
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, 16, CKV, KPE, 16, causal, SM_SCALE, dtype, dtype)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=_poisoned((sum(qo_lens), 16, CKV), dtype, device),
                           lse=_poisoned((sum(qo_lens), 16), torch.float32, device), return_lse=True)
    qo_indptr = _indptr(qo_lens)
    for r in (0, 2):
        rows = slice(int(qo_indptr[r]), int(qo_indptr[r + 1]))
        assert (out[rows] == 0).all() and torch.isneginf(lse[rows]).all()
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("device", devices())
def test_mla_every_request_empty_over_a_cache_of_no_pages(device: str) -> None:
    """kv_len 0 everywhere, so the caller's latent cache has no pages at all (an empty tensor, whose data
    pointer may be null): every row is o = 0, lse = -inf."""
    gen = torch.Generator().manual_seed(14)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ckv, kpe, indptr, indices, lens = _latent_cache([0, 0, 0], 16, dtype, device, gen, joined=True, spare_pages=0)
    assert ckv.shape[0] == 0
    q_nope, q_pe = _queries([1, 2, 1], 16, dtype, device, gen)
    wrapper = _wrapper(device)
    wrapper.plan(_indptr([1, 2, 1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, dtype, dtype)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=_poisoned((4, 16, CKV), dtype, device),
                           lse=_poisoned((4, 16), torch.float32, device), return_lse=True)
    assert (out == 0).all() and torch.isneginf(lse).all()


@pytest.mark.parametrize("device", devices())
def test_mla_batch_is_qo_indptrs_and_longer_kv_buffers_are_read_up_to_it(device: str) -> None:
    """As FlashInfer: the batch size comes from qo_indptr; kv_indptr / kv_len_arr may be buffers sized for a
    larger batch, whose tail (here garbage) is never read."""
    gen = torch.Generator().manual_seed(15)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_lens, qo_lens = [37, 5, 20], [1, 1, 1]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, dtype, device, gen, joined=True)
    q_nope, q_pe = _queries(qo_lens, 16, dtype, device, gen)
    padded_indptr = torch.cat([indptr, torch.tensor([999, 5, -3], dtype=torch.int32)])
    padded_lens = torch.cat([lens, torch.tensor([4096, -1], dtype=torch.int32)])
    wrapper = _wrapper(device)
    wrapper.plan(_indptr(qo_lens), padded_indptr, indices, padded_lens, 16, CKV, KPE, 16, False, SM_SCALE, dtype,
                 dtype)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, False)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("device", devices())
def test_mla_causal_queries_before_the_first_key_are_zero(device: str) -> None:
    """Causal with qo_len > kv_len (FlashInfer computes it): the first qo_len - kv_len queries of a request
    see no key, o = 0 and lse = -inf; the rest as the reference."""
    gen = torch.Generator().manual_seed(16)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_lens, qo_lens = [1, 40, 3], [2, 4, 9]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, dtype, device, gen, joined=True)
    q_nope, q_pe = _queries(qo_lens, 16, dtype, device, gen)
    wrapper = _wrapper(device)
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, 16, CKV, KPE, 16, True, SM_SCALE, dtype, dtype)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=_poisoned((15, 16, CKV), dtype, device),
                           lse=_poisoned((15, 16), torch.float32, device), return_lse=True)
    for row in (0, 6, 7, 8, 9, 10, 11):  # request 0's first query, request 2's first six
        assert (out[row] == 0).all() and torch.isneginf(lse[row]).all(), row
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, True)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.parametrize("device", devices())
def test_mla_empty_batch(device: str) -> None:
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    empty = torch.zeros(0, dtype=torch.int32)
    wrapper = _wrapper(device)
    wrapper.plan(torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), empty, empty, 16, CKV, KPE, 16,
                 False, SM_SCALE, dtype, dtype)
    q_nope = torch.empty(0, 16, CKV, dtype=dtype, device=device)
    q_pe = torch.empty(0, 16, KPE, dtype=dtype, device=device)
    buffer = torch.randn(2, 16, CKV + KPE).to(dtype).to(device)
    out, lse = wrapper.run(q_nope, q_pe, buffer[..., :CKV], buffer[..., CKV:], return_lse=True)
    assert out.shape == (0, 16, CKV) and lse.shape == (0, 16) and lse.dtype == torch.float32


@pytest.mark.parametrize("device", devices())
def test_mla_nan_propagates(device: str) -> None:
    """A NaN query row gives NaN o and lse for that row only; a NaN in the latent keys reaches exactly the
    rows that see it (causal); the other rows match the reference."""
    gen = torch.Generator().manual_seed(21)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_lens, qo_lens = [30, 12], [4, 3]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, dtype, device, gen, joined=True)
    q_nope, q_pe = _queries(qo_lens, 16, dtype, device, gen)
    q_pe[5, 3, 7] = float("nan")  # request 1, its second query, head 3
    page, slot = int(indices[int(indptr[0]) + 28 // 16]), 28 % 16
    # request 0, key 28 (in kpe: a key, not a value, so masked rows never multiply it): seen by queries 2, 3
    kpe[page, slot, 10] = float("nan")
    wrapper = _wrapper(device)
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, 16, CKV, KPE, 16, True, SM_SCALE, dtype, dtype)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=_poisoned((7, 16, CKV), dtype, device),
                           lse=_poisoned((7, 16), torch.float32, device), return_lse=True)
    out, lse = out.float().cpu(), lse.cpu()
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, True)
    nan_rows = torch.zeros(7, 16, dtype=torch.bool)
    nan_rows[2:4] = True
    nan_rows[5, 3] = True
    assert torch.equal(torch.isnan(ref_lse), nan_rows), "the reference itself must put NaN exactly there"
    assert torch.equal(torch.isnan(lse), nan_rows)
    assert torch.isnan(out[nan_rows]).all() and not torch.isnan(out[~nan_rows]).any()
    tol = tolerance(dtype)
    torch.testing.assert_close(out[~nan_rows], ref_out[~nan_rows], atol=tol, rtol=tol)
    torch.testing.assert_close(lse[~nan_rows], ref_lse[~nan_rows], atol=2e-3, rtol=1e-4)


def test_mla_slices_of_one_buffer_are_used_without_a_copy() -> None:
    """ckv/kpe as slices of one [pages, page_size, 576] buffer are the keys' view (no copy); a live edit of the
    buffer after plan() shows in the next run; separate tensors give the same result (through a copy)."""
    gen = torch.Generator().manual_seed(5)
    ckv, kpe, indptr, indices, lens = _latent_cache([40, 7], 16, torch.float32, "cpu", gen, joined=True)
    keys = latent_keys(ckv, kpe)
    assert keys.data_ptr() == ckv.data_ptr() and keys.untyped_storage().data_ptr() == kpe.untyped_storage().data_ptr()
    assert keys.shape == (ckv.shape[0], 16, CKV + KPE)
    copied = latent_keys(ckv.contiguous(), kpe.contiguous())
    assert torch.equal(copied, keys) and copied.data_ptr() != ckv.data_ptr()
    q_nope, q_pe = _queries([1, 1], 16, torch.float32, "cpu", gen)
    wrapper = _wrapper("cpu")
    wrapper.plan(_indptr([1, 1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, torch.float32,
                 torch.float32)
    first = wrapper.run(q_nope, q_pe, ckv, kpe)
    assert torch.equal(wrapper.run(q_nope, q_pe, ckv.contiguous(), kpe.contiguous()), first)
    kpe.mul_(3.0)  # through the buffer
    ref_out, _ = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, [1, 1], [40, 7], False)
    assert_close_out(wrapper.run(q_nope, q_pe, ckv, kpe), ref_out, torch.float32)


def test_mla_cache_of_too_few_pages_is_named_in_the_callers_terms() -> None:
    """The fallback's inner prefill plan named its own argument (paged_kv_indices) for MLA's kv_indices."""
    gen = torch.Generator().manual_seed(6)
    ckv, kpe, indptr, indices, lens = _latent_cache([40, 7], 16, torch.float32, "cpu", gen, joined=True)
    q_nope, q_pe = _queries([1, 1], 16, torch.float32, "cpu", gen)
    wrapper = _wrapper("cpu")
    wrapper.plan(_indptr([1, 1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, torch.float32,
                 torch.float32)
    highest = int(indices[: int(indptr[-1])].max())
    with pytest.raises(ValueError, match=f"^kv_indices reference page {highest} but ckv_cache has {highest} pages"):
        wrapper.run(q_nope, q_pe, ckv[:highest], kpe[:highest])


# -- fp8 latent cache ----------------------------------------------------------------------------------
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("mode", ["decode", "speculative"])
def test_mla_fp8_latent_cache_matches_the_fp8_reference(device: str, mode: str) -> None:
    """e4m3 ckv/kpe with per-tensor k_scale/v_scale: the reference dequantizes the same fp8 values."""
    gen = torch.Generator().manual_seed(31 + len(mode))
    q_dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_lens, qo_lens, causal = _MODES[mode]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, e4m3, device, gen, joined=True)
    q_nope, q_pe = _queries(qo_lens, 16, q_dtype, device, gen)
    k_scale, v_scale = 0.3, 1.7
    wrapper = _wrapper(device)
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, 16, CKV, KPE, 16, causal, SM_SCALE, q_dtype, e4m3)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=_poisoned((sum(qo_lens), 16, CKV), q_dtype, device),
                           return_lse=True, k_scale=k_scale, v_scale=torch.tensor(v_scale))
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal, k_scale, v_scale)
    assert_close_out(out / v_scale, ref_out / v_scale, q_dtype)
    assert_close_lse(lse, ref_lse)
    unscaled = wrapper.run(q_nope, q_pe, ckv, kpe)
    assert not torch.allclose(unscaled.float(), out.float(), atol=0.1), "the scales must change the result"


def test_mla_fp8_scales_are_checked() -> None:
    gen = torch.Generator().manual_seed(3)
    ckv, kpe, indptr, indices, lens = _latent_cache([5], 16, e4m3, "cpu", gen, joined=True)
    q_nope, q_pe = _queries([1], 16, torch.float32, "cpu", gen)
    wrapper = _wrapper("cpu")
    wrapper.plan(_indptr([1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, torch.float32, e4m3)
    with pytest.raises(ValueError, match="k_scale must be a float or a one-element tensor"):
        wrapper.run(q_nope, q_pe, ckv, kpe, k_scale=torch.ones(16))
    with pytest.raises(TypeError, match="kv_data_type"):  # a bf16 cache for an fp8 plan
        wrapper.run(q_nope, q_pe, ckv.float(), kpe.float())


# -- append ----------------------------------------------------------------------------------------------
def _append_case(cache_dtype, device, gen):
    page_size, kv_lens = 16, [20, 3]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, page_size, cache_dtype, device, gen, joined=True)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    append_indptr = torch.tensor([0, 4, 6], dtype=torch.int32)  # the last 4 and 2 tokens of each request
    batch, positions = jitattn.get_batch_indices_positions(append_indptr, lens, 6)
    return ckv, kpe, indptr, indices, last, batch, positions, page_size


@pytest.mark.parametrize("device", devices())
def test_append_paged_mla_kv_cache_writes_both_parts(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    ckv, kpe, indptr, indices, last, batch, positions, page_size = _append_case(dtype, device, gen)
    before_ckv, before_kpe = ckv.clone(), kpe.clone()
    new_ckv = torch.randn(6, CKV, generator=gen).to(dtype).to(device)
    new_kpe = torch.randn(6, KPE, generator=gen).to(dtype).to(device)
    jitattn.ops.page.append_paged_mla_kv_cache(new_ckv, new_kpe, batch.to(device), positions.to(device), ckv, kpe,
                                           indices.to(device), indptr.to(device), last.to(device))
    written = torch.zeros(ckv.shape[:2], dtype=torch.bool)
    for t in range(6):
        r, pos = int(batch[t]), int(positions[t])
        page = int(indices[int(indptr[r]) + pos // page_size])
        written[page, pos % page_size] = True
        assert torch.equal(ckv[page, pos % page_size].cpu(), new_ckv[t].cpu())
        assert torch.equal(kpe[page, pos % page_size].cpu(), new_kpe[t].cpu())
    assert torch.equal(ckv.cpu()[~written], before_ckv.cpu()[~written]), "other slots are untouched"
    assert torch.equal(kpe.cpu()[~written], before_kpe.cpu()[~written])


@pytest.mark.parametrize("device", devices())
def test_append_paged_mla_kv_cache_into_fp8_saturates(device: str) -> None:
    """bf16 rows into an e4m3 latent cache round like to_cache_dtype: beyond +-448 (inf too) -> +-448."""
    gen = torch.Generator().manual_seed(4)
    ckv, kpe, indptr, indices, last, batch, positions, page_size = _append_case(e4m3, device, gen)
    new_ckv = (torch.randn(6, CKV, generator=gen) * 300).to(torch.bfloat16)
    new_kpe = (torch.randn(6, KPE, generator=gen) * 300).to(torch.bfloat16)
    new_ckv[0, :3] = torch.tensor([1e4, -1e4, float("inf")])
    new_kpe[1, :2] = torch.tensor([float("-inf"), 5000.0])
    jitattn.ops.page.append_paged_mla_kv_cache(new_ckv.to(device), new_kpe.to(device), batch.to(device),
                                           positions.to(device), ckv, kpe, indices.to(device), indptr.to(device),
                                           last.to(device))
    expected_ckv, expected_kpe = to_cache_dtype(new_ckv, e4m3).float(), to_cache_dtype(new_kpe, e4m3).float()
    assert expected_ckv[0, :3].tolist() == [448.0, -448.0, 448.0]
    for t in range(6):
        r, pos = int(batch[t]), int(positions[t])
        page = int(indices[int(indptr[r]) + pos // page_size])
        assert torch.equal(ckv[page, pos % page_size].cpu().float(), expected_ckv[t])
        assert torch.equal(kpe[page, pos % page_size].cpu().float(), expected_kpe[t])


# -- CUDA graphs: the fixed buffers ---------------------------------------------------------------------
def _graph_buffers(device: str, batch: int, pages: int) -> dict[str, torch.Tensor]:
    return dict(qo_indptr=torch.empty(batch + 1, dtype=torch.int32, device=device),
                kv_indptr=torch.empty(batch + 1, dtype=torch.int32, device=device),
                kv_indices=torch.empty(pages, dtype=torch.int32, device=device),
                kv_len_arr=torch.empty(batch, dtype=torch.int32, device=device))


def test_mla_graph_mode_buffer_rules() -> None:
    """Every fixed buffer is required, 1-D int32 on the workspace's device, and large enough for the batch."""
    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    buffers = _graph_buffers("cpu", 2, 8)
    for name in buffers:
        with pytest.raises(ValueError, match=f"use_cuda_graph=True needs the fixed buffer {name}"):
            jitattn.BatchMLAPagedAttentionWrapper(workspace, True, **{**buffers, name: None})
    with pytest.raises(ValueError, match="kv_indices buffer must be a 1-D int32 tensor"):
        jitattn.BatchMLAPagedAttentionWrapper(workspace, True, **{**buffers, "kv_indices": torch.empty(8)})
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(workspace, True, **buffers)
    assert wrapper.is_cuda_graph_enabled
    gen = torch.Generator().manual_seed(8)

    def plan(kv_lens):
        ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, torch.float32, "cpu", gen, joined=True)
        wrapper.plan(_indptr([1] * len(kv_lens)), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE,
                     torch.float32, torch.float32)

    plan([30, 7])
    assert buffers["kv_len_arr"].tolist() == [30, 7], "plan() copies kv_len_arr into its fixed buffer"
    assert buffers["kv_indptr"].tolist() == [0, 2, 3]
    planned = {name: b.clone() for name, b in buffers.items()}
    with pytest.raises(ValueError, match="kv_indices buffer holds 8 entries but this batch needs 10"):
        plan([100, 40])  # 7 + 3 pages
    with pytest.raises(ValueError, match="qo_indptr buffer holds 3 entries but this batch needs 4"):
        plan([5, 5, 5])
    for name, b in buffers.items():
        assert torch.equal(b, planned[name]), f"a refused plan wrote into the {name} buffer"


def test_mla_graph_mode_replans_into_the_same_buffers() -> None:
    """On the cpu target graph mode works the same way: each plan refills the fixed buffers and runs match."""
    gen = torch.Generator().manual_seed(9)
    buffers = _graph_buffers("cpu", 3, 40)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(0, dtype=torch.uint8), True, **buffers)
    ckv, kpe, _, _, _ = _latent_cache([40 * 16], 16, torch.float32, "cpu", gen, joined=True, spare_pages=0)
    q_nope, q_pe = _queries([1, 1, 1], 16, torch.float32, "cpu", gen)
    out = _poisoned((3, 16, CKV), torch.float32, "cpu")
    for kv_lens in ([100, 3, 250], [1, 17, 60], [0, 200, 16]):
        pages = [(n + 15) // 16 for n in kv_lens]
        indices = torch.randperm(40, generator=gen)[: sum(pages)].to(torch.int32)
        indptr, lens = _indptr(pages), torch.tensor(kv_lens, dtype=torch.int32)
        wrapper.plan(_indptr([1, 1, 1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, torch.float32,
                     torch.float32)
        out.fill_(POISON)
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)
        ref_out, _ = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, [1, 1, 1], kv_lens, False)
        assert_close_out(out, ref_out, torch.float32)


@pytest.mark.gpu
def test_mla_cuda_graph_replays_after_replanning() -> None:
    """A decode run captured once replays the latest plan (new lengths and pages, same batch size) into the
    same output, and gives the reference each time."""
    gen = torch.Generator().manual_seed(10)
    batch, heads, page_size, max_pages = 8, 128, 64, 8 * 16
    dtype = torch.bfloat16
    buffers = _graph_buffers("cuda", batch, max_pages)
    wrapper = _wrapper("cuda", use_cuda_graph=True, **buffers)
    buffer = torch.randn(max_pages, page_size, CKV + KPE, generator=gen).to(dtype).cuda()
    ckv, kpe = buffer[..., :CKV], buffer[..., CKV:]
    q_nope, q_pe = _queries([1] * batch, heads, dtype, "cuda", gen)
    out = torch.empty(batch, heads, CKV, dtype=dtype, device="cuda")
    lse = torch.empty(batch, heads, dtype=torch.float32, device="cuda")

    def plan():
        kv_lens = torch.randint(0, 16 * page_size, (batch,), generator=gen).tolist()
        pages = [(n + page_size - 1) // page_size for n in kv_lens]
        indices = torch.randperm(max_pages, generator=gen)[: sum(pages)].to(torch.int32)
        indptr = _indptr(pages)
        wrapper.plan(_indptr([1] * batch), indptr, indices, torch.tensor(kv_lens, dtype=torch.int32), heads, CKV, KPE,
                     page_size, False, SM_SCALE, dtype, dtype)
        return indptr, indices, kv_lens

    plan()
    wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)  # loads the module outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)
    for _ in range(5):
        indptr, indices, kv_lens = plan()
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, [1] * batch, kv_lens, False)
        assert_close_out(out, ref_out, dtype)
        assert_close_lse(lse, ref_lse)


# -- the plan / run rules -------------------------------------------------------------------------------
def _one_request_plan(wrapper, **overrides) -> None:
    args = dict(qo_indptr=_indptr([1]), kv_indptr=_indptr([1]), kv_indices=torch.zeros(1, dtype=torch.int32),
                kv_len_arr=torch.tensor([10], dtype=torch.int32), num_heads=16, head_dim_ckv=CKV, head_dim_kpe=KPE,
                page_size=16, causal=False, sm_scale=SM_SCALE, q_data_type=torch.float32,
                kv_data_type=torch.float32)
    wrapper.plan(**{**args, **overrides})


def test_mla_plan_checks_lengths_against_the_pages() -> None:
    wrapper = _wrapper("cpu")
    with pytest.raises(ValueError, match="needs 3 pages"):
        _one_request_plan(wrapper, kv_indptr=_indptr([2]), kv_indices=torch.tensor([0, 1], dtype=torch.int32),
                          kv_len_arr=torch.tensor([40], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_len_arr\[0\] = -1 is negative"):
        _one_request_plan(wrapper, kv_len_arr=torch.tensor([-1], dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_len_arr has 0 entries, but qo_indptr describes 1 requests"):
        _one_request_plan(wrapper, kv_len_arr=torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv_indptr has 1 entries, but qo_indptr describes 1 requests, which need 2"):
        _one_request_plan(wrapper, kv_indptr=torch.zeros(1, dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="use_profiler"):
        _one_request_plan(wrapper, use_profiler=True)
    with pytest.raises(ValueError, match="page_size"):
        _one_request_plan(wrapper, page_size=0)
    with pytest.raises(TypeError, match="kv_indices has dtype torch.int64; index arrays must be int32"):
        _one_request_plan(wrapper, kv_indices=torch.zeros(1, dtype=torch.int64))
    with pytest.raises(ValueError, match="head_dim_ckv=512, head_dim_kpe=8 is not supported: MLA runs on"):
        _one_request_plan(wrapper, head_dim_kpe=8)


@pytest.mark.parametrize("bad", [dict(kv_len_arr=torch.tensor([20], dtype=torch.int32)),
                                 dict(kv_indices=torch.zeros(1, dtype=torch.int64)), dict(page_size=0),
                                 dict(sm_scale=None)], ids=["lengths", "int64", "page_size", "sm_scale"])
def test_a_refused_mla_plan_leaves_none(bad) -> None:
    """After a plan() that raised, run() says there is no plan (it must not run the previous batch's)."""
    gen = torch.Generator().manual_seed(7)
    ckv, kpe, indptr, indices, lens = _latent_cache([10], 16, torch.float32, "cpu", gen, joined=True)
    q_nope, q_pe = _queries([1], 16, torch.float32, "cpu", gen)
    wrapper = _wrapper("cpu")
    _one_request_plan(wrapper, kv_indices=indices)
    wrapper.run(q_nope, q_pe, ckv, kpe)
    with pytest.raises((ValueError, TypeError)):
        _one_request_plan(wrapper, **{"kv_indices": indices, **bad})
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q_nope, q_pe, ckv, kpe)


def test_mla_run_rules() -> None:
    """run() before plan(), wrong shapes, dtypes and devices: errors that name the MLA wrapper and the fix."""
    gen = torch.Generator().manual_seed(6)
    ckv, kpe, indptr, indices, lens = _latent_cache([10], 16, torch.float32, "cpu", gen, joined=True)
    q_nope, q_pe = _queries([1], 16, torch.float32, "cpu", gen)
    wrapper = _wrapper("cpu")
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q_nope, q_pe, ckv, kpe)
    _one_request_plan(wrapper, kv_indices=indices)
    with pytest.raises(ValueError, match="q_pe has head dim 32; the plan has 64"):
        wrapper.run(q_nope, q_pe[..., :32], ckv, kpe)
    with pytest.raises(ValueError, match=r"q_nope has shape \(1, 8, 512\); .* num_heads=16"):
        wrapper.run(q_nope[:, :8], q_pe[:, :8], ckv, kpe)  # 8 heads, planned 16
    with pytest.raises(ValueError, match=r"q_pe has shape \(2, 16, 64\); the plan has 1 query tokens"):
        wrapper.run(q_nope, torch.cat([q_pe, q_pe]), ckv, kpe)
    with pytest.raises(ValueError, match="must have the same"):
        wrapper.run(q_nope, q_pe, ckv, kpe[:1])
    with pytest.raises(TypeError, match="same dtype"):
        wrapper.run(q_nope, q_pe, ckv, kpe.double())
    with pytest.raises(ValueError, match=r"ckv_cache has shape \(\d+, 8, 512\): pages of 8 tokens, but the plan has "
                                         r"page_size=16"):
        wrapper.run(q_nope, q_pe, ckv.reshape(-1, 8, CKV), kpe.reshape(-1, 8, KPE))
    with pytest.raises(NotImplementedError, match="kv_len is not supported by jitattn; the batch is described"):
        wrapper.run(q_nope, q_pe, ckv, kpe, kv_len=lens)
    out = torch.empty(1, 16, CKV, dtype=torch.float64)
    with pytest.raises((TypeError, ValueError), match="out"):
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)


def test_mla_workspace_rules() -> None:
    """The float workspace sets the target; this tier (paged prefill kernels, no KV split) needs no bytes of it,
    so any size works; a non-tensor is refused with the allocation to make."""
    with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
        jitattn.BatchMLAPagedAttentionWrapper(128 << 20)
    with pytest.raises(ValueError, match="backend"):
        jitattn.BatchMLAPagedAttentionWrapper(torch.empty(16, dtype=torch.uint8), backend="cutlass")
    gen = torch.Generator().manual_seed(7)
    ckv, kpe, indptr, indices, lens = _latent_cache([70, 3], 16, torch.float32, "cpu", gen, joined=True)
    q_nope, q_pe = _queries([1, 1], 16, torch.float32, "cpu", gen)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    wrapper.plan(_indptr([1, 1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, torch.float32,
                 torch.float32)
    ref_out, _ = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, [1, 1], [70, 3], False)
    assert_close_out(wrapper.run(q_nope, q_pe, ckv, kpe), ref_out, torch.float32)


# -- non-absorbed MLA prefill (qk 192 / vo 128) ----------------------------------------------------------
@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_heads", [16, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_non_absorbed_mla_prefill_through_the_ragged_wrapper(device: str, num_heads: int, causal: bool) -> None:
    """DeepSeek prefill before absorption: q/k = [nope 128 | rope 64], v 128, num_kv_heads == num_heads."""
    gen = torch.Generator().manual_seed(num_heads + causal)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    qo_lens, kv_lens = ([9, 1, 20], [9, 30, 45]) if device == "cpu" else ([300, 1, 129], [300, 700, 1000])
    dqk = QK_NOPE + QK_ROPE
    q = torch.randn(sum(qo_lens), num_heads, dqk, generator=gen).to(dtype).to(device)
    k = torch.randn(sum(kv_lens), num_heads, dqk, generator=gen).to(dtype).to(device)
    v = torch.randn(sum(kv_lens), num_heads, V_HEAD, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), num_heads, num_heads, dqk, head_dim_vo=V_HEAD, causal=causal,
                 sm_scale=SM_SCALE, q_data_type=dtype)
    out = _poisoned((sum(qo_lens), num_heads, V_HEAD), dtype, device)
    out, lse = wrapper.run(q, k, v, out=out, return_lse=True)
    ref_out, ref_lse = reference.batch_ragged_attention(q.cpu(), k.cpu(), v.cpu(), _indptr(qo_lens), _indptr(kv_lens),
                                                        causal=causal, sm_scale=SM_SCALE)
    assert_close_out(out, ref_out, dtype)
    assert_close_lse(lse, ref_lse)

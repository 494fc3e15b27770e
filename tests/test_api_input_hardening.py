"""Bad input a fuzzing pass over the public API found accepted (2026-12-02): each now fails with a clear
error instead of a crash, silently wrong output or a corrupted cache. cpu target, small shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.jit.loader import KernelError

from attention_cases import assert_close_out, random_paged_batch

PAGE = 16
HQ, HKV, D = 8, 2, 64  # test_api_dropin's decode shapes: the same cpu module


def _workspace() -> torch.Tensor:
    return torch.empty(16 << 20, dtype=torch.uint8)


def _decode_batch():
    gen = torch.Generator().manual_seed(10)
    batch = random_paged_batch([5, 20, 33], HKV, D, PAGE, torch.float32, generator=gen)
    q = torch.randn(3, HQ, D, generator=gen)
    return batch, q


def _decode_wrapper(batch, **options):
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                 q_data_type=torch.float32, **options)
    return wrapper


@pytest.mark.parametrize("page", [10**7, -50_000_000], ids=["past-the-pool", "negative"])
def test_fast_decode_plan_page_outside_the_cache_is_a_kernel_error(page):
    """fast_decode_plan checks no page ids on the host; the cpu kernel refuses one outside the cache (it
    used to read there: a segfault)."""
    batch, q = _decode_batch()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    indices = batch.kv_indices.clone()
    indices[-1] = page
    jitattn.fast_decode_plan(wrapper, batch.kv_indptr, indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                             q_data_type=torch.float32)
    with pytest.raises(KernelError, match=f"kv_indices\\[{indices.numel() - 1}\\]={page} is outside the kv cache"):
        wrapper.run(q, batch.cache)


@pytest.mark.parametrize("last", [0, PAGE + 1])
def test_fast_decode_plan_checks_host_last_page_lengths(last):
    """Host last_page_len is checked without a sync (a 0 for a request with pages was computed over a page too few
    keys); device ones are trusted, as FlashInfer's fast path trusts them."""
    batch, _ = _decode_batch()
    lengths = batch.kv_last_page_len.clone()
    lengths[0] = last
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(ValueError, match=f"last_page_len\\[0\\] = {last} is out of range: a request with pages needs"):
        jitattn.fast_decode_plan(wrapper, batch.kv_indptr, batch.kv_indices, lengths, HQ, HKV, D, PAGE,
                                 q_data_type=torch.float32)


@pytest.mark.parametrize("which", ["indices", "last_page_len"])
def test_fast_decode_plan_refuses_int64_tables(which):
    batch, _ = _decode_batch()
    tables = dict(indptr=batch.kv_indptr, indices=batch.kv_indices, last_page_len=batch.kv_last_page_len)
    tables[which] = tables[which].long()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(TypeError, match=f"{which} has dtype int64; expected one of int32"):
        jitattn.fast_decode_plan(wrapper, tables["indptr"], tables["indices"], tables["last_page_len"], HQ, HKV,
                                 D, PAGE, q_data_type=torch.float32)


def test_fast_decode_plan_reads_strided_tables_as_their_values():
    """Index arrays that are strided views (a column of a wider table) were read by the kernel as if packed: the
    pages of other rows, a silently wrong result (2026-12-06 sweep)."""
    batch, q = _decode_batch()
    expected = _decode_wrapper(batch).run(q, batch.cache)
    strided = {name: torch.stack([t, t.flip(0)], 1)[:, 0] for name, t in
               (("indptr", batch.kv_indptr), ("indices", batch.kv_indices), ("last", batch.kv_last_page_len))}
    assert all(t.stride(0) == 2 for t in strided.values())
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    jitattn.fast_decode_plan(wrapper, strided["indptr"], strided["indices"], strided["last"], HQ, HKV, D, PAGE,
                             q_data_type=torch.float32)
    torch.testing.assert_close(wrapper.run(q, batch.cache), expected, atol=0, rtol=0)


def test_fast_decode_plan_refuses_indices_shorter_than_the_page_table():
    batch, _ = _decode_batch()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    n = int(batch.kv_indptr[-1])
    with pytest.raises(ValueError, match=rf"indptr\[-1\] = {n} pages but indices has {n - 2} entries"):
        jitattn.fast_decode_plan(wrapper, batch.kv_indptr, batch.kv_indices[: n - 2], batch.kv_last_page_len, HQ,
                                 HKV, D, PAGE, q_data_type=torch.float32)


def test_fast_decode_plan_names_a_host_indptr_that_disagrees_with_indptr():
    batch, _ = _decode_batch()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    args = (batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match="global_override_indptr_cpu has 3 entries but indptr has 4"):
        jitattn.fast_decode_plan(wrapper, *args, q_data_type=torch.float32,
                                 global_override_indptr_cpu=batch.kv_indptr[:3].clone())


@pytest.mark.parametrize("single", ["prefill", "decode"])
def test_single_calls_name_q_and_k_of_different_head_dims(single):
    """The plan took q's head dim and the run then blamed "the kv cache" against "the plan" (or advised padding),
    which the caller of a single call never made (2026-12-06 sweep; POD's prefill part prefixes its own names)."""
    q = torch.randn(10, 4, 32) if single == "prefill" else torch.randn(4, 32)
    fn = getattr(jitattn, f"single_{single}_with_kv_cache")
    with pytest.raises(ValueError, match=f"single_{single}_with_kv_cache: q has head_dim 32 but k has 64"):
        fn(q, torch.randn(12, 2, 64), torch.randn(12, 2, 64))


def test_a_strided_workspace_or_fixed_buffer_is_refused():
    """The kernels address both packed from data_ptr: a strided workspace had its gaps overwritten, a strided
    CUDA-graph buffer was written through its strides and read packed (another batch's pages; 2026-12-06 sweep)."""
    with pytest.raises(ValueError, match=r"float_workspace_buffer \(strides \(2,\)\) is not contiguous"):
        jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.zeros(2 << 20, dtype=torch.uint8)[::2])
    batch, _ = _decode_batch()
    n = batch.kv_indptr.numel()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(), use_cuda_graph=True, paged_kv_indptr_buffer=torch.empty(n, dtype=torch.int32),
        paged_kv_indices_buffer=torch.zeros(256, dtype=torch.int32)[::2],
        paged_kv_last_page_len_buffer=torch.empty(n - 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_indices buffer \(strides \(2,\)\) is not contiguous"):
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     q_data_type=torch.float32)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match=r"kv_indices buffer \(strides \(2,\)\) is not contiguous"):
        jitattn.BatchMLAPagedAttentionWrapper(_workspace(), True, i32(0, 1), i32(0, 1),
                                              torch.zeros(64, dtype=torch.int32)[::2], i32(1))


def test_a_fixed_buffer_of_two_dimensions_is_refused_by_name():
    batch, _ = _decode_batch()
    n = batch.kv_indptr.numel()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        _workspace(), use_cuda_graph=True, paged_kv_indptr_buffer=torch.zeros(2, n + 1, dtype=torch.int32),
        paged_kv_indices_buffer=torch.zeros(256, dtype=torch.int32),
        paged_kv_last_page_len_buffer=torch.empty(n - 1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"kv_indptr buffer has shape \(2, 5\); it must be one-dimensional"):
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                     q_data_type=torch.float32)


def test_k_and_v_of_different_dtypes_are_named_as_such():
    batch, q = _decode_batch()
    wrapper = _decode_wrapper(batch)
    with pytest.raises(TypeError, match=r"k and v caches have different dtypes \(torch.float32 vs torch.float16\)"):
        wrapper.run(q, (batch.cache[:, 0], batch.cache[:, 1].half()))


def test_mla_plan_errors_name_its_own_arrays():
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(_workspace())
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    args = (i32(0, 1, 2), i32(0, 1, 2), i32(0, 1), i32(5, 9), 16, 512, 64, 16, False, 0.07, torch.bfloat16,
            torch.bfloat16)
    with pytest.raises(ValueError, match="kv_indptr must be non-decreasing"):
        wrapper.plan(args[0], i32(0, 2, 1), *args[2:])
    with pytest.raises(ValueError, match=r"kv_indices\[1\] = -3 is a negative page index"):
        wrapper.plan(args[0], args[1], i32(0, -3), *args[3:])
    with pytest.raises(ValueError, match=r"kv_indptr\[0\] must be 0"):
        wrapper.plan(args[0], i32(1, 2, 3), *args[2:])


@pytest.mark.parametrize("options, error, message", [
    (dict(window_left=2**32 + 1), ValueError, r"window_left=4294967297 must be -1"),  # was truncated to 1
    (dict(window_left=2**31), ValueError, r"window_left=2147483648 must be -1"),  # was negative: no window
    (dict(window_left=1.5), TypeError, "window_left=1.5 must be an int"),
    (dict(window_left="3"), TypeError, "window_left='3' must be an int"),
    (dict(sm_scale=1e300), ValueError, "sm_scale=1e\\+300 must be a positive finite number"),  # inf in float32
    (dict(sm_scale=1e-300), ValueError, "sm_scale=1e-300 must be"),  # 0 in float32: uniform attention
    (dict(sm_scale="x"), TypeError, "sm_scale='x' must be a number"),
    (dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=math.nan), ValueError, "rope_theta=nan must be"),
    (dict(pos_encoding_mode="ROPE_LLAMA", rope_scale=1e-300), ValueError, "rope_scale=1e-300 must be"),
    (dict(logits_soft_cap=math.inf), ValueError, "logits_soft_cap=inf must be"),
], ids=["window-2^32+1", "window-2^31", "window-float", "window-str", "sm_scale-huge", "sm_scale-tiny",
        "sm_scale-str", "rope_theta-nan", "rope_scale-tiny", "soft_cap-inf"])
def test_plan_scalars_outside_what_the_kernels_hold_are_refused(options, error, message):
    batch, _ = _decode_batch()
    with pytest.raises(error, match=message):
        _decode_wrapper(batch, **options)


@pytest.mark.parametrize("scales, message", [
    (dict(k_scale=math.nan), "k_scale=nan must be a positive finite number"),
    (dict(v_scale=-1.0), "v_scale=-1.0 must be a positive finite number"),
    (dict(v_scale=math.inf), "v_scale=inf must be"),
    (dict(q_scale=0.0), "q_scale=0.0 must be"),
], ids=["k-nan", "v-negative", "v-inf", "q-zero"])
def test_run_scales_must_be_positive_and_finite(scales, message):
    batch, q = _decode_batch()
    wrapper = _decode_wrapper(batch)
    with pytest.raises(ValueError, match=message):
        wrapper.run(q, batch.cache, **scales)


@pytest.mark.parametrize("which", ["out", "lse"])
def test_expanded_outputs_are_refused(which):
    """Rows of an expand()ed output share memory: the kernel's writes would overwrite each other."""
    batch, q = _decode_batch()
    wrapper = _decode_wrapper(batch)
    out = torch.empty(1, HQ, D).expand(3, -1, -1) if which == "out" else None
    lse = torch.empty(1, HQ).expand(3, -1) if which == "lse" else None
    with pytest.raises(ValueError, match=f"{which} .*share memory"):
        wrapper.run(q, batch.cache, out=out, lse=lse, return_lse=lse is not None)


def _append_args(cache):
    gen = torch.Generator().manual_seed(11)
    kv_indptr = torch.tensor([0, 1], dtype=torch.int32)
    kv_indices = torch.tensor([0], dtype=torch.int32)
    last = torch.tensor([3], dtype=torch.int32)
    batch_indices, positions = jitattn.get_batch_indices_positions(
        torch.tensor([0, 3], dtype=torch.int32), jitattn.get_seq_lens(kv_indptr, last, PAGE), 3)
    k, v = torch.randn(3, HKV, D, generator=gen), torch.randn(3, HKV, D, generator=gen)
    return k, v, batch_indices, positions, cache, kv_indices, kv_indptr, last


def test_append_refuses_an_expanded_cache_and_one_buffer_for_k_and_v():
    pages = torch.randn(1, PAGE, HKV, D).expand(4, -1, -1, -1)
    with pytest.raises(ValueError, match="the k cache .*share memory"):
        jitattn.append_paged_kv_cache(*_append_args((pages, pages.clone())))
    same = torch.randn(4, PAGE, HKV, D)
    with pytest.raises(ValueError, match="k and v share memory"):
        jitattn.append_paged_kv_cache(*_append_args((same, same)))


def test_append_refuses_k_and_v_caches_that_overlap_and_keeps_ones_that_interleave():
    """Caches cut from one buffer: pages (or heads) of one that are the other's are refused, since the appended
    values would overwrite keys; views that interleave without sharing an element write what a pair of separate
    caches gets."""
    buffer = torch.randn(5, PAGE, 2 * HKV, D)
    heads = buffer[:, :, :HKV]
    for k_cache, v_cache in ((heads[:4], heads[1:]), (heads[1:], heads[:4]), (heads[:4], buffer[:4, :, 1:HKV + 1])):
        with pytest.raises(ValueError, match="k and v share memory, so the appended values would overwrite keys"):
            jitattn.append_paged_kv_cache(*_append_args((k_cache, v_cache)))
    stacked = torch.randn(4, 2, PAGE, HKV, D)
    for k_cache, v_cache in ((stacked[:, 0], stacked[:, 1]), (buffer[:4, :, :HKV], buffer[:4, :, HKV:]),
                             (heads[:4, : PAGE // 2], heads[:4, PAGE // 2:])):
        args = list(_append_args((k_cache, v_cache)))  # 3 tokens on page 0 (half pages: 8 slots each)
        expected = (k_cache.clone(), v_cache.clone())
        jitattn.append_paged_kv_cache(*args)
        k, v, positions = args[0], args[1], args[3].long()
        expected[0][0, positions], expected[1][0, positions] = k, v
        torch.testing.assert_close(k_cache, expected[0], rtol=0, atol=0)
        torch.testing.assert_close(v_cache, expected[1], rtol=0, atol=0)


def test_views_overlap_agrees_with_the_elements_the_views_share():
    """``checks.views_overlap`` against brute force over random pairs of views of one buffer (one page shape and
    strides, pages and offsets at random): it never reports an overlap the views do not have, and finds every one
    the views have when their strides nest (each above the span of the smaller ones; others it does not tell)."""
    import itertools
    import random

    from jitattn.runtime.checks import views_overlap

    rng = random.Random(5)
    buffer = torch.zeros(4096)
    found = 0
    for _ in range(3000):
        page_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        inner = [rng.choice([1, 2, 3, 5, 8, 16]) for _ in page_shape]
        step = rng.randint(1, 200)
        strides = (step, *inner)
        pages = rng.randint(1, 4), rng.randint(1, 4)
        first = rng.randint(400, 600)  # the second view near the first (within two pages) or anywhere
        starts = first, (first + rng.randint(-2 * step, 2 * step) if rng.random() < 0.7 else rng.randint(0, 600))
        a, b = (buffer.as_strided((n, *page_shape), strides, start) for n, start in zip(pages, starts))
        elements = [{start + sum(i * st for i, st in zip(index, strides))
                     for index in itertools.product(*(range(n) for n in t.shape))} for t, start in zip((a, b), starts)]
        shared = bool(elements[0] & elements[1])
        dims = sorted((st for n, st in zip((max(pages), *page_shape), strides) if n > 1), reverse=True)
        sizes = {st: n for n, st in zip((max(pages), *page_shape), strides) if n > 1}
        nested = len(set(dims)) == len(dims) and all(
            st > sum((sizes[t] - 1) * t for t in dims[i + 1:]) for i, st in enumerate(dims))
        told = views_overlap(a, b)
        assert not told or shared, (page_shape, strides, pages, starts)
        if nested:
            assert told == shared, (page_shape, strides, pages, starts)
        found += told
    assert found > 100, "the draw must hit overlapping pairs"


def test_shares_element_agrees_with_the_bytes_the_views_share():
    """``checks.shares_element`` against brute force over random views of one byte buffer (ranks 1-3, then views of
    two ranks, dtypes of 1, 2 and 4 bytes, extents, strides and offsets at random, size-1 dimensions of any stride):
    whenever it answers, the answer is whether the views share a byte; column slices of one buffer, also of two
    dtypes, are told apart."""
    import itertools
    import random

    from jitattn.runtime.checks import shares_element

    rng = random.Random(11)
    storage = torch.zeros(4096, dtype=torch.uint8).untyped_storage()
    answered = [0, 0]
    for trial in range(9000):
        rank, views = rng.randint(0, 3), []
        for _ in range(2):
            rank = rank if trial < 6000 else rng.randint(0, 4)  # then views of two ranks (merged dimensions)
            dtype = rng.choice([torch.uint8, torch.int16, torch.float32, torch.float64])
            size = torch.tensor([], dtype=dtype).element_size()
            shape = [rng.randint(1, 3) for _ in range(rank)]
            strides = [rng.randint(0, 8) for _ in range(rank)]
            views.append(torch.empty(0, dtype=dtype).set_(storage, rng.randint(0, 64 // size), shape, strides))
        touched = [{t.data_ptr() + sum(i * st for i, st in zip(index, t.stride())) * t.element_size() + byte
                    for index in itertools.product(*(range(n) for n in t.shape)) for byte in range(t.element_size())}
                   for t in views]
        told = shares_element(*views)
        if told is not None:
            answered[trial >= 6000] += 1
            assert told == bool(touched[0] & touched[1]), [(t.shape, t.stride(), t.dtype, t.data_ptr()) for t in views]
    assert answered[0] > 1500 and answered[1] > 200, answered
    # a last dimension of one element against one of several bytes (the pairing of the views' byte dimensions)
    float32 = torch.empty(0, dtype=torch.float32).set_(storage, 5, (1,), (1,))  # byte 20..23
    float64 = torch.empty(0, dtype=torch.float64).set_(storage, 2, (1,), (0,))  # bytes 16..23
    assert shares_element(float32, float64) is not False
    buffer = torch.zeros(8, 1, 656, dtype=torch.uint8)
    latent, rope = buffer[..., :512].view(torch.float8_e4m3fn), buffer[..., 528:].view(torch.bfloat16)
    assert shares_element(latent, rope) is False and shares_element(latent, buffer[..., 500:520]) is True
    rows = torch.zeros(8, 576)
    assert shares_element(rows[:, :512].unsqueeze(1), rows[:, 512:].unsqueeze(1)) is False  # page size 1


def test_batch_indices_positions_need_append_indptr_to_start_at_zero():
    with pytest.raises(ValueError, match=r"append_indptr\[0\]=1 must be 0"):
        jitattn.get_batch_indices_positions(torch.tensor([1, 3, 5], dtype=torch.int32),
                                            torch.tensor([4, 4], dtype=torch.int32), 5)


def test_single_prefill_two_dimensional_mask_must_be_qo_by_kv():
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(n, h, D, generator=gen) for n, h in ((3, HQ), (7, HKV), (7, HKV)))
    with pytest.raises(ValueError, match=r"custom_mask has shape \(7, 3\); a 2-D mask must be \[qo_len, kv_len\]"):
        jitattn.single_prefill_with_kv_cache(q, k, v, custom_mask=torch.ones(7, 3, dtype=torch.bool))


def _mla_wrapper_plan(**overrides):
    args = dict(qo_indptr=torch.tensor([0, 1], dtype=torch.int32), kv_indptr=torch.tensor([0, 1], dtype=torch.int32),
                kv_indices=torch.tensor([0], dtype=torch.int32), kv_len_arr=torch.tensor([5], dtype=torch.int32),
                num_heads=4, head_dim_ckv=512, head_dim_kpe=64, page_size=PAGE, causal=False,
                sm_scale=1 / math.sqrt(192), q_data_type=torch.float32, kv_data_type=torch.float32)
    args.update(overrides)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(_workspace())
    wrapper.plan(**args)
    return wrapper


def test_mla_sm_scale_is_required_on_every_kernel():
    """The prefill kernels (cpu) took a None sm_scale as 1/sqrt(576); MLA scales by the pre-absorption dim."""
    with pytest.raises(ValueError, match="sm_scale=None must be a positive finite float"):
        _mla_wrapper_plan(sm_scale=None)
    with pytest.raises(ValueError, match="num_heads=4.0 must be a positive int"):
        _mla_wrapper_plan(num_heads=4.0)


@pytest.mark.parametrize("ckv,kpe", [(256, 64), (512, 32)])
def test_mla_latent_dims_outside_the_kernels_are_named_as_mla_dims(ckv, kpe):
    """The refusal names head_dim_ckv / head_dim_kpe and the pairs that run, not the prefill shape they map to."""
    with pytest.raises(ValueError, match=f"head_dim_ckv={ckv}, head_dim_kpe={kpe} is not supported: MLA runs on "
                                         "head_dim_ckv 512 with head_dim_kpe 64"):
        _mla_wrapper_plan(head_dim_ckv=ckv, head_dim_kpe=kpe)


def test_mla_q_parts_of_different_dtypes_are_refused():
    wrapper = _mla_wrapper_plan()
    gen = torch.Generator().manual_seed(13)
    ckv, kpe = torch.randn(1, PAGE, 512, generator=gen), torch.randn(1, PAGE, 64, generator=gen)
    q_nope, q_pe = torch.randn(1, 4, 512, generator=gen), torch.randn(1, 4, 64, generator=gen).half()
    with pytest.raises(TypeError, match="q_nope is torch.float32 but q_pe is torch.float16"):
        wrapper.run(q_nope, q_pe, ckv, kpe)


def test_cascade_level_arrays_must_be_lists():
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, _workspace())
    t = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="qo_indptr_arr must be a list"):
        wrapper.plan(t, [t, t], [t, t], [t, t], HQ, HKV, D, PAGE)


def test_a_workspace_that_is_not_a_tensor_is_refused_where_it_is_given():
    with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
        jitattn.MultiLevelCascadeAttentionWrapper(2, None)
    with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
        jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace()).reset_workspace_buffer(None)
    with pytest.raises(TypeError, match="float_workspace_buffer must be a torch.Tensor"):
        jitattn.MultiLevelCascadeAttentionWrapper(2, _workspace()).reset_workspace_buffer([1])


@pytest.mark.parametrize("make", [
    lambda ws: jitattn.MultiLevelCascadeAttentionWrapper(2, ws), jitattn.PODWithPagedKVCacheWrapper,
    jitattn.BatchDecodeWithSharedPrefixPagedKVCacheWrapper, jitattn.BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    jitattn.BlockSparseAttentionWrapper, jitattn.VariableBlockSparseAttentionWrapper,
], ids=["cascade", "pod", "shared_prefix_decode", "shared_prefix_prefill", "block_sparse", "variable_block_sparse"])
def test_a_composite_wrapper_names_itself_refusing_a_strided_workspace(make):
    """These wrappers run others of their own; a strided workspace was refused in the inner wrapper's name."""
    strided = torch.zeros(2 << 20, dtype=torch.uint8)[::2]
    wrapper = make(_workspace())
    name = type(wrapper).__name__
    with pytest.raises(ValueError, match=rf"^{name}.reset_workspace_buffer: float_workspace_buffer \(strides"):
        wrapper.reset_workspace_buffer(strided)
    with pytest.raises(ValueError, match=rf"^{name}: float_workspace_buffer \(strides"):
        make(strided)


def test_cascade_level_offsets_must_be_one_dimensional_and_not_empty():
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, _workspace())
    t, empty = torch.tensor([0, 1], dtype=torch.int32), torch.empty(0, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"qo_indptr_arr\[0\] must be a 1-D int32 tensor"):
        wrapper.plan([empty, t], [t, t], [t[:1], t[:1]], [t[1:], t[1:]], HQ, HKV, D, PAGE)


@pytest.mark.parametrize("heads", [4.0, "4", True], ids=["float", "str", "bool"])
def test_head_counts_must_be_ints(heads):
    batch, _ = _decode_batch()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(TypeError, match="num_qo_heads=.* must be an int"):
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, heads, HKV, D, PAGE,
                     q_data_type=torch.float32)


def test_decode_fixed_split_size_must_be_an_int():
    batch, _ = _decode_batch()
    with pytest.raises(TypeError, match="fixed_split_size=1.5 must be None or a positive int"):
        _decode_wrapper(batch, fixed_split_size=1.5)


def test_kv_pair_errors_name_both_values():
    gen = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(n, h, D, generator=gen) for n, h in ((3, HQ), (7, HKV), (5, HKV)))
    with pytest.raises(ValueError, match=r"k has shape \(7, 2, 64\) but v \(5, 2, 64\)"):
        jitattn.single_prefill_with_kv_cache(q, k, v)


def _paged_prefill_plan(**options):
    gen = torch.Generator().manual_seed(15)
    batch = random_paged_batch([5, 9], HKV, D, PAGE, torch.float32, generator=gen)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(_workspace())
    wrapper.plan(torch.tensor([0, 2, 5], dtype=torch.int32), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len,
                 HQ, HKV, D, PAGE, q_data_type=torch.float32, **options)
    return wrapper, batch


def test_paged_prefill_mask_arguments_are_checked():
    with pytest.raises(TypeError, match="custom_mask must be a bool torch.Tensor, got list"):
        _paged_prefill_plan(custom_mask=[True] * 37)
    with pytest.raises(ValueError, match="prefix_len_ptr needs token_pos_in_items_ptr"):
        _paged_prefill_plan(prefix_len_ptr=torch.tensor([1, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="prefix_len_ptr has a negative length"):
        _paged_prefill_plan(prefix_len_ptr=torch.tensor([-1, 1], dtype=torch.int32),
                            token_pos_in_items_ptr=torch.zeros(16, dtype=torch.int32), token_pos_in_items_len=8)


@pytest.mark.parametrize("causal", ["False", None, 2, 1.0, torch.tensor(True)],
                         ids=["str", "none", "two", "float", "tensor"])
def test_causal_must_be_a_bool(causal):
    """``causal`` took any value by its truthiness: the string "False" planned a causal mask."""
    with pytest.raises(TypeError, match="causal=.* must be True or False"):
        _paged_prefill_plan(causal=causal)
    t = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(TypeError, match="causal=.* must be True or False"):
        jitattn.MultiLevelCascadeAttentionWrapper(2, _workspace()).plan([t, t], [t, t], [t[:1], t[:1]], [t[1:], t[1:]],
                                                                         HQ, HKV, D, PAGE, causal=causal)
    with pytest.raises(TypeError, match="causal=.* must be True or False"):
        _mla_wrapper_plan(causal=causal)


@pytest.mark.parametrize("causal", [True, np.bool_(True), 1], ids=["bool", "numpy", "int"])
def test_causal_takes_bools_numpy_bools_and_zero_one(causal):
    """Each spelling of True plans the causal mask: the output is causal=True's, not causal=False's."""
    gen = torch.Generator().manual_seed(16)
    q = torch.randn(5, HQ, D, generator=gen)
    outs = {}
    for name, value in (("given", causal), ("true", True), ("false", False)):
        wrapper, batch = _paged_prefill_plan(causal=value)
        outs[name] = wrapper.run(q, batch.cache)
    assert torch.equal(outs["given"], outs["true"])
    assert not torch.allclose(outs["given"], outs["false"])

    ckv, kpe = torch.randn(1, PAGE, 512, generator=gen), torch.randn(1, PAGE, 64, generator=gen)
    q_nope, q_pe = torch.randn(2, 4, 512, generator=gen), torch.randn(2, 4, 64, generator=gen)
    mla = {}
    for name, value in (("given", causal), ("true", True), ("false", False)):
        wrapper = _mla_wrapper_plan(causal=value, qo_indptr=torch.tensor([0, 2], dtype=torch.int32))
        mla[name] = wrapper.run(q_nope, q_pe, ckv, kpe)
    assert torch.equal(mla["given"], mla["true"])  # two queries over 5 keys: the first sees 4 of them when causal
    assert not torch.allclose(mla["given"], mla["false"])


def test_mla_sm_scale_must_be_a_float32_normal():
    """1e-300 passed MLA's check (positive, finite) and became 0 in the kernels' float32."""
    with pytest.raises(ValueError, match="sm_scale=1e-300 must be a positive finite float within float32's normal"):
        _mla_wrapper_plan(sm_scale=1e-300)
    with pytest.raises(ValueError, match="sm_scale=1e\\+39 must be a positive finite float"):
        _mla_wrapper_plan(sm_scale=1e39)


def test_run_checks_a_meta_q_after_a_cpu_run():
    """The checked-inputs signature held get_device(), -1 for cpu and meta tensors alike: a meta q after a cpu
    run skipped every check and launched the cpu kernel on no storage."""
    batch, q = _decode_batch()
    wrapper = _decode_wrapper(batch)
    wrapper.run(q, batch.cache)
    with pytest.raises((ValueError, TypeError, RuntimeError), match="meta"):
        wrapper.run(q.to("meta"), batch.cache)
    with pytest.raises((ValueError, TypeError, RuntimeError), match="meta"):
        wrapper.run(q, batch.cache.to("meta"))


def test_get_seq_lens_page_size_must_be_an_int():
    indptr, last = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    assert jitattn.get_seq_lens(indptr, last, 16).tolist() == [19]
    with pytest.raises(TypeError, match="page_size=16.5 must be an int"):
        jitattn.get_seq_lens(indptr, last, 16.5)
    with pytest.raises(TypeError, match=r"must be an int \(pass \.item\(\) of a 0-d tensor\)"):
        jitattn.get_seq_lens(indptr, last, torch.tensor(16))
    with pytest.raises(TypeError, match=r"must be an int .*append_indptr\[-1\] pass \.item\(\)"):
        jitattn.get_batch_indices_positions(indptr, torch.tensor([2], dtype=torch.int32), indptr[-1])


@pytest.mark.parametrize("value, error", [(1.5, TypeError), (True, TypeError), (0, ValueError)],
                         ids=["float", "bool", "zero"])
def test_fixed_split_size_is_checked_alike_by_every_wrapper(value, error):
    """One check (kv_split.check_fixed_split_size) for decode, prefill and cascade; cascade took 1.5 pages."""
    message = f"fixed_split_size={value!r} must be None or a positive int"
    batch, _ = _decode_batch()
    with pytest.raises(error, match=message):
        _decode_wrapper(batch, fixed_split_size=value)
    with pytest.raises(error, match=message):
        _paged_prefill_plan(fixed_split_size=value)
    t = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(error, match=message):
        jitattn.MultiLevelCascadeAttentionWrapper(2, _workspace()).plan([t, t], [t, t], [t[:1], t[:1]], [t[1:], t[1:]],
                                                                         HQ, HKV, D, PAGE, fixed_split_size=value)


def test_return_lse_takes_a_bool_only():
    """A string is not read by its truthiness ('False' gave a tuple): refused, as causal= is, by the batch
    wrappers' run() and the single-request calls."""
    batch, q = _decode_batch()
    wrapper = _decode_wrapper(batch)
    for bad in ("False", "no", None, 2):
        with pytest.raises(TypeError, match="return_lse=.* must be True or False"):
            wrapper.run(q, batch.cache, return_lse=bad)
        with pytest.raises(TypeError, match="return_lse=.* must be True or False"):
            jitattn.single_prefill_with_kv_cache(q, q[:, :HKV], q[:, :HKV], return_lse=bad)
    assert isinstance(wrapper.run(q, batch.cache, return_lse=1), tuple)  # 0 / 1 are taken, as for causal=


def test_out_and_lse_that_share_memory_are_refused():
    batch, q = _decode_batch()
    wrapper = _decode_wrapper(batch)
    buffer = torch.empty(3, HQ, D)
    with pytest.raises(ValueError, match="out and lse share memory"):
        wrapper.run(q, batch.cache, out=buffer, lse=buffer[..., 0], return_lse=True)
    out, lse = wrapper.run(q, batch.cache, out=buffer, lse=torch.empty(3, HQ), return_lse=True)
    assert out is buffer and not lse.isnan().any()


# A second pass (2026-12-06) found the cases below accepted.

@pytest.mark.parametrize("where", ["q", "out", "lse"])
def test_tensors_inside_the_split_workspace_are_refused(where):
    """A split plan writes its partials into the float workspace's first bytes while it reads q and writes out:
    a q, out or lse cut from there came back wrong (NaN for q); one past them is fine."""
    batch, q = _decode_batch()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace := _workspace())
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                 q_data_type=torch.float32, fixed_split_size=1)
    ref_out, ref_lse = wrapper.run(q, batch.cache, return_lse=True)
    floats = workspace.view(torch.float32)
    inside = {"q": floats[: q.numel()].view_as(q).copy_(q), "out": floats[: q.numel()].view_as(q),
              "lse": floats[64: 64 + 3 * HQ].view(3, HQ)}[where]
    args = {"q": q, "out": None, "lse": None, where: inside}
    with pytest.raises(ValueError, match=f"{where} lies in the float workspace's first"):
        wrapper.run(args["q"], batch.cache, out=args["out"], lse=args["lse"], return_lse=True)
    beyond = floats[-q.numel():].view_as(q)  # past the partials: the caller's to use
    out, lse = wrapper.run(q, batch.cache, out=beyond, return_lse=True)
    assert out is beyond and torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_batch_custom_mask_must_be_flat_or_the_one_requests_qo_by_kv():
    """A transposed [kv_len, qo_len] mask has the right element count and was read row-major as [qo, kv]."""
    mask = torch.rand(3, 5, generator=torch.Generator().manual_seed(2)) > 0.4
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    indptr = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
    for bad in (mask.t(), mask[None]):
        with pytest.raises(ValueError, match=r"pass it flattened .* or \[qo_len, kv_len\] = \(3, 5\)"):
            wrapper.plan(indptr(3), indptr(5), HQ, HKV, D, custom_mask=bad)
    two = torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"pass it flattened \(1-D"):
        wrapper.plan(two, two, HQ, HKV, D, custom_mask=torch.ones(1, 5, dtype=torch.bool))
    for good in (mask, mask.reshape(-1)):
        wrapper.plan(indptr(3), indptr(5), HQ, HKV, D, custom_mask=good)


@pytest.mark.parametrize("case", ["s_in_v", "s_other_in_v", "v_other_in_s"])
def test_merge_in_place_refuses_states_that_share_memory(case):
    gen = torch.Generator().manual_seed(4)
    v, s = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, generator=gen)
    v_other, s_other = torch.randn(3, 4, 8, generator=gen), torch.randn(3, 4, generator=gen)
    if case == "s_in_v":
        s, message = v[..., 0], "v and s share memory"
    elif case == "s_other_in_v":
        s_other, message = v[..., 1], "v shares memory with s_other"
    else:
        s, message = v_other[..., 0], "s shares memory with v_other"
    with pytest.raises(ValueError, match=message):
        jitattn.merge_state_in_place(v, s, v_other, s_other)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_sparse_and_nested_tensors_are_named_as_such():
    k = v = torch.randn(10, HKV, D)
    with pytest.raises(TypeError, match="q is a sparse_coo tensor; .* pass q.to_dense()"):
        jitattn.single_decode_with_kv_cache(torch.randn(HQ, D).to_sparse(), k, v)
    nested = torch.nested.nested_tensor([torch.randn(3, HQ, D), torch.randn(2, HQ, D)])
    with pytest.raises(TypeError, match="q is a nested tensor"):
        jitattn.single_prefill_with_kv_cache(nested, k, v)


def test_fused_add_rmsnorm_names_an_expanded_input_as_input():
    x = torch.randn(1, 128).expand(5, 128)
    with pytest.raises(ValueError, match=r"^input \(shape \(5, 128\), strides \(0, 1\)\) has elements that share"):
        jitattn.fused_add_rmsnorm(x, torch.randn(5, 128), torch.randn(128))


def test_workspace_size_refuses_heads_that_plan_refuses():
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(_workspace())
    with pytest.raises(ValueError, match="num_qo_heads=5 is not a multiple of num_kv_heads=2"):
        wrapper.workspace_size(8, 1000, 5, 2, 64, 16)


def test_batch_attention_q_dtype_none_takes_the_16_bit_kv_dtype():
    """Refused before as a bf16 query over an f16 KV; now planned for f16 queries, which run exactly."""
    gen = torch.Generator().manual_seed(11)
    batch = random_paged_batch([5, 40], HKV, D, PAGE, torch.float16, generator=gen)
    qo_indptr = torch.tensor([0, 1, 4], dtype=torch.int32)  # a decode row and a 3-token prefill
    q = torch.randn(4, HQ, D, generator=gen).to(torch.float16)
    wrapper = jitattn.BatchAttention(device="cpu")
    wrapper.plan(qo_indptr, batch.kv_indptr, batch.kv_indices, torch.tensor([5, 40], dtype=torch.int32), HQ, HKV, D,
                 D, PAGE, q_data_type=None, kv_data_type=torch.float16)
    out, _ = wrapper.run(q, batch.cache)
    expected, _ = reference.batch_prefill_paged(q, batch.cache, qo_indptr, batch.kv_indptr, batch.kv_indices,
                                                batch.kv_last_page_len)
    assert out.dtype == torch.float16
    assert_close_out(out, expected, torch.float16)
    with pytest.raises(TypeError):  # the plan is f16's: a bf16 query is refused
        wrapper.run(q.to(torch.bfloat16), batch.cache)


def test_flashinfer_install_takes_a_module_name_and_its_functions_pickle():
    import pickle

    import jitattn.flashinfer as namespace

    for bad in (3, "", "flash infer"):
        with pytest.raises(TypeError, match="name must be the module name"):
            namespace.install(bad)
    for function in (namespace.single_decode_with_kv_cache, namespace.single_prefill_with_kv_cache):
        assert pickle.loads(pickle.dumps(function)) is function


def _ragged_graph_wrapper(**mask_buffers) -> jitattn.BatchPrefillWithRaggedKVCacheWrapper:
    i32 = dict(dtype=torch.int32)
    return jitattn.BatchPrefillWithRaggedKVCacheWrapper(
        _workspace(), use_cuda_graph=True, qo_indptr_buf=torch.empty(3, **i32), kv_indptr_buf=torch.empty(3, **i32),
        **mask_buffers)


@pytest.mark.parametrize("given", [{}, {"custom_mask_buf": torch.empty(64, dtype=torch.uint8)},
                                   {"mask_indptr_buf": torch.empty(3, dtype=torch.int32)}],
                         ids=["none", "mask-only", "indptr-only"])
def test_a_graph_wrapper_refuses_a_mask_without_its_fixed_buffers(given):
    """A captured run() reads the mask where the plan of its capture put it: without the caller's fixed buffers each
    plan's mask would be a new allocation, and replays after a re-plan would read a stale or freed one."""
    qo, kv = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 6, 10], dtype=torch.int32)
    missing = [name for name in ("custom_mask_buf", "mask_indptr_buf") if name not in given]
    masks = {"custom_mask": torch.ones(26, dtype=torch.bool),
             "packed_custom_mask": torch.full((4,), 255, dtype=torch.uint8),  # 3 + 1 bytes
             "prefix_len_ptr": torch.tensor([2, 1], dtype=torch.int32)}  # multi-item scoring: planned as a mask
    for name, mask in masks.items():
        extra = dict(token_pos_in_items_ptr=torch.zeros(8, dtype=torch.int32), token_pos_in_items_len=4) \
            if name == "prefix_len_ptr" else {}
        with pytest.raises(ValueError, match=f"needs the fixed buffers {' and '.join(missing)}"):
            _ragged_graph_wrapper(**given).plan(qo, kv, HQ, HKV, D, **{name: mask}, **extra)
    _ragged_graph_wrapper(**given).plan(qo, kv, HQ, HKV, D, causal=True)  # no mask: no mask buffers needed


def test_a_graph_wrapper_plans_masks_into_its_fixed_buffers():
    """Each plan's packed mask goes into the same caller buffer, and the run reads the latest plan's mask."""
    gen = torch.Generator().manual_seed(21)
    qo, kv = torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 6, 10], dtype=torch.int32)
    q, k, v = torch.randn(5, HQ, D, generator=gen), torch.randn(10, HKV, D, generator=gen), torch.randn(10, HKV, D,
                                                                                                        generator=gen)
    mask_buf = torch.empty(64, dtype=torch.uint8)
    wrapper = _ragged_graph_wrapper(custom_mask_buf=mask_buf, mask_indptr_buf=torch.empty(3, dtype=torch.int32))
    for seed in (1, 2):
        mask = torch.rand(26, generator=torch.Generator().manual_seed(seed)) < 0.6
        wrapper.plan(qo, kv, HQ, HKV, D, custom_mask=mask, q_data_type=torch.float32)
        assert wrapper._plan.custom_mask.data_ptr() == mask_buf.data_ptr()
        out = wrapper.run(q, k, v)
        ref, _ = reference.batch_ragged_attention(q, k, v, qo, kv, custom_mask=mask)
        assert_close_out(out, ref, torch.float32)


def test_a_mask_passed_to_run_is_named_as_a_plan_argument():
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    qo = torch.tensor([0, 3], dtype=torch.int32)
    wrapper.plan(qo, qo, HQ, HKV, D, q_data_type=torch.float32)
    q, k = torch.randn(3, HQ, D), torch.randn(3, HKV, D)
    with pytest.raises(TypeError, match=r"\['custom_mask'\]; custom_mask is a plan\(\) argument"):
        wrapper.run(q, k, k, custom_mask=torch.ones(9, dtype=torch.bool))
    with pytest.raises(TypeError, match="parameters of a custom variant"):
        wrapper.run(q, k, k, gate=1.0)
    batch, q = _decode_batch()
    decode = _decode_wrapper(batch)  # decode's plan() takes no mask: no advice to re-plan with one
    with pytest.raises(TypeError, match=r"\['custom_mask'\]; decode attends to every key .* takes no mask"):
        decode.run(q, batch.cache, custom_mask=torch.ones(9, dtype=torch.bool))
    with pytest.raises(TypeError, match=r"\['sm_scale'\]; sm_scale is a plan\(\) argument"):
        decode.run(q, batch.cache, sm_scale=0.1)


@pytest.mark.parametrize("name", ["custom_mask", "packed_custom_mask"])
def test_a_meta_mask_is_refused_by_name(name):
    q, k = torch.randn(3, HQ, D), torch.randn(4, HKV, D)
    mask = torch.ones(3, 4, dtype=torch.bool, device="meta") if name == "custom_mask" else torch.ones(
        2, dtype=torch.uint8, device="meta")
    with pytest.raises(ValueError, match=f"{name} is a meta tensor"):
        jitattn.single_prefill_with_kv_cache(q, k, k, **{name: mask})

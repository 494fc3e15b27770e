"""Bad input to the public API raises a clear error before anything is launched."""

from __future__ import annotations

import pytest
import torch

import jitattn
from jitattn.jit.loader import Module

from attention_cases import random_paged_batch

_real_call, _real_bind = Module.call, Module.bind


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any launch during these tests is a failure: errors must come first."""
    def refuse(self, entry, *args, **values):
        raise AssertionError(f"{entry} was launched despite bad input")

    def bind(self, entry, params):  # the hot path's bound call (PreparedAttention), launched later
        return lambda stream: refuse(self, entry)
    monkeypatch.setattr(Module, "launch", refuse)
    monkeypatch.setattr(Module, "call", refuse)
    monkeypatch.setattr(Module, "bind", bind)


def _decode(**overrides):
    batch = random_paged_batch([5, 20], 2, 64, 16, torch.bfloat16)
    args = dict(indptr=batch.kv_indptr, indices=batch.kv_indices, last_page_len=batch.kv_last_page_len,
                num_qo_heads=8, num_kv_heads=2, head_dim=64, page_size=16, q_data_type=torch.bfloat16)
    args.update(overrides)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(**args)
    return wrapper, batch


def test_head_dim_36_is_refused_at_plan() -> None:
    with pytest.raises(ValueError, match="head_dim_qk=36.*multiple of 8"):
        _decode(head_dim=36)


def test_group_size_must_divide() -> None:
    with pytest.raises(ValueError, match="num_qo_heads=6 must be a positive multiple of num_kv_heads=4"):
        _decode(num_qo_heads=6, num_kv_heads=4)


def test_last_page_len_out_of_range() -> None:
    batch = random_paged_batch([5, 20], 2, 64, 16, torch.bfloat16)
    with pytest.raises(ValueError, match=r"last_page_len\[1\] = 17 is out of range"):
        _decode(last_page_len=torch.tensor([5, 17], dtype=torch.int32), indptr=batch.kv_indptr,
                indices=batch.kv_indices)


def test_int64_index_arrays_are_refused() -> None:
    batch = random_paged_batch([5, 20], 2, 64, 16, torch.bfloat16)
    with pytest.raises(TypeError, match="int32"):
        _decode(indptr=batch.kv_indptr.long())


def test_indptr_must_start_at_zero_and_not_decrease() -> None:
    with pytest.raises(ValueError, match=r"indptr\[0\] must be 0"):
        _decode(indptr=torch.tensor([1, 1, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="non-decreasing"):
        _decode(indptr=torch.tensor([0, 2, 1], dtype=torch.int32))


def test_indices_past_the_page_pool() -> None:
    wrapper, batch = _decode()
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    small = batch.cache[: int(batch.kv_indices.max())]  # drop the highest referenced page
    with pytest.raises(ValueError, match="references page .* only"):
        wrapper.run(q, small)


@pytest.mark.parametrize("level", [0, 1, 2])
def test_cascade_names_the_level_whose_indices_pass_the_page_pool(level: int) -> None:
    """Each level launches through a wrapper of its own (the last on the decode kernel): the error said
    "indices references page ..." whichever level it was."""
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    indices = [i32(0), i32(1, 2), i32(3, 4)]
    indices[level] = indices[level] + 30
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(3, torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan([i32(0, 2), i32(0, 1, 2), i32(0, 1, 2)], [i32(0, 1), i32(0, 1, 2), i32(0, 1, 2)], indices,
                 [i32(16), i32(16, 16), i32(5, 9)], 4, 2, 64, 16, q_data_type=torch.float16)
    with pytest.raises(ValueError, match=rf"^paged_kv_indices_arr\[{level}\] references page 3\d but the kv cache "
                                         "has only 8 pages"):
        wrapper.run(torch.randn(2, 4, 64).half(), torch.randn(8, 2, 16, 2, 64).half())


def test_wrong_q_dtype_shape_and_kv_dtype() -> None:
    wrapper, batch = _decode()
    with pytest.raises(TypeError, match=r"q has dtype float16 but the plan has q_data_type=bfloat16; pass "
                                        r"q_data_type=torch.float16 to plan\(\)"):
        wrapper.run(torch.randn(2, 8, 64).half(), batch.cache)
    for dtype in (torch.float64, torch.int32):  # no plan() takes these: the fix is a cast, not another q_data_type
        with pytest.raises(TypeError, match=f"q has dtype {str(dtype)[6:]}; attention takes a float16, bfloat16 or "
                                            "float32 .* cast q to the plan's bfloat16"):
            wrapper.run(torch.randn(2, 8, 64).to(dtype), batch.cache)
    with pytest.raises(ValueError, match="q has shape"):
        wrapper.run(torch.randn(3, 8, 64).to(torch.bfloat16), batch.cache)
    with pytest.raises(TypeError, match="kv cache dtype"):
        wrapper.run(torch.randn(2, 8, 64).to(torch.bfloat16), batch.cache.half())


def test_kv_cache_shape_mismatch() -> None:
    wrapper, batch = _decode()
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="kv heads"):
        wrapper.run(q, batch.cache.transpose(2, 3))  # an HND tensor given to an NHD wrapper
    with pytest.raises(ValueError, match="single tensor must be"):
        wrapper.run(q, batch.cache[:, 0])


def test_out_and_lse_are_checked() -> None:
    wrapper, batch = _decode()
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="out has shape"):
        wrapper.run(q, batch.cache, out=torch.empty(2, 8, 32, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="lse has dtype"):
        wrapper.run(q, batch.cache, lse=torch.empty(2, 8, dtype=torch.float16))


def test_unsupported_device_is_refused() -> None:
    with pytest.raises(ValueError, match="not supported"):
        jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8, device="meta"))


def test_run_before_plan() -> None:
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(torch.randn(1, 4, 64), torch.randn(1, 2, 16, 4, 64))


def test_run_after_a_refused_plan_says_the_plan_was_dropped() -> None:
    """A plan() that raised leaves no plan (the last batch's is not run by mistake): run() says so, not that plan()
    was never called."""
    wrapper, batch = _decode()
    with pytest.raises(ValueError):
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 0)
    with pytest.raises(RuntimeError, match="without a plan.*a plan\\(\\) that raised leaves none"):
        wrapper.run(torch.randn(2, 8, 64, dtype=torch.bfloat16), batch.cache)


def test_sizes_take_numpy_ints_and_refuse_bools() -> None:
    import numpy as np

    workspace = torch.empty(1 << 20, dtype=torch.uint8)
    assert jitattn.MultiLevelCascadeAttentionWrapper(np.int64(2), workspace)._num_levels == 2
    for bad in (True, 2.0, "2", 0):
        with pytest.raises(ValueError, match="num_levels=.* must be a positive int"):
            jitattn.MultiLevelCascadeAttentionWrapper(bad, workspace)
    assert jitattn.get_seq_lens(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                                np.int64(16)).tolist() == [3]


def test_bad_options() -> None:
    for mode in ("ROPE_GPTJ", "ROPE", "rope"):  # "rope" is the spec's word, not one of FlashInfer's names
        with pytest.raises(ValueError, match=f"pos_encoding_mode='{mode}' is not supported; use 'NONE', 'ROPE_LLAMA'"):
            _decode(pos_encoding_mode=mode)
    with pytest.raises(ValueError, match="window_left"):
        _decode(window_left=-2)
    with pytest.raises(ValueError, match="logits_soft_cap"):
        _decode(logits_soft_cap=-1.0)
    with pytest.raises(ValueError, match="q_data_type"):
        _decode(q_data_type="int8")


def test_custom_mask_size_is_checked() -> None:
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="custom_mask has 7 elements"):
        wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 4, 4, 64,
                     custom_mask=torch.ones(7, dtype=torch.bool))


def test_out_and_lse_that_share_memory_with_an_input_are_refused(monkeypatch) -> None:
    """The kernel reads q and the KV while it writes out / lse: a buffer over either would corrupt the result."""
    wrapper, batch = _decode()
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match="out shares memory with q"):
        wrapper.run(q, batch.cache, out=q)
    cache_view = batch.cache.view(-1)[:2 * 8 * 64].view(2, 8, 64)
    with pytest.raises(ValueError, match="out shares memory with the kv cache"):
        wrapper.run(q, batch.cache, out=cache_view)
    lse_in_q = q.view(-1).view(torch.float32)[:16].view(2, 8)
    with pytest.raises(ValueError, match="lse shares memory with q"):
        wrapper.run(q, batch.cache, lse=lse_in_q)
    monkeypatch.setattr(Module, "call", _real_call)  # the ragged part launches once (plan() binds the launch)
    monkeypatch.setattr(Module, "bind", _real_bind)
    ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    ragged.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 4, 4, 64,
                q_data_type=torch.float16)
    q, k, v = (torch.randn(3, 4, 64).half() for _ in range(3))
    with pytest.raises(ValueError, match="out shares memory with v"):
        ragged.run(q, k, v, out=v)
    ragged.run(q, k, v)  # an out the wrapper allocates does not vouch for a caller's out of the same shape
    with pytest.raises(ValueError, match="out shares memory with v"):
        ragged.run(q, k, v, out=v)


def test_hnd_ragged_kv_and_single_prefill_sinks_are_reported_as_the_caller_passed_them() -> None:
    """An HND ragged wrapper shows k's shape as given (not the transposed view it runs on) and says the layout;
    single_prefill_with_kv_cache's sinks errors name that function, not the wrapper under it."""
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), "HND")
    wrapper.plan(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 11], dtype=torch.int32), 8, 2, 64,
                 q_data_type=torch.float32)
    k = torch.randn(11, 2, 64)  # NHD by mistake
    with pytest.raises(ValueError, match=r"k has shape \(11, 2, 64\); this wrapper's kv_layout is HND, so k is "
                                         r"\[num_kv_heads=2, >= 11 tokens, 64\]"):
        wrapper.run(torch.randn(4, 8, 64), k, k)
    with pytest.raises(ValueError, match="single_prefill_with_kv_cache: sinks has dtype float16"):
        jitattn.single_prefill_with_kv_cache(torch.randn(4, 8, 64), k, k, sinks=torch.zeros(8, dtype=torch.float16))
    k = torch.randn(5, 2, 64)  # NHD, passed as HND: 5 kv heads for 8 query heads
    for call, q in ((jitattn.single_prefill_with_kv_cache, torch.randn(4, 8, 64)),
                    (jitattn.single_decode_with_kv_cache, torch.randn(8, 64))):
        with pytest.raises(ValueError, match=r"k has shape \(5, 2, 64\), read as \[num_kv_heads, kv_len, head_dim\] "
                                             r"\(kv_layout='HND'\): 5 kv heads, which do not divide q's 8"):
            call(q, k, k, kv_layout="HND")


def test_ragged_kv_shape_is_checked() -> None:
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    wrapper.plan(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32), 4, 2, 64,
                 q_data_type=torch.float16)
    q = torch.randn(2, 4, 64).half()
    with pytest.raises(ValueError, match="k has shape"):
        wrapper.run(q, torch.randn(2, 2, 64).half(), torch.randn(3, 2, 64).half())


def test_ragged_plan_given_a_paged_caches_arguments_says_so() -> None:
    """A paged cache's plan arguments on the ragged wrapper (indices where num_qo_heads goes) name the mix-up, not
    the mask arguments the shifted sizes land in."""
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16, dtype=torch.uint8))
    i32 = dict(dtype=torch.int32)
    indptr, indices, last = torch.tensor([0, 1, 2], **i32), torch.tensor([0, 1], **i32), torch.tensor([4, 4], **i32)
    with pytest.raises(TypeError, match=r"got a tensor as num_qo_heads: .*\(BatchPrefillWithPagedKVCacheWrapper\)"):
        wrapper.plan(torch.tensor([0, 4, 8], **i32), indptr, indices, last, 8, 8, 64, 16)


def test_checks_run_again_when_the_tensors_change_shape(monkeypatch) -> None:
    monkeypatch.setattr(Module, "call", _real_call)  # this test launches: the first call passes and is remembered
    monkeypatch.setattr(Module, "bind", _real_bind)  # (plan() binds the launch)
    wrapper, batch = _decode()
    q = torch.randn(2, 8, 64).to(torch.bfloat16)
    wrapper.run(q, batch.cache)
    with pytest.raises(ValueError, match="q has shape"):
        wrapper.run(torch.randn(2, 4, 64).to(torch.bfloat16), batch.cache)
    with pytest.raises(ValueError, match="references page .* only"):
        wrapper.run(q, batch.cache[: int(batch.kv_indices.max())])
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        wrapper.run([1.0], batch.cache)


def test_plan_options_are_reused_only_for_equal_arguments_of_equal_types() -> None:
    """plan() keeps recent parsed options by argument: 0 and False (or 1 and True) stay apart, so a value
    refused once is refused every time, whatever an earlier plan cached."""
    from jitattn.runtime.builder import attention_options
    from jitattn.spec import Op

    common = dict(num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, q_data_type=torch.float16, kv_data_type=None)
    first = attention_options(Op.DECODE, **common, pos_encoding_mode=0)
    assert attention_options(Op.DECODE, **common, pos_encoding_mode=0) is first
    for _ in range(2):
        with pytest.raises(ValueError, match="pos_encoding_mode=False"):
            attention_options(Op.DECODE, **common, pos_encoding_mode=False)
    scaled = attention_options(Op.DECODE, **common, sm_scale=0.5)
    assert scaled.scalars.sm_scale == 0.5 and first.scalars.sm_scale == 64 ** -0.5
    assert attention_options(Op.PREFILL, **common).op is Op.PREFILL


def test_plan_options_memo_returns_what_parsing_gives() -> None:
    """On random FlashInfer-style option spellings the memoised options equal a fresh parse, call after call."""
    import random

    from jitattn.runtime.builder import _parse_options, attention_options
    from jitattn.spec import MaskMode, Op

    rng = random.Random(3)
    choices = dict(q_data_type=[torch.float16, torch.bfloat16, "float16", "bfloat16", None],
                   kv_data_type=[None, torch.float16, torch.float8_e4m3fn, "bfloat16"],
                   pos_encoding_mode=["NONE", 0, "ROPE_LLAMA", 1, "ALIBI"], window_left=[-1, 0, 128, None],
                   logits_soft_cap=[None, 0.0, 30.0, 50], sm_scale=[None, 0.125, 1, 0.5],
                   rope_scale=[None, 1.0, 8.0], rope_theta=[None, 1e4, 500000.0])
    for _ in range(300):
        kw = {name: rng.choice(values) for name, values in choices.items()}
        op = rng.choice([Op.DECODE, Op.PREFILL])
        mask = rng.choice([MaskMode.NONE, MaskMode.CAUSAL])
        for _ in range(2):  # the second call is a memo hit
            got = attention_options(op, num_qo_heads=8, num_kv_heads=2, head_dim_qk=64, mask_mode=mask, **kw)
            expected = _parse_options(op, 8, 2, 64, None, kw["q_data_type"], kw["kv_data_type"], None, None,
                                      kw["pos_encoding_mode"], mask, kw["window_left"], kw["logits_soft_cap"],
                                      kw["sm_scale"], kw["rope_scale"], kw["rope_theta"], None)
            assert got == expected, kw


def test_the_launch_guard_sees_the_bound_hot_path() -> None:
    q, k = torch.randn(4, 64), torch.randn(6, 2, 64)
    with pytest.raises(AssertionError, match="was launched despite bad input"):
        jitattn.single_decode_with_kv_cache(q, k, k)


def test_single_decode_names_its_own_arguments() -> None:
    """q_scale is checked as q_scale (it used to surface as the sm_scale it multiplies), and k / v of two dtypes
    as such (it used to name a plan() the single call never showed)."""
    q, k = torch.randn(4, 64), torch.randn(6, 2, 64)
    for bad in (-2.0, 0, float("nan"), float("inf"), torch.tensor([0.5, 0.5])):
        with pytest.raises(ValueError, match="q_scale.* must be a positive finite number|q_scale must be a float"):
            jitattn.single_decode_with_kv_cache(q, k, k, q_scale=bad)
    for bad in (True, "1"):  # as run(q_scale=...) refuses them
        with pytest.raises(TypeError, match=f"q_scale={bad!r} must be a number"):
            jitattn.single_decode_with_kv_cache(q, k, k, q_scale=bad)
    with pytest.raises(TypeError, match="k is torch.float16 but v is torch.float32"):
        jitattn.single_decode_with_kv_cache(q.half(), k.half(), k)
    for bad, message in ((torch.zeros(4, dtype=torch.float16), "sinks has dtype float16"),
                         (torch.zeros(3), "sinks has shape \\(3,\\)")):
        with pytest.raises(ValueError, match=f"^single_decode_with_kv_cache: {message}"):
            jitattn.single_decode_with_kv_cache(q, k, k, sinks=bad)


def _wrappers() -> dict:
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    i32 = torch.zeros(8, dtype=torch.int32)
    return {
        "decode": lambda: jitattn.BatchDecodeWithPagedKVCacheWrapper(ws),
        "cuda_graph_decode": lambda: jitattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, i32, i32, i32),
        "paged_prefill": lambda: jitattn.BatchPrefillWithPagedKVCacheWrapper(ws),
        "ragged_prefill": lambda: jitattn.BatchPrefillWithRaggedKVCacheWrapper(ws),
        "sinks": lambda: jitattn.BatchAttentionWithAttentionSinkWrapper(ws),
        "cascade": lambda: jitattn.MultiLevelCascadeAttentionWrapper(2, ws),
        "mla": lambda: jitattn.BatchMLAPagedAttentionWrapper(ws),
        "pod": lambda: jitattn.PODWithPagedKVCacheWrapper(ws),
        "batch_pod": lambda: jitattn.BatchPODWithPagedKVCacheWrapper(ws),
        "batch_attention": lambda: jitattn.BatchAttention(device="cpu"),
        "shared_prefix_decode": lambda: jitattn.BatchDecodeWithSharedPrefixPagedKVCacheWrapper(ws),
        "shared_prefix_prefill": lambda: jitattn.BatchPrefillWithSharedPrefixPagedKVCacheWrapper(ws),
        "block_sparse": lambda: jitattn.BlockSparseAttentionWrapper(ws),
        "variable_block_sparse": lambda: jitattn.VariableBlockSparseAttentionWrapper(ws),
    }


@pytest.mark.parametrize("name", list(_wrappers()))
@pytest.mark.parametrize("how", ["copy", "deepcopy", "pickle"])
def test_a_wrapper_is_not_copied_or_pickled(name: str, how: str) -> None:
    """A copy would share the plan's buffers, kernels and torch.compile registration (re-planning one would change
    the other); deepcopy and pickle failed inside ctypes. Each is refused, saying what to do."""
    import copy
    import pickle

    wrapper = _wrappers()[name]()
    do = {"copy": copy.copy, "deepcopy": copy.deepcopy, "pickle": pickle.dumps}[how]
    with pytest.raises(TypeError, match=f"{type(wrapper).__name__} cannot be copied or pickled.*new wrapper"):
        do(wrapper)


def test_a_numpy_head_dim_is_taken_as_the_other_int_arguments_are() -> None:
    import numpy as np

    wrapper, _ = _decode(head_dim=np.int64(64))
    assert wrapper._plan is not None


@pytest.mark.parametrize("name", ["sm_scale", "logits_soft_cap"])
def test_a_bool_is_not_a_scale(name: str) -> None:
    with pytest.raises(TypeError, match=f"{name}=True must be a number, not a bool"):
        _decode(**{name: True})


def test_speed_flags_given_as_strings_are_refused() -> None:
    """bool("False") is True: such a flag would silently do the opposite of what was written."""
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    with pytest.raises(TypeError, match="use_tensor_cores='no' must be True or False"):
        jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, use_tensor_cores="no")
    with pytest.raises(TypeError, match="disable_split_kv='False' must be True or False"):
        _decode(disable_split_kv="False")
    with pytest.raises(TypeError, match="non_blocking='no' must be True or False"):
        _decode(non_blocking="no")
    wrapper, batch = _decode()
    with pytest.raises(TypeError, match="enable_pdl='no' must be True or False"):
        wrapper.run(torch.randn(2, 8, 64, dtype=torch.bfloat16), batch.cache, enable_pdl="no")
    q, k = torch.randn(3, 4, 64), torch.randn(7, 2, 64)
    with pytest.raises(TypeError, match="use_fp16_qk_reduction='no' must be True or False"):
        jitattn.single_prefill_with_kv_cache(q, k, k, use_fp16_qk_reduction="no")
    with pytest.raises(TypeError, match="enable_pdl='no' must be True or False"):
        jitattn.rmsnorm(torch.randn(2, 64), torch.randn(64), enable_pdl="no")


@pytest.mark.parametrize("kwargs", [{"rope_scale": 1e-40}, {"rope_theta": 1e-300}, {"rope_scale": 1e39}])
def test_rope_ops_refuse_parameters_float32_cannot_hold(kwargs: dict) -> None:
    """As the attention wrappers do: the kernels take these and their reciprocals in float32 (they gave NaN)."""
    q, k = torch.randn(5, 4, 64), torch.randn(5, 2, 64)
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=f"{name}=.*its reciprocal too, in float32"):
        jitattn.apply_rope_pos_ids(q, k, torch.arange(5, dtype=torch.int32), **kwargs)


def test_a_norm_weight_in_the_memory_it_writes_is_refused() -> None:
    """Rows after the first would read a weight the call had already overwritten."""
    x, buf = torch.randn(2, 64), torch.randn(2, 64)
    with pytest.raises(ValueError, match="rmsnorm: weight shares memory with out"):
        jitattn.rmsnorm(x, buf[0], out=buf)
    x, residual = torch.randn(1, 64), torch.randn(1, 64)
    with pytest.raises(ValueError, match="fused_add_rmsnorm: weight shares memory with residual"):
        jitattn.fused_add_rmsnorm(x, residual, residual.view(64))
    with pytest.raises(ValueError, match="fused_add_rmsnorm: weight shares memory with input"):
        jitattn.fused_add_rmsnorm(x, residual, x.view(64))


def test_appended_tokens_that_live_in_the_cache_are_refused() -> None:
    cache = torch.randn(4, 2, 4, 2, 64)
    i32 = lambda *values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="append_key lies in paged_kv_cache's memory.*clone"):
        jitattn.append_paged_kv_cache(cache[1, 0, :3], torch.randn(3, 2, 64), i32(0, 0, 0), i32(1, 2, 3), cache,
                                      i32(0, 1), i32(0, 1, 2), i32(4, 1))
    with pytest.raises(ValueError, match="append_value lies in paged_kv_cache's memory"):
        jitattn.append_paged_kv_cache(torch.randn(3, 2, 64), cache[2, 1, :3], i32(0, 0, 0), i32(1, 2, 3), cache,
                                      i32(0, 1), i32(0, 1, 2), i32(4, 1))


def test_strided_out_over_what_the_kernel_reads_is_refused(monkeypatch) -> None:
    """An out that is a strided view into the memory the launch reads (the paged cache's K heads, MLA's latent
    cache cut from one 576-wide buffer) is refused as a dense one is; an out beside q in one buffer (column slices
    that share no element) runs, with the bits of a separate out."""
    gen = torch.Generator().manual_seed(3)
    ints = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    kbig = torch.randn(4, 16, 8, 64, generator=gen).to(torch.bfloat16)
    kc, vc = kbig[:, :, :4], torch.randn(4, 16, 4, 64, generator=gen).to(torch.bfloat16)  # K: strided heads
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8))
    wrapper.plan(ints([0, 16, 32]), ints([0, 2, 4]), ints([0, 1, 0, 1]), ints([16, 16]), 4, 4, 64, 16,
                 q_data_type=torch.bfloat16)
    q = torch.randn(32, 4, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="out shares memory with k,"):
        wrapper.run(q, (kc, vc), out=kc[0:2].view(32, 4, 64))
    mla = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8))
    plan = (ints([0, 1, 2, 3, 4]), ints([0, 4, 8, 12, 16]), ints([0, 1, 2, 3] * 4), ints([64] * 4), 16, 512, 64, 16,
            False, 0.1, torch.bfloat16, torch.bfloat16)
    mla.plan(*plan)
    latent = torch.randn(4, 16, 576, generator=gen).to(torch.bfloat16)
    ckv, kpe = latent[..., :512], latent[..., 512:]
    both = torch.randn(4, 16, 1024, generator=gen).to(torch.bfloat16)  # [q_nope | out] in one buffer
    q_nope, q_pe = both[..., :512], torch.randn(4, 16, 64, generator=gen).to(torch.bfloat16)
    with pytest.raises(ValueError, match="out shares memory with ckv_cache"):
        mla.run(q_nope, q_pe, ckv, kpe, out=latent[..., :512])
    with pytest.raises(ValueError, match="lse shares memory with (ckv|kpe)_cache"):
        mla.run(q_nope, q_pe, ckv, kpe, lse=kpe[..., :2].view(torch.float32)[..., 0])
    np = pytest.importorskip("numpy")
    arena = torch.randn(4096, generator=gen)  # out in another storage over the same memory (from_dlpack)
    decode = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    decode.plan(ints([0, 1]), ints([0]), ints([16]), 4, 4, 64, 16, q_data_type=torch.float32)
    with pytest.raises(ValueError, match="out shares memory with q"):
        decode.run(arena[:256].view(1, 4, 64), torch.randn(1, 2, 16, 4, 64),
                   out=torch.from_dlpack(np.from_dlpack(arena)[64:320]).view(1, 4, 64))
    rows = torch.randn(10, 4, 64, generator=gen)  # merged rows would overwrite rows still to be read
    with pytest.raises(ValueError, match="v and v_other share memory but not row for row"):
        jitattn.merge_state_in_place(rows[0:8:2], torch.randn(4, 4), rows[2:10:2], torch.randn(4, 4))
    monkeypatch.undo()  # launches allowed from here (a plan binds its launch): the refusals above came first
    mla.plan(*plan)
    expected = mla.run(q_nope, q_pe, ckv, kpe)
    assert torch.equal(mla.run(q_nope, q_pe, ckv, kpe, out=both[..., 512:]), expected)
    ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8))
    ragged.plan(ints([0, 8]), ints([0, 8]), 4, 4, 192, head_dim_vo=128, q_data_type=torch.float32)
    qo = torch.randn(8, 4 * (192 + 128), generator=gen)  # [q | out], heads of 192 and of 128 columns
    k, v = torch.randn(8, 4, 192, generator=gen), torch.randn(8, 4, 128, generator=gen)
    q = qo[:, :4 * 192].view(8, 4, 192)
    assert torch.equal(ragged.run(q, k, v, out=qo[:, 4 * 192:].view(8, 4, 128)), ragged.run(q, k, v))

"""The wrappers under torch.compile(fullgraph=True): no graph breaks, no recompiles across plan()."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_out, random_paged_batch


GPU_SPECS = [attention_spec(
    Op.DECODE, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
    head_dim_qk=128, head_dim_vo=128, num_qo_heads=32, num_kv_heads=8, pos_encoding=PosEncoding.NONE,
    use_sliding_window=False, use_logits_soft_cap=False, mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD,
    kv_storage=KVStorage.PAGED,
)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _fullgraph_counted(function):
    """``function`` under torch.compile(fullgraph=True), and the list of the graphs it compiles."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    return torch.compile(function, fullgraph=True, backend=counting_backend), graphs


def test_decode_compiles_fullgraph_and_survives_replanning() -> None:
    gen = torch.Generator().manual_seed(3)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    # ops around the call stay in the same graph
    attention_layer, compiles = _fullgraph_counted(lambda q, cache: wrapper.run(q * 1.0, cache) + 0.0)

    for lens in ([5, 40, 17], [300, 1, 64], [9, 9, 200]):
        pages = sum((n + 15) // 16 for n in lens)
        # A serving engine's KV pool has a fixed size: keep it at 40 pages.
        batch = random_paged_batch(lens, 2, 64, 16, torch.bfloat16, generator=gen, spare_pages=40 - pages)
        q = torch.randn(3, 8, 64, generator=gen).to(torch.bfloat16)
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16,
                     q_data_type=torch.bfloat16)
        out = attention_layer(q, batch.cache)
        expected, _ = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
        assert_close_out(out, expected, torch.bfloat16)
    assert len(compiles) == 1, f"recompiled {len(compiles) - 1} times across plan() calls"


def test_ragged_prefill_compiles_with_aot_eager() -> None:
    gen = torch.Generator().manual_seed(4)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    qo = torch.tensor([0, 3, 8], dtype=torch.int32)
    kv = torch.tensor([0, 10, 15], dtype=torch.int32)
    wrapper.plan(qo, kv, 4, 2, 64, causal=True, q_data_type=torch.float16)
    q = torch.randn(8, 4, 64, generator=gen).half()
    k = torch.randn(15, 2, 64, generator=gen).half()
    v = torch.randn(15, 2, 64, generator=gen).half()

    @torch.compile(fullgraph=True, backend="aot_eager")
    def layer(q, k, v):
        out, lse = wrapper.run(q, k, v, return_lse=True)
        return out, lse

    out, lse = layer(q, k, v)
    expected, expected_lse = reference.batch_ragged_attention(q, k, v, qo, kv, causal=True)
    assert_close_out(out, expected, torch.float16)
    torch.testing.assert_close(lse, expected_lse, atol=2e-3, rtol=1e-4)


@pytest.mark.parametrize("route", ["rope_first", "fp8_upcast"])
def test_paged_prefill_that_gathers_its_rows_compiles_once_across_plans(route) -> None:
    """The gather of a plan that reads the cache's rows (RoPE first, the fp8 upcast) ran in the graph: its check of
    the pool against the plan's highest page became a guard, so each plan recompiled (under fullgraph=True the
    ninth failed on the recompile limit). It is a custom op now."""
    gen = torch.Generator().manual_seed(6)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    kv_dtype = torch.float8_e4m3fn if route == "fp8_upcast" else torch.float16
    options = dict(kv_data_type=kv_dtype, fp8_upcast=True) if route == "fp8_upcast" else dict(
        pos_encoding_mode="ROPE_LLAMA", rope_first=True)
    layer, compiles = _fullgraph_counted(lambda q, cache: wrapper.run(q, cache) + 0.0)

    qo = torch.tensor([0, 3, 6], dtype=torch.int32)
    q = torch.randn(6, 4, 64, generator=gen).half()
    for lens in ([20, 9], [33, 40], [5, 64]):
        pages = sum((n + 15) // 16 for n in lens)
        batch = random_paged_batch(lens, 2, 64, 16, kv_dtype, generator=gen, spare_pages=12 - pages)
        wrapper.plan(qo, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 4, 2, 64, 16, causal=True,
                     q_data_type=torch.float16, **options)
        out = layer(q, batch.cache)
        torch.testing.assert_close(out, wrapper.run(q, batch.cache), atol=0, rtol=0)
        expected, _ = reference.batch_prefill_paged(
            q, batch.cache, qo, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, causal=True,
            pos_encoding_mode=options.get("pos_encoding_mode", "NONE"))
        assert_close_out(out, expected, torch.float16)
    assert len(compiles) == 1, f"recompiled {len(compiles) - 1} times across plan() calls"


def test_cascade_and_merges_compile_fullgraph() -> None:
    gen = torch.Generator().manual_seed(5)
    cache = torch.randn(8, 2, 16, 2, 64, generator=gen).half()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan([i32([0, 2]), i32([0, 1, 2])], [i32([0, 2]), i32([0, 1, 2])], [i32([0, 1]), i32([2, 3])],
                 [i32([16]), i32([5, 9])], 4, 2, 64, 16, q_data_type=torch.float16)
    q = torch.randn(2, 4, 64, generator=gen).half()
    eager = wrapper.run(q, cache)

    @torch.compile(fullgraph=True, backend="aot_eager")
    def step(q, cache):
        out = wrapper.run(q, cache)
        v, s = jitattn.merge_state(out, torch.zeros(2, 4), out, torch.zeros(2, 4))
        return out, v

    out, merged = step(q, cache)
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(merged, eager)


def test_cascade_does_not_recompile_when_the_pages_change() -> None:
    """Its run() checked the pool against the plan's highest page index: traced, a guard on it recompiled the step
    at nearly every plan (past the limit of 8, fullgraph=True failed)."""
    gen = torch.Generator().manual_seed(13)
    cache = torch.randn(12, 2, 16, 2, 64, generator=gen).half()
    i32 = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    step, graphs = _fullgraph_counted(lambda q, cache: wrapper.run(q, cache) + 0.0)
    q = torch.randn(2, 4, 64, generator=gen).half()
    for shared, own in ((3, [7, 1]), (9, [2, 11]), (0, [5, 4])):
        wrapper.plan([i32([0, 2]), i32([0, 1, 2])], [i32([0, 1]), i32([0, 1, 2])], [i32([shared]), i32(own)],
                     [i32([16]), i32([5, 9])], 4, 2, 64, 16, q_data_type=torch.float16)
        torch.testing.assert_close(step(q, cache), wrapper.run(q, cache), atol=0, rtol=0)
    assert len(graphs) == 1, f"recompiled {len(graphs) - 1} times across plan() calls"


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_decode_compiles_with_inductor_on_cuda(mode: str) -> None:
    """mode="reduce-overhead": Inductor runs the wrapper's op between its CUDA graphs (the op is cudagraph-unsafe);
    captured inside one, replays would launch the plan of the capture."""
    gen = torch.Generator().manual_seed(8)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    layer = torch.compile(lambda q, cache: torch.nn.functional.silu(wrapper.run(q * 2.0, cache)), fullgraph=True,
                          mode=mode)
    for lens in ([5, 400, 17], [3000, 1, 64], [9, 9, 9], [5, 400, 17]):
        pages = sum((n + 15) // 16 for n in lens)
        batch = random_paged_batch(lens, 8, 128, 16, torch.bfloat16, device="cuda", generator=gen,
                                   spare_pages=300 - pages)
        q = torch.randn(3, 32, 128, generator=gen).to(torch.bfloat16).cuda()
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 32, 8, 128, 16,
                     q_data_type=torch.bfloat16)
        for _ in range(3):  # (reduce-overhead: warm-up, capture, replay)
            out = layer(q, batch.cache).clone()
        expected, _ = reference.batch_decode_paged(q * 2.0, batch.cache, batch.kv_indptr, batch.kv_indices,
                                                   batch.kv_last_page_len)
        assert_close_out(out, torch.nn.functional.silu(expected.cuda()).cpu(), torch.bfloat16)


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_append_and_seq_lens_under_compile(backend: str) -> None:
    """The page-table checks traced by Dynamo (numpy on the host) run on every backend, and still refuse bad pages
    (their one-pass unsigned max has no cpu kernel in torch: under compile they take min and max)."""
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cache = torch.zeros(3, 2, 2, 1, 4)

    @torch.compile(backend=backend)
    def step(k, v, cache, indices):
        jitattn.append_paged_kv_cache(k, v, i32(0, 0), i32(0, 1), cache, indices, i32(0, 1), i32(2))
        return jitattn.get_seq_lens(i32(0, 2, 3), i32(1, 4), 4)

    lens = step(torch.ones(2, 1, 4), torch.full((2, 1, 4), 2.0), cache, i32(2))
    assert lens.tolist() == [5, 4]
    assert (cache[2, 0] == 1).all() and (cache[2, 1] == 2).all() and (cache[:2] == 0).all()
    with pytest.raises(ValueError, match="negative page index"):
        step(torch.ones(2, 1, 4), torch.ones(2, 1, 4), cache, i32(-1))


def test_a_plan_inside_a_compiled_step_runs_on_the_host() -> None:
    """Traced, a plan's host arrays became fake tensors: an empty KV (single_decode_with_kv_cache, or a batch of empty
    requests planned in the step) lost its placeholder address and the launch was refused, where eager returns 0."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(4, 64, generator=gen).half()

    @torch.compile(backend="eager")
    def single(q, k, v):
        return jitattn.single_decode_with_kv_cache(q, k, v)

    for n in (0, 5):
        k, v = (torch.randn(n, 2, 64, generator=gen).half() for _ in range(2))
        torch.testing.assert_close(single(q, k, v), jitattn.single_decode_with_kv_cache(q, k, v), atol=0, rtol=0)
    assert not single(q, k[:0], v[:0]).any()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    cache = torch.randn(3, 2, 16, 2, 64, generator=gen).half()
    empty = torch.zeros(3, dtype=torch.int32)

    @torch.compile(backend="eager")
    def step(q, cache, indptr, indices, last):
        wrapper.plan(indptr, indices, last, 4, 2, 64, 16, q_data_type=torch.float16)
        return wrapper.run(q, cache)

    out = step(torch.randn(2, 4, 64, generator=gen).half(), cache, empty, empty[:0], empty[:2])
    assert out.shape == (2, 4, 64) and not out.any()


@pytest.mark.parametrize("namespace", ["jitattn", "jitattn.flashinfer"])
def test_batch_attention_compiles_fullgraph_across_plans(namespace: str) -> None:
    """Its run() composes the parts' launches in Python (a data_ptr comparison among them): traced, it broke the
    graph mid-function and torch failed building guards ("sources must not be empty"); then it was a graph break.
    It is one custom op now (jitattn::batch_attention_run): one graph across plans of other mixes."""
    import importlib

    api = importlib.import_module(namespace)
    gen = torch.Generator().manual_seed(8)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    cache = torch.randn(8, 2, 16, 2, 64, generator=gen).half()
    wrapper = api.BatchAttention(device="cpu")
    layer, graphs = _fullgraph_counted(lambda q, c: wrapper.run(q, c))
    q = torch.randn(8, 4, 64, generator=gen).half()
    for qo, lens in (((0, 1, 8), (20, 30)), ((0, 4, 8), (9, 40)), ((0, 1, 2, 8), (5, 7, 33))):
        pages = [(n + 15) // 16 for n in lens]
        indptr = i32(*[sum(pages[:i]) for i in range(len(pages) + 1)])
        wrapper.plan(i32(*qo), indptr, i32(*range(sum(pages))), i32(*lens), 4, 2, 64, 64, 16, causal=True,
                     q_data_type=torch.float16, kv_data_type=torch.float16)
        for got, expected in zip(layer(q, cache), wrapper.run(q, cache)):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert len(graphs) == 1, f"{len(graphs)} graphs across plan() calls"


def test_mla_compiles_fullgraph_over_views_of_one_latent_buffer() -> None:
    """Its run() compared the latent caches' addresses (ckv and kpe as views of one buffer, SGLang's layout): under
    fullgraph=True Dynamo failed on the pointer arithmetic. It is one custom op now (jitattn::mla_run)."""
    import math

    gen = torch.Generator().manual_seed(9)
    heads, page, ckv_dim = 16, 16, 512
    latent = (torch.randn(4, page, ckv_dim + 64, generator=gen) * 0.3).bfloat16()
    ckv, kpe = latent[..., :ckv_dim], latent[..., ckv_dim:]
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    layer, graphs = _fullgraph_counted(lambda *args: wrapper.run(*args, return_lse=True))
    for n in (20, 35, 9):
        pages = (n + page - 1) // page
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, pages], dtype=torch.int32),
                     torch.tensor([2, 0, 1][:pages], dtype=torch.int32), torch.tensor([n], dtype=torch.int32), heads,
                     ckv_dim, 64, page, False, 1 / math.sqrt(192), torch.bfloat16, torch.bfloat16)
        q_nope, q_pe = (torch.randn(1, heads, d, generator=gen).bfloat16() for d in (ckv_dim, 64))
        for got, expected in zip(layer(q_nope, q_pe, ckv, kpe), wrapper.run(q_nope, q_pe, ckv, kpe, return_lse=True)):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert len(graphs) == 1, f"recompiled {len(graphs) - 1} times across plan() calls"


def test_a_scale_tensor_is_refused_by_name_under_compile() -> None:
    """Traced, its value became a data-dependent guard: Dynamo failed with 'Could not guard on data-dependent
    expression' and no word of the argument."""
    gen = torch.Generator().manual_seed(10)
    batch = random_paged_batch([5, 9], 2, 64, 16, torch.bfloat16, generator=gen)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 4, 2, 64, 16, q_data_type=torch.bfloat16)
    layer = torch.compile(lambda q, cache, s: wrapper.run(q, cache, k_scale=s), fullgraph=True, backend="aot_eager")
    with pytest.raises(Exception) as info:
        layer(torch.randn(2, 4, 64, generator=gen).bfloat16(), batch.cache, torch.tensor(0.5))
    raised = info.value.__cause__ or info.value
    assert "k_scale as a tensor is not supported under torch.compile" in str(raised), repr(info.value)


def test_the_flashinfer_namespace_keeps_its_lse_base_under_compile() -> None:
    """The MLA op called the wrapper's run(), which on jitattn.flashinfer's subclass already returns base 2: the
    compiled LSE was converted twice (log2(e)^2 times the natural one), and return_lse_base_on_e gave base 2.
    merge_state_in_place's checks of s ran outside its op, where Dynamo cannot trace them."""
    import math

    import jitattn.flashinfer as fi

    gen = torch.Generator().manual_seed(12)
    latent = torch.randn(4, 16, 576, generator=gen).bfloat16()
    ckv, kpe = latent[..., :512], latent[..., 512:]
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper = fi.mla.BatchMLAPagedAttentionWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    wrapper.plan(i32(0, 1, 2), i32(0, 2, 3), i32(3, 0, 1), i32(20, 9), 4, 512, 64, 16, False, 0.1, torch.bfloat16,
                 torch.bfloat16)
    q_nope, q_pe = (torch.randn(2, 4, d, generator=gen).bfloat16() for d in (512, 64))
    for base_e in (False, True):
        torch._dynamo.reset()
        compiled = torch.compile(lambda *a: wrapper.run(*a, return_lse=True, return_lse_base_on_e=base_e),
                                 fullgraph=True, backend="aot_eager")
        for got, expected in zip(compiled(q_nope, q_pe, ckv, kpe), wrapper.run(
                q_nope, q_pe, ckv, kpe, return_lse=True, return_lse_base_on_e=base_e)):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    torch._dynamo.reset()
    v, s = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, generator=gen)
    v_other, s_other = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 2, generator=gen)
    eager_v, eager_s = v.clone(), s.clone()
    fi.merge_state_in_place(eager_v, eager_s, v_other, s_other)
    torch.compile(fi.merge_state_in_place, fullgraph=True, backend="aot_eager")(v, s, v_other, s_other)
    torch.testing.assert_close(v, eager_v, atol=0, rtol=0)
    torch.testing.assert_close(s, eager_s, atol=1e-6, rtol=0)
    assert math.isfinite(float(s.sum()))


@pytest.mark.parametrize("case", ["out_dtype", "lse_dtype", "out_shape", "unknown_keyword"])
def test_run_buffers_and_keywords_get_eager_errors_under_compile(case: str) -> None:
    """The op's result was copied into any out= / lse= (a float16 lse rounded the LSE) and stray keywords were
    dropped, where eager refuses them."""
    gen = torch.Generator().manual_seed(14)
    batch = random_paged_batch([5, 9], 2, 64, 16, torch.float16, generator=gen)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 4, 2, 64, 16, q_data_type=torch.float16)
    q = torch.randn(2, 4, 64, generator=gen).half()
    kwargs, error, match = {
        "out_dtype": (dict(out=torch.empty(2, 4, 64)), TypeError, "out has dtype float32; expected one of float16"),
        "lse_dtype": (dict(lse=torch.empty(2, 4).half(), return_lse=True), TypeError, "lse has dtype float16"),
        "out_shape": (dict(out=torch.empty(3, 4, 64).half()), ValueError, r"out has shape \(3, 4, 64\); expected"),
        "unknown_keyword": (dict(foo=q), TypeError, r"got unexpected keyword argument\(s\) \['foo'\]"),
    }[case]
    with pytest.raises(error, match=match):  # eager
        wrapper.run(q, batch.cache, **kwargs)
    with pytest.raises(Exception) as info:
        torch.compile(lambda q, c: wrapper.run(q, c, **kwargs), fullgraph=True, backend="aot_eager")(q, batch.cache)
    raised = info.value.__cause__ or info.value
    assert error.__name__ in type(raised).__name__ and re.search(match, str(raised)), repr(info.value)


@pytest.mark.parametrize("namespace", ["jitattn", "jitattn.flashinfer"])
def test_run_return_lse_compiles_fullgraph(namespace: str) -> None:
    """FlashInfer's run_return_lse was a functools.partialmethod, whose __get__ Dynamo cannot trace: under
    fullgraph=True every such call failed."""
    import importlib

    api = importlib.import_module(namespace)
    gen = torch.Generator().manual_seed(15)
    batch = random_paged_batch([5, 9], 2, 64, 16, torch.float16, generator=gen)
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    decode = api.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    decode.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 4, 2, 64, 16, q_data_type=torch.float16)
    cascade = api.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    cascade.plan([i32(0, 2), i32(0, 1, 2)], [i32(0, 1), i32(0, 1, 2)], [i32(0), i32(1, 2)], [i32(16), i32(5, 9)],
                 4, 2, 64, 16, q_data_type=torch.float16)
    q = torch.randn(2, 4, 64, generator=gen).half()
    for call in (decode.run_return_lse, cascade.run_return_lse, cascade.forward_return_lse):
        torch._dynamo.reset()
        got = torch.compile(lambda q, c: call(q, c), fullgraph=True, backend="aot_eager")(q, batch.cache)
        for g, e in zip(got, call(q, batch.cache)):
            torch.testing.assert_close(g, e, atol=0, rtol=0)


def test_hnd_ragged_prefill_does_not_recompile_when_the_kv_length_changes() -> None:
    """Its check of the HND views against the plan's total_kv ran in the trace: a guard, a recompile at every plan."""
    gen = torch.Generator().manual_seed(16)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "HND")
    layer, graphs = _fullgraph_counted(lambda q, k, v: wrapper.run(q, k, v) + 0.0)
    q = torch.randn(4, 4, 64, generator=gen).half()
    k, v = (torch.randn(2, 64, 64, generator=gen).half() for _ in range(2))
    for n in (1, 5, 30):
        wrapper.plan(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4 + n], dtype=torch.int32), 4, 2, 64,
                     causal=True, q_data_type=torch.float16)
        torch.testing.assert_close(layer(q, k, v), wrapper.run(q, k, v), atol=0, rtol=0)
    assert len(graphs) == 1, f"recompiled {len(graphs) - 1} times across plan() calls"


@pytest.mark.parametrize("namespace", ["jitattn", "jitattn.flashinfer"])
def test_a_split_cascade_does_not_recompile_when_its_chunk_count_changes(namespace: str) -> None:
    """Its run() passed the plan's state buffers through the trace: their chunk counts became guards and each plan of
    another split recompiled (fullgraph=True failed on the ninth). The whole run is one op now."""
    import importlib

    api = importlib.import_module(namespace)
    gen = torch.Generator().manual_seed(17)
    cache = torch.randn(40, 2, 16, 2, 64, generator=gen).half()
    q = torch.randn(2, 4, 64, generator=gen).half()
    i32 = lambda *v: torch.tensor(v, dtype=torch.int32)  # noqa: E731
    wrapper = api.MultiLevelCascadeAttentionWrapper(2, torch.empty(8 << 20, dtype=torch.uint8))
    step, graphs = _fullgraph_counted(lambda q, c: wrapper.run(q, c, return_lse=True))
    for shared in (1, 4, 11, 2):
        wrapper.plan([i32(0, 2), i32(0, 1, 2)], [i32(0, shared), i32(0, 1, 2)],
                     [torch.arange(shared, dtype=torch.int32), i32(30, 31)], [i32(16), i32(5, 9)], 4, 2, 64, 16,
                     q_data_type=torch.float16, fixed_split_size=1)
        for got, expected in zip(step(q, cache), wrapper.run(q, cache, return_lse=True)):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert len(graphs) == 1, f"recompiled {len(graphs) - 1} times across plan() calls"

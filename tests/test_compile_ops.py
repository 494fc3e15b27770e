"""The per-layer ops beside attention under torch.compile(fullgraph=True): RMSNorm, the gated activations, RoPE and
the paged cache writes are custom ops there (runtime/compiled_ops.py). A decoder layer calling them compiles as one
graph, writes what eager writes (bit for bit: the same kernels run), does not recompile when index values change,
and raises eager's errors when the graph runs."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo

import jitattn

HEADS, KV_HEADS, HEAD, HIDDEN, PAGE = 4, 2, 32, 64, 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _counted(function, backend: str = "aot_eager"):
    """``function`` under torch.compile(fullgraph=True) on ``backend``, and the list of the graphs it compiles."""
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend(backend)(gm, example_inputs)

    return torch.compile(function, fullgraph=True, backend=counting_backend), graphs


def _i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _layer(hidden, residual, w, cos_sin, positions, cache, batch_indices, kv_indices, kv_indptr, last, gate_up):
    """One decoder layer's calls around attention, as SGLang makes them (q and k rotated in place as slices of the
    fused qkv; the cache written as a (k, v) pair of views of one buffer)."""
    jitattn.fused_add_rmsnorm(hidden, residual, w["norm"])
    qkv = hidden @ w["qkv"]
    q, k, v = qkv.split([HEADS * HEAD, KV_HEADS * HEAD, KV_HEADS * HEAD], dim=-1)
    jitattn.apply_rope_with_cos_sin_cache_inplace(positions, q, k, HEAD, cos_sin)
    jitattn.append_paged_kv_cache(k.view(-1, KV_HEADS, HEAD), v.view(-1, KV_HEADS, HEAD), batch_indices, positions,
                                  (cache[:, 0], cache[:, 1]), kv_indices, kv_indptr, last)
    q_rope, k_rope = jitattn.apply_llama31_rope_pos_ids(q.view(-1, HEADS, HEAD), k.view(-1, KV_HEADS, HEAD), positions)
    normed = jitattn.gemma_rmsnorm(q_rope, w["head_norm"])
    jitattn.rmsnorm(k_rope, w["head_norm"], out=k_rope)  # in place, as FlashInfer takes out=input
    act = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=gate_up.dtype)
    jitattn.gelu_tanh_and_mul(gate_up, out=act)
    return normed, k_rope, jitattn.silu_and_mul(gate_up) + act, qkv


def _inputs(gen: torch.Generator, tokens: int, pages: list[int]):
    rope_cache = torch.randn(64, HEAD, generator=gen)
    weights = dict(norm=torch.randn(HIDDEN, generator=gen), qkv=torch.randn(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD,
                   generator=gen) / 8, head_norm=torch.randn(HEAD, generator=gen))
    positions = torch.randperm(PAGE * len(pages), generator=gen)[:tokens].to(torch.int32)
    return (torch.randn(tokens, HIDDEN, generator=gen), torch.randn(tokens, HIDDEN, generator=gen), weights,
            rope_cache, positions, torch.randn(8, 2, PAGE, KV_HEADS, HEAD, generator=gen),
            torch.zeros(tokens, dtype=torch.int32), _i32(*pages), _i32(0, len(pages)), _i32(PAGE),
            torch.randn(tokens, 2 * HIDDEN, generator=gen))


def _cloned(args):
    return [{k: v.clone() for k, v in a.items()} if isinstance(a, dict) else a.clone() for a in args]


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_decoder_layer_of_the_ops_compiles_fullgraph_and_writes_what_eager_writes(backend: str) -> None:
    gen = torch.Generator().manual_seed(1)
    layer, graphs = _counted(_layer, backend)
    for pages in ([3, 5], [0, 7], [6, 1]):  # other pages and positions: values, not shapes, so no recompile
        args = _inputs(gen, 6, pages)
        eager_args, compiled_args = _cloned(args), _cloned(args)
        expected = _layer(*eager_args)
        got = layer(*compiled_args)
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=0, rtol=0)
        for name, g, e in zip(("hidden", "residual", "w", "cos_sin", "positions", "cache"), compiled_args,
                              eager_args):
            if isinstance(g, torch.Tensor):  # the in-place writes: the norm, the residual, the cache
                torch.testing.assert_close(g, e, atol=0, rtol=0, msg=name)
        assert not torch.equal(compiled_args[5], args[5])  # the cache was written
    assert len(graphs) == 1, f"{len(graphs)} graphs: a graph break or a recompile"


def test_the_mla_cache_write_compiles_over_views_of_one_latent_buffer() -> None:
    gen = torch.Generator().manual_seed(2)
    latent = torch.randn(4, PAGE, 576, generator=gen).bfloat16()
    ckv, kpe = latent[..., :512], latent[..., 512:]
    append = lambda c, p, idx: jitattn.append_paged_mla_kv_cache(  # noqa: E731
        c, p, _i32(0, 0), _i32(1, 2), ckv, kpe, idx, _i32(0, 1), _i32(3))
    step, graphs = _counted(append)
    for page in (2, 0):
        c, p = torch.randn(2, 512, generator=gen).bfloat16(), torch.randn(2, 64, generator=gen).bfloat16()
        step(c, p, _i32(page))
        assert torch.equal(ckv[page, 1:3], c) and torch.equal(kpe[page, 1:3], p)
    assert len(graphs) == 1


def test_a_single_tensor_cache_and_functional_rope_compile_fullgraph() -> None:
    gen = torch.Generator().manual_seed(3)
    indptr, offsets = _i32(0, 2, 3), _i32(4, 0)

    def step(q, k, v, cache):
        q_rope, k_rope = jitattn.apply_rope(q, k, indptr, offsets, rotary_dim=16, interleave=True)
        jitattn.apply_llama31_rope_inplace(q, k, indptr, offsets)
        jitattn.append_paged_kv_cache(k_rope, v, _i32(0, 0, 1), _i32(4, 5, 0), cache, _i32(0, 1, 2), indptr,
                                      _i32(2, 1))
        return q_rope, jitattn.gelu_and_mul(q.flatten())  # a 1-D input: one row

    args = [torch.randn(3, h, HEAD, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
    args.append(torch.zeros(3, 2, PAGE, KV_HEADS, HEAD))
    eager_args, compiled_args = _cloned(args), _cloned(args)
    expected = step(*eager_args)
    compiled, graphs = _counted(step)
    got = compiled(*compiled_args)
    for g, e in zip((*got, *compiled_args), (*expected, *eager_args)):
        torch.testing.assert_close(g, e, atol=0, rtol=0)
    assert compiled_args[3].any() and not torch.equal(compiled_args[0], args[0])  # written in place
    assert len(graphs) == 1


def test_bad_input_under_compile_raises_the_eager_error() -> None:
    """Checks of values the graph holds run when it runs (the tensors' shapes, the index arrays' values); those of
    Python arguments run at trace time."""
    x = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match=r"weight has shape \(32,\); expected \(64,\)"):
        torch.compile(lambda x, w: jitattn.rmsnorm(x, w), fullgraph=True, backend="aot_eager")(x, torch.randn(32))
    _raises_under_compile(lambda x: jitattn.rmsnorm(x, torch.ones(HIDDEN), eps=-1.0), x, error=ValueError,
                          match="eps=-1.0 must be a finite number >= 0")
    torch._dynamo.reset()
    cache = torch.zeros(2, 2, PAGE, 1, 8)
    write = torch.compile(lambda k, idx: jitattn.append_paged_kv_cache(
        k, k, _i32(0), _i32(0), cache, idx, _i32(0, 1), _i32(1)), fullgraph=True, backend="aot_eager")
    with pytest.raises(IndexError, match=r"kv_indices\[0\] = 5 references a page past the end"):
        write(torch.ones(1, 1, 8), _i32(5))
    assert not cache.any()  # a refused write leaves the cache as it was
    torch._dynamo.reset()
    with pytest.raises(IndexError, match=r"positions\[1\]=70 is outside cos_sin_cache's 64 rows"):
        torch.compile(lambda pos, q, k: jitattn.apply_rope_with_cos_sin_cache_inplace(pos, q, k, 8, torch.ones(64, 8)),
                      fullgraph=True, backend="aot_eager")(torch.tensor([0, 70]), torch.randn(2, 16), torch.randn(2, 8))


def _raises_under_compile(function, *args, error: type, match: str) -> None:
    """``function(*args)`` compiled with fullgraph=True raises ``error`` (as Dynamo's Unsupported whose cause it is,
    when raised at trace time), and without fullgraph it falls back to eager, which raises ``error`` itself."""
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(function, fullgraph=True, backend="aot_eager")(*args)
    raised = info.value.__cause__ or info.value  # (the cause: Dynamo's Observed<error>)
    assert error.__name__ in type(raised).__name__ and re.search(match, str(raised)), repr(info.value)
    torch._dynamo.reset()
    with pytest.raises(error, match=match):
        torch.compile(function, backend="aot_eager")(*args)


@pytest.mark.parametrize("case", ["fused_add_rmsnorm", "rope_inplace", "append", "mla_append", "rmsnorm_out"])
def test_a_written_tensor_that_requires_grad_is_refused_under_compile(case: str) -> None:
    """Inside the op the written tensors are copies (functionalisation) and grad mode is off: its own check could not
    fire, and the write went into a tensor autograd then ignored (wrong gradients)."""
    leaf = lambda *shape: torch.randn(*shape, requires_grad=True)  # noqa: E731
    calls = {
        "fused_add_rmsnorm": (lambda x, r: jitattn.fused_add_rmsnorm(x, r, torch.ones(HIDDEN)),
                              (leaf(2, HIDDEN), torch.randn(2, HIDDEN)), "input requires grad"),
        "rope_inplace": (lambda q, k: jitattn.apply_rope_pos_ids_inplace(q, k, _i32(0, 1)),
                         (torch.randn(2, 2, 8), leaf(2, 1, 8)), "k requires grad"),
        "append": (lambda k, c: jitattn.append_paged_kv_cache(k, k, _i32(0), _i32(0), c, _i32(0), _i32(0, 1), _i32(1)),
                   (torch.randn(1, 1, 8), leaf(1, 2, PAGE, 1, 8)), "paged_kv_cache requires grad"),
        "mla_append": (lambda c, p, ckv, kpe: jitattn.append_paged_mla_kv_cache(
            c, p, _i32(0), _i32(0), ckv, kpe, _i32(0), _i32(0, 1), _i32(1)),
            (torch.randn(1, 16), torch.randn(1, 8), torch.randn(1, PAGE, 16), leaf(1, PAGE, 8)),
            "kpe_cache requires grad"),
        "rmsnorm_out": (lambda x, o: jitattn.rmsnorm(x, torch.ones(HIDDEN), out=o),
                        (torch.randn(2, HIDDEN), leaf(2, HIDDEN)), "out requires grad|rmsnorm is inference-only"),
    }
    function, args, match = calls[case]
    _raises_under_compile(function, *args, error=RuntimeError, match=match)
    torch._dynamo.reset()
    with torch.no_grad():  # the same call is fine where nothing records it
        torch.compile(function, fullgraph=True, backend="aot_eager")(*args)


def test_inputs_that_require_grad_name_the_inference_only_op_under_compile() -> None:
    """Dynamo traced the autograd.Function eager ties the outputs to, whose backward raises: under fullgraph a model
    with a Parameter weight failed with an unrelated error even when nothing called backward."""
    weight = torch.nn.Parameter(torch.ones(HIDDEN))
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: jitattn.rmsnorm(x, weight), fullgraph=True, backend="aot_eager")(torch.randn(2, HIDDEN))
    assert "rmsnorm is inference-only" in str(info.value.__cause__)
    with torch.inference_mode():
        out = torch.compile(lambda x: jitattn.rmsnorm(x, weight), fullgraph=True, backend="aot_eager")(torch.ones(2,
                                                                                                          HIDDEN))
    torch.testing.assert_close(out, torch.ones(2, HIDDEN), atol=1e-5, rtol=0)


def test_rope_parameters_that_change_between_calls_compile_fullgraph() -> None:
    """A rope_theta differing between layers (Gemma 3: 10k local, 1M global) became symbolic on the second call, and
    the check of it (math.isfinite) broke the graph; dynamic=True did the same to the defaults. Each value is one
    graph (the op takes it as a constant)."""
    gen = torch.Generator().manual_seed(5)
    step, graphs = _counted(lambda q, k, pos, theta: jitattn.apply_rope_pos_ids(q, k, pos, rope_theta=theta))
    q, k = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 1, 16, generator=gen)
    for theta in (1e4, 1e6, 5e5):
        for got, expected in zip(step(q, k, _i32(0, 4, 9), theta), jitattn.apply_rope_pos_ids(q, k, _i32(0, 4, 9),
                                                                                               rope_theta=theta)):
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
    assert len(graphs) <= 4  # one a value, and one more while Dynamo tries the value as symbolic
    torch._dynamo.reset()
    dynamic = torch.compile(lambda q, k, pos: jitattn.apply_llama31_rope_pos_ids(q, k, pos, interleave=1),
                            fullgraph=True, dynamic=True, backend="aot_eager")
    for got, expected in zip(dynamic(q, k, _i32(0, 4, 9)), jitattn.apply_llama31_rope_pos_ids(q, k, _i32(0, 4, 9),
                                                                                             interleave=True)):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("case", ["eps_tensor", "eps_none", "indptr_list", "rotary_dim_float", "one_tuple_cache",
                                  "kv_layout_none"])
def test_arguments_of_the_wrong_kind_get_eager_errors_under_compile(case: str) -> None:
    x, cache = torch.randn(2, HIDDEN), torch.zeros(2, 2, PAGE, 1, 8)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    append = lambda c, layout="NHD": jitattn.append_paged_kv_cache(  # noqa: E731
        k[:1], k[:1], _i32(0), _i32(0), c, _i32(0), _i32(0, 1), _i32(1), kv_layout=layout)
    calls = {
        "eps_tensor": (lambda x: jitattn.rmsnorm(x, torch.ones(HIDDEN), eps=torch.tensor(1e-6)), (x,), TypeError,
                       r"eps is a tensor; it must be a Python float \(for a one-element tensor pass .item\(\)\)"),
        "eps_none": (lambda x: jitattn.rmsnorm(x, torch.ones(HIDDEN), eps=None), (x,), TypeError,
                     "eps=None must be a Python float"),
        "indptr_list": (lambda q, k: jitattn.apply_rope(q, k, [0, 2], _i32(0)), (q, k), TypeError,
                        "indptr must be a torch.Tensor"),
        "rotary_dim_float": (lambda q, k: jitattn.apply_rope_pos_ids(q, k, _i32(0, 1), rotary_dim=8.0), (q, k),
                             TypeError, r"rotary_dim=8.0 must be an int or None"),
        "one_tuple_cache": (lambda c: append((c,)), (cache,), ValueError,
                            r"paged_kv_cache as a tuple must be \(k_cache, v_cache\); got 1 items"),
        "kv_layout_none": (lambda c: append(c, None), (cache,), ValueError, "kv_layout=None is not supported"),
    }
    function, args, error, match = calls[case]
    _raises_under_compile(function, *args, error=error, match=match)
    assert not cache.any()


def test_ops_that_launch_a_plan_or_copy_host_arrays_stay_outside_inductors_cuda_graphs() -> None:
    """Under mode="reduce-overhead" (transformers' generate compiles a static cache's forward so on a GPU) a replay of
    a graph holding a wrapper's launch would run the captured plan: Inductor partitions around such ops."""
    unsafe = torch._C.Tag.cudagraph_unsafe
    for name in ("wrapper_run", "wrapper_rope_first", "wrapper_kv_rows", "mla_run", "cascade_run", "batch_attention_run",
                 "rotate", "append_paged_kv_cache", "append_paged_mla_kv_cache"):
        assert unsafe in getattr(torch.ops.jitattn, name).default.tags, name
    for name in ("rms_norm", "act_and_mul", "merge_state"):  # device work only: captured with their neighbours
        assert unsafe not in getattr(torch.ops.jitattn, name).default.tags, name

"""The per-layer ops beside attention under torch.compile(fullgraph=True): RMSNorm, the gated activations, RoPE and
the paged cache writes are custom ops there (runtime/compiled_ops.py). A decoder layer calling them compiles as one
graph, writes what eager writes (bit for bit: the same kernels run), does not recompile when index values change,
and raises eager's errors when the graph runs."""

from __future__ import annotations

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


def test_bad_input_under_compile_raises_the_eager_error_when_the_graph_runs() -> None:
    x = torch.randn(3, HIDDEN)
    with pytest.raises(ValueError, match=r"weight has shape \(32,\); expected \(64,\)"):
        torch.compile(lambda x, w: jitattn.rmsnorm(x, w), fullgraph=True, backend="aot_eager")(x, torch.randn(32))
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="eps=-1.0 must be a finite number >= 0"):
        torch.compile(lambda x: jitattn.rmsnorm(x, torch.ones(HIDDEN), eps=-1.0), fullgraph=True,
                      backend="aot_eager")(x)
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

"""The serving engine on an H200 at Llama-3-8B shapes (random bf16 weights), and its CUDA-graph decode.

Run: ``python3 -m pytest -q -s tests/test_serving_engine_gpu.py`` (each test prints its errors and times).
"""

from __future__ import annotations

import time

import pytest
import torch

from jitattn import model_specs
from jitattn.serving import Engine, LlamaModel, preset, reference_generate
from jitattn.spec import Target

pytestmark = pytest.mark.gpu

BIG = preset("llama-3-8b-shapes")  # 32 layers
GPU_SPECS = model_specs(Target.CUDA, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                        kv_dtype=torch.bfloat16)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def test_llama_3_8b_shapes_64_requests_sharing_a_2k_prompt_match_the_reference_under_teacher_forcing(
        monkeypatch) -> None:
    from jitattn.serving import engine as engine_module

    # the cascade steps under test on every step (timing would first try flat steps, reading back a step late)
    monkeypatch.setattr(engine_module.DecodePathChooser, "choose", lambda self, bucket, estimate=None: "cascade")
    started = time.perf_counter()
    model = LlamaModel.random(BIG, seed=0, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, BIG.vocab_size, (2048,), generator=gen).tolist()
    prompts = [system + torch.randint(0, BIG.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 64, (64,), generator=gen)]
    new_tokens = 4
    forced = torch.randint(0, BIG.vocab_size, (64, new_tokens), generator=gen).tolist()
    engine = Engine(model, num_pages=64 * 10 + 200, page_size=16, max_batch_size=64, prefill_chunk_tokens=2048)
    requests = [engine.add_request(prompts[0], new_tokens, forced_tokens=forced[0], keep_logits=True)]
    while engine.waiting or engine.prefilling:
        engine.step()
    requests += [engine.add_request(p, new_tokens, forced_tokens=f, keep_logits=True)
                 for p, f in zip(prompts[1:], forced[1:])]
    engine.run()
    torch.cuda.synchronize()
    engine_s = time.perf_counter() - started
    assert engine.stats.cascade_steps > 0 and engine.stats.reused_prompt_tokens == 63 * 2048
    worst = 0.0
    for r, p, f in zip(requests, prompts, forced):
        _, expected = reference_generate(model, p, new_tokens, forced_tokens=f)
        worst = max(worst, _relative_error(torch.stack(r.logits), torch.stack(expected)))
    print(f"\n8B shapes, 64 x 2k shared: engine {engine_s:.1f} s (weights included), total "
          f"{time.perf_counter() - started:.1f} s; worst relative logits error {worst:.2e}; {engine.stats}")
    assert worst < 3e-2  # bf16 activations over 32 layers (both sides round every matmul to bf16)


@pytest.mark.parametrize("batch", [3, 8, 13])
def test_cuda_graph_decode_matches_eager_decode(batch: int) -> None:
    config = BIG.with_layers(2)
    model = LlamaModel.random(config, seed=1, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(5, 300, (batch,), generator=gen)]
    forced = torch.randint(0, config.vocab_size, (batch, 8), generator=gen).tolist()
    logits = {}
    for graphs in (False, True):
        engine = Engine(model, num_pages=400, page_size=16, max_batch_size=16, cascade=False, cuda_graphs=graphs,
                        max_seq_len=512)
        requests = [engine.add_request(p, 8, forced_tokens=f, keep_logits=True) for p, f in zip(prompts, forced)]
        engine.run()
        assert (engine.stats.graph_steps > 0) == graphs
        logits[graphs] = torch.stack([torch.stack(r.logits) for r in requests])
    worst = _relative_error(logits[True], logits[False])
    print(f"\ngraphs vs eager, batch {batch}: relative logits error {worst:.2e}")
    assert worst < 1e-2


@pytest.mark.parametrize("batch,tree", [(3, False), (8, False), (13, False), (13, True)],
                         ids=["b3", "b8", "b13", "b13-three-levels"])
def test_captured_cascade_decode_matches_eager_cascade_decode(batch: int, tree: bool, monkeypatch) -> None:
    """Requests over two shared system prompts (tree: the first also forks into two branches, a three-level
    prefix tree), cascade on: the captured cascade step (forced: the timed choice would pick either) gives the
    eager cascade step's logits."""
    from jitattn.serving import engine as engine_module

    config = BIG.with_layers(2)
    model = LlamaModel.random(config, seed=2, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(100 + batch)
    systems = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (300, 70)]
    branches = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (40, 75)] if tree else [[]]
    prompts = [systems[i % 2] + (branches[(i // 2) % len(branches)] if i % 2 == 0 else [])
               + torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for i, n in enumerate(torch.randint(1, 40, (batch,), generator=gen))]
    forced = torch.randint(0, config.vocab_size, (batch, 8), generator=gen).tolist()
    monkeypatch.setattr(engine_module.DecodePathChooser, "choose", lambda self, bucket, estimate=None: "cascade")
    logits = {}
    for graphs in (False, True):
        engine = Engine(model, num_pages=600, page_size=16, max_batch_size=16, cascade=True, cuda_graphs=graphs,
                        max_seq_len=512, cascade_depth=2 if tree else None)  # the whole tree, not its cheapest cut
        lead = 4 if tree else 2  # both system prompts (and, for the tree, both branches) cached first
        first = [engine.add_request(p, 8, forced_tokens=f, keep_logits=True) for p, f in zip(prompts[:lead], forced)]
        while engine.waiting or engine.prefilling:
            engine.step()  # the two system prompts are cached before the others arrive
        rest = [engine.add_request(p, 8, forced_tokens=f, keep_logits=True)
                for p, f in zip(prompts[lead:], forced[lead:])]
        engine.run()
        assert engine.stats.cascade_steps > 0 and (engine.stats.graph_steps > 0) == graphs
        assert engine.stats.max_cascade_levels == (3 if tree else 2)
        logits[graphs] = torch.stack([torch.stack(r.logits) for r in first + rest])
    worst = _relative_error(logits[True], logits[False])
    print(f"\ncaptured vs eager cascade, batch {batch}: relative logits error {worst:.2e}")
    assert worst < 1e-2


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_overlapped_steps_give_the_greedy_tokens_of_steps_read_back_one_by_one(graphs: bool, monkeypatch) -> None:
    """overlap (the cuda default): a decode step's tokens stay on the device for the next step and reach the host
    one step later; greedy tokens (fed from the device, not forced) equal those of steps read back one by one,
    with requests finishing at different steps and others still being prefilled."""
    from jitattn.serving import engine as engine_module

    config = BIG.with_layers(2)
    model = LlamaModel.random(config, seed=3, dtype=torch.bfloat16, device="cuda")
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, config.vocab_size, (200,), generator=gen).tolist()
    prompts = [system + torch.randint(0, config.vocab_size, (int(n),), generator=gen).tolist()
               for n in torch.randint(1, 60, (11,), generator=gen)]
    lengths = torch.randint(2, 12, (11,), generator=gen).tolist()
    monkeypatch.setattr(engine_module.DecodePathChooser, "choose", lambda self, bucket, estimate=None: "cascade")
    outputs = {}
    for overlap in (False, True):
        engine = Engine(model, num_pages=400, page_size=16, max_batch_size=16, cascade=True, cuda_graphs=graphs,
                        max_seq_len=512, prefill_chunk_tokens=64, overlap=overlap)
        requests = [engine.add_request(prompts[0], lengths[0])]
        while engine.waiting or engine.prefilling:
            engine.step()
        requests += [engine.add_request(p, n) for p, n in zip(prompts[1:], lengths[1:])]
        engine.run()
        assert engine.stats.cascade_steps > 0 and not engine.has_work
        outputs[overlap] = [r.output for r in requests]
        assert [len(o) for o in outputs[overlap]] == lengths
    assert outputs[True] == outputs[False]

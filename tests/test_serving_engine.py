"""The serving engine on the cpu target in float32: exact greedy tokens, prefix sharing, eviction, cascade."""

from __future__ import annotations

import collections
import dataclasses
import gc
import sys
import time

import pytest
import torch

import jitattn

from jitattn.serving import (
    Engine, KVPool, LlamaModel, RadixCache, preset, random_weights, reference_generate, save_checkpoint,
)
from jitattn.serving.attention import (
    SeqView, SharedNode, limit_levels, pages_saved, prefix_tree, tree_cascade_levels,
)

CONFIG = preset("tiny")
PAGE = 8
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(CONFIG, seed=0)


def _prompts(seed: int, system_len: int, suffix_lens: list[int]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, CONFIG.vocab_size, (system_len,), generator=gen).tolist()
    return [system + torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in suffix_lens]


@pytest.fixture(scope="module")
def shared_workload(model):
    """Prompts sharing a 37-token system prompt (4 whole pages of 8) and their reference tokens."""
    prompts = _prompts(1, 37, [3, 17, 1, 30, 9, 12])
    return prompts, [reference_generate(model, p, NEW_TOKENS)[0] for p in prompts]


def _serve(engine: Engine, prompts: list[list[int]], new_tokens: int = NEW_TOKENS, first_alone: bool = True):
    """The first request alone until its prompt is cached, then the rest at once; returns the requests."""
    requests = [engine.add_request(prompts[0], new_tokens)]
    if first_alone:
        while engine.prefilling or engine.waiting:
            engine.step()
    requests += [engine.add_request(p, new_tokens) for p in prompts[1:]]
    engine.run()
    return requests


OVERLAP = pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])


@OVERLAP
@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "flat"])
@pytest.mark.parametrize("chunk", [16, 512], ids=["chunked", "whole-prompt"])
def test_greedy_tokens_equal_the_per_request_reference(model, shared_workload, cascade, chunk, overlap) -> None:
    """overlap: each step's tokens stay on the device for the next step and reach the host one step later."""
    prompts, expected = shared_workload
    engine = Engine(model, num_pages=64, page_size=PAGE, prefill_chunk_tokens=chunk, cascade=cascade,
                    overlap=overlap)
    requests = _serve(engine, prompts)
    assert [r.output for r in requests] == expected
    assert engine.stats.decode_steps > 0
    # every decoded token against its whole context (the prompt and the tokens before it), whichever path
    decoded = [(len(p), len(r.output)) for p, r in zip(prompts, requests)]
    assert engine.stats.decode_tokens == sum(n - 1 for _, n in decoded)
    assert engine.stats.decode_pairs == sum(length + k for length, n in decoded for k in range(1, n))
    assert (engine.stats.cascade_steps > 0) == cascade
    if chunk == 16:
        assert engine.stats.prefill_steps > len(prompts)  # prompts really took several chunks


def test_prefix_pages_are_shared_not_copied(model, shared_workload) -> None:
    prompts, expected = shared_workload
    engine = Engine(model, num_pages=64, page_size=PAGE, prefill_chunk_tokens=64)
    first = engine.add_request(prompts[0], NEW_TOKENS)
    engine.step()
    others = [engine.add_request(p, NEW_TOKENS) for p in prompts[1:]]
    engine.step()  # admits the others: each finds the system prompt's 4 pages in the radix tree
    shared = first.pages[:4]
    for r in others:
        assert r.num_shared_pages == 4 and r.pages[:4] == shared
    # held by the first request, the tree and every other request
    assert all(engine.pool.refcount(p) == 2 + len(others) for p in shared)
    engine.run()
    assert [r.output for r in [first] + others] == expected
    assert engine.stats.reused_prompt_tokens == 4 * PAGE * len(others)
    assert engine.stats.peak_pages_saved >= 4 * len(others)
    assert engine.stats.peak_bytes_saved == engine.stats.peak_pages_saved * engine.pool.bytes_per_page > 0
    # finished requests let go; the tree alone still holds the cached prompt pages
    assert all(engine.pool.refcount(p) == 1 for p in shared)
    assert engine.pool.num_used == engine.radix.num_cached_pages


def test_requests_arriving_together_wait_for_the_shared_prefix(model, shared_workload) -> None:
    prompts, expected = shared_workload
    engine = Engine(model, num_pages=64, page_size=PAGE)
    requests = _serve(engine, prompts, first_alone=False)
    assert [r.output for r in requests] == expected
    assert [r.num_shared_pages for r in requests] == [0] + [4] * (len(prompts) - 1)


def test_a_request_waits_only_for_a_prefill_that_caches_its_next_page() -> None:
    from jitattn.serving.radix import caches_next_page

    base = list(range(100, 120))  # 5 pages of 4
    assert caches_next_page(base, base[:12] + [7], 2, 4)  # pages 0-2 agree: page 2 is the tree's next
    assert not caches_next_page(base, base[:8] + [7, 7, 7, 7], 2, 4)  # page 2 differs
    assert not caches_next_page(base, [7] + base[1:], 2, 4)  # an earlier page differs
    assert not caches_next_page(base[:11], base, 2, 4)  # the other prompt has no whole page 2


def test_cascade_and_flat_decode_give_the_same_tokens(model) -> None:
    # two prefix groups and a request sharing nothing (a cascade node without shared pages)
    prompts = _prompts(5, 50, [4, 9, 25, 2]) + _prompts(6, 20, [11, 3]) + _prompts(8, 0, [13])
    outputs = {}
    for cascade in (True, False):
        engine = Engine(model, num_pages=25, page_size=PAGE, cascade=cascade)
        requests = [engine.add_request(prompts[0], NEW_TOKENS), engine.add_request(prompts[4], NEW_TOKENS)]
        while engine.waiting or engine.prefilling:
            engine.step()
        requests += [engine.add_request(p, NEW_TOKENS) for p in prompts[1:4] + prompts[5:]]
        engine.run()
        outputs[cascade] = {r.rid: r.output for r in requests}
        assert sorted(r.num_shared_pages for r in requests) == [0, 0, 0, 2, 6, 6, 6]
        assert (engine.stats.cascade_steps > 0) == cascade
    assert outputs[True] == outputs[False]


def _calls_per_step(model, prompts: list[list[int]], cascade: bool) -> tuple[list, list]:
    """Each step's count of calls of every jitattn function (module.function), and the requests' tokens."""
    engine = Engine(model, num_pages=256, page_size=PAGE, prefill_chunk_tokens=64, cascade=cascade, overlap=False)
    requests = [engine.add_request(p, NEW_TOKENS) for p in prompts]
    steps = []

    def count(frame, event, arg) -> None:
        name = frame.f_globals.get("__name__", "")
        if event == "call" and name.startswith("jitattn"):
            calls[f"{name}.{frame.f_code.co_name}"] += 1
    outer = sys.getprofile()  # (a profiler running the tests gets its hook back)
    while engine.waiting or engine.prefilling or engine.running:
        calls = collections.Counter()
        sys.setprofile(count)
        try:
            engine.step()
        finally:
            sys.setprofile(outer)
        steps.append(calls)
    return steps, [r.output for r in requests]


def test_cascade_on_adds_no_host_work_to_a_batch_that_shares_nothing(model) -> None:
    """Requests sharing no prefix page (chunked prefill beside decode): with cascade on every step calls the same
    jitattn functions as many times as with it off, so a workload without sharing pays nothing for the option."""
    gen = torch.Generator().manual_seed(21)
    prompts = [torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()
               for n in torch.randint(20, 120, (12,), generator=gen).tolist()]
    for cascade in (True, False):  # the kernels loaded (their first calls differ) before the traced runs
        _calls_per_step(model, prompts, cascade)
    gc.collect()  # the engines no longer used are freed now, not by a collection inside a traced step (a freed
    gc.disable()  # wrapper's weakref callback is a jitattn call)
    try:
        on, off = _calls_per_step(model, prompts, True), _calls_per_step(model, prompts, False)
    finally:
        gc.enable()
    assert on[1] == off[1]
    assert len(on[0]) == len(off[0]) > 10
    for step, (a, b) in enumerate(zip(on[0], off[0])):
        assert a == b, f"step {step}: cascade on only {dict(a - b)}, off only {dict(b - a)}"


def test_eviction_frees_lru_prefixes_when_the_pool_is_full(model) -> None:
    # 9 usable pages; each request needs 3 (a 20-token prompt + 5 outputs) and leaves 2 cached
    prompts = _prompts(7, 0, [20] * 6)
    engine = Engine(model, num_pages=10, page_size=PAGE, max_batch_size=2)
    requests = [engine.add_request(p, 5) for p in prompts]
    engine.run()
    assert [r.output for r in requests] == [reference_generate(model, p, 5)[0] for p in prompts]
    assert engine.stats.evicted_pages > 0
    assert engine.radix.num_cached_pages <= engine.pool.num_pages - 1
    # the oldest prompts were evicted first, the newest is still cached
    assert engine.radix.match(prompts[0]) == []
    assert len(engine.radix.match(prompts[-1])) == 2


def test_a_request_larger_than_the_pool_is_refused_at_once_and_stalls_no_one(model) -> None:
    engine = Engine(model, num_pages=4, page_size=PAGE)
    before = engine.add_request(list(range(5)), 3)
    with pytest.raises(ValueError, match="needs 6 KV pages of 8 tokens .* the whole pool holds 3"):
        engine.add_request(list(range(40)), 4)
    after = engine.add_request(list(range(7, 12)), 3)
    engine.run()
    assert [r.output for r in (before, after)] == [reference_generate(model, list(range(5)), 3)[0],
                                                   reference_generate(model, list(range(7, 12)), 3)[0]]


def test_bad_engine_arguments_are_refused_clearly(model) -> None:
    """Flags are booleans (a string such as "no" is truthy, so it would turn the feature on); the model is one."""
    for name in ("cascade", "cuda_graphs", "overlap"):
        with pytest.raises(TypeError, match=f"{name}='no' must be True or False"):
            Engine(model, num_pages=8, page_size=PAGE, **{name: "no"})
    with pytest.raises(TypeError, match="model is NoneType; pass a jitattn.serving.LlamaModel"):
        Engine(None, num_pages=8)
    assert not Engine(model, num_pages=8, page_size=PAGE, overlap=0, cascade=False).overlap


def test_bad_requests_are_refused_clearly(model) -> None:
    engine = Engine(model, num_pages=8, page_size=PAGE, max_seq_len=64)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([CONFIG.vocab_size], 2)
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        engine.add_request([1] * 60, 5)
    later = engine.add_request([1, 2], 2, arrival=1.0)
    earlier = engine.add_request([1, 2], 2, arrival=0.5)  # added after, arrived before: queued ahead of it
    assert list(engine.waiting) == [earlier, later]
    with pytest.raises(ValueError, match=r"after the engine's clock\(\) .* not time.time\(\)"):
        engine.add_request([1, 2], 2, arrival=time.time())  # another time base: would wait for decades
    numpy = pytest.importorskip("numpy")
    assert engine.add_request(numpy.array([1, 2]), 2, 1.0, stop_token_ids=numpy.array([3])).prompt == [1, 2]
    for prompt, match in (([1.0, 2.0], r"prompt\[0\] = 1.0 is not a token id \(float\)"),
                          ([1, True], r"prompt\[1\] = True is not a token id"),
                          ([1, torch.tensor(2)], r"prompt\[1\] = tensor\(2\) is not a token id"),
                          (torch.tensor([1.0, 2.0]), "1-D with an integer dtype; got shape \\(2,\\) float32"),
                          (torch.ones(2, 2, dtype=torch.int64), "1-D with an integer dtype; got shape \\(2, 2\\)"),
                          ("hello", "list of token ids"), (7, "list of token ids")):
        with pytest.raises(TypeError, match=match):
            engine.add_request(prompt, 2, arrival=1.0)
    with pytest.raises(ValueError, match=r"max_new_tokens=2.5 must be an int >= 1"):
        engine.add_request([1, 2], 2.5, arrival=1.0)
    with pytest.raises(ValueError, match=r"forced_tokens\[0\] = -1: token -1 is outside"):
        engine.add_request([1, 2], 3, arrival=1.0, forced_tokens=[-1, 2])
    queued = len(engine.waiting)
    request = engine.add_request(torch.tensor([3, 4, 5]), 2, arrival=1.0)  # integer tensors and numpy-like ints
    assert request.prompt == [3, 4, 5] and len(engine.waiting) == queued + 1


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), "0", True])
def test_an_arrival_that_is_not_a_finite_number_is_refused_and_stalls_no_one(model, arrival) -> None:
    """A NaN arrival passes every order check and an infinite one is never due: either would keep run() from
    returning; a string would break every later step's comparisons."""
    engine = Engine(model, num_pages=8, page_size=PAGE)
    with pytest.raises(ValueError, match=f"arrival={arrival!r} must be a finite number"):
        engine.add_request([1, 2], 2, arrival=arrival)
    good = engine.add_request([3, 4], 2)
    engine.run()
    assert good.output == reference_generate(model, [3, 4], 2)[0] and not engine.waiting


def test_a_request_without_an_arrival_arrives_when_it_is_added(model) -> None:
    """The default arrival is the engine's clock at add_request (it was 0: the engine's start, so a request added
    later had its waiting time counted from startup), and such a request goes ahead of those queued for later."""
    now = [100.0]
    engine = Engine(model, num_pages=16, page_size=PAGE, clock=lambda: now[0])
    scheduled = engine.add_request([1, 2, 3], 2, arrival=now[0] + 5)
    request = engine.add_request([4, 5], 2)
    assert request.arrival == 100.0 and list(engine.waiting) == [request, scheduled]
    now[0] = 107.0
    engine.run()
    assert request.output == reference_generate(model, [4, 5], 2)[0] and request.first_token_time - request.arrival \
        == pytest.approx(7.0)


def test_a_clock_that_is_not_a_function_of_finite_seconds_is_refused(model) -> None:
    """A NaN clock made run() spin for good (no arrival is ever due, and no wait is ever positive)."""
    with pytest.raises(TypeError, match="clock=5 must be a function"):
        Engine(model, num_pages=8, page_size=PAGE, clock=5)
    for reading in (float("nan"), "now", None):
        engine = Engine(model, num_pages=8, page_size=PAGE, clock=lambda: reading)
        with pytest.raises(ValueError, match=f"clock\\(\\)={reading!r} must be a finite number"):
            engine.add_request([1, 2], 2)  # (its arrival is checked against the clock)


def test_a_clock_stepped_backwards_holds_up_no_request(model) -> None:
    """A caller's clock read back below an earlier reading (time.time under an NTP step) reads as that earlier time
    until it passes it again: a request that arrived at 100 was held while the clock read 50, and run() spun."""
    now = [100.0]
    engine = Engine(model, num_pages=16, page_size=PAGE, clock=lambda: now[0])
    request = engine.add_request([1, 2, 3], 3)
    now[0] = 50.0
    assert engine.clock() == 100.0
    engine.run()
    assert request.output == reference_generate(model, [1, 2, 3], 3)[0] and not engine.waiting
    now[0] = 120.0
    assert engine.clock() == 120.0


@pytest.mark.parametrize("name", ["num_pages", "page_size", "max_batch_size", "prefill_chunk_tokens", "max_seq_len"])
@pytest.mark.parametrize("bad", [8.0, 2.5, "8", 0, True])
def test_engine_sizes_must_be_positive_ints(model, name, bad) -> None:
    sizes = dict(num_pages=8, page_size=PAGE)
    with pytest.raises(ValueError, match=f"{name}={bad!r} must be an int >= 1"):
        Engine(model, **{**sizes, name: bad})


@OVERLAP
def test_teacher_forced_logits_match_the_reference(model, shared_workload, overlap) -> None:
    prompts, _ = shared_workload
    forced = [list(range(10, 10 + NEW_TOKENS))] * len(prompts)
    engine = Engine(model, num_pages=64, page_size=PAGE, prefill_chunk_tokens=24, overlap=overlap)
    requests = [engine.add_request(p, NEW_TOKENS, forced_tokens=f, keep_logits=True) for p, f in zip(prompts, forced)]
    engine.run()
    for r, p, f in zip(requests, prompts, forced):
        tokens, logits = reference_generate(model, p, NEW_TOKENS, forced_tokens=f)
        assert r.output == tokens
        torch.testing.assert_close(torch.stack(r.logits), torch.stack(logits), rtol=1e-4, atol=1e-4)



def test_reference_takes_and_checks_tokens_as_add_request_does(model) -> None:
    """reference_generate took ``max_new_tokens`` forced tokens where the engine takes ``max_new_tokens - 1`` (the
    last output is never fed: IndexError), and met an out-of-vocabulary or empty prompt with torch's IndexError."""
    prompt, forced = [5, 6, 7], [1, 2, 3]
    engine = Engine(model, num_pages=16, page_size=PAGE)
    request = engine.add_request(prompt, 4, forced_tokens=forced, keep_logits=True)
    engine.run()
    tokens, logits = reference_generate(model, prompt, 4, forced_tokens=forced)
    assert request.output == tokens and len(tokens) == 4
    torch.testing.assert_close(torch.stack(request.logits), torch.stack(logits), rtol=1e-4, atol=1e-4)
    vocab = model.config.vocab_size
    for args, kwargs, match in [(([vocab], 2), {}, rf"prompt\[0\] = {vocab}: token {vocab} is outside"),
                                (([], 2), {}, "a request needs a non-empty prompt"),
                                (([1, 2], 3), {"forced_tokens": [4]}, "forced_tokens needs max_new_tokens - 1 tokens"),
                                (([1, 2], 0), {}, "max_new_tokens=0 must be an int >= 1")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(*args, **kwargs)
        with pytest.raises(ValueError, match=match):
            reference_generate(model, *args, **kwargs)

def test_models_the_kernels_cannot_run_are_refused_when_built(tmp_path) -> None:
    """A config or model the attention kernels cannot run used to be taken, and its first request then stayed in
    prefilling for good, holding its pages; a bad checkpoint said which file."""
    from dataclasses import asdict

    from jitattn.serving.config import ModelConfig

    for field, bad, match in (("head_dim", 6, "head_dim=6 is not a head dim the attention kernels take"),
                              ("rope_theta", 0.0, "rope_theta=0.0 must be a finite number > 0"),
                              ("rms_norm_eps", float("nan"), "rms_norm_eps=nan must be a finite number >= 0")):
        with pytest.raises(ValueError, match=match):
            ModelConfig(**{**asdict(CONFIG), field: bad})
    weights = random_weights(CONFIG)
    with pytest.raises(TypeError, match="dtype=torch.float64 is not one the kernels take"):
        LlamaModel(CONFIG, weights, dtype=torch.float64)
    with pytest.raises(TypeError, match="dtype='bf16' is not one the kernels take; use .*torch.bfloat16"):
        LlamaModel.random(CONFIG, dtype="bf16")  # refused before the weights are drawn
    with pytest.raises(ValueError, match="device='gpu0' is not a device"):
        LlamaModel.random(CONFIG, device="gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="this machine has no CUDA device; use device='cpu'"):
            LlamaModel.random(CONFIG, device="cuda")
    with pytest.raises(ValueError, match="LlamaModel: 1 weights missing, e.g. model.norm.weight"):
        LlamaModel(CONFIG, {n: t for n, t in weights.items() if n != "model.norm.weight"})
    with pytest.raises(ValueError, match=r"model.norm.weight is of shape \(3,\); the config says"):
        LlamaModel(CONFIG, {**weights, "model.norm.weight": torch.ones(3)})
    with pytest.raises(TypeError, match="weights must be a dict"):
        save_checkpoint(CONFIG, None, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists(), "nothing half-written"
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LlamaModel.from_checkpoint(tmp_path / "bad")
    with pytest.raises(ValueError, match="unknown model"):
        preset(["tiny"])
    with pytest.raises(TypeError, match="config must be a ModelConfig"):
        random_weights({"hidden_size": 64})


def test_checkpoint_directory_round_trip(model, tmp_path) -> None:
    save_checkpoint(CONFIG, random_weights(CONFIG, seed=0), tmp_path)  # the fixture model's weights
    loaded = LlamaModel.from_checkpoint(tmp_path)
    prompt = _prompts(9, 0, [13])[0]
    assert reference_generate(loaded, prompt, 4)[0] == reference_generate(model, prompt, 4)[0]


def test_graph_bucket_step_gives_the_eager_step_logits(model, monkeypatch) -> None:
    """The CUDA-graph decode step's data flow on the cpu target: fixed buffers planned by a
    ``use_cuda_graph=True`` wrapper, rows padded to the bucket with the scratch page. Capture is
    replaced by a stand-in whose replay re-runs the recorded forward (no CUDA here)."""
    import contextlib

    from jitattn.serving.graphs import DecodeGraph

    class ReplayByRerun:
        owner: DecodeGraph

        def replay(self) -> None:
            self.owner.logits.copy_(self.owner._forward())

    monkeypatch.setattr(torch.cuda, "CUDAGraph", ReplayByRerun)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    engine = Engine(model, num_pages=64, page_size=PAGE, cascade=False)
    for prompt in _prompts(11, 0, [5, 17, 30]):
        engine.add_request(prompt, 8)
    while engine.waiting or engine.prefilling:
        engine.step()
    graph = DecodeGraph(model, engine.pool, engine.planner.workspace, 4, 8)
    ReplayByRerun.owner = graph
    for batch in (engine.running, engine.running[:2]):  # 1 and 2 padded rows, one captured bucket
        seqs = [SeqView(tuple(r.pages[: -(-len(r.fed_tokens) // PAGE)]), len(r.fed_tokens), 1) for r in batch]
        ids = torch.tensor([r.fed_tokens[-1] for r in batch])
        expected, _, _ = engine._decode_logits(seqs, ids)
        # Not bit-exact: the model's CPU GEMMs see 4 padded rows here and 3 or 2 in the eager step, and the BLAS
        # picks its blocking by shape (last-bit differences on some CPUs). A wrong page or padding row would be
        # off by O(1), far beyond this tolerance.
        torch.testing.assert_close(graph.run(seqs, ids), expected, rtol=1e-4, atol=1e-5)


def _fake_graphs(monkeypatch) -> None:
    """CUDA-graph capture replaced by a stand-in whose replay re-runs the recorded forward (no CUDA here)."""
    import contextlib

    from jitattn.serving.graphs import CascadeGraph, DecodeGraph

    captured: list = []  # the graph objects, in the order they capture

    def recording(cls):
        real_run = cls.run

        def run(self, *args, **kwargs):
            captured.append(self)
            return real_run(self, *args, **kwargs)
        return run

    class ReplayByRerun:
        def __init__(self) -> None:
            self.owner = captured[-1]

        def replay(self) -> None:
            self.owner.logits.copy_(self.owner._forward())

    for cls in (DecodeGraph, CascadeGraph):
        monkeypatch.setattr(cls, "run", recording(cls))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", ReplayByRerun)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())


@pytest.mark.parametrize("graph_ms,cascade_ms", [(20.0, 35.0), (40.0, 5.0)], ids=["graph-faster", "cascade-faster"])
def test_with_graphs_shared_prefix_steps_take_the_faster_path(model, shared_workload, monkeypatch, graph_ms,
                                                              cascade_ms) -> None:
    """cascade=True with CUDA graphs: each step of requests sharing prefix pages takes the path measured
    faster (here the step times are faked), and the greedy tokens are the reference's either way."""
    prompts, expected = shared_workload
    _fake_graphs(monkeypatch)
    monkeypatch.setattr(jitattn.ops.cascade, "num_workers", lambda device: 64)  # the captured shared level is chunked
    engine = Engine(model, num_pages=64, page_size=PAGE, cascade=True)
    engine.cuda_graphs = True  # on the cpu target, with capture faked above
    record, taken = engine.decode_paths.record, []
    monkeypatch.setattr(engine.decode_paths, "record", lambda bucket, path, seconds: taken.append(path) or record(
        bucket, path, (graph_ms if path == "flat" else cascade_ms) / 1e3))
    requests = _serve(engine, prompts, new_tokens=16)
    assert [r.output[:NEW_TOKENS] for r in requests] == expected
    assert engine.graphs.flat and engine.graphs.cascade, "both paths are captured and replayed"
    faster = "flat" if graph_ms < cascade_ms else "cascade"
    assert taken[4:] and all(path == faster for path in taken[4:]), ("after two timed steps of each (the first "
                                                                     "of each is the warm-up), the faster path", taken)


@pytest.mark.parametrize("flat_ms,cascade_ms", [(20.0, 35.0), (40.0, 5.0)], ids=["flat-faster", "cascade-faster"])
def test_without_graphs_shared_prefix_steps_take_the_faster_path(model, shared_workload, monkeypatch, flat_ms,
                                                                 cascade_ms) -> None:
    """cascade=True without CUDA graphs: the eager steps are timed too, so a batch whose shared prefix is too
    short to pay for cascade's extra launches decodes flat (cascade on never loses to cascade off); the
    greedy tokens are the reference's either way."""
    prompts, expected = shared_workload
    engine = Engine(model, num_pages=64, page_size=PAGE, cascade=True)
    record, taken = engine.decode_paths.record, []
    monkeypatch.setattr(engine.decode_paths, "record", lambda bucket, path, seconds: taken.append(path) or record(
        bucket, path, (flat_ms if path == "flat" else cascade_ms) / 1e3))
    requests = _serve(engine, prompts, new_tokens=16)
    assert [r.output[:NEW_TOKENS] for r in requests] == expected
    faster = "flat" if flat_ms < cascade_ms else "cascade"
    assert taken[4:] and all(path == faster for path in taken[4:]), ("after two timed steps of each (the first "
                                                                     "of each is the warm-up), the faster path", taken)
    assert engine.stats.cascade_steps >= 2 and not engine.graphs.flat, "cascade steps were measured, nothing captured"


def test_under_tensor_parallelism_every_rank_takes_rank_0s_path(model, shared_workload, monkeypatch) -> None:
    """The path is rank 0's (broadcast): here a fake group always answers "cascade" although this rank's own
    timings favour the captured graph, and the steps follow the broadcast."""
    prompts, expected = shared_workload
    _fake_graphs(monkeypatch)
    engine = Engine(model, num_pages=64, page_size=PAGE, cascade=True)
    engine.cuda_graphs = True
    record = engine.decode_paths.record
    monkeypatch.setattr(engine.decode_paths, "record", lambda bucket, path, seconds: record(
        bucket, path, (0.001 if path == "flat" else 1.0)))
    broadcasts = []
    monkeypatch.setattr(engine.group, "broadcast",  # admissions pass through; a path choice is rank 0's "cascade"
                        lambda obj: (broadcasts.append(obj) or "cascade") if obj in ("flat", "cascade") else obj)
    requests = _serve(engine, prompts, new_tokens=8)
    assert [r.output[:NEW_TOKENS] for r in requests] == expected
    assert broadcasts and engine.stats.cascade_steps == len(broadcasts), "every step with a choice took cascade"


def test_a_step_whose_bytes_say_cascade_does_under_half_the_work_takes_it_unmeasured() -> None:
    from jitattn.serving.decode_path import BYTES_PER_SHARED_FLOP, DecodePathChooser, cascade_estimate

    chooser = DecodePathChooser()
    assert chooser.choose(8, estimate=2.5) == "cascade"  # nothing measured, nothing explored
    assert chooser.choose(8, estimate=1.5) == "flat"  # below trust: measured as before, flat first
    chooser.record(8, "cascade", 1.0)
    assert chooser.averages(8) == {}  # a cascade step's first record is its warm-up
    # 128 requests over a 16k prefix at Llama-3-8B shapes: weights 16 GB, flat KV 275 GB, cascade KV 2 GB, shared
    # FLOPs 1.1e12
    assert cascade_estimate(16e9 + 275e9, 16e9 + 2e9, 1.1e12) > 10
    assert cascade_estimate(10.0, 10.0, 0.0) == 1.0
    assert cascade_estimate(10.0, 5.0, 5.0 / BYTES_PER_SHARED_FLOP) == 1.0  # the FLOPs count as bytes
    with pytest.raises(ValueError, match="trust"):
        DecodePathChooser(trust=1.0)


def test_a_step_whose_bytes_say_cascade_saves_a_tenth_or_less_takes_flat_unmeasured() -> None:
    from jitattn.serving.decode_path import DecodePathChooser, flat_reread_fraction

    chooser = DecodePathChooser()
    for _ in range(40):  # never explores cascade: no measurement could pay for the cascade step's launches
        assert chooser.choose(8, estimate=1.05) == "flat"
        chooser.record(8, "flat", 1.0)
    assert set(chooser.averages(8)) == {"flat"}
    assert chooser.choose(8, estimate=1.5) == "cascade"  # between the two: the unmeasured path is tried
    with pytest.raises(ValueError, match="flat_below"):
        DecodePathChooser(flat_below=2.0)
    # L2 keeps a layer's shared pages between its requests' reads when they fit (each re-read at L2_REREAD_COST of a
    # DRAM byte); of a larger set the part that does not fit is read again from DRAM; no L2 modelled: all DRAM
    from jitattn.serving.decode_path import L2_REREAD_COST

    mib = 2.0**20
    assert flat_reread_fraction(8 * mib, 30 * mib) == L2_REREAD_COST  # 64 requests over a 2k prefix: 8 MiB a layer
    assert flat_reread_fraction(64 * mib, 32 * mib) == pytest.approx(0.5 + 0.5 * L2_REREAD_COST)  # a 16k prefix
    assert flat_reread_fraction(64 * mib, 0) == 1.0


def test_the_engine_estimate_counts_the_flat_steps_rereads_that_l2_serves() -> None:
    """Llama-3-8B shapes on an H200 (60 MiB L2, half of it keeping shared pages): 64 requests over a 2k prefix
    (8 MiB per layer) give an estimate the chooser takes as flat, over a 4k prefix one it measures, over a 16k
    prefix (64 MiB per layer, past the L2) one it takes as cascade; without the L2 every one would be cascade."""
    from jitattn.serving.decode_path import DecodePathChooser

    engine = Engine(LlamaModel.random(preset("tiny"), seed=0, dtype=torch.float32, device="cpu"), num_pages=8,
                    page_size=16, max_batch_size=64, cascade=True)
    # Llama-3-8B's terms: weight bytes, KV bytes per token (32 layers x 8 heads x 128 x K and V x 2 bytes),
    # attention FLOPs per (query, key) pair (4 x 32 heads x 128 x 32 layers), layers, L2 bytes for shared pages
    llama = dataclasses.replace(engine.costs, weight_bytes=16.06e9, kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
                                flops_per_pair=4 * 32 * 128 * 32, layers=32, l2_bytes=30 * 2.0**20)
    chooser, paths = DecodePathChooser(), {}
    for prefix in (2048, 4096, 16384):
        pages = prefix // 16
        seqs = [SeqView(tuple(range(pages)) + (pages + i, pages + 64 + i), prefix + 20, 1) for i in range(64)]
        tree = [[SharedNode(0, 64, 0, pages)]]
        estimate = llama.cascade_estimate(seqs, tree, sum(s.kv_len for s in seqs))
        paths[prefix] = "measured" if chooser.flat_below < estimate < chooser.trust else chooser.choose(64, estimate)
        no_l2 = dataclasses.replace(llama, l2_bytes=0)
        assert no_l2.cascade_estimate(seqs, tree, sum(s.kv_len for s in seqs)) > estimate  # every re-read in DRAM
    assert paths == {2048: "flat", 4096: "measured", 16384: "cascade"}


def test_cheapest_depth_keeps_the_tree_only_where_its_rereads_outlast_the_shared_levels_flops() -> None:
    """Llama-3-8B shapes (4 KiB of K and V per token and layer, 16 KiFLOP per query-token pair), 30 MiB of L2 for
    shared pages: 128 requests under 4 branches of 2k, 32 each, make the shared levels compute-bound whether the
    root is 8k or 32k (past L2): the two-level cascade's root re-reads hide under its FLOPs, and a third level only
    adds its cost (as measured: 113.1 against 100.5 us at 8k on the H200, 204.3 against 198.9 at 32k on the H100).
    Under 32 branches of 4
    requests the re-reads outlast the FLOPs and the tree keeps its levels; without the FLOPs (0) the re-reads alone
    decide, and both roots keep the tree."""
    from jitattn.serving.decode_path import LEVEL_SECONDS, SHARED_FLOPS_PER_SECOND, cheapest_depth

    token, l2, pair = 4096, 30 * 2.0**20, 4 * 32 * 128

    def depth(root: int, branches: int, compute: bool = True) -> int:
        cuts = [branches * (root + 2048), root + branches * 2048]
        seconds = 128 * (root + 2048) * pair / SHARED_FLOPS_PER_SECOND if compute else 0.0
        return cheapest_depth(cuts, cuts[1], token, l2, LEVEL_SECONDS, seconds)

    assert [depth(8192, 4), depth(32768, 4), depth(32768, 32)] == [1, 1, 2]
    assert [depth(8192, 4, compute=False), depth(32768, 4, compute=False)] == [2, 2]
    # no level cost and no L2: the whole tree (each page once); a tie takes the fewer levels
    assert cheapest_depth([40960, 20000, 16384], 16384, token, 0, 0.0) == 3
    assert cheapest_depth([16384, 16384], 16384, token, l2, LEVEL_SECONDS) == 1


def test_a_cuda_engine_keeps_a_tree_level_only_where_its_rereads_outlast_the_flops() -> None:
    """The engine's cut of a three-level tree (a root over 128 requests, branches, own pages) with Llama-3-8B's
    terms and the cuda level cost: agent-fork's 4 branches of 32 take two levels under an 8k and a 32k root
    (compute-bound shared levels), 32 branches of 4 keep the tree under a 32k root; ``cascade_depth`` is a cap the
    cut never exceeds, and on the cpu (no level cost) the tree stays whole."""
    from jitattn.serving.decode_path import LEVEL_SECONDS

    def tree_of(root_pages: int, branches: int) -> list:
        seqs = []
        for i in range(128):
            branch = root_pages + 1000 * (i // (128 // branches))
            own = root_pages + 50000 + 10 * i
            pages = tuple(range(root_pages)) + tuple(range(branch, branch + 128)) + tuple(range(own, own + 5))
            seqs.append(SeqView(pages, len(pages) * 16 - 3, 1))
        tree = prefix_tree(seqs)
        assert [len(level) for level in tree] == [1, branches]
        return tree

    model = LlamaModel.random(preset("tiny"), seed=0, dtype=torch.float32, device="cpu")
    shapes = ((512, 4), (2048, 4), (2048, 32))
    for depth, expected in ((None, [1, 1, 2]), (1, [1, 1, 1])):
        engine = Engine(model, num_pages=8, page_size=16, max_batch_size=128, cascade=True, cascade_depth=depth)
        assert engine.costs.depth(tree_of(512, 4), 128) == (2 if depth is None else 1)  # cpu: no level cost
        cuda = dataclasses.replace(engine.costs, weight_bytes=16.06e9, kv_bytes_per_token=32 * 8 * 128 * 2 * 2,
                                   flops_per_pair=4 * 32 * 128 * 32, layers=32, l2_bytes=30 * 2.0**20,
                                   level_seconds=LEVEL_SECONDS)
        assert [cuda.depth(tree_of(root, branches), 128) for root, branches in shapes] == expected


def test_decode_path_chooser_measures_each_path_then_keeps_the_faster() -> None:
    from jitattn.serving.decode_path import DecodePathChooser

    chooser = DecodePathChooser(warmup=1, smoothing=0.5, explore_every=4)
    taken = []
    times = {"flat": 0.020, "cascade": 0.010}
    for _ in range(12):
        path = chooser.choose(64)
        taken.append(path)
        chooser.record(64, path, times[path])
    assert taken[:4] == ["flat", "flat", "cascade", "cascade"], "a warm-up and a timed step of each"
    assert chooser.averages(64) == pytest.approx({"flat": 0.020, "cascade": 0.010})
    assert taken[4:] == ["cascade", "cascade", "cascade", "flat"] * 2, "the slower path once every 4 steps"
    # a bucket not measured yet follows the nearest measured one (its own averages stay apart), and every
    # explore_every steps runs the other path until it has measured both itself
    assert chooser.choose(8) == "cascade" and chooser.averages(8) == {}
    follower = DecodePathChooser(warmup=1, smoothing=0.5, explore_every=4)
    for path, seconds in (("flat", 0.02), ("flat", 0.02), ("cascade", 0.01), ("cascade", 0.01)):
        follower.record(8, path, seconds)
    bucket_times = {"flat": 0.010, "cascade": 0.020}  # in bucket 128 the other way round
    followed = []
    for _ in range(12):
        followed.append(follower.choose(128))
        follower.record(128, followed[-1], bucket_times[followed[-1]])
    assert followed[:8] == ["cascade"] * 3 + ["flat"] + ["cascade"] * 3 + ["flat"], followed
    assert set(follower.averages(128)) == {"flat", "cascade"} and followed[8:11] == ["flat"] * 3  # its own choice
    assert DecodePathChooser().choose(8) == "flat", "the first bucket measured tries flat first"
    times["cascade"] = 0.050  # the shared prefix's advantage is gone: the averages follow
    for _ in range(6):
        path = chooser.choose(64)
        chooser.record(64, path, times[path])
    assert chooser.choose(64) == "flat"
    slow = DecodePathChooser(warmup=0, smoothing=0.5, explore_every=4)
    for path, seconds in (("flat", 0.020), ("cascade", 0.010), ("cascade", 2.0)):  # a step that waited long
        slow.record(64, path, seconds)
    assert slow.averages(64)["cascade"] == pytest.approx(0.02), "an outlier counts 3x the average at most"
    with pytest.raises(ValueError, match="path"):
        chooser.record(64, "graph", 0.1)
    with pytest.raises(ValueError, match="smoothing"):
        DecodePathChooser(smoothing=0.0)


def test_cascade_graph_step_gives_the_eager_cascade_logits(model, monkeypatch) -> None:
    """The captured cascade step's data flow on the cpu target: the prefix tree's levels padded to the graph's
    node counts, rows padded to the bucket with the scratch page, the cascade wrapper planned into fixed buffers.
    Capture is replaced by a stand-in whose replay re-runs the recorded forward (no CUDA here)."""
    import contextlib

    from jitattn.serving.graphs import CascadeGraph, padded_cascade_levels

    class ReplayByRerun:
        owner: CascadeGraph

        def replay(self) -> None:
            self.owner.logits.copy_(self.owner._forward())

    monkeypatch.setattr(torch.cuda, "CUDAGraph", ReplayByRerun)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(jitattn.ops.cascade, "num_workers", lambda device: 64)  # the shared levels are chunked
    engine = Engine(model, num_pages=96, page_size=PAGE, cascade=True)
    system = _prompts(12, 24, [0])[0]
    fork = system + _prompts(14, 16, [0])[0]
    prompts = [fork + p for p in _prompts(15, 0, [5, 17])] + [system + p for p in _prompts(16, 0, [30])] + _prompts(
        13, 16, [2, 9])  # a two-level tree (system, fork) and a second system prompt
    engine.add_request(prompts[0], 8)
    engine.add_request(prompts[3], 8)
    while engine.waiting or engine.prefilling:
        engine.step()
    for p in prompts[1:3] + prompts[4:]:
        engine.add_request(p, 8)
    while engine.waiting or engine.prefilling:
        engine.step()
    batch = sorted(engine.running, key=lambda r: tuple(r.pages))
    graph = None
    for rows in (batch, batch[:3]):  # 3 and 5 padded rows of one bucket: two levels, then one
        seqs = [SeqView(tuple(r.pages[: -(-len(r.fed_tokens) // PAGE)]), len(r.fed_tokens), 1) for r in rows]
        ids = torch.tensor([r.fed_tokens[-1] for r in rows])
        tree = engine.planner.cascade_tree(seqs)
        assert tree is not None
        levels, capacities = padded_cascade_levels(seqs, tree, 8, PAGE)
        assert capacities == (8,) * len(tree) and [t.numel() for t in levels[0]] == [9] * len(tree) + [9]
        expected, _, _ = engine._decode_logits(seqs, ids)  # appends this step's k/v; the graph's appends rewrite them
        graph = CascadeGraph(model, engine.pool, engine.planner.workspace, 8, 16, capacities)
        ReplayByRerun.owner = graph
        torch.testing.assert_close(graph.run(seqs, ids, levels), expected, rtol=1e-4, atol=1e-4)
    assert len(prefix_tree([SeqView(tuple(r.pages[:-1]) + (r.pages[-1],), 30, 1) for r in batch])) == 2
    with pytest.raises(ValueError, match="captured for"):  # levels padded for a larger bucket's node counts
        graph.run(seqs, ids, padded_cascade_levels(seqs, tree, 32, PAGE)[0])


def test_node_capacity_bounds_any_level_of_the_bucket() -> None:
    from jitattn.serving.graphs import node_capacity

    assert [node_capacity(n, 64) for n in (1, 8, 9, 17, 33, 64)] == [8, 8, 16, 32, 64, 64]
    assert node_capacity(3, 4) == 4 and node_capacity(2, 2) == 2


def test_with_graphs_a_deep_tree_replays_captured_cascade_steps(model, monkeypatch) -> None:
    """Graphs on, cascade always chosen: a three-level tree's steps replay captured cascade graphs (none runs
    eagerly), keyed by bucket and node counts, and the greedy tokens are the reference's."""
    _fake_graphs(monkeypatch)
    gen = torch.Generator().manual_seed(22)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()

    system, shots, fork = tokens(40), tokens(21), tokens(11)
    prompts = [system + shots + fork + tokens(n) for n in (5, 3, 9)] + [system + shots + tokens(6), system + tokens(12)]
    expected = [reference_generate(model, p, 6)[0] for p in prompts]
    engine = Engine(model, num_pages=64, page_size=PAGE, cascade=True, overlap=True)  # as on cuda
    engine.cuda_graphs = True
    monkeypatch.setattr(engine.decode_paths, "choose", lambda bucket, estimate=None: "cascade")
    requests = _serve(engine, prompts, 6)
    assert [r.output for r in requests] == expected
    assert engine.stats.max_cascade_levels == 4 and engine.stats.cascade_steps > 0
    assert engine.stats.graph_steps == engine.stats.decode_steps, "every decode step replayed a graph"
    assert any(len(capacities) == 3 for _, capacities in engine.graphs.cascade)


def test_graphs_captured_at_startup_serve_a_tree_without_capturing_again(model, monkeypatch) -> None:
    """capture_graphs(): every bucket's flat graph and its cascade graphs of one and two shared levels, before any
    request; a workload of a two-level tree then replays them (no capture while serving), tokens exact."""
    _fake_graphs(monkeypatch)
    gen = torch.Generator().manual_seed(23)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()

    system, branch = tokens(40), tokens(21)
    prompts = [system + branch + tokens(n) for n in (5, 3, 9)] + [system + tokens(n) for n in (6, 12)]
    expected = [reference_generate(model, p, 6)[0] for p in prompts]
    engine = Engine(model, num_pages=64, page_size=PAGE, max_batch_size=8, cascade=True, overlap=True)
    engine.cuda_graphs = True
    monkeypatch.setattr(engine.decode_paths, "choose", lambda bucket, estimate=None: "cascade")
    assert engine.capture_graphs() == 3 * len(engine.graphs.buckets)  # buckets 1, 2, 4, 8
    assert engine.clock() < 0.5, "the clock starts when startup capture ends"
    assert sorted(engine.graphs.cascade) == sorted((b, (min(8, b),) * d) for b in (1, 2, 4, 8) for d in (1, 2))
    graphs = (dict(engine.graphs.flat), dict(engine.graphs.cascade))
    requests = _serve(engine, prompts, 6)
    assert [r.output for r in requests] == expected
    assert engine.stats.max_cascade_levels == 3 and engine.stats.graph_steps == engine.stats.decode_steps
    assert (engine.graphs.flat, engine.graphs.cascade) == graphs, "no graph captured while serving"
    with pytest.raises(RuntimeError, match="before any request"):
        engine.add_request(prompts[0], 2)
        engine.capture_graphs()


def test_pool_refcounts_and_double_release() -> None:
    pool = KVPool(1, 5, 4, 1, 8, torch.float32, "cpu")
    pages = pool.alloc(3)
    assert KVPool.SCRATCH_PAGE not in pages and pool.num_free == 1
    assert pool.alloc(2) is None and pool.num_free == 1  # nothing taken on failure
    pool.incref(pages[:1])
    assert pool.decref(pages) == 2 and pool.decref(pages[:1]) == 1
    with pytest.raises(RuntimeError, match="already free"):
        pool.decref(pages[:1])


def test_pool_refuses_pages_it_does_not_hand_out_and_changes_nothing() -> None:
    """A negative id indexed from the end (decref([-1]) freed the last page and put -1 on the free list); a call
    with one bad page among good ones changed the good ones' counts before it raised."""
    pool = KVPool(1, 6, 2, 1, 8, torch.float32, "cpu")
    held = pool.alloc(2)
    for call, error, match in ((lambda: pool.decref([-1]), ValueError, "page -1 is not one this pool hands out"),
                               (lambda: pool.decref([99]), ValueError, "page 99 is not one"),
                               (lambda: pool.incref([0]), ValueError, "page 0 is the scratch page"),
                               (lambda: pool.incref([held[0], 5]), RuntimeError, "page 5 is free"),
                               (lambda: pool.decref([held[0], held[0]]), RuntimeError, "listed 2 times"),
                               (lambda: pool.decref([1.5]), TypeError, "must be an int"),
                               (lambda: pool.alloc(-2), ValueError, "alloc\\(-2\\)"),
                               (lambda: pool.alloc(1.5), ValueError, "must be an int >= 0")):
        with pytest.raises(error, match=match):
            call()
    assert [pool.refcount(p) for p in held] == [1, 1] and pool.num_free == 3


def test_radix_insert_of_a_free_page_leaves_the_tree_as_it_was() -> None:
    pool = KVPool(1, 6, 2, 1, 8, torch.float32, "cpu")
    tree = RadixCache(pool)
    page = pool.alloc(1)[0]
    with pytest.raises(RuntimeError, match="page 4 is free"):
        tree.insert([1, 2, 3, 4], [page, 4])
    assert tree.match([1, 2, 3, 4]) == [] and pool.refcount(page) == 1 and tree.num_cached_pages == 0



def test_radix_tree_keys_tensor_tokens_by_their_values() -> None:
    """A 1-D integer tensor of tokens was keyed by its elements' identities: a second insert of the same tokens
    added a branch (and page references) nothing could reach, and match never hit."""
    pool = KVPool(1, 6, 2, 1, 8, torch.float32, "cpu")
    tree = RadixCache(pool)
    pages = pool.alloc(2)
    assert tree.insert([1, 2, 3, 4], pages) == 2
    assert tree.insert(torch.tensor([1, 2, 3, 4]), pages) == 0 and [pool.refcount(p) for p in pages] == [2, 2]
    assert tree.match(torch.tensor([1, 2, 3, 4, 5], dtype=torch.int32)) == pages
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor([[1, 2]])):
        with pytest.raises(TypeError, match="tokens as a tensor or array must be 1-D with an integer dtype"):
            tree.match(bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn], ids=["f32", "e4m3"])  # e4m3: no isfinite
def test_a_model_whose_weights_hold_nan_is_refused(dtype) -> None:
    """It served every request garbage (argmax of NaN logits: token 0) without an error."""
    weights = {name: w.to(dtype) for name, w in random_weights(CONFIG).items()}
    LlamaModel(CONFIG, weights)  # finite: taken
    weights["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")
    with pytest.raises(ValueError, match="weight model.layers.0.mlp.down_proj.weight holds NaN or inf"):
        LlamaModel(CONFIG, weights)


@pytest.mark.parametrize("prompt, match", [(bytearray(b"ab"), "got bytearray"), (memoryview(b"ab"), "got memoryview"),
                                           (torch.tensor([1, 2], device="meta"), "meta tensor")])
def test_prompts_of_bytes_or_without_data_are_refused(model, prompt, match) -> None:
    with pytest.raises(TypeError, match=match):
        Engine(model, num_pages=8, page_size=PAGE).add_request(prompt, 2)


def test_radix_tree_splits_shares_and_evicts_lru() -> None:
    pool = KVPool(1, 16, 2, 1, 8, torch.float32, "cpu")
    tree = RadixCache(pool)
    a = pool.alloc(3)
    assert tree.insert([1, 2, 3, 4, 5, 6], a) == 3
    assert tree.match([1, 2, 3, 4, 9, 9, 9]) == a[:2]  # splits the node after 2 pages
    b = pool.alloc(2)
    assert tree.insert([1, 2, 3, 4, 7, 8, 9, 9], a[:2] + b) == 2  # shares the first two pages
    assert tree.match([1, 2, 3, 4, 7, 8, 9, 9, 0]) == a[:2] + b
    assert tree.match([1, 2, 3, 4, 5, 6], max_pages=1) == a[:1]
    pool.decref(a + b)  # the inserting requests let go: only the tree holds them
    tree.match([1, 2, 3, 4, 7, 8])  # the b branch is now the more recent one
    assert tree.evict(1) == 1 and tree.match([1, 2, 3, 4, 5, 6]) == a[:2]  # the LRU leaf (a[2]) went first
    held = tree.match([1, 2, 3, 4, 7, 8, 9, 9])
    pool.incref(held)  # a request holds the b branch: it cannot be evicted
    assert tree.evict(10) == 0
    pool.decref(held)
    assert tree.evict(10) == 4 and tree.num_cached_pages == 0 and pool.num_free == 15


# -- N-level cascade along the prefix tree -----------------------------------------------------------------

def _tree_seqs() -> list[SeqView]:
    # pages (page 8); each seq's last page is its own: A, B under [3, 4]; C, D under [5, 6]; E under [5]
    return [SeqView((1, 2, 3, 4, 10, 11), 44, 1), SeqView((1, 2, 3, 4, 12), 33, 1), SeqView((1, 2, 5, 6, 13), 40, 1),
            SeqView((1, 2, 5, 6, 14, 15), 48, 1), SeqView((1, 2, 5, 7), 30, 1), SeqView((20, 21), 9, 1)]


def test_prefix_tree_has_a_level_per_fork() -> None:
    tree = prefix_tree(_tree_seqs())
    assert tree == [[SharedNode(0, 5, 0, 2)], [SharedNode(0, 2, 2, 4), SharedNode(2, 5, 2, 3)],
                    [SharedNode(2, 4, 3, 4)]]
    assert prefix_tree([SeqView((1, 2), 9, 1), SeqView((3, 2), 9, 1)]) == []  # nothing shared
    assert prefix_tree([SeqView((1, 2), 9, 1), SeqView((1, 3), 9, 1)]) == [[SharedNode(0, 2, 0, 1)]]
    # the shortest agreement of any member bounds the node; a member's last page is never shared
    assert prefix_tree([SeqView((1, 2, 3), 20, 1), SeqView((1, 2), 9, 1), SeqView((1, 2, 4), 19, 1)]) == [
        [SharedNode(0, 3, 0, 1)]]


def test_limit_levels_folds_the_deeper_levels_into_the_last_kept_one() -> None:
    tree = prefix_tree(_tree_seqs())
    # two-level cascade: each seq's deepest node, its pages from the root's first
    assert limit_levels(tree, 5, 1) == [[SharedNode(0, 2, 0, 4), SharedNode(2, 4, 0, 4), SharedNode(4, 5, 0, 3)]]
    assert limit_levels(tree, 5, 2) == [tree[0], [SharedNode(0, 2, 2, 4), SharedNode(2, 4, 2, 4),
                                                  SharedNode(4, 5, 2, 3)]]
    assert limit_levels(tree, 5, 3) == tree and limit_levels([], 5, 1) == []
    with pytest.raises(ValueError, match="at least 1"):
        limit_levels(tree, 5, 0)


def test_engine_refuses_a_cascade_depth_below_one(model) -> None:
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="cascade_depth"):
            Engine(model, num_pages=8, page_size=PAGE, cascade_depth=bad)
    numpy = pytest.importorskip("numpy")
    Engine(model, num_pages=8, page_size=PAGE, cascade_depth=numpy.int64(2))  # as num_pages takes one


def test_pages_saved_counts_every_repeated_page_reference() -> None:
    seqs = _tree_seqs()
    by_set = sum(len(s.pages) for s in seqs) - len({p for s in seqs for p in s.pages})
    assert pages_saved(prefix_tree(seqs)) == by_set == 4 * 2 + 1 * 2 + 2 * 1 + 1 * 1  # the four nodes


def test_tree_cascade_levels_cover_every_seq_once_per_level() -> None:
    seqs = _tree_seqs()
    qo, kv_indptr, kv_indices, last = tree_cascade_levels(seqs, prefix_tree(seqs), PAGE)
    assert [t.tolist() for t in qo] == [[0, 5, 6], [0, 2, 5, 6], [0, 2, 4, 6], [0, 1, 2, 3, 4, 5, 6]]
    assert [t.tolist() for t in kv_indptr] == [[0, 2, 2], [0, 2, 3, 3], [0, 0, 1, 1], [0, 2, 3, 4, 6, 7, 9]]
    assert [t.tolist() for t in kv_indices] == [[1, 2], [3, 4, 5], [6], [10, 11, 12, 13, 14, 15, 7, 20, 21]]
    assert [t.tolist() for t in last] == [[8, 8], [8, 8, 8], [8, 8, 8], [4, 1, 8, 8, 6, 1]]
    # every seq reads each of its pages exactly once across the levels
    for r, seq in enumerate(seqs):
        read = []
        for q, ip, ix in zip(qo, kv_indptr, kv_indices):
            node = int(torch.searchsorted(q, torch.tensor(r), right=True)) - 1
            read += ix[int(ip[node]):int(ip[node + 1])].tolist()
        assert read == list(seq.pages), r


@OVERLAP
@pytest.mark.parametrize("depth", [None, 1], ids=["tree-depth", "two-level"])
def test_n_level_cascade_greedy_tokens_equal_the_reference(model, overlap, depth) -> None:
    """A prefix tree three levels deep (a system prompt, a few-shot block, a fork; forks at a page boundary
    and mid-page), requests finishing at different steps, a pool small enough that cached prefixes are
    evicted while the shared nodes are in use: exact greedy tokens, and steps of four levels."""
    gen = torch.Generator().manual_seed(21)

    def tokens(n: int) -> list[int]:
        return torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist()

    system, shots, fork = tokens(40), tokens(21), tokens(11)  # 40: a page boundary; 61 and 72 mid-page
    first = system + shots + fork + tokens(5)
    rest = [system + shots + fork + tokens(3), system + shots + fork + tokens(9), system + shots + tokens(6),
            system + tokens(12), tokens(7)]
    lengths = [6, 3, 8, 5, 7, 4]
    prompts = [first] + rest
    expected = [reference_generate(model, p, n)[0] for p, n in zip(prompts, lengths)]
    stale = [tokens(17) for _ in range(3)]  # cached, finished prefixes the pool must evict later
    outputs = {}
    for cascade in (True, False):
        engine = Engine(model, num_pages=25, page_size=PAGE, cascade=cascade, overlap=overlap, cascade_depth=depth)
        engine.decode_paths.choose = lambda bucket, estimate=None: "cascade"  # every step of shared pages: the levels under test
        for p in stale:
            engine.add_request(p, 1)
        engine.run()
        requests = [engine.add_request(first, lengths[0])]
        while engine.prefilling or engine.waiting:
            engine.step()
        requests += [engine.add_request(p, n) for p, n in zip(rest, lengths[1:])]
        engine.run()
        outputs[cascade] = [r.output for r in requests]
        assert engine.stats.evicted_pages > 0
        assert engine.stats.max_cascade_levels == ((4 if depth is None else depth + 1) if cascade else 0)
    assert outputs[True] == expected
    assert outputs[False] == expected


def test_pages_in_budget_counts_every_layers_k_and_v() -> None:
    from jitattn.serving import pages_in_budget

    # 32 layers x K,V x 16 tokens x 8 heads x 128 dims x 2 bytes = 2 MiB a page
    assert pages_in_budget(10 << 20, 32, 16, 8, 128, torch.bfloat16) == 5
    assert pages_in_budget((10 << 20) - 1, 32, 16, 8, 128, torch.bfloat16) == 4
    assert pages_in_budget(0, 32, 16, 8, 128, torch.float32) == 0
    pool = KVPool(2, 3, 4, 2, 8, torch.float32, "cpu")
    assert pages_in_budget(3 * pool.bytes_per_page, 2, 4, 2, 8, torch.float32) == 3


def test_pool_and_group_shapes_are_checked_where_they_are_made() -> None:
    from jitattn.serving.kv_pool import KVPool, pages_in_budget
    from jitattn.serving.parallel import TPGroup

    for args, error, match in [((0, "2"), TypeError, "size='2' must be an int"),
                               ((0, 0), ValueError, r"rank must be in \[0, size\)"),
                               ((3, 1), ValueError, r"rank must be in \[0, size\)")]:
        with pytest.raises(error, match=match):
            TPGroup(*args)
    with pytest.raises(TypeError, match="num_pages=4.5 must be an int"):
        KVPool(1, 4.5, 4, 1, 8, torch.float32, "cpu")
    with pytest.raises(ValueError, match="page_size=0, .* holds nothing"):
        pages_in_budget(10**9, 1, 0, 1, 8, torch.float32)


def test_a_pool_larger_than_memory_says_how_large_and_what_to_lower(monkeypatch) -> None:
    """The allocator's own error ("[enforce fail at alloc_cpu.cpp] ... can't allocate", or CUDA's out of memory) is
    replaced by the pool's size and the fix, as the exception serving code catches for it."""
    from jitattn.serving import kv_pool

    def refuse(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(kv_pool.torch, "zeros", refuse)
    with pytest.raises(torch.OutOfMemoryError, match=r"num_pages=1000000 x page_size=16 tokens over 2 layers "
                                                     r"needs 122\.1 GiB on cpu, .*give fewer num_pages") as info:
        kv_pool.KVPool(2, 10**6, 16, 8, 128, torch.bfloat16, "cpu")
    assert "can't allocate" in str(info.value.__cause__)

"""How requests end: at a stop token or after ``max_new_tokens``; given up by ``Engine.abort`` in every state or
because their prefill raised (the others' tokens stay the reference's); a decode step that raises is retried by the
next ``step()``."""

from __future__ import annotations

import logging

import pytest
import torch

from jitattn.serving import Engine, LlamaModel, preset, reference_generate

CONFIG = preset("tiny")
PAGE = 8


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return LlamaModel.random(CONFIG, seed=0)


def _prompts(seed: int, lens: list[int], system_len: int = 19) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, CONFIG.vocab_size, (system_len,), generator=gen).tolist()
    return [system + torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in lens]


def _pages_back(engine: Engine) -> None:
    """Every page a request held is free again: those in use are the radix tree's cached prompt pages."""
    assert not engine.has_work
    assert engine.pool.num_used == engine.radix.num_cached_pages


def _stopped_reference(reference: list[int], stop: set[int]) -> list[int]:
    """The greedy tokens up to and including the first stop token."""
    for i, token in enumerate(reference):
        if token in stop:
            return reference[: i + 1]
    return reference


@pytest.mark.parametrize("cascade", [True, False], ids=["cascade", "flat"])
@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_a_request_ends_at_its_first_stop_token(model, overlap, cascade) -> None:
    """Stop tokens at the first output (the prefill's), mid-way, at the last output, never met, and a set of two;
    each request's output is the reference's up to its first stop token (kept), the others run their length, and
    a stopped request's pages go back to the pool at once (with overlap, after the step launched before its stop
    token was read back)."""
    prompts = _prompts(11, [5, 12, 3, 20, 8, 1])
    references = [reference_generate(model, p, 7)[0] for p in prompts]
    stops = [{references[0][0]}, {references[1][3]}, {references[2][6]}, None, {references[4][2], references[4][4]},
             set()]
    engine = Engine(model, num_pages=64, page_size=PAGE, max_batch_size=8, cascade=cascade, overlap=overlap)
    requests = [engine.add_request(p, 7, stop_token_ids=stop) for p, stop in zip(prompts, stops)]
    engine.run()
    expected = [_stopped_reference(ref, stop or set()) for ref, stop in zip(references, stops)]
    assert [r.output for r in requests] == expected
    assert [r.finish_reason for r in requests] == ["stop" if len(e) < 7 or e[-1] in (s or ()) else "length"
                                                   for e, s in zip(expected, stops)]
    assert len(requests[0].output) == 1 and requests[3].finish_reason == "length"
    _pages_back(engine)


def test_stop_token_ids_are_checked_at_add_request(model) -> None:
    engine = Engine(model, num_pages=16, page_size=PAGE)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 2], 3, stop_token_ids=[CONFIG.vocab_size])
    with pytest.raises(TypeError, match="stop_token_ids\\[0\\] = 2.5 is not a token id"):
        engine.add_request([1, 2], 3, stop_token_ids=[2.5])
    with pytest.raises(TypeError, match="stop_token_ids must be a list of token ids"):
        engine.add_request([1, 2], 3, stop_token_ids=7)
    with pytest.raises(ValueError, match="teacher forcing"):
        engine.add_request([1, 2], 3, forced_tokens=[4, 5], stop_token_ids=[9])
    with pytest.raises(TypeError, match="keep_logits='no' must be True or False"):
        engine.add_request([1, 2], 3, keep_logits="no")
    request = engine.add_request([1, 2], 3, stop_token_ids=torch.tensor([9, 4]))
    assert request.stop_token_ids == {4, 9} and not engine.failed


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
@pytest.mark.parametrize("state", ["waiting", "prefilling", "running"])
def test_an_aborted_request_frees_its_pages_and_the_others_finish_exactly(model, state, overlap) -> None:
    prompts = _prompts(3, [5, 21, 9, 14])
    expected = [reference_generate(model, p, 5)[0] for p in prompts]
    engine = Engine(model, num_pages=64, page_size=PAGE, max_batch_size=8, prefill_chunk_tokens=16,
                    cascade=True, overlap=overlap)
    requests = [engine.add_request(p, 5) for p in prompts]
    victim = requests[1]
    for _ in range(40):
        queue = {"waiting": engine.waiting, "prefilling": engine.prefilling, "running": engine.running}[state]
        if victim in queue and (state != "running" or victim.output):
            break
        engine.step()
    else:
        pytest.fail(f"request 1 never reached {state}")
    assert engine.abort(victim, "client went away")
    assert victim.error == "client went away" and victim.finish_reason == "abort"
    assert victim in engine.failed and not victim.pages
    assert not engine.abort(victim), "a request ends once"
    engine.run()
    assert victim not in engine.finished
    outputs = [r.output for r in requests]
    assert outputs[:1] + outputs[2:] == expected[:1] + expected[2:]
    assert expected[1][: len(victim.output)] == victim.output, "what it produced before the abort is exact"
    assert not engine.abort(requests[0]), "a finished request cannot be aborted"
    _pages_back(engine)


def test_abort_refuses_what_is_not_a_request(model) -> None:
    engine = Engine(model, num_pages=16, page_size=PAGE)
    request = engine.add_request([1, 2, 3], 2)
    with pytest.raises(TypeError, match="abort\\(\\) takes a Request"):
        engine.abort(request.rid)
    other = Engine(model, num_pages=16, page_size=PAGE).add_request([1, 2, 3], 2)
    assert not engine.abort(other), "another engine's request is not this engine's to end"
    assert engine.waiting[0] is request


def _failing_prefill(monkeypatch, model: LlamaModel, poison: list[int]) -> list[int]:
    """model.forward raises on a chunk whose token ids hold ``poison`` (consecutively); returns a list that counts
    the calls it failed."""
    real, failures = model.forward, []

    def forward(ids, positions, attention):
        flat = ids.tolist()
        if any(flat[i: i + len(poison)] == poison for i in range(len(flat) - len(poison) + 1)):
            failures.append(1)
            raise RuntimeError("CUDA out of memory (simulated)")
        return real(ids, positions, attention)
    monkeypatch.setattr(model, "forward", forward)
    return failures


@pytest.mark.parametrize("bad_first", [False, True], ids=["bad-second", "bad-first"])
@pytest.mark.parametrize("chunk", [8, 512], ids=["chunked", "whole-prompt"])
def test_a_prefill_that_raises_gives_up_its_chunks_requests_and_the_rest_go_on(model, monkeypatch, caplog, chunk,
                                                                                bad_first) -> None:
    """The bad request ends with the error (returned by that step, listed in ``failed``, logged), its pages back in
    the pool; requests that shared its chunk (each run again alone) or came after it are served exactly. With chunks
    of 8 tokens the bad request fails in a chunk of its own when it comes first, else beside the first request's
    last tokens."""
    prompts = _prompts(5, [6, 11, 3])
    expected = [reference_generate(model, p, 4)[0] for p in prompts]
    bad = prompts[0][:19] + [7, 7, 7, 7, 7, 7, 7, 7, 7, 7]  # the shared system prompt, then the poison
    engine = Engine(model, num_pages=64, page_size=PAGE, max_batch_size=8, prefill_chunk_tokens=chunk,
                    cascade=True, overlap=True)
    failures = _failing_prefill(monkeypatch, model, [7, 7, 7, 7])
    if bad_first:
        bad_request = engine.add_request(bad, 4)
    first = engine.add_request(prompts[0], 4)
    if not bad_first:
        bad_request = engine.add_request(bad, 4)
    rest = [engine.add_request(p, 4) for p in prompts[1:]]
    ended = []
    with caplog.at_level(logging.WARNING, logger="jitattn"):
        while engine.has_work:
            ended += engine.step()
    assert failures, "the poisoned chunk ran"
    assert bad_request.error.startswith("prefill failed: RuntimeError: CUDA out of memory")
    assert bad_request.finish_reason == "error" and first.finish_reason == "length"
    assert bad_request in ended and engine.failed == [bad_request] and bad_request not in engine.finished
    assert any(f"prefill of request {bad_request.rid} raised" in r.getMessage() and r.exc_info
               for r in caplog.records)
    assert [first.output] + [r.output for r in rest] == expected
    alone = any("running each alone" in r.getMessage() for r in caplog.records)
    # first, the bad request runs alone (the others wait for the system prompt pages it will cache)
    assert alone == (not bad_first), "a chunk of several requests runs each alone"
    _pages_back(engine)


def test_a_decode_step_that_raises_is_retried_by_the_next_step(model, monkeypatch) -> None:
    """Nothing a failed decode step touched is kept: the next ``step()`` runs it again and every token is exact."""
    prompts = _prompts(7, [4, 9, 13])
    expected = [reference_generate(model, p, 6)[0] for p in prompts]
    engine = Engine(model, num_pages=64, page_size=PAGE, max_batch_size=8, cascade=True, overlap=True)
    requests = [engine.add_request(p, 6) for p in prompts]
    real, failed, ran = engine.planner.decode_step, set(), {"flat": 0, "cascade": 0}

    def decode_step(seqs, tree=None):
        kind = "cascade" if tree else "flat"
        if kind not in failed:  # the first step of each kind raises once
            failed.add(kind)
            raise RuntimeError(f"a launch failed (simulated, {kind})")
        ran[kind] += 1
        return real(seqs, tree)
    monkeypatch.setattr(engine.planner, "decode_step", decode_step)
    raised = 0
    while engine.has_work:
        try:
            engine.step()
        except RuntimeError as error:
            assert "simulated" in str(error)
            raised += 1
    assert raised == 2 and failed == {"flat", "cascade"} and not engine.failed
    assert [r.output for r in requests] == expected
    _pages_back(engine)
    # a step that raised is counted when it runs again, once
    assert (engine.stats.decode_steps, engine.stats.cascade_steps) == (ran["flat"] + ran["cascade"], ran["cascade"])


@pytest.mark.parametrize("overlap", [False, True], ids=["read-each-step", "overlap"])
def test_on_finish_sees_every_request_end_aborted_ones_included(model, overlap) -> None:
    """run(on_finish) reports each request once as it ends: finished, aborted from inside a callback, or aborted
    while waiting; with stop tokens and kept logits under overlap, each output has its logits."""
    prompts = _prompts(13, [4, 9, 6, 11])
    engine = Engine(model, num_pages=64, page_size=PAGE, max_batch_size=2, overlap=overlap)
    first_tokens = reference_generate(model, prompts[0], 6)[0]
    requests = [engine.add_request(p, 6, keep_logits=True, stop_token_ids=[first_tokens[3]] if i == 0 else None)
                for i, p in enumerate(prompts)]
    seen = []

    def on_finish(request) -> None:
        seen.append(request.rid)
        if request is requests[0]:
            assert engine.abort(requests[3], "not needed any more")  # still waiting (two at a time)

    engine.run(on_finish)
    assert sorted(seen) == [0, 1, 2, 3] and len(set(seen)) == 4
    assert requests[0].output == first_tokens[:4] and requests[0].finish_reason == "stop"
    assert requests[3].finish_reason == "abort" and not requests[3].output
    assert all(len(r.logits) == len(r.output) for r in requests)
    assert not engine.has_work
    _pages_back(engine)



def test_on_finish_that_is_not_a_function_is_refused_before_any_step(model) -> None:
    """run(on_finish="x") ran the whole batch, then failed on the first call with Python's "'str' object is not
    callable"."""
    engine = Engine(model, num_pages=32, page_size=PAGE)
    request = engine.add_request(_prompts(3, [5])[0], 3)
    with pytest.raises(TypeError, match="on_finish='x' must be a function"):
        engine.run(on_finish="x")
    assert engine.stats.steps == 0 and engine.has_work
    assert engine.run() == [request] and len(request.output) == 3

@pytest.mark.parametrize("failing_call", range(2, 16))
def test_a_clock_that_fails_once_loses_no_request_and_no_page(model, failing_call) -> None:
    """The caller's clock raising at any one of its reads (admission, a prefill's first token, the end of requests,
    an abort) raises that step; the next steps finish every request exactly, ended once, all pages back."""
    calls, armed = 0, False

    def clock() -> float:
        nonlocal calls
        calls += armed
        if calls == failing_call:
            raise OSError("the clock's source went away")
        return calls * 1e-3

    prompts = _prompts(41, [10, 11, 12, 13, 14])
    engine = Engine(model, num_pages=40, page_size=4, max_batch_size=8, clock=clock)
    requests = [engine.add_request(p, 4) for p in prompts]
    armed, raised = True, 0
    while engine.has_work:
        try:
            engine.step()
        except OSError:
            raised += 1
    assert raised == (failing_call <= calls)
    assert [r.output for r in requests] == [reference_generate(model, p, 4)[0] for p in prompts]
    assert [r.finish_reason for r in requests] == ["length"] * 5 and engine.finished == requests
    _pages_back(engine)


def test_on_finish_raising_still_reports_the_steps_other_requests(model) -> None:
    engine = Engine(model, num_pages=40, page_size=4)
    requests = [engine.add_request(p, 3) for p in _prompts(42, [3, 4, 5])]
    seen = []

    def on_finish(request) -> None:
        seen.append(request.rid)
        if request is requests[0]:
            raise RuntimeError("a bug in the caller's callback")

    with pytest.raises(RuntimeError, match="callback"):
        engine.run(on_finish=on_finish)
    engine.run(on_finish=on_finish)
    assert sorted(seen) == sorted(r.rid for r in requests)


def test_step_returns_every_request_that_ended_when_the_caller_clears_finished(model) -> None:
    """A long-running server bounds its memory by clearing ``finished`` after reading each step's results."""
    engine = Engine(model, num_pages=64, page_size=4, max_batch_size=3)
    requests = [engine.add_request(p, 2 + i % 3) for i, p in enumerate(_prompts(43, [3, 5, 4, 6, 2, 7, 3, 4]))]
    delivered = []
    while engine.has_work:
        delivered += engine.step()
        engine.finished.clear()
    assert sorted(r.rid for r in delivered) == [r.rid for r in requests]

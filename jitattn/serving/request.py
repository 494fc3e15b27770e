"""A generation request and its progress, the engine's counters, and the checks a request's tokens pass."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch


@dataclass(eq=False)
class Request:
    """One generation request and its progress (times in seconds of the engine's clock). The fields up to
    ``stop_token_ids`` are the request as added: the engine reserved its pages and schedules by them, so changing
    one afterwards is not supported (abort the request and add a new one)."""

    rid: int
    prompt: list[int]
    max_new_tokens: int
    arrival: float = 0.0
    forced_tokens: list[int] | None = None  # teacher forcing: fed instead of the greedy tokens
    keep_logits: bool = False
    stop_token_ids: frozenset[int] = frozenset()  # a greedy token among these ends the request (it is kept)
    output: list[int] = field(default_factory=list)  # greedy tokens
    logits: list[torch.Tensor] = field(default_factory=list)  # float32 on the host, when keep_logits
    pages: list[int] = field(default_factory=list)
    page_tuple: tuple[int, ...] = ()  # ``pages`` as a tuple, made once (every step slices it for its SeqView)
    num_shared_pages: int = 0  # leading pages found in the radix tree at admission
    num_computed: int = 0  # prompt tokens whose KV is in the pool
    unread: int = 0  # 1 while this request's greedy token of a decode step in flight is not on the host yet
    first_token_time: float | None = None
    finish_time: float | None = None  # when it finished or was given up
    error: str | None = None  # why the engine gave it up (``Engine.abort``, a failed prefill); None: it ran or runs
    finish_reason: str | None = None  # "stop", "length"; "abort" or "error" when given up; None while it runs

    @property
    def fed_tokens(self) -> list[int]:
        """Prompt plus the tokens fed back so far (the greedy ones, or the forced ones)."""
        fed = self.output if self.forced_tokens is None else self.forced_tokens[: len(self.output)]
        return self.prompt + fed

    @property
    def num_fed(self) -> int:
        """Tokens in the KV after the next decode step: the prompt and every output, the one still on the device
        (``unread``) included; ``len(fed_tokens)`` when none is, without building the list."""
        return len(self.prompt) + len(self.output) + self.unread

    @property
    def last_fed_token(self) -> int | None:
        """The token the next decode step feeds, when the host has it: ``fed_tokens[-1]`` without building the
        list (a 16k-token prompt: 128 such copies cost ~20 ms a step); None while it is the unread greedy token
        of a step still in flight (the next step takes it from the device)."""
        produced = len(self.output) + self.unread
        if produced == 0:
            return self.prompt[-1]
        if self.forced_tokens is not None:
            return self.forced_tokens[produced - 1]
        return None if self.unread else self.output[-1]

    @property
    def stopped(self) -> bool:
        """Its last greedy token on the host is a stop token."""
        return bool(self.output) and self.output[-1] in self.stop_token_ids

    @property
    def exhausted(self) -> bool:
        """No further decode step: done, or every output produced with the unread one (which may yet be a stop
        token: a step launched before it was read back is then dropped for this request)."""
        return self.stopped or len(self.output) + self.unread >= self.max_new_tokens

    @property
    def done(self) -> bool:
        return self.stopped or len(self.output) >= self.max_new_tokens


@dataclass
class EngineStats:
    steps: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    cascade_steps: int = 0
    graph_steps: int = 0
    prefill_tokens: int = 0  # prompt tokens computed
    reused_prompt_tokens: int = 0  # prompt tokens found in the radix tree (not computed)
    generated_tokens: int = 0
    evicted_pages: int = 0
    max_cascade_levels: int = 0  # levels of the deepest cascade decode step (prefix-tree levels + the own pages)
    decode_seconds: float = 0.0  # wall time of the decode steps (each ends with its tokens on the host)
    decode_tokens: int = 0  # tokens the decode steps produced (the sum of their batch sizes)
    decode_kv_tokens: int = 0  # KV tokens the decode steps' attention read (per layer): a cascade reads a
    #                            shared node's once, a flat step every request's whole history
    decode_pairs: int = 0  # (query, key) pairs the decode steps' attention computed: each token's whole context
    peak_pages_saved: int = 0  # max over decode steps of (pages the batch references - distinct pages)
    peak_bytes_saved: int = 0

    def count_decode_step(self, kv_tokens: int, batch: int, pairs: int) -> None:
        """One more decode step of ``batch`` tokens that read ``kv_tokens`` KV tokens a layer over ``pairs``
        (query, key) pairs."""
        self.decode_steps += 1
        self.decode_kv_tokens += kv_tokens
        self.decode_tokens += batch
        self.decode_pairs += pairs


def listed_tokens(name: str, tokens):
    """``tokens`` given as a 1-D integer tensor or numpy array (as tokenizers return them) as a list of ints (whose
    elements hash by value, as a tensor's do not); anything else as it is."""
    if type(tokens).__name__ == "ndarray" and hasattr(tokens, "__array__"):
        if tokens.dtype.kind not in "iub":  # (torch's own error for object or string arrays names neither)
            raise TypeError(f"{name} as a tensor or array must be 1-D with an integer dtype; got shape "
                            f"{tuple(tokens.shape)} {tokens.dtype}")
        tokens = torch.as_tensor(tokens)
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
            raise TypeError(f"{name} as a tensor or array must be 1-D with an integer dtype; got shape "
                            f"{tuple(tokens.shape)} {str(tokens.dtype).removeprefix('torch.')}")
        if tokens.is_meta:
            raise TypeError(f"{name} is a meta tensor (no data); pass a tensor on the cpu or a GPU")
        return tokens.tolist()
    return tokens


def token_ids(name: str, tokens, vocab_size: int) -> list[int]:
    """``tokens`` (a sequence of ints, or a 1-D integer tensor or numpy array, as tokenizers return them) as a list
    of ints in ``[0, vocab_size)``."""
    tokens = listed_tokens(name, tokens)
    if isinstance(tokens, (str, bytes, bytearray, memoryview)) or not isinstance(tokens, Sequence):
        raise TypeError(f"{name} must be a list of token ids (ints); got {type(tokens).__name__}")
    ids = []
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, numbers.Integral):
            raise TypeError(f"{name}[{i}] = {token!r} is not a token id ({type(token).__name__}); pass ints")
        if not 0 <= token < vocab_size:
            raise ValueError(f"{name}[{i}] = {int(token)}: token {int(token)} is outside the vocabulary "
                             f"[0, {vocab_size})")
        ids.append(int(token))
    return ids


def request_tokens(prompt, max_new_tokens, forced_tokens, stop_token_ids, vocab_size: int,
                   max_seq_len: int) -> tuple[list[int], int, list[int] | None, frozenset[int]]:
    """A new request's ``prompt``, ``max_new_tokens``, ``forced_tokens`` (None or every fed output's token) and
    ``stop_token_ids`` (:func:`stop_tokens`), checked against the vocabulary and ``max_seq_len``."""
    prompt = token_ids("prompt", prompt, vocab_size)
    max_new_tokens = positive_int("max_new_tokens", max_new_tokens)
    if not prompt:
        raise ValueError("a request needs a non-empty prompt")
    if len(prompt) + max_new_tokens > max_seq_len:
        raise ValueError(f"prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) exceeds "
                         f"max_seq_len={max_seq_len}")
    if forced_tokens is not None:
        forced_tokens = token_ids("forced_tokens", forced_tokens, vocab_size)
        if len(forced_tokens) < max_new_tokens - 1:
            raise ValueError("forced_tokens needs max_new_tokens - 1 tokens (the last output is never fed)")
    return prompt, max_new_tokens, forced_tokens, stop_tokens(stop_token_ids, vocab_size, forced_tokens is not None)


def stop_tokens(stop_token_ids, vocab_size: int, forced: bool) -> frozenset[int]:
    """``stop_token_ids`` (None, or token ids: a sequence or a 1-D integer tensor) as a frozenset; refused beside
    teacher forcing (``forced``), which feeds every forced token whatever the greedy ones are."""
    if stop_token_ids is None:
        return frozenset()
    if isinstance(stop_token_ids, (set, frozenset)):
        stop_token_ids = list(stop_token_ids)
    ids = frozenset(token_ids("stop_token_ids", stop_token_ids, vocab_size))
    if ids and forced:
        raise ValueError("stop_token_ids with forced_tokens: teacher forcing feeds every forced token, so nothing "
                         "stops it; pass one or the other")
    return ids


def positive_int(name: str, value) -> int:
    """``value`` as an int >= 1 (a bool, a float or a string is refused)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}={value!r} must be an int >= 1")
    return int(value)


def callback(name: str, value):
    """``value`` (a function, or None: nothing to call) as a function; anything else is refused up front, not when
    the first call comes."""
    if value is None:
        return lambda *args: None
    if not callable(value):
        raise TypeError(f"{name}={value!r} must be a function (or None)")
    return value


def arrival_time(arrival, name: str = "arrival") -> float:
    """``arrival`` (seconds on the engine's clock, or the clock's own reading) as a finite float: None, a string,
    NaN or an infinity is refused (a NaN passes every order check and an infinite one is never due: either would
    stall the queue)."""
    if isinstance(arrival, bool) or not isinstance(arrival, numbers.Real) or not math.isfinite(arrival):
        raise ValueError(f"{name}={arrival!r} must be a finite number of seconds on the engine's clock")
    return float(arrival)


class NonDecreasingClock:
    """The caller's clock, checked (``arrival_time``) and never read back below its latest reading: a clock stepped
    backwards (``time.time`` under an NTP correction) would hold every queued request until it caught up again."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock, self._latest = clock, -math.inf

    def __call__(self) -> float:
        self._latest = max(arrival_time(self._clock(), "clock()"), self._latest)
        return self._latest


def clock_or_error(clock: Callable[[], float]) -> tuple[float, Exception | None]:
    """(``clock()``, None), or (NaN, what it raised): requests that ended are ended either way, the caller raises."""
    try:
        return clock(), None
    except Exception as exc:  # noqa: BLE001 - the caller's clock; re-raised by the caller
        return math.nan, exc


MAX_ARRIVAL_AHEAD = 86400.0  # seconds: an arrival further ahead of the engine's clock is on another time base


def on_engine_clock(arrival: float, now: float) -> float:
    """``arrival``, refused when it is more than a day after the engine's clock reads ``now`` (``time.time()`` passed
    for an engine counting from its startup: the request would wait for decades and hold up those behind it)."""
    if arrival - now > MAX_ARRIVAL_AHEAD:
        raise ValueError(f"arrival={arrival} is {arrival - now:.3g} s after the engine's clock() (now {now:.3g}): "
                         "arrivals count on that clock (seconds since startup, or your clock=), not time.time(); "
                         "pass engine.clock() + a delay, or None for now")
    return arrival

"""The scheduler: admit arriving requests, prefill them in chunks, decode the running batch.

Each :meth:`Engine.step` does, in order:

1. **admit** requests that have arrived (rank 0 decides under tensor parallelism, so every rank
   admits the same ones): match the prompt in the radix tree (shared pages, referenced not
   copied; a request waits while one being prefilled will cache more of its prefix) and take
   the request's own pages for its whole life up front, evicting LRU cached prefixes when the
   pool is full, so a running request never runs out of pages;
2. **prefill** up to ``prefill_chunk_tokens`` prompt tokens over the admitted requests, oldest
   first (a long prompt takes several steps), then cache the prompt's completed pages in the
   radix tree; a request whose prompt is done gets its first token (greedy);
3. **decode** one token for every running request, ordered by pages so that the requests under each
   node of the batch's prefix tree sit together (a cascade step has a level per tree level:
   ``attention.prefix_tree``; on cuda the tree may be cut to fewer levels where re-reading a node for each of
   its children costs less than a level, its FLOPs counted too: ``decode_path.cheapest_depth``), with one plan
   for every layer; on cuda a flat step may replay a
   captured CUDA graph of its batch-size bucket, and so may a cascade step of any number of prefix
   groups and levels (``graphs.CascadeGraph``, one graph per bucket and level shape). A step whose
   requests share prefix pages takes the faster of the flat step and the cascade step, as timed per
   bucket (``decode_path.DecodePathChooser``), with graphs on or off.

With ``overlap`` (the default on cuda) a decode step's greedy tokens stay on the device: the next step
takes them from there, and they reach the host after that next step is launched. The host's share of a
step (ordering, prefix tree, plan, page tables) then runs while the GPU runs the step before it, and a
request's token appears in its ``output`` one step later. Every copy to the device goes through page-locked
memory on the stream, so nothing in a step waits for the GPU until the read-back. A step that prefills
reads the step in flight back first, and its decode starts on an idle GPU.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from collections import deque
from typing import Callable

import torch

from ..jit import compile_count
from ..log import get_logger
from ..runtime.options import resolve_flag
from .attention import AttentionPlanner, SeqView, kv_tokens_read, limit_levels, pages_saved, prefix_tree, to_device
from .decode_path import LEVEL_SECONDS, DecodePathChooser
from .graphs import MAX_SHARED_LEVELS, StepGraphs, padded_cascade_levels
from .in_flight import InFlight, input_ids, timing_event, to_host
from .kv_pool import KVPool
from .model import LlamaModel
from .radix import RadixCache, caches_next_page
from .request import (EngineStats, NonDecreasingClock, Request, arrival_time, callback, clock_or_error,
                      on_engine_clock, positive_int, request_tokens)
from .step_cost import StepCosts


class Engine:
    """A continuous-batching engine over one model shard (see the module docstring).

    ``num_pages`` pages of ``page_size`` tokens form the KV pool (per layer); at most ``max_batch_size`` requests
    are admitted at once; a prefill step computes at most ``prefill_chunk_tokens`` prompt tokens; ``cascade`` turns
    cascade decode on; ``cuda_graphs`` replays captured decode steps (cuda only): flat ones and, with ``cascade``,
    cascade ones of any shape, each step of shared prefixes taking the path measured faster for its batch bucket;
    ``overlap`` (default: on cuda) reads each decode step's tokens back only after the next step is launched (see
    the module docstring); ``cascade_depth`` caps a cascade step's shared levels (None: the prefix tree's depth on
    the cpu, its cheapest cut on cuda; 1: the two-level cascade of one node per prefix group,
    ``attention.limit_levels``); ``clock`` gives the time in seconds (default: since the engine was made) that
    request arrivals are compared with.
    """

    def __init__(self, model: LlamaModel, *, num_pages: int, page_size: int = 16, max_batch_size: int = 64,
                 prefill_chunk_tokens: int = 512, cascade: bool = True, cuda_graphs: bool = False,
                 max_seq_len: int = 4096, overlap: bool | None = None, cascade_depth: int | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        num_pages, page_size, max_batch_size, prefill_chunk_tokens, max_seq_len = (positive_int(n, v) for n, v in (
            ("num_pages", num_pages), ("page_size", page_size), ("max_batch_size", max_batch_size),
            ("prefill_chunk_tokens", prefill_chunk_tokens), ("max_seq_len", max_seq_len)))
        if cascade_depth is not None:  # None: the prefix tree's depth
            cascade_depth = positive_int("cascade_depth", cascade_depth)
        if clock is not None and not callable(clock):
            raise TypeError(f"clock={clock!r} must be a function returning seconds (or None: since startup)")
        if not isinstance(model, LlamaModel):
            raise TypeError(f"model is {type(model).__name__}; pass a jitattn.serving.LlamaModel")
        cascade, cuda_graphs = resolve_flag(cascade, "cascade"), resolve_flag(cuda_graphs, "cuda_graphs")
        if cuda_graphs and model.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs a model on a CUDA device")
        c = model.config
        self.model, self.group = model, model.group
        self.pool = KVPool(c.num_hidden_layers, num_pages, page_size, model.num_kv_heads, c.head_dim, model.dtype,
                           model.device)
        self.radix = RadixCache(self.pool)
        self.planner = AttentionPlanner(self.pool, model.num_q_heads, model.num_kv_heads, c.head_dim, model.dtype,
                                        model.device, cascade=cascade)
        self.max_batch_size, self.max_seq_len = max_batch_size, max_seq_len
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.cuda_graphs = cuda_graphs
        self.overlap = model.device.type == "cuda" if overlap is None else resolve_flag(overlap, "overlap")
        # Half the L2 keeps a layer's shared pages between its requests' reads (the weights and the requests' own
        # pages stream through it too). Off cuda no L2 and no level cost are modelled (no cut by cost).
        on_cuda = model.device.type == "cuda"
        l2 = torch.cuda.get_device_properties(model.device).L2_cache_size if on_cuda else 0
        self.costs = StepCosts(model.weight_bytes, self.pool.bytes_per_page / page_size,
                               4 * model.num_q_heads * c.head_dim * c.num_hidden_layers, c.num_hidden_layers, l2 / 2,
                               page_size, LEVEL_SECONDS if on_cuda else 0.0, cascade_depth)
        self._pending: InFlight | None = None  # the decode step whose tokens are not read back yet (overlap)
        self._last_ready = 0.0  # perf_counter when the last decode step's tokens reached the host
        graph_pool = torch.cuda.graph_pool_handle() if cuda_graphs else None
        self.graphs = StepGraphs(model, self.pool, self.planner.workspace, max_batch_size,
                                 self.pool.pages_for(max_seq_len), graph_pool)
        # A step whose requests share prefix pages runs the faster of the flat and the cascade step, as measured. Off
        # cuda none is taken as flat unmeasured: the byte model is of a GPU's DRAM and L2 (cpu steps are timed).
        self.decode_paths = DecodePathChooser() if on_cuda else DecodePathChooser(flat_below=0.0)
        self._clock_origin = time.perf_counter()  # the default clock's zero (capture_graphs moves it past capture)
        self._clock = None if clock is None else NonDecreasingClock(clock)  # None: seconds since startup
        self.waiting: deque[Request] = deque()
        self.prefilling: list[Request] = []
        self.running: list[Request] = []
        self.finished: list[Request] = []
        self.failed: list[Request] = []  # given up: aborted, or their prefill raised (``Request.error`` says which)
        self._unreported: list[Request] = []  # ended, not yet returned by step() (``finished`` is the caller's too)
        self.stats = EngineStats()
        self._next_rid = 0
        self._order: list[Request] = []  # _batch_order's cache: the running requests sorted by pages
        self._order_members: tuple[int, ...] = ()

    # --- requests ---------------------------------------------------------------------------

    def add_request(self, prompt: list[int], max_new_tokens: int, arrival: float | None = None,
                    forced_tokens: list[int] | None = None, keep_logits: bool = False,
                    stop_token_ids: Sequence[int] | None = None) -> Request:
        """Queue a request (``arrival``: seconds on the engine's clock, None for now; queued in arrival order).

        ``prompt`` (and ``forced_tokens``, ``stop_token_ids``): token ids, a sequence of ints or a 1-D integer
        tensor. The request finishes after ``max_new_tokens`` outputs or at its first greedy token in
        ``stop_token_ids`` (an end-of-sequence id: kept as its last output), whichever comes first. Everything is
        checked here, so a bad request is refused at once and never holds up the requests queued around it,
        including one that could never fit the KV pool."""
        prompt, max_new_tokens, forced_tokens, stop = request_tokens(
            prompt, max_new_tokens, forced_tokens, stop_token_ids, self.model.config.vocab_size, self.max_seq_len)
        arrival = self.clock() if arrival is None else on_engine_clock(arrival_time(arrival), self.clock())
        if not isinstance(keep_logits, bool):  # a string such as "no" would be taken as True
            raise TypeError(f"keep_logits={keep_logits!r} must be True or False")
        needed = self.pool.pages_for(len(prompt) + max_new_tokens - 1)  # every output but the last is fed
        if needed > self.pool.num_pages - 1:
            raise ValueError(f"the request needs {needed} KV pages of {self.pool.page_size} tokens (prompt "
                             f"{len(prompt)} + {max_new_tokens - 1} fed outputs) but the whole pool holds "
                             f"{self.pool.num_pages - 1}; shorten it or give the engine more pages (num_pages)")
        at = len(self.waiting)  # ahead of the requests queued for later (after those of the same time)
        while at and self.waiting[at - 1].arrival > arrival:
            at -= 1
        request = Request(self._next_rid, prompt, max_new_tokens, arrival, forced_tokens, keep_logits, stop)
        self._next_rid += 1
        self.waiting.insert(at, request)
        return request

    def clock(self) -> float:
        """Seconds on the engine's clock: the caller's ``clock``, else since startup (``capture_graphs``
        restarts it), the time base of arrivals, TTFT and finish times."""
        return self._clock() if self._clock is not None else time.perf_counter() - self._clock_origin

    def capture_graphs(self, shared_levels: Sequence[int] = (1, 2)) -> int:
        """Capture every batch-size bucket's decode graphs now, as a serving engine does at startup (cuda_graphs
        only, before any request runs): the flat step's and, with cascade on, the cascade step's of each count
        in ``shared_levels`` (at most 8 prefix groups per level, or the bucket's rows, as :func:`node_capacity`
        sizes them). A step of another shape captures on first use. The default clock (arrivals, TTFT) starts
        again when it returns. Returns how many graphs were captured."""
        if not self.cuda_graphs:
            raise ValueError("capture_graphs() needs an engine made with cuda_graphs=True")
        if self.has_work:
            raise RuntimeError("capture_graphs() runs before any request is served (its replays write the KV pool's "
                               "scratch page only, but a step in flight would race them)")
        captured = self.graphs.capture(shared_levels if self.planner.use_cascade else ())
        self._clock_origin = time.perf_counter()  # arrivals (and TTFT) count from the end of startup
        return captured

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._pending
                    or self._unreported)

    def run(self, on_finish: Callable[[Request], None] | None = None) -> list[Request]:
        """Step until every queued request has ended; returns the finished ones in finishing order (those given up
        are in ``failed``, ``error`` set). ``on_finish`` is called with each as it ends, either way; when it raises,
        the step's other requests still get their call, then the first error is raised."""
        on_finish = callback("on_finish", on_finish)
        while self.has_work:
            errors = []
            for request in self.step():
                try:
                    on_finish(request)
                except Exception as exc:  # noqa: BLE001 - the caller's; raised once the others were called
                    errors.append(exc)
            if errors:
                raise errors[0]
        return self.finished

    # --- one step ---------------------------------------------------------------------------

    def step(self) -> list[Request]:
        """Admit, prefill one chunk budget, decode one token for the running batch; returns the requests that ended
        now: those finished, and those given up (``error`` set: aborted since the last step, or their prefill raised
        -- logged; the other requests go on). A decode step that raises leaves every request as it was: ``step()``
        again retries it, and returns what the failed one ended too. Under tensor parallelism a failure must be the
        same on every rank (one rank giving a request up alone would leave the ranks' collectives unmatched)."""
        self.stats.steps += 1
        self._admit()
        done = []
        try:
            if self.prefilling:  # a prefill chunk runs alone on the GPU: the step in flight finishes first
                done += self._read_back()
            done += self._prefill()
            done += self._decode()
        finally:
            now, clock_error = clock_or_error(self.clock)
            for request in done:
                self._end(request, "stop" if request.stopped else "length", now=now)
            self.finished += done
            if clock_error is not None:  # raised once every request that ended is listed as such
                raise clock_error
        if not done and not self.prefilling and not self.running and self.waiting:
            wait = self.waiting[0].arrival - self.clock()
            if wait > 0:
                time.sleep(min(wait, 0.05))  # nothing to do before the next arrival
        ended, self._unreported = self._unreported, []
        return ended

    def abort(self, request: Request, reason: str = "aborted by the caller") -> bool:
        """Give ``request`` up (its client went away): it leaves the queue or the batch at once, its KV pages go
        back to the pool (the prompt pages the radix tree cached stay cached), and it is listed in ``failed`` with
        ``error`` = ``reason``. Returns False when it had already ended (or is not this engine's). Under tensor
        parallelism every rank aborts it, as every rank added it."""
        if not isinstance(request, Request):
            raise TypeError(f"abort() takes a Request (as add_request returns it); got {type(request).__name__}")
        for queue in (self.waiting, self.prefilling, self.running):
            if request in queue:
                now = self.clock()  # before anything changes: a failing clock leaves the request where it was
                queue.remove(request)
                self._end(request, "abort", str(reason), now=now)
                return True
        return False

    def _end(self, request: Request, finish_reason: str, error: str | None = None, *, now: float) -> None:
        """Mark ``request`` (taken out of its queue by the caller) ended at ``now`` (the caller reads the clock before
        it takes the request out) and give its KV pages back to the pool (a decode step in flight may still read them:
        anything that writes them again is launched after it, on the same stream); with an ``error`` it was given up,
        and is listed in ``failed``."""
        request.finish_reason, request.finish_time, request.unread = finish_reason, now, 0
        self.pool.decref(request.pages)
        request.pages, request.page_tuple = [], ()
        self._unreported.append(request)
        if error is not None:
            request.error = error
            self.failed.append(request)

    def _admit(self) -> None:
        now = self.clock()
        arrived = 0
        while arrived < len(self.waiting) and self.waiting[arrived].arrival <= now:
            arrived += 1
        arrived = self.group.broadcast(arrived)  # every rank admits what rank 0 saw arrive
        for _ in range(arrived):
            if len(self.prefilling) + len(self.running) >= self.max_batch_size:
                return
            request = self.waiting[0]
            ps = self.pool.page_size
            max_shared = (len(request.prompt) - 1) // ps
            shared = self.radix.match(request.prompt, max_pages=max_shared)
            if len(shared) < max_shared and any(caches_next_page(r.prompt, request.prompt, len(shared), ps)
                                                for r in self.prefilling):
                return  # a request being prefilled will cache more of this prompt: share it, do not recompute it
            # KV the request will ever hold: the prompt and every output but the last (never fed)
            own = self.pool.pages_for(len(request.prompt) + request.max_new_tokens - 1) - len(shared)
            self.pool.incref(shared)
            pages = self._alloc(own)
            if pages is None:
                self.pool.decref(shared)
                if not self.prefilling and not self.running:
                    raise RuntimeError(
                        f"request {request.rid} needs {own} free KV pages and the pool has {self.pool.num_free} "
                        f"(of {self.pool.num_pages}) after evicting every idle cached prefix; give the engine "
                        "more num_pages or shorter requests")
                return  # wait for running requests to finish
            self.waiting.popleft()
            request.pages, request.num_shared_pages = shared + pages, len(shared)
            request.page_tuple = tuple(request.pages)
            request.num_computed = len(shared) * ps
            self.stats.reused_prompt_tokens += request.num_computed
            self.prefilling.append(request)

    def _alloc(self, count: int) -> list[int] | None:
        pages = self.pool.alloc(count)
        if pages is None:
            self.stats.evicted_pages += self.radix.evict(count - self.pool.num_free)
            pages = self.pool.alloc(count)
        return pages

    def _prefill(self) -> list[Request]:
        """Compute one chunk budget of prompt tokens, oldest request first; returns the requests finished by it (their
        one output). A request whose prefill raises is given up (``error``); the others go on."""
        budget, chunk = self.prefill_chunk_tokens, []
        for request in self.prefilling:
            if budget == 0:
                break
            n = min(len(request.prompt) - request.num_computed, budget)
            chunk.append((request, n))
            budget -= n
        if not chunk:
            return []
        chunk, logits = self._prefill_isolating_failures(chunk)
        done, tokens, now = [], None, self.clock()  # read before any request moves: a failing clock changes nothing
        for i, (request, n) in enumerate(chunk):
            request.num_computed += n
            full = request.num_computed // self.pool.page_size
            self.radix.insert(request.prompt, request.pages[:full])
            if request.num_computed == len(request.prompt):
                self.prefilling.remove(request)
                request.first_token_time = now
                if tokens is None:  # the greedy tokens of the whole chunk: one argmax, one read-back
                    tokens = logits.argmax(-1).tolist()
                self._emit(request, logits[i], tokens[i])
                (done if request.done else self.running).append(request)
        return done

    def _prefill_isolating_failures(self, chunk: list[tuple[Request, int]]) -> tuple[list, torch.Tensor | None]:
        """``chunk`` and its logits (``_prefill_logits``); when it raises, each request's part again alone, and those
        that still raise given up: returns the parts that ran and their logits (None when none did). A part that is
        run again rewrites the KV its failed run may have written (only the request's own pages)."""
        try:
            return chunk, self._prefill_logits(chunk)
        except Exception as error:  # a request's failure must not hold up the others (nor itself be retried forever)
            if len(chunk) == 1:
                self._give_up_prefill(chunk[0][0], error)
                return [], None
            get_logger().warning("prefill of requests %s raised; running each alone", [r.rid for r, _ in chunk],
                                 exc_info=True)
        ran, rows = [], []
        for part in chunk:
            try:
                rows.append(self._prefill_logits([part]))
                ran.append(part)
            except Exception as error:
                self._give_up_prefill(part[0], error)
        return ran, torch.cat(rows) if rows else None

    def _give_up_prefill(self, request: Request, error: Exception) -> None:
        """Give up ``request``, whose prefill raised ``error`` (called while it is handled: the log has its trace)."""
        get_logger().warning("prefill of request %d raised; it is given up", request.rid, exc_info=True)
        now, _ = clock_or_error(self.clock)  # given up either way (a failing clock is raised by the step's next read)
        self.prefilling.remove(request)
        self._end(request, "error", f"prefill failed: {type(error).__name__}: {error}", now=now)

    def _prefill_logits(self, chunk: list[tuple[Request, int]]) -> torch.Tensor:
        """The logits of the last token of each (request, tokens) of ``chunk``, its KV written to the pool."""
        seqs, ids, positions = [], [], []
        for request, n in chunk:
            start, end = request.num_computed, request.num_computed + n
            seqs.append(SeqView(request.page_tuple[: self.pool.pages_for(end)], end, n))
            ids += request.prompt[start:end]
            positions += range(start, end)
        attention = self.planner.prefill_step(seqs)
        dev = self.model.device
        with torch.no_grad():
            hidden = self.model.forward(torch.tensor(ids, device=dev), torch.tensor(positions, device=dev), attention)
            last_rows = torch.tensor(list(itertools.accumulate(n for _, n in chunk)), device=dev) - 1
            logits = self.model.logits(hidden[last_rows])
        if dev.type == "cuda":  # the decode step after it is timed from an idle GPU
            torch.cuda.synchronize(dev)
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += len(ids)
        return logits

    def _emit(self, request: Request, logits: torch.Tensor, token: int) -> None:
        request.output.append(token)
        if request.keep_logits:
            request.logits.append(logits.float().cpu())
        self.stats.generated_tokens += 1

    def _decode(self) -> list[Request]:
        """Launch a decode step of every running request that has outputs to come; returns the requests finished.

        With ``overlap`` the step's tokens stay on the device: the next step takes them from there, and they
        reach the host (``_read_back``) after the next step is launched, so the host's work of a step (ordering,
        prefix tree, plan) runs while the GPU runs the step before it. Without, they are read back at once."""
        # Ordered by pages, so the requests under each node of the prefix tree are consecutive (cascade
        # attention reads a node's pages once for them).
        batch = [r for r in self._batch_order() if not r.exhausted]
        if not batch:
            return self._read_back()
        started = time.perf_counter()
        seqs, host_ids, from_device = [], [], []
        rows = self._pending.rows if self._pending is not None else {}
        for request in batch:
            fed = request.num_fed
            seqs.append(SeqView(request.page_tuple[: self.pool.pages_for(fed)], fed, 1))
            token = request.last_fed_token
            host_ids.append(0 if token is None else token)
            from_device.append(-1 if token is not None else rows[request.rid])
        shared = prefix_tree(seqs)  # every page the batch reads more than once (a set of all pages cost ~4 ms)
        saved = pages_saved(shared)
        if saved > self.stats.peak_pages_saved:
            self.stats.peak_pages_saved = saved
            self.stats.peak_bytes_saved = saved * self.pool.bytes_per_page
        depth = self.costs.depth(shared, len(seqs), MAX_SHARED_LEVELS if self.cuda_graphs else None)
        if depth < len(shared):
            shared = limit_levels(shared, len(seqs), depth)
        builds, begin = compile_count(), timing_event(self.model.device)
        ids = input_ids(host_ids, from_device, self._pending, self.model.device)
        logits, chosen, kv_tokens = self._decode_logits(seqs, ids, shared)
        with torch.no_grad():
            tokens = logits.argmax(-1)
            keep = [i for i, r in enumerate(batch) if r.keep_logits]
            kept = logits[keep].float() if keep else None  # a copy: a graph's next replay rewrites its logits
        end = timing_event(self.model.device)
        self.stats.count_decode_step(kv_tokens, len(seqs), sum(s.kv_len for s in seqs))
        step = InFlight(batch, {r.rid: i for i, r in enumerate(batch)}, tokens, to_host(tokens), kept,
                         dict(zip(keep, range(len(keep)))), started, chosen, self.graphs.bucket(len(seqs)), builds,
                         time.perf_counter() - started, (begin, end) if begin is not None else None)
        done = self._read_back()  # the step before: its tokens while this one runs
        for request in batch:
            request.unread = 1
        self._pending = step
        return done + ([] if self.overlap else self._read_back())

    def _read_back(self) -> list[Request]:
        """The step in flight's tokens (and kept logits) to the host, its requests' outputs; those that are done."""
        step = self._pending
        if step is None:
            return []
        tokens = step.host_tokens().tolist()  # (a device error surfaces here: the step stays pending)
        self._pending = None
        ready = time.perf_counter()
        done = []
        for i, request in enumerate(step.batch):
            if request.finish_reason is not None:
                continue  # ended while the step ran: aborted, or its last token (read back before) was a stop token
            request.unread = 0
            request.output.append(tokens[i])
            if request.keep_logits:
                request.logits.append(step.kept[step.kept_rows[i]].cpu())
            self.stats.generated_tokens += 1
            if request.done:
                self.running.remove(request)
                done.append(request)
        # the step's share of the wall time: from its launch, or from the step before's tokens when it was
        # launched while that one ran
        seconds = ready - max(step.started, self._last_ready)
        self._last_ready = ready
        self.stats.decode_seconds += seconds
        if step.chosen is not None and compile_count() == step.builds:  # a build says nothing of its path
            self.decode_paths.record(step.bucket, step.chosen, step.cost(seconds))
        return done

    def _batch_order(self) -> list[Request]:
        """The running requests ordered by pages, sorted again only when the running set changed."""
        members = tuple(r.rid for r in self.running)
        if members != self._order_members:
            # Lexicographic order of the page lists: the requests under each node are consecutive.
            self._order, self._order_members = sorted(self.running, key=lambda r: r.pages), members
        return self._order

    def _decode_logits(self, seqs: list[SeqView], ids: torch.Tensor, shared=None) -> tuple[torch.Tensor, str | None, int]:
        """The step's logits, the path it took when it had a choice (prefix pages shared), and the KV tokens its
        attention reads per layer; ``ids``: the input ids on the device."""
        dev, ps = self.model.device, self.pool.page_size
        with torch.no_grad():
            tree = self.planner.cascade_tree(seqs, shared)
            chosen = None
            bucket = self.graphs.bucket(len(seqs))
            flat_tokens = kv_tokens_read(seqs, [], ps)  # what a flat step's attention reads per layer
            if tree is not None:
                # rank 0's choice under tensor parallelism: every rank runs the same step (under CUDA graphs the
                # tree is already cut to MAX_SHARED_LEVELS: StepCosts.depth)
                estimate = self.costs.cascade_estimate(seqs, tree, flat_tokens)
                chosen = self.group.broadcast(self.decode_paths.choose(bucket, estimate))
                if chosen == "flat":
                    tree = None
            if self.cuda_graphs and tree is None:
                if bucket not in self.graphs.flat:
                    chosen = None  # a step that captures says nothing of its path's replays
                logits = self.graphs.flat_graph(bucket).run(seqs, ids)
                self._count_step(True, 0)
                return logits, chosen, flat_tokens
            if self.cuda_graphs:  # a captured cascade step: any number of groups and levels
                levels, capacities = padded_cascade_levels(seqs, tree, bucket, ps)
                if (bucket, capacities) not in self.graphs.cascade:
                    chosen = None
                logits = self.graphs.cascade_graph(bucket, capacities).run(seqs, ids, levels)
                self._count_step(True, len(capacities) + 1)
                return logits, chosen, kv_tokens_read(seqs, tree[: len(capacities)], ps)
            attention = self.planner.decode_step(seqs, tree)
            positions = to_device(torch.tensor([s.kv_len - 1 for s in seqs]), dev)
            logits = self.model.logits(self.model.forward(ids, positions, attention))
            self._count_step(False, self.planner.last_decode_levels)
            return logits, chosen, self.planner.last_decode_kv_tokens

    def _count_step(self, graph: bool, levels: int) -> None:
        """Count a decode step once it ran (a retried step counts then): a replay or not, of ``levels`` (0: flat)."""
        self.stats.graph_steps += graph
        self.stats.cascade_steps += levels > 0
        self.stats.max_cascade_levels = max(self.stats.max_cascade_levels, levels)

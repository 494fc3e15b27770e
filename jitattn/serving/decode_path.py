"""Which decode step the engine runs when requests share prefix pages: measured, per batch bucket.

A flat decode step (a captured graph with CUDA graphs on) reads every request's shared prefix again,
while a cascade step reads the shared prefix once but has more launches per layer (each shared level,
the requests' own pages, the merge). Which is faster depends on the model, the batch and how long the
shared prefix is: on the H200 with Llama-3-8B shapes, 64 requests over a 2048-token system prompt,
the eager cascade engine made 1,261 tokens/s against the flat step's 1,390, while a prefix of tens
of thousands of tokens makes the flat step's reads the larger cost. So the engine times both, with
CUDA graphs on or off, and a user never loses by leaving cascade on.

Some steps need no measurement: when the bytes (and the shared levels' FLOPs) say the cascade step does
under half the flat step's work (``estimate`` >= ``trust``: at 128 requests over a 16k prefix the flat
step reads ~8x the cascade step's bytes from DRAM), the engine takes the cascade step at once; timing the
flat one would cost a graph capture and several slow steps per bucket (a 62-step run spent all but 3 of its
steps exploring and on flat steps this way). When they say the cascade step saves at most a tenth of the
flat step's work (``estimate`` <= ``flat_below``), it takes the flat step at once: the cascade step's extra
launches (the shared levels' and the merge) then cost about what it saves (64 requests over a 1k or 2k prefix:
0.98x and 1.02x measured). The flat step's re-reads of a shared page that L2 serves count at a fraction of a
DRAM byte (:func:`flat_reread_fraction`): 64 requests over a 2k prefix read its 8 MiB per layer from L2 after
the first request.

``DecodePathChooser`` keeps, per batch-size bucket, a moving average of each path's step time
(the wall time from the step's launch, or from the read-back of the step before it when the two overlap,
to its own tokens on the host: its whole cost to the engine's throughput), tries each
path after a warm-up step, then takes the faster, and every ``explore_every`` steps of a bucket
runs the other path once to follow lengths that grow. A sample counts at most ``outlier`` times
the path's average (a step that waited for a kernel build must not lock the other path in for
hundreds of steps); the engine does not record steps that built a kernel at all.

Batch buckets change as requests join and finish (a batch that grows by a prefill chunk's requests per step
visits each bucket for a step or two), so only the first bucket measured explores both paths; a bucket not
measured yet takes the path that was faster in the nearest bucket that is (on the H200 with Llama-3-8B shapes
and 64 requests over a 2k prefix, exploring every bucket ran 50 of 99 steps on the slower path: 0.93x), and
every ``explore_every`` steps runs the other one, until it has measured both itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PATHS = ("flat", "cascade")


@dataclass
class _Bucket:
    seen: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PATHS, 0))  # steps run per path
    average: dict[str, float] = field(default_factory=dict)  # seconds per step, once measured
    steps: int = 0


class DecodePathChooser:
    """The faster of ``"flat"`` (a flat step: captured under CUDA graphs) and ``"cascade"`` per bucket.

    ``warmup`` steps of each path are not timed (the first captures the graph or loads kernels);
    ``smoothing`` weighs a new sample in the moving average; ``explore_every`` > 0 runs the slower
    path once every that many steps of a bucket. An estimate of at least ``trust`` takes cascade, one of at
    most ``flat_below`` flat, without measuring (0 turns the flat rule off).
    """

    def __init__(self, warmup: int = 1, smoothing: float = 0.25, explore_every: int = 32, outlier: float = 3.0,
                 trust: float = 2.0, flat_below: float = 1.1) -> None:
        if warmup < 0 or not 0.0 < smoothing <= 1.0 or explore_every < 0 or not outlier >= 1.0 or not trust > 1.0:
            raise ValueError(f"warmup={warmup} >= 0, 0 < smoothing={smoothing} <= 1, explore_every={explore_every} "
                             f">= 0, outlier={outlier} >= 1 and trust={trust} > 1 are required")
        if not 0.0 <= flat_below < trust:
            raise ValueError(f"flat_below={flat_below} must be in [0, trust={trust})")
        self.warmup, self.smoothing, self.explore_every, self.outlier = warmup, smoothing, explore_every, outlier
        self.trust, self.flat_below = trust, flat_below
        self._buckets: dict[int, _Bucket] = {}

    def choose(self, bucket: int, estimate: float | None = None) -> str:
        """The path the next step of ``bucket`` should take; ``estimate``: the flat step's work over the cascade
        step's (:func:`cascade_estimate`), taken as the answer when it is at least ``trust`` (cascade) or at most
        ``flat_below`` (flat)."""
        if estimate is not None and estimate >= self.trust:
            return "cascade"
        if estimate is not None and estimate <= self.flat_below:
            return "flat"
        state = self._buckets.setdefault(bucket, _Bucket())
        if len(state.average) < len(PATHS):
            nearest = self._nearest_measured(bucket)
            if nearest is not None:  # a bucket not measured yet follows the nearest one that is, and now and
                follow = min(PATHS, key=lambda p: self._buckets[nearest].average[p])  # then measures the other
                if self.explore_every and state.steps % self.explore_every == self.explore_every - 1:
                    return next(p for p in PATHS if p != follow)
                return follow
            for path in PATHS:  # the first bucket measured: each path before any comparison
                if path not in state.average:
                    return path
        faster, slower = sorted(PATHS, key=lambda p: state.average[p])
        if self.explore_every and state.steps % self.explore_every == self.explore_every - 1:
            return slower
        return faster

    def _nearest_measured(self, bucket: int) -> int | None:
        """The bucket nearest ``bucket`` with both paths measured (None: none yet)."""
        measured = [b for b, state in self._buckets.items() if len(state.average) == len(PATHS)]
        return min(measured, key=lambda b: (abs(b - bucket), b)) if measured else None

    def record(self, bucket: int, path: str, seconds: float) -> None:
        """A step of ``bucket`` on ``path`` took ``seconds`` (wall time, its tokens on the host)."""
        if path not in PATHS:
            raise ValueError(f"path={path!r} is not one of {PATHS}")
        state = self._buckets.setdefault(bucket, _Bucket())
        state.steps += 1
        state.seen[path] += 1
        if state.seen[path] <= self.warmup:
            return
        previous = state.average.get(path)
        if previous is None:
            state.average[path] = seconds
        else:
            seconds = min(seconds, self.outlier * previous)
            state.average[path] = previous + self.smoothing * (seconds - previous)

    def averages(self, bucket: int) -> dict[str, float]:
        """Seconds per step of each measured path of ``bucket`` (empty before any timed step)."""
        state = self._buckets.get(bucket)
        return dict(state.average) if state is not None else {}


# The rates of a decode step's reads and of the shared levels' attention on the prefill kernels (H200: read-stream
# ~4.4 TB/s; the estimate below was fitted with 500 TFLOP/s for the levels, which measured 415-420 at 128 queries
# over a 16k prefix and on the 8k agent-fork tree).
READ_BYTES_PER_SECOND = 4.4e12
SHARED_FLOPS_PER_SECOND = 5e14
# Bytes a decode step could read in the time the GPU does one FLOP of the shared levels' attention: a shared level
# is compute-bound (every request's queries against the node's KV), so its FLOPs count as this many bytes.
BYTES_PER_SHARED_FLOP = READ_BYTES_PER_SECOND / SHARED_FLOPS_PER_SECOND


def cascade_estimate(flat_bytes: float, cascade_bytes: float, shared_flops: float) -> float:
    """How many times the flat step's work the cascade step's is worth, from the bytes each reads (weights and the
    KV its path reads) and the FLOPs of the cascade's shared levels (counted at ``BYTES_PER_SHARED_FLOP``)."""
    return flat_bytes / (cascade_bytes + shared_flops * BYTES_PER_SHARED_FLOP)


# What a flat step's re-read of a shared page that L2 serves costs, in DRAM bytes: the L2 traffic and the
# decode kernel's work on it are not free. Fitted to the H200 sweep of 64 requests (Llama-3-8B shapes, graphs):
# cascade over flat measured 0.98x at a 1k prefix, 1.02x at 2k, 1.18x at 4k, 1.41x at 8k; this cost gives
# estimates of 1.05, 1.09, 1.18 and 1.5.
L2_REREAD_COST = 0.13


def flat_reread_fraction(working_set_bytes: float, l2_bytes: float) -> float:
    """What a flat step's re-reads of shared pages (every member after the first reading a node's pages again)
    cost as a fraction of their DRAM bytes, when one layer's shared pages are ``working_set_bytes`` and
    ``l2_bytes`` of L2 can keep them between the members' reads (0: no cache modelled, every re-read reaches
    DRAM). A layer's members read its shared pages at about the same time, so what fits is read from L2 (at
    ``L2_REREAD_COST``); of a larger set the part that does not fit is read again from DRAM."""
    if l2_bytes <= 0:
        return 1.0
    miss = 0.0 if working_set_bytes <= l2_bytes else 1.0 - l2_bytes / working_set_bytes
    return miss + (1.0 - miss) * L2_REREAD_COST


# The fixed cost of one more shared level in a cascade step, per layer: its prefill launch over the level's nodes
# and one more state per query to merge. The shared levels of a cut run at the slower of their reads and their
# FLOPs, which every cut has alike (each query meets each shared token once; a node of few queries fills its prefill
# tiles partly, so its FLOPs take longer than counted, which only matters near the balance); with tens of queries
# per node they are compute-bound, and then a level's cost is the whole difference between two cuts. Fitted to the
# H200 with Llama-3-8B shapes: an 8k root shared by 128 requests under 4 branches of 2k
# (``cascade/agent_fork_b128_root8192_4x2048_u128``) took 113.1 us a layer as a three-level tree and 100.5 us as the
# two-level cascade of the same pages (which reads the root again for three branches, 101 MB a layer). Under a 32k
# root, past L2, the tree still lost (H100: 204.3 against 198.9 us; 8.0 us slower at the 8k root there): with 32
# queries a node, the two-level cascade's root re-reads (partly from L2, its branches reading the root together) cost
# no more than its FLOPs.
LEVEL_SECONDS = 1.26e-5


def cheapest_depth(shared_tokens: list[int], once_tokens: int, token_bytes: float, l2_bytes: float,
                   level_seconds: float, compute_seconds: float = 0.0) -> int:
    """The number of shared levels (1 .. ``len(shared_tokens)``) of the cheapest cascade step over a prefix tree.

    ``shared_tokens[d - 1]``: the shared KV tokens a layer reads with the tree cut to ``d`` levels
    (``attention.limit_levels``: the last level reads each member's deeper shared pages with its node's, so a
    shallower cut reads a node's pages again for each of its children); ``once_tokens``: the whole tree's, each
    shared page once. ``token_bytes``: one token's K and V bytes in a layer. The re-reads cost
    :func:`flat_reread_fraction` of their bytes (L2 may keep the tree's pages between them) at
    ``READ_BYTES_PER_SECOND``; a cut's shared levels take the longer of that reading and ``compute_seconds`` (their
    FLOPs in a layer, the same for every cut), plus ``level_seconds`` a level; a tie takes fewer levels."""
    once = once_tokens
    reread = flat_reread_fraction(once * token_bytes, l2_bytes)
    seconds_per_token = token_bytes / READ_BYTES_PER_SECOND
    costs = [max((once + (tokens - once) * reread) * seconds_per_token, compute_seconds) + level_seconds * depth
             for depth, tokens in enumerate(shared_tokens, 1)]
    return 1 + costs.index(min(costs))

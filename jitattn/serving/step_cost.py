"""What a decode step's paths cost, from the model's sizes: the flat step against the cascade step
(``decode_path.cascade_estimate``) and the cheapest cut of the prefix tree (``decode_path.cheapest_depth``)."""

from __future__ import annotations

from dataclasses import dataclass

from .attention import SeqView, SharedNode, kv_tokens_read, limit_levels, shared_tokens
from .decode_path import SHARED_FLOPS_PER_SECOND, cascade_estimate, cheapest_depth, flat_reread_fraction


@dataclass(frozen=True)
class StepCosts:
    """The step-independent terms of a decode step's cost and the engine's caps on its levels.

    ``kv_bytes_per_token``: every layer's K and V of one token; ``flops_per_pair``: attention FLOPs per (query,
    shared token) pair over every head and layer; ``l2_bytes``: the L2 that keeps a layer's shared pages between its
    requests' reads (0: none modelled); ``level_seconds``: one more shared level's fixed cost (0: none known, the
    tree is not cut); ``cascade_depth``: the user's cap on shared levels (None: none)."""

    weight_bytes: float
    kv_bytes_per_token: float
    flops_per_pair: float
    layers: int
    l2_bytes: float
    page_size: int
    level_seconds: float = 0.0
    cascade_depth: int | None = None

    def cascade_estimate(self, seqs: list[SeqView], tree: list[list[SharedNode]], flat_kv_tokens: int) -> float:
        """``decode_path.cascade_estimate`` of a step: the weights and each path's KV bytes (``flat_kv_tokens``: the
        flat step's), the shared levels' FLOPs (each member's queries against each node's tokens)."""
        ps = self.page_size
        shared_pairs = self.shared_pairs(tree)
        once = shared_tokens(tree, ps)  # each node's tokens
        cascade_tokens = kv_tokens_read(seqs, tree, ps)
        reread = flat_kv_tokens - cascade_tokens  # what the flat step reads again, per member after the first
        working_set = once * self.kv_bytes_per_token / self.layers
        flat_dram = flat_kv_tokens - reread * (1.0 - flat_reread_fraction(working_set, self.l2_bytes))
        return cascade_estimate(self.weight_bytes + flat_dram * self.kv_bytes_per_token,
                                self.weight_bytes + cascade_tokens * self.kv_bytes_per_token,
                                shared_pairs * self.flops_per_pair)

    def shared_pairs(self, tree: list[list[SharedNode]]) -> int:
        """(query, shared token) pairs of a step over ``tree``: each member's query against each node's tokens (the
        same for every cut of the tree)."""
        return sum((node.end - node.first) * (node.page_end - node.page_begin) * self.page_size
                   for nodes in tree for node in nodes)

    def depth(self, tree: list[list[SharedNode]], num_seqs: int, max_levels: int | None = None) -> int:
        """Shared levels a cascade step over ``tree`` takes: at most ``cascade_depth`` and ``max_levels`` (that of
        captured cascade steps; None: no cap); without ``cascade_depth``, the cheapest cut by
        ``decode_path.cheapest_depth`` where a level's cost is known, else the whole tree."""
        most = len(tree) if self.cascade_depth is None else min(len(tree), self.cascade_depth)
        if max_levels is not None:
            most = min(most, max_levels)
        if self.cascade_depth is not None or most <= 1 or not self.level_seconds:
            return most
        ps = self.page_size
        cuts = [shared_tokens(limit_levels(tree, num_seqs, d), ps) for d in range(1, most + 1)]
        compute = self.shared_pairs(tree) * self.flops_per_pair / self.layers / SHARED_FLOPS_PER_SECOND
        return cheapest_depth(cuts, shared_tokens(tree, ps), self.kv_bytes_per_token / self.layers, self.l2_bytes,
                              self.level_seconds, compute)

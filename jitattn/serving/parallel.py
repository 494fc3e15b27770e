"""Tensor parallelism: which heads and MLP columns a rank owns, and the collectives the engine calls.

Each rank of a ``tp``-way group owns ``num_attention_heads / tp`` query heads and the KV heads
they read: ``num_key_value_heads / tp`` of them, or one replicated KV head when ``tp`` exceeds
the KV heads (vLLM's and SGLang's rule). The MLP's gate/up projections are split by columns and
its down projection by rows; the attention output projection is split by rows too, so both
blocks end in one ``all_reduce`` of partial sums. With ``tp == 1`` every collective is a no-op
and ``torch.distributed`` is never touched.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank owns: query heads ``[q_start, q_start + num_q)``, KV heads ``[kv_start, kv_start + num_kv)``."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def head_shard(num_q_heads: int, num_kv_heads: int, rank: int, tp: int) -> HeadShard:
    """The query and KV heads rank ``rank`` of ``tp`` owns (KV heads replicated when ``tp`` exceeds them)."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"rank {rank} of tp {tp}: need tp >= 1 and 0 <= rank < tp")
    if num_q_heads % tp:
        raise ValueError(f"tp={tp} must divide num_attention_heads={num_q_heads}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tp={tp} must divide num_key_value_heads={num_kv_heads} or be a multiple of it")
    num_q = num_q_heads // tp
    group = num_q_heads // num_kv_heads
    if num_kv_heads >= tp:
        num_kv = num_kv_heads // tp
        return HeadShard(rank * num_q, num_q, rank * num_kv, num_kv)
    return HeadShard(rank * num_q, num_q, (rank * num_q) // group, 1)  # one replicated KV head


def column_range(size: int, rank: int, tp: int) -> tuple[int, int]:
    if size % tp:
        raise ValueError(f"tp={tp} must divide the MLP's intermediate_size={size}")
    return rank * size // tp, (rank + 1) * size // tp


class TPGroup:
    """The engine's view of its tensor-parallel group (``torch.distributed``'s default group when tp > 1)."""

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        for name, value in (("rank", rank), ("size", size)):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"TPGroup {name}={value!r} must be an int")
        if not 0 <= rank < size:
            raise ValueError(f"TPGroup(rank={rank}, size={size}): the rank must be in [0, size) and size >= 1")
        if size > 1:
            import torch.distributed as dist

            if not dist.is_initialized():
                raise RuntimeError(f"tp={size} needs torch.distributed initialised first "
                                   "(launch with torchrun and call torch.distributed.init_process_group)")
            if dist.get_world_size() != size or dist.get_rank() != rank:
                raise ValueError(f"tp={size}, rank={rank} differ from the process group "
                                 f"(world size {dist.get_world_size()}, rank {dist.get_rank()})")
        self.rank, self.size = rank, size

    @classmethod
    def from_env(cls) -> "TPGroup":
        """The default process group when one is initialised, else a group of one."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return cls(dist.get_rank(), dist.get_world_size())
        return cls()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place (every rank gets the same bits)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(tensor)
        return tensor

    def broadcast(self, obj):
        """Rank 0's ``obj`` on every rank (the scheduler's time-dependent decisions must agree)."""
        if self.size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

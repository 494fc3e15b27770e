"""The attention states of a cascade plan's levels (``jitattn.ops.cascade``): one buffer every run reuses."""

from __future__ import annotations

import torch

from .merge import PreparedMerge


class LevelStates:
    """The attention states of a cascade plan's levels: reused by every run(), and by later plans of the
    same ``layout`` (a graph captured around run() keeps their addresses).

    ``levels``: per launch (a level, or every level in one) the (out, lse) rows it writes; ``v``/``s``:
    all of them as the ``[total_q, num_states, ...]`` views ``merge_states`` reads. Runs are ordered on
    a stream, so one buffer serves every call (like the workspace, a plan must not run on two streams
    at once)."""

    def __init__(self, launch_states: list[int], total_q: int, num_heads: int, head_dim_vo: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.layout = (launch_states, total_q, num_heads, head_dim_vo, dtype, device)
        num_states = sum(launch_states)
        values = torch.empty((num_states * total_q, num_heads, head_dim_vo), dtype=dtype, device=device)
        lses = torch.empty((num_states * total_q, num_heads), dtype=torch.float32, device=device)
        self.values, self.lses = values, lses  # state s of query row i at row s * total_q + i
        self.levels: list[tuple[torch.Tensor, torch.Tensor]] = []
        row = 0
        for chunks in launch_states:
            rows = chunks * total_q
            self.levels.append((values[row: row + rows], lses[row: row + rows]))
            row += rows
        self.v = values.view(num_states, total_q, num_heads, head_dim_vo).transpose(0, 1)
        self.s = lses.view(num_states, total_q, num_heads).transpose(0, 1)
        self.merge = PreparedMerge(self.v, self.s)

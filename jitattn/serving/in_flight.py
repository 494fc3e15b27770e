"""A decode step in flight: its greedy tokens on their way to the host, and what it cost."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import to_device
from .request import Request


@dataclass(eq=False)
class InFlight:
    """A launched decode step whose greedy tokens have not reached the host yet."""

    batch: list[Request]
    rows: dict[int, int]  # request id -> its row in the step
    tokens: torch.Tensor  # [len(batch)] on the device
    host: tuple[torch.Tensor, torch.cuda.Event | None]  # their copy on the host, and the event that says it is done
    kept: torch.Tensor | None  # float32 logits of the keep_logits requests' rows (on the device)
    kept_rows: dict[int, int]  # row in the step -> row in kept
    started: float  # perf_counter when the host began the step
    chosen: str | None  # the path the chooser took (None: no choice, or a step that captured a graph)
    bucket: int
    builds: int  # compile_count() when it started
    host_s: float = 0.0  # the host's time to launch it
    gpu: tuple[torch.cuda.Event, torch.cuda.Event] | None = None  # timing events around its device work (cuda)

    def host_tokens(self) -> torch.Tensor:
        copy, event = self.host
        if event is not None:
            event.synchronize()
        return copy

    def cost(self, interval: float) -> float:
        """What the step cost the engine's throughput, for the path chooser: with timing events, the longer of
        its device work and its host work (overlapped steps run both at once; the wall interval to its tokens
        would also count the next step's host work, a capture or a wrapper's first use); else ``interval``."""
        if self.gpu is None:
            return interval
        begin, end = self.gpu
        return max(begin.elapsed_time(end) / 1e3, self.host_s)


def to_host(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """A copy of ``tokens`` on the host, started now, and the event that marks it done (None off cuda)."""
    if tokens.device.type != "cuda":
        return tokens.clone(), None
    copy = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    copy.copy_(tokens, non_blocking=True)  # on the tokens' device's stream: the event goes there too
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tokens.device))
    return copy, event


def timing_event(device: torch.device) -> torch.cuda.Event | None:
    """A timing event recorded now on ``device``'s current stream (None off cuda)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def input_ids(host_ids: list[int], from_device: list[int], pending: InFlight | None,
              device: torch.device) -> torch.Tensor:
    """A decode step's input ids on ``device``: ``host_ids[i]``, or where ``from_device[i]`` >= 0 the token at that
    row of the step in flight (``pending``: its tokens are still on the device)."""
    table = to_device(torch.tensor([host_ids, from_device], dtype=torch.long), device)
    if pending is None or max(from_device) < 0:
        return table[0]
    return torch.where(table[1] >= 0, pending.tokens[table[1].clamp(min=0)], table[0])

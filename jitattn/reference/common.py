"""Shared pieces of the float64 reference: types, constants, argument normalisation."""

from __future__ import annotations

from typing import Optional, Sequence, Tuple, Union

import torch
from torch import Tensor


PagedKVCache = Union[Tensor, Tuple[Tensor, Tensor], Sequence[Tensor]]


F64 = torch.float64


NEG_INF = float("-inf")


POS_ENCODING_MODES = {0: "NONE", 1: "ROPE_LLAMA", 2: "ALIBI"}


def to_list(x: Union[Tensor, Sequence[int]]) -> list:
    """Return a python list of ints from a tensor (any device) or a sequence."""
    if isinstance(x, Tensor):
        return [int(v) for v in x.detach().cpu().reshape(-1).tolist()]
    return [int(v) for v in x]


def pos_encoding_name(mode: Union[str, int, None]) -> str:
    """Map a pos-encoding mode (name, FlashInfer enum int, or None) to a name."""
    if mode is None:
        return "NONE"
    if isinstance(mode, bool):
        raise ValueError(f"invalid pos_encoding_mode {mode!r}")
    if isinstance(mode, int):
        if mode not in POS_ENCODING_MODES:
            raise ValueError(f"invalid pos_encoding_mode {mode!r}")
        return POS_ENCODING_MODES[mode]
    if isinstance(mode, str):
        name = mode.upper()
        if name in POS_ENCODING_MODES.values():
            return name
    raise ValueError(
        f"invalid pos_encoding_mode {mode!r}; expected one of "
        f"{sorted(POS_ENCODING_MODES.values())}"
    )


def dequantize(x: Tensor, scale: Optional[float]) -> Tensor:
    """Upcast ``x`` to float64 and multiply by ``scale`` (None means 1.0)."""
    out = x.to(F64)
    if scale is not None:
        out = out * float(scale)
    return out

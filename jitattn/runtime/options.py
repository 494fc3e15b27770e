"""Parsing and defaulting of the options every attention wrapper accepts.

Accepts FlashInfer's spellings ("NONE", "ROPE_LLAMA", "ALIBI", their integer
codes 0/1/2, torch dtypes or their names) and turns them into our enums and
an ``AttentionScalars`` with every default applied.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .. import env
from ..abi import POS_ENCODING_CODES
from ..page_table import positive_int  # noqa: F401  (the base layer's check, shared by the ops through here)
from ..spec import DType, KVLayout, MaskMode, Op, PosEncoding
from ..variant import AttentionVariant
from .launch import AttentionScalars

@dataclass(frozen=True)
class AttentionOptions:
    """What one plan computes, with every FlashInfer default applied."""

    op: Op
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype
    num_qo_heads: int
    num_kv_heads: int
    head_dim_qk: int
    head_dim_vo: int
    pos_encoding: PosEncoding
    mask_mode: MaskMode
    scalars: AttentionScalars
    variant: AttentionVariant | None = None


# FlashInfer's integer spellings are the ABI codes.
_POS_CODES = {POS_ENCODING_CODES[p.value]: p for p in (PosEncoding.NONE, PosEncoding.ROPE_LLAMA, PosEncoding.ALIBI)}


def parse_pos_encoding(value: str | int | PosEncoding) -> PosEncoding:
    if isinstance(value, int) and not isinstance(value, bool):
        if value in _POS_CODES:
            return _POS_CODES[value]
        raise ValueError(f"pos_encoding_mode={value} is not supported; use 'NONE', 'ROPE_LLAMA' or 'ALIBI'")
    if isinstance(value, PosEncoding):
        return value
    if isinstance(value, str) and value.strip().upper() in _POS_NAMES:  # FlashInfer's names ("rope" is the spec's)
        return _POS_NAMES[value.strip().upper()]
    raise ValueError(f"pos_encoding_mode={value!r} is not supported; use 'NONE', 'ROPE_LLAMA' or 'ALIBI'")


_POS_NAMES = {"NONE": PosEncoding.NONE, "ROPE_LLAMA": PosEncoding.ROPE_LLAMA, "ALIBI": PosEncoding.ALIBI}


_TORCH_DTYPES = frozenset(d.torch_dtype for d in DType)


def parse_dtype(value: str | torch.dtype, name: str) -> torch.dtype:
    if isinstance(value, torch.dtype) and value in _TORCH_DTYPES:  # the usual argument, without the text round trip
        return value
    return DType.parse(value, name).torch_dtype


def resolve_dtypes(
    q_data_type: str | torch.dtype | None, kv_data_type: str | torch.dtype | None,
    data_type: str | torch.dtype | None = None,
) -> tuple[torch.dtype, torch.dtype]:
    """(q dtype, kv dtype) as FlashInfer resolves them.

    ``data_type`` (FlashInfer's older single dtype) fills only what the caller did not give:
    an explicit ``q_data_type`` or ``kv_data_type`` always wins; q defaults to float16 and kv
    to the q dtype.
    """
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    q_dtype = parse_dtype("float16" if q_data_type is None else q_data_type, "q_data_type")
    kv_dtype = parse_dtype(kv_data_type, "kv_data_type") if kv_data_type is not None else q_dtype
    return q_dtype, kv_dtype


def hashable(values: tuple) -> bool:
    """Whether ``values`` (a plan's shapes and options) can key a cache of planned wrappers (an sm_scale given as a
    numpy array cannot: planned afresh). A tensor hashes by identity while its value can change in place (a 0-d
    sm_scale filled anew), so a tensor among them is planned afresh too."""
    if any(isinstance(v, torch.Tensor) for v in values):
        return False
    try:
        hash(values)
    except TypeError:
        return False
    return True


def refuse_unsupported(what: str, hint: str = "leave it unset", **arguments: object) -> None:
    """Raise NotImplementedError naming each FlashInfer argument that was given but is not implemented.

    An argument that would change results is never accepted and ignored.
    """
    given = [name for name, value in arguments.items() if value is not None]
    if given:
        raise NotImplementedError(
            f"{what}: {', '.join(given)} {'is' if len(given) == 1 else 'are'} not supported by jitattn; {hint}"
        )


def check_head_dim(head_dim: object, name: str = "head_dim") -> int:
    """``head_dim`` as an int (Python's or numpy's; a bool, a float or a string is refused)."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, numbers.Integral) or head_dim < 1:
        raise ValueError(f"{name}={head_dim!r} must be a positive int (a multiple of 8 from 8 to 256, "
                         "or 192/128, 576/512)")
    return int(head_dim)


def parse_kv_layout(value: str | KVLayout) -> KVLayout:
    return KVLayout.parse(value, "kv_layout")


_INT32_MAX = 2**31 - 1
# The kernels hold scales in float32: a scale (and a RoPE parameter's reciprocal) must be a normal float32.
_F32_MAX = 3.4028234663852886e38
_F32_MIN_NORMAL = 1.1754943508222875e-38


def number(value, name: str) -> float:
    """``value`` as a float; a clear TypeError for what is not a number (strings and bools included: True would
    pass as 1.0)."""
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name}={value!r} must be a number, not a string")
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}={value!r} must be a number, not a bool")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}={value!r} must be a number") from None


def f32_scale(value: float) -> bool:
    """Whether ``value`` is a positive normal float32 (so neither it nor a product with it is 0 or inf)."""
    return _F32_MIN_NORMAL <= value <= _F32_MAX


def resolve_flag(value, name: str) -> bool:
    """A boolean argument (``causal``) as a bool: True / False, numpy's bools or the ints 0 / 1. Anything else
    (a string such as "False", None, a tensor) is a TypeError rather than its Python truthiness."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, numbers.Integral) and value in (0, 1):
        return bool(value)
    raise TypeError(f"{name}={value!r} must be True or False")


# Boolean arguments that only tune speed or are taken for FlashInfer's signatures (disable_split_kv is the one with
# an effect): plan_arguments checks those a plan() takes.
FLAG_ARGUMENTS = ("disable_split_kv", "non_blocking", "use_tensor_cores", "use_fp16_qk_reduction", "enable_pdl")


def check_flag(value, name: str) -> None:
    """One of FLAG_ARGUMENTS: None or what ``resolve_flag`` takes, so a string such as "False" is a TypeError rather
    than silently its truthiness (two identity tests on the hot path)."""
    if value is not None and value is not True and value is not False:
        resolve_flag(value, name)


def check_flags(**flags) -> None:
    """``check_flag`` of each."""
    for name, value in flags.items():
        check_flag(value, name)


def resolve_window_left(value) -> int:
    """``window_left`` as an int: -1 (None) for no window, else the number of keys left of the query kept."""
    if value is None:
        return -1
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"window_left={value!r} must be an int (-1 or None: no window)")
    value = int(value)
    if not -1 <= value <= _INT32_MAX:
        raise ValueError(f"window_left={value} must be -1 (no window) or in [0, 2**31 - 1]")
    return value


def resolve_scalars(
    *, head_dim_qk: int, causal: bool, pos_encoding: PosEncoding, window_left: int | None,
    logits_soft_cap: float | None, sm_scale: float | None, rope_scale: float | None, rope_theta: float | None,
) -> AttentionScalars:
    """Validate run-time scalars and apply FlashInfer's defaults."""
    check_head_dim(head_dim_qk, "head_dim_qk")
    window_left = resolve_window_left(window_left)
    cap = 0.0 if logits_soft_cap is None else number(logits_soft_cap, "logits_soft_cap")
    if not (cap == 0 or f32_scale(cap)):
        raise ValueError(f"logits_soft_cap={logits_soft_cap} must be None, 0 (off) or a positive finite number")
    scale = 1.0 / math.sqrt(head_dim_qk) if sm_scale is None else number(sm_scale, "sm_scale")
    if not f32_scale(scale):
        raise ValueError(f"sm_scale={sm_scale} must be a positive finite number within float32's normal range")
    rope_scale = 1.0 if rope_scale is None else number(rope_scale, "rope_scale")
    rope_theta = 1e4 if rope_theta is None else number(rope_theta, "rope_theta")
    for name, value in (("rope_scale", rope_scale), ("rope_theta", rope_theta)):
        # the kernels take the reciprocal in float32: both must be normal float32 numbers
        if not (f32_scale(value) and f32_scale(1.0 / value)):
            raise ValueError(f"{name}={value} must be a positive finite number (its reciprocal too, in float32)")
    return AttentionScalars(
        causal=bool(causal), pos_encoding=pos_encoding, window_left=window_left, sm_scale=scale,
        logits_soft_cap=cap, rope_scale=rope_scale, rope_theta=rope_theta,
    )


def per_tensor_scale(value, name: str) -> float | None:
    """FlashInfer's scale_q/scale_k/scale_v arguments: None, or one value per tensor (a float or a one-element
    tensor); per-head scales are refused."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() != 1:
        raise NotImplementedError(f"{name} with {value.numel()} values (per-head scales) is not supported; "
                                  "pass one per-tensor scale")
    return fp8_scale(value, name)


def fp8_scale(value: float | torch.Tensor | None, name: str) -> float:
    """A per-tensor fp8 dequantization scale as a float (None means 1)."""
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if torch.compiler.is_compiling():  # (traced, its value becomes a data-dependent guard Dynamo cannot make)
            raise NotImplementedError(f"{name} as a tensor is not supported under torch.compile (the value is read "
                                      "on the host); pass a Python float")
        if value.numel() != 1:
            raise ValueError(f"{name} must be a float or a one-element tensor (per-tensor scale)")
        if value.device.type != "cpu":
            raise ValueError(f"{name} on {value.device} would need a device sync; pass a Python float")
        value = value.item()
    value = number(value, name)
    if not f32_scale(value):
        raise ValueError(f"{name}={value} must be a positive finite number (a dequantization scale)")
    return value


def resolve_batch_invariant(value: bool | None) -> bool:
    """A plan's ``batch_invariant`` argument: True/False, or None for the ``JITATTN_BATCH_INVARIANT`` knob."""
    if value is None:
        return env.batch_invariant()
    if not isinstance(value, bool):
        raise TypeError(f"batch_invariant={value!r} must be True, False or None (None: JITATTN_BATCH_INVARIANT)")
    return value


# The hint for FlashInfer's trtllm-gen page-table inputs (block_tables, seq_lens, ...).
PAGE_TABLE_HINT = ("describe the batch with the page table arguments (indptr / indices / last_page_len) instead "
                   "of trtllm-gen's block_tables / seq_lens")


def per_level(name: str, values, levels: int) -> list:
    """A per-level argument (``qo_indptr_buf_arr`` and the like) as a list of ``levels`` entries; None: None each."""
    if values is None:
        return [None] * levels
    if isinstance(values, torch.Tensor) or not hasattr(values, "__len__") or len(values) != levels:
        got = ("is a tensor" if isinstance(values, torch.Tensor) else f"has {len(values)} entries"
               if hasattr(values, "__len__") else f"is {type(values).__name__} {values!r}")
        raise ValueError(f"{name} {got}; give a list of one entry per level (num_levels={levels})")
    return list(values)

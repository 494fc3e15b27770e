"""Routes of a prefill plan around the kernel: an fp8 paged cache gathered into 16-bit rows
(``JITATTN_PREFILL_FP8_UPCAST``) and RoPE applied before the kernel (``JITATTN_PREFILL_ROPE_FIRST``), each taken
where the kernel it leads to is the Hopper tier's (``auto``), asked for (``on`` / ``plan(...=True)``) or never
(``off``); never under CUDA graphs, whose fixed buffers the copies are not.

The prefill wrappers call these from ``plan()`` and keep what they return beside the plan; ``run()`` applies it
(``runtime/kv_upcast.py``, ``runtime/rope_first.py``).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .. import env, hardware
from ..kernels import prefill as prefill_kernels
from ..page_table import PagedIndex, check_indptr
from ..runtime.builder import attention_options, kernel_spec
from ..runtime.kv_upcast import KVUpcast
from ..runtime.options import parse_pos_encoding, resolve_dtypes, resolve_flag
from ..runtime.rope_first import OPERAND_DTYPE, RopeFirst
from ..spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target


class PlanSite(NamedTuple):
    """The wrapper a plan is made for: its name (for errors), target, device and whether it captures graphs."""

    name: str
    target: Target
    device: torch.device
    use_cuda_graph: bool


def prefill_options(num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, options: dict, **changes):
    """The ``AttentionOptions`` of a prefill plan of ``options`` (plan()'s keywords) with ``changes``."""
    o = {**options, **changes}
    masked = o["custom_mask"] is not None or o["packed_custom_mask"] is not None or \
        o["multi_item"].get("prefix_len_ptr") is not None
    return attention_options(
        Op.PREFILL, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk,
        head_dim_vo=o["head_dim_vo"], q_data_type=o["q_data_type"], kv_data_type=o["kv_data_type"],
        o_data_type=o["o_data_type"], pos_encoding_mode=o["pos_encoding_mode"],
        mask_mode=MaskMode.CUSTOM if masked else MaskMode.CAUSAL if resolve_flag(o["causal"], "causal")
        else MaskMode.NONE, window_left=o["window_left"], logits_soft_cap=o["logits_soft_cap"],
        sm_scale=o["sm_scale"], rope_scale=o["rope_scale"], rope_theta=o["rope_theta"], variant=o["variant"])


def takes_sm90(target: Target, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, options: dict,
               **changes) -> bool:
    """Whether the prefill plan of ``options`` with ``changes`` runs on the Hopper tier (over ragged KV)."""
    if target is not Target.CUDA:
        return False
    twin = prefill_options(num_qo_heads, num_kv_heads, head_dim_qk, options, **changes)
    spec = kernel_spec(twin, Target.CUDA, KVLayout.NHD, KVStorage.RAGGED)
    return prefill_kernels.tier(spec, hardware.known_arch_list()) == "sm90"


def _mode(site: PlanSite, choice: bool | None, argument: str, knob: str, read) -> str:
    """'off', 'on' or 'auto' from plan()'s ``argument`` (None: the knob's value), checked."""
    if choice is not None and not isinstance(choice, bool):
        raise TypeError(f"{argument}={choice!r} must be True, False or None (None: {knob})")
    if choice and site.use_cuda_graph:
        raise ValueError(f"{site.name}.plan({argument}=True) with use_cuda_graph=True: the copies a run() makes have "
                         f"no fixed buffer to be captured in; leave {argument} unset or False")
    mode = read() if choice is None else "on" if choice else "off"
    return "off" if site.use_cuda_graph else mode


def rope_first_route(site: PlanSite, previous: RopeFirst | None, qo_indptr: torch.Tensor,
                     kv_indptr_host: Callable[[], torch.Tensor], num_qo_heads: int, num_kv_heads: int,
                     head_dim_qk: int, options: dict, choice: bool | None) -> tuple[dict, RopeFirst] | None:
    """A ``ROPE_LLAMA`` plan's RoPE done before the kernel: the options of the f16 plan without RoPE and the
    rotation (its angle table shared with ``previous`` where it covers the positions), or None (RoPE stays in the
    kernel). ``choice``: plan()'s ``rope_first``; ``kv_indptr_host``: gives the keys' ragged indptr (called only
    when the route is taken: a plan without RoPE does not pay for it)."""
    mode = _mode(site, choice, "rope_first", "JITATTN_PREFILL_ROPE_FIRST", env.prefill_rope_first)
    if mode == "off" or parse_pos_encoding(options["pos_encoding_mode"]) is not PosEncoding.ROPE_LLAMA:
        return None
    planned = prefill_options(num_qo_heads, num_kv_heads, head_dim_qk, options)
    if planned.q_dtype.itemsize != 2:
        return None
    changes = dict(pos_encoding_mode="NONE", q_data_type=OPERAND_DTYPE, kv_data_type=OPERAND_DTYPE,
                   o_data_type=planned.o_dtype, rope_scale=None, rope_theta=None)
    if mode == "auto" and not takes_sm90(site.target, num_qo_heads, num_kv_heads, head_dim_qk, options, **changes):
        return None
    rope = RopeFirst(check_indptr("qo_indptr", qo_indptr), kv_indptr_host(), head_dim=head_dim_qk,
                     rope_scale=planned.scalars.rope_scale, rope_theta=planned.scalars.rope_theta,
                     device=site.device, previous=previous)
    return {**options, **changes}, rope


def fp8_upcast_route(site: PlanSite, kv_layout: KVLayout, index: PagedIndex, num_qo_heads: int,
                     num_kv_heads: int, head_dim_qk: int, options: dict, choice: bool | None) -> KVUpcast | None:
    """The gather that turns a paged plan of fp8 KV into one of 16-bit ragged KV, or None. ``choice``: plan()'s
    ``fp8_upcast``. Only from ``plan()`` (a cascade level plans through ``plan_checked``; the POD and
    BatchAttention wrappers pass False: they launch the paged plan's kernel themselves)."""
    mode = _mode(site, choice, "fp8_upcast", "JITATTN_PREFILL_FP8_UPCAST", env.prefill_fp8_upcast)
    if mode == "off":
        return None
    q_dtype, kv_dtype = resolve_dtypes(options["q_data_type"], options["kv_data_type"])
    if kv_dtype.itemsize != 1 or q_dtype.itemsize != 2:
        return None
    if mode == "auto" and not takes_sm90(site.target, num_qo_heads, num_kv_heads, head_dim_qk, options,
                                         q_data_type=q_dtype, kv_data_type=q_dtype):
        return None  # only where the 16-bit kernel is the Hopper tier's
    return paged_gather(site, kv_layout, index, num_kv_heads, head_dim_qk, options, q_dtype)


def paged_gather(site: PlanSite, kv_layout: KVLayout, index: PagedIndex, num_kv_heads: int, head_dim_qk: int,
                 options: dict, out_dtype: torch.dtype) -> KVUpcast:
    """The gather of a paged plan's pages (``options``: plan()'s keywords) into ragged ``out_dtype`` rows."""
    _, kv_dtype = resolve_dtypes(options["q_data_type"], options["kv_data_type"])
    head_dim_vo = head_dim_qk if options["head_dim_vo"] is None else options["head_dim_vo"]
    return KVUpcast(index, kv_layout, num_kv_heads=num_kv_heads, head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo,
                    kv_dtype=kv_dtype, out_dtype=out_dtype, device=site.device)

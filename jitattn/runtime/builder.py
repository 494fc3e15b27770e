"""Building an attention plan: options -> run-time scalars -> spec -> kernel -> one upload -> ``AttentionPlan``.

Decode, paged and ragged prefill (and cascade, through the prefill wrapper) all plan here. The
wrappers validate their own page tables and masks into a ``HostIndex`` and choose the split;
everything after that is the same for every op.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from .. import hardware
from ..log import get_logger
from ..kernels.prefill_sm90 import mask_states_bytes
from ..jit import Module, load
from ..page_table import PagedIndex
from ..kv_split import KVSplit
from ..spec import KVLayout, KVStorage, MaskMode, Op, Target, VariantSpec
from ..variant import AttentionVariant
from .batch import AttentionPlan, log_plan, upload, upload_int32
from .checks import cpu_threads, stream_capturing
from .launch import PreparedAttention
from .options import (
    AttentionOptions, check_head_dim, parse_dtype, parse_pos_encoding, resolve_dtypes, resolve_scalars,
)
from .specs import attention_spec


# Options of recent plans by their arguments (with their types, so 1, 1.0 and True stay apart): a serving
# loop plans the same options every step. Only plain values are keys; AttentionOptions is immutable.
_OPTIONS: dict[tuple, AttentionOptions] = {}
_PLAIN = frozenset((str, int, float, bool, type(None), torch.dtype, Op, MaskMode))


def attention_options(
    op: Op, *, num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int | None = None,
    q_data_type, kv_data_type, data_type=None, o_data_type=None, pos_encoding_mode="NONE",
    mask_mode: MaskMode = MaskMode.NONE, window_left: int | None = -1, logits_soft_cap: float | None = None,
    sm_scale: float | None = None, rope_scale: float | None = None, rope_theta: float | None = None,
    variant: AttentionVariant | None = None,
) -> AttentionOptions:
    """Parse and default one plan's options (FlashInfer spellings accepted); raises naming a bad one."""
    values = (op, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, q_data_type, kv_data_type, data_type,
              o_data_type, pos_encoding_mode, mask_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
              rope_theta)
    types = tuple(map(type, values))
    key = (values, types) if variant is None and _PLAIN.issuperset(types) else None
    options = _OPTIONS.get(key) if key is not None else None
    if options is None:
        options = _parse_options(op, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, q_data_type, kv_data_type,
                                 data_type, o_data_type, pos_encoding_mode, mask_mode, window_left, logits_soft_cap,
                                 sm_scale, rope_scale, rope_theta, variant)
        if key is not None:
            if len(_OPTIONS) >= 256:
                _OPTIONS.clear()
            _OPTIONS[key] = options
    return options


def _parse_options(op, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo, q_data_type, kv_data_type, data_type,
                   o_data_type, pos_encoding_mode, mask_mode, window_left, logits_soft_cap, sm_scale, rope_scale,
                   rope_theta, variant) -> AttentionOptions:
    for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):  # (before the spec caches: 8.0 == 8)
            raise TypeError(f"{name}={value!r} must be an int")
    if variant is not None and not isinstance(variant, AttentionVariant):  # (before the spec caches hash it)
        hint = " (AttentionVariant.from_dict(d) makes one of a dict)" if isinstance(variant, dict) else ""
        raise TypeError(f"variant must be a jitattn.AttentionVariant or None; got {type(variant).__name__}{hint}")
    head_dim_qk = check_head_dim(head_dim_qk, "head_dim_qk" if op is Op.PREFILL else "head_dim")  # numpy ints too
    head_dim_vo = head_dim_qk if head_dim_vo is None else check_head_dim(head_dim_vo, "head_dim_vo")
    q_dtype, kv_dtype = resolve_dtypes(q_data_type, kv_data_type, data_type)
    o_dtype = parse_dtype(o_data_type, "o_data_type") if o_data_type is not None else q_dtype
    pos = parse_pos_encoding(pos_encoding_mode)
    scalars = resolve_scalars(
        head_dim_qk=head_dim_qk, causal=mask_mode is MaskMode.CAUSAL, pos_encoding=pos, window_left=window_left,
        logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
    )
    return AttentionOptions(op, q_dtype, kv_dtype, o_dtype, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo,
                            pos, mask_mode, scalars, variant)


def kernel_spec(options: AttentionOptions, target: Target, kv_layout: KVLayout, storage: KVStorage) -> VariantSpec:
    """The spec of the kernel that runs ``options`` (the one function the wrappers and the CLI share)."""
    return attention_spec(
        options.op, target, q_dtype=options.q_dtype, kv_dtype=options.kv_dtype, o_dtype=options.o_dtype,
        head_dim_qk=options.head_dim_qk, head_dim_vo=options.head_dim_vo, num_qo_heads=options.num_qo_heads,
        num_kv_heads=options.num_kv_heads, pos_encoding=options.pos_encoding,
        use_sliding_window=options.scalars.window_left >= 0, use_logits_soft_cap=options.scalars.logits_soft_cap > 0,
        mask_mode=options.mask_mode, kv_layout=kv_layout, kv_storage=storage, variant=options.variant,
    )


@dataclass(frozen=True)
class HostIndex:
    """One batch's validated index arrays, on the host."""

    qo_indptr: torch.Tensor  # int32 [batch + 1]
    kv_indptr: torch.Tensor  # int32 [batch + 1]: pages (paged) or rows of k/v (ragged)
    paged: PagedIndex | None  # None: ragged KV
    mask: torch.Tensor | None = None  # bit-packed uint8 custom mask
    mask_indptr: torch.Tensor | None = None  # int32 byte offsets per request

    @property
    def batch_size(self) -> int:
        return self.qo_indptr.numel() - 1


def make_plan(
    wrapper: str, spec: VariantSpec, module: Module, options: AttentionOptions, kv_layout: KVLayout, *,
    qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor | None,
    kv_last_page_len: torch.Tensor | None, custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None,
    index: PagedIndex | None, total_qo: int, total_kv: int | None, split: KVSplit,
    split_indptr: torch.Tensor | None, use_cuda_graph: bool, workspace_bytes: int = 0,
    split_counters: torch.Tensor | None = None, launch: PreparedAttention | None = None,
    mask_states: torch.Tensor | None = None,
) -> AttentionPlan:
    """An ``AttentionPlan`` over index arrays already on the device (its launch struct filled once).

    ``launch``: a prepared launch of the same kernel, options, batch, page size and split, already
    pointed at these arrays (``PreparedAttention.point_at``): used instead of filling a new one."""
    plan = AttentionPlan(
        split_counters=split_counters, launch=launch,
        spec=spec, module=module, options=options,
        page_size=index.page_size if index is not None else None, kv_layout=kv_layout, total_qo=total_qo,
        qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
        custom_mask=custom_mask, mask_indptr=mask_indptr, index=index, split=split, split_indptr=split_indptr,
        total_kv=total_kv, use_cuda_graph=use_cuda_graph, wrapper=wrapper, mask_states=mask_states,
    )
    log_plan(wrapper, plan, workspace_bytes)
    return plan


def upload_mask(host: torch.Tensor, device: torch.device, buffer: torch.Tensor | None = None) -> torch.Tensor:
    """``upload`` of a packed custom mask (uint8). On cuda the sm90 prefill kernel reads a mask row in aligned 4-byte
    words, the last of which may reach up to 3 bytes past the mask's end (its bits there are never used), so a
    copy of the plan's own is 4 zero bytes longer: no read leaves the allocation (compute-sanitizer memcheck). A
    caller's fixed ``buffer`` (CUDA graphs) is used as it is."""
    if buffer is not None or device.type != "cuda":
        return upload(host, device, buffer, "custom_mask")
    n = host.numel()
    padded = torch.empty(n + 4, dtype=torch.uint8, device=device)
    padded[:n].copy_(host.reshape(-1))
    padded[n:].zero_()
    return padded[: max(n, 1)]


def _check_graph_mask_buffers(wrapper: str, buffers: dict[str, torch.Tensor | None]) -> None:
    """A custom mask planned by a ``use_cuda_graph=True`` wrapper goes into the caller's fixed buffers: a captured run
    reads the mask where the plan of its capture put it, so a copy of each plan's own would leave replays reading a
    stale or freed one (FlashInfer refuses a mask without them too). Multi-item scoring is planned as such a mask
    here, so it needs them as well. The cpu target has no graphs, but refuses the same plans (the same program
    moved to cuda must not change behaviour)."""
    missing = [arg for role, arg in (("custom_mask", "custom_mask_buf"), ("mask_indptr", "mask_indptr_buf"))
               if buffers.get(role) is None]
    if missing:
        raise ValueError(f"{wrapper}.plan(): a custom mask (custom_mask, packed_custom_mask, or the one multi-item "
                         f"scoring's prefix_len_ptr builds) under use_cuda_graph=True needs the fixed buffers "
                         f"{' and '.join(missing)}: construct the wrapper with them, sized for the largest mask "
                         "(uint8: its packed bytes plus 4, as the sm90 kernel reads whole 4-byte words; int32: "
                         "batch_size + 1); a captured run() reads the mask where its plan put it")


def build_plan(
    wrapper: str, target: Target, device: torch.device, kv_layout: KVLayout, options: AttentionOptions,
    host: HostIndex, split: KVSplit, buffers: dict[str, torch.Tensor | None], use_cuda_graph: bool,
    workspace_bytes: int = 0, spec: VariantSpec | None = None, split_counters: torch.Tensor | None = None,
    launch: PreparedAttention | None = None,
) -> AttentionPlan:
    """Load the kernel for ``options`` and upload ``host``'s arrays (one copy, or into the fixed buffers).

    ``spec``: the kernel's spec when the caller already computed it (decode does, to size its split).
    ``launch``: a paged plan's prepared launch of the same kernel, options, batch, page size, split and
    counters (the previous plan's, which must no longer be in use): pointed at the uploaded arrays and
    used instead of filling a new one."""
    if use_cuda_graph and host.mask is not None:
        _check_graph_mask_buffers(wrapper, buffers)
    if spec is None:
        storage = KVStorage.PAGED if host.paged is not None else KVStorage.RAGGED
        spec = kernel_spec(options, target, kv_layout, storage)
    module = load(spec)
    paged = host.paged
    # kv_indptr checked first: a decode wrapper's own qo_indptr buffer is sized by the caller's kv_indptr buffer,
    # so a batch too large for both is reported as the caller's
    arrays = [("kv_indptr", host.kv_indptr), ("qo_indptr", host.qo_indptr)]
    if paged is not None:
        arrays += [("kv_indices", paged.indices), ("kv_last_page_len", paged.last_page_len)]
    if host.mask_indptr is not None:
        arrays.append(("mask_indptr", host.mask_indptr))
    if split.kv_chunk_size or buffers.get("split_indptr") is not None:
        arrays.append(("split_indptr", split.host_indptr()))
    on_device = dict(zip((name for name, _ in arrays), upload_int32(
        [(name, array, buffers.get(name)) for name, array in arrays], device)))
    mask = upload_mask(host.mask, device, buffers.get("custom_mask")) if host.mask is not None else None
    # Read through numpy (an int32 tensor never requires grad): indexing the tensor costs a few µs more.
    total_qo = int(host.qo_indptr.numpy()[-1])
    total_kv = None if paged is not None else int(host.kv_indptr.numpy()[-1])
    if launch is not None:
        launch.point_at(on_device["qo_indptr"], on_device["kv_indptr"], on_device["kv_indices"],
                        on_device["kv_last_page_len"], on_device.get("split_indptr"))
    return make_plan(
        wrapper, spec, module, options, kv_layout, qo_indptr=on_device["qo_indptr"],
        kv_indptr=on_device["kv_indptr"], kv_indices=on_device.get("kv_indices"),
        kv_last_page_len=on_device.get("kv_last_page_len"), custom_mask=mask, mask_indptr=on_device.get("mask_indptr"),
        index=paged, total_qo=total_qo, total_kv=total_kv,
        split=split, split_indptr=on_device.get("split_indptr"), use_cuda_graph=use_cuda_graph,
        workspace_bytes=workspace_bytes, split_counters=split_counters, launch=launch,
        mask_states=_mask_states_buffer(wrapper, module, host, split, buffers, use_cuda_graph, device),
    )


# Under CUDA graphs a wrapper's first custom-mask plan allocates its blocks' states buffer, fixed from then on (a
# capture keeps its address): GRAPH_MASK_STATES_HEADROOM times that plan's bytes, at least GRAPH_MASK_STATES_MIN. A
# later plan that needs more finds a header of 0 there, and its kernel classifies blocks itself (exact, slower).
GRAPH_MASK_STATES_HEADROOM = 4
GRAPH_MASK_STATES_MIN = 1 << 20


def _mask_states_buffer(wrapper: str, module: Module, host: HostIndex, split: KVSplit,
                        buffers: dict[str, torch.Tensor | None], use_cuda_graph: bool,
                        device: torch.device) -> torch.Tensor | None:
    """The zeroed buffer the module's blocks' states go into (a module with a ``mask_states`` entry: the sm90
    tier's custom-mask kernels, ``kernels.prefill_sm90``): the plan's own, or under CUDA graphs the wrapper's
    (``buffers["mask_states"]``, made by its first such plan); None: none (the kernel classifies blocks from the
    mask rows). Not for a split plan (its launches' ``workspace`` is the float workspace's split-KV partials), an
    empty batch, or a plan made inside a CUDA graph capture (its writes would replay over later plans' states)."""
    if host.mask is None or split.kv_chunk_size or "mask_states" not in module.entry_names or stream_capturing():
        return None
    qo = host.qo_indptr.numpy()
    kv_lens = (host.paged.kv_len_array if host.paged is not None else np.diff(host.kv_indptr.numpy())).tolist()
    needed = mask_states_bytes(module.spec, np.diff(qo).tolist(), kv_lens)
    if not needed:
        return None
    if not use_cuda_graph:
        return torch.zeros(needed, dtype=torch.uint8, device=device)
    states = buffers.get("mask_states")
    if states is None:
        states = torch.empty(max(GRAPH_MASK_STATES_HEADROOM * needed, GRAPH_MASK_STATES_MIN), dtype=torch.uint8,
                             device=device)
        buffers["mask_states"] = states
    elif needed > states.numel():
        get_logger().info("%s.plan(): the blocks' states of this custom mask take %d bytes, the wrapper's buffer "
                          "(sized by its first custom-mask plan) %d: its kernel classifies blocks itself (slower)",
                          wrapper, needed, states.numel())
    states[:needed].zero_()  # (the rows' ends are raised by atomicMax; a plan past the end gets header 0)
    return states


def num_workers(device: torch.device) -> int:
    """The parallel workers a schedule spreads over: the SMs of a CUDA device, the OpenMP threads on the cpu."""
    return hardware.num_sms(device.index or 0) if device.type == "cuda" else cpu_threads()

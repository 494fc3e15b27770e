"""What decode and prefill wrappers share: the stored plan and the run step.

``plan()`` (in each wrapper) validates and uploads everything once and
stores an ``AttentionPlan``; ``run_plan`` checks the per-call tensors
against it and launches. ``run_plan`` never synchronises the device.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from ..jit import Module, load
from ..log import get_logger
from ..page_table import PagedIndex, check_page_pool
from ..kv_split import KVSplit, split_workspace_bytes
from ..spec import KVLayout, Op, VariantSpec
from .checks import (FP8_DTYPES, byte_extent, check_no_overlap, check_planned_dtype, check_tensor, not_planned,
                     outputs_meet_inputs, refuse_in_workspace, refuse_outputs_over_inputs, stream_capturing, target_of)
from .grad import claim_outputs
from .kv import check_kv_pair, split_paged_kv_cache
from .launch import PreparedAttention, write_mask_states
from .options import AttentionOptions
from .variant_args import VariantArgs, unexpected_run_arguments


@dataclass
class AttentionPlan:
    spec: VariantSpec
    module: Module
    options: AttentionOptions  # dtypes, heads, head dims, run-time scalars
    page_size: int | None  # None: ragged KV
    kv_layout: KVLayout
    total_qo: int  # rows of q the plan covers
    qo_indptr: torch.Tensor  # on the device
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor | None
    kv_last_page_len: torch.Tensor | None
    custom_mask: torch.Tensor | None
    mask_indptr: torch.Tensor | None
    index: PagedIndex | None
    split: KVSplit
    split_indptr: torch.Tensor | None
    total_kv: int | None = None  # ragged: rows of k/v the plan covers
    use_cuda_graph: bool = False  # index tensors live in fixed caller buffers
    # the params struct, filled once here; or given (fast_decode_plan's, re-pointed at this plan's arrays)
    launch: PreparedAttention | None = None
    checked_signature: tuple | None = None  # q/kv shapes, strides, dtypes, devices that passed the checks
    checked_outputs: tuple | None = None  # the same for out/lse
    checked_workspace: torch.Tensor | None = None  # the workspace that passed the size check
    workspace_region: tuple[int, int] = (0, 0)  # its bytes the split-KV partials take (start, end addresses)
    extents: tuple[int, ...] = (0,) * 5  # bytes of q, k, v, out, lse from their pointers (set with their checks)
    kv_offsets: tuple[int, int] | None = None  # k/v pointers relative to a one-tensor cache's
    variant_args: VariantArgs | None = None  # the variant's struct (spec.variant only), filled per run()
    wrapper: str = ""
    kv_pointer_alignment: int = 16  # bytes; set from kv_alignment()
    split_counters: torch.Tensor | None = None  # the wrapper's zeroed split-KV chunk counters (None: the plan's own)
    q_rows: int = 0  # rows of q the plan reads: total_qo, or fewer when rows repeat (share_queries)
    # the sm90 custom-mask kernel's zeroed block states buffer (None: none), written at plan time (write_mask_states)
    mask_states: torch.Tensor | None = None
    # The use_sinks twin of ``launch`` (same plan): made by the first run() with sinks, or at plan time when asked.
    sink_launch: PreparedAttention | None = None

    # The options the run path reads, as attributes of the plan.
    scalars = property(lambda self: self.options.scalars)
    q_dtype = property(lambda self: self.options.q_dtype)
    kv_dtype = property(lambda self: self.options.kv_dtype)
    o_dtype = property(lambda self: self.options.o_dtype)
    num_qo_heads = property(lambda self: self.options.num_qo_heads)
    num_kv_heads = property(lambda self: self.options.num_kv_heads)
    head_dim_qk = property(lambda self: self.options.head_dim_qk)
    head_dim_vo = property(lambda self: self.options.head_dim_vo)

    def __post_init__(self) -> None:
        self.q_rows = self.q_rows or self.total_qo
        self.kv_pointer_alignment = kv_alignment(self)[0]
        if self.spec.variant is not None:
            self.variant_args = VariantArgs(self.spec.variant, self.wrapper or "wrapper")
        if self.launch is None:
            self.launch = self._prepare(self.module)
        if self.spec.use_sinks:
            self.sink_launch = self.launch
        if self.mask_states is not None:
            write_mask_states(self.launch, self.mask_states)

    def _prepare(self, module: Module) -> PreparedAttention:
        prepared = PreparedAttention(
            module, qo_indptr=self.qo_indptr, kv_indptr=self.kv_indptr, kv_indices=self.kv_indices,
            kv_last_page_len=self.kv_last_page_len, page_size=self.page_size or 1, kv_layout=self.kv_layout,
            custom_mask=self.custom_mask, mask_indptr=self.mask_indptr, num_qo_heads=self.num_qo_heads,
            num_kv_heads=self.num_kv_heads, head_dim_qk=self.head_dim_qk, head_dim_vo=self.head_dim_vo,
            scalars=self.scalars, split_indptr=self.split_indptr if self.split.kv_chunk_size else None,
            kv_chunk_size=self.split.kv_chunk_size,
            variant_params=self.variant_args.address if self.variant_args is not None else None,
            # A captured split launch (batch-invariant decode under CUDA graphs) must size its grid by the
            # whole workspace: the chunk count of a later plan may differ from the captured one's.
            split_workspace_bytes=split_workspace_bytes(self.split.num_chunks, self.num_qo_heads, self.head_dim_vo)
            if self.split.kv_chunk_size and not self.use_cuda_graph else 0,
            split_counters=self.split_counters,
        )
        prepared.params.q_row_period = self.q_rows if self.q_rows != self.total_qo else 0
        prepared.params.short_items = int(self.split.short_items)
        return prepared

    def sink_launch_ready(self) -> PreparedAttention:
        """The launch of this plan's kernel built with ``use_sinks`` (loaded once per plan, a cache hit after
        the first build)."""
        if self.sink_launch is None:
            if self.spec.variant is not None:
                raise ValueError(
                    f"{self.wrapper}.run(sinks=...) with a custom variant is not supported; add the sink to the "
                    "variant (a tensor parameter) or plan without the variant"
                )
            self.sink_launch = self._prepare(load(_sink_twin(self.spec)))
            if self.mask_states is not None:
                write_mask_states(self.sink_launch, self.mask_states)
            self.checked_signature = self.checked_outputs = None  # the twin's strides are set by the next checks
        return self.sink_launch

    def launches(self) -> tuple[PreparedAttention, ...]:
        """Every prepared launch of this plan (strides are set on all of them together)."""
        if self.sink_launch is None or self.sink_launch is self.launch:
            return (self.launch,)
        return (self.launch, self.sink_launch)


@functools.lru_cache(maxsize=256)  # every plan() of a serving loop asks for the same twin; validation is not free
def _sink_twin(spec: VariantSpec) -> VariantSpec:
    return spec.replace(use_sinks=True)


def share_queries(plan: AttentionPlan, q_rows: int) -> None:
    """Make ``plan`` read query row ``t % q_rows`` for output row t (q then has ``q_rows`` rows).

    A cascade level cut into chunks is one batch whose chunks all attend with the same queries:
    this lets them read those queries in place instead of a repeated copy."""
    if plan.total_qo % max(1, q_rows):
        raise ValueError(f"total_qo={plan.total_qo} is not a multiple of q_rows={q_rows}")
    plan.q_rows = q_rows
    for launch in plan.launches():
        launch.params.q_row_period = q_rows
    plan.checked_signature = None


def check_fits(host: torch.Tensor, device: torch.device, buffer: torch.Tensor, name: str) -> None:
    """Raise unless the fixed ``buffer`` can take ``host`` (its dtype, its device, enough entries)."""
    if buffer.dim() != 1:
        raise ValueError(f"{name} buffer has shape {tuple(buffer.shape)}; it must be one-dimensional: allocate it "
                         f"with torch.empty(n, dtype={host.dtype})")
    if not buffer.is_contiguous():  # written through its strides, read by the kernels as packed from data_ptr
        raise ValueError(f"{name} buffer (strides {tuple(buffer.stride())}) is not contiguous: the kernels read it "
                         "packed; allocate it with torch.empty")
    if buffer.dtype != host.dtype or buffer.device != device or buffer.numel() < host.numel():
        fix = (f"allocate it as {host.dtype}" if buffer.dtype != host.dtype else
               f"allocate it on {device}" if buffer.device != device else "allocate it for the largest batch")
        raise ValueError(
            f"{name} buffer ({buffer.numel()} x {buffer.dtype} on {buffer.device}) cannot hold "
            f"{host.numel()} x {host.dtype} on {device}; {fix}"
        )


def upload(host: torch.Tensor, device: torch.device, buffer: torch.Tensor | None = None, name: str = "") -> torch.Tensor:
    """Copy a host tensor to ``device`` (into ``buffer`` when given, as CUDA-graph mode requires).

    Always a copy, also on the cpu target: the caller may refill its index tensors for the
    next batch while this plan is still in use. Into a cuda ``buffer`` the copy is ordered on the
    current stream without the host waiting: launches that read the buffer run on that stream.
    """
    if buffer is None:
        return host.to(device, non_blocking=False) if device.type != "cpu" else host.clone()
    check_fits(host, device, buffer, name)
    if device.type == "cuda":  # through page-locked memory, ordered on the stream: the host does not wait for
        # the GPU (a captured step's buffers can be refilled for the next replay while this one runs)
        staged = pinned_staging(host.numel(), host.dtype)
        staged.copy_(host.reshape(-1))
        buffer[: host.numel()].copy_(staged, non_blocking=True)
    else:
        buffer[: host.numel()].copy_(host)
    # The same address, its length the batch's (qo_indptr sizes the launch). An empty array (a page table
    # of no pages) is the buffer's first entry instead, never read: an empty view has no address, and a
    # launch captured with a stand-in pointer would go on reading it after later plans filled the buffer.
    return buffer[: max(host.numel(), 1)]


def pinned_staging(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A page-locked staging buffer of ``n`` entries from torch's caching host allocator.

    A pageable buffer costs page faults and a bounce copy (hundreds of µs for a 64k-page table
    on some hosts); a pinned one is copied by DMA. Copied with ``non_blocking=True`` and then
    dropped, the allocator reuses the block only once that copy is done, so ``plan()`` never
    waits for the GPU (the host can plan the next step while this one runs). Not
    ``Tensor.pin_memory()``: that first asks the driver whether the tensor is pinned (~0.3 ms a call).
    """
    return torch.empty(n, dtype=dtype, pin_memory=True)


def upload_int32(
    arrays: list[tuple[str, torch.Tensor, torch.Tensor | None]], device: torch.device,
) -> list[torch.Tensor]:
    """Upload several int32 host arrays: into their fixed buffers when given, the rest in one copy.

    One host-to-device copy instead of one per array keeps ``plan()`` cheap; each
    array starts on a 16-byte boundary of the shared device tensor.
    """
    out: list[torch.Tensor | None] = [None] * len(arrays)
    packed: list[tuple[int, torch.Tensor]] = []
    for name, host, buffer in arrays:  # every fixed buffer checked before any is written: a refused plan leaves
        if buffer is not None:         # the current plan's arrays as they were
            check_fits(host, device, buffer, name)
    for i, (name, host, buffer) in enumerate(arrays):
        if buffer is not None or device.type == "cpu":
            out[i] = upload(host, device, buffer, name)
        else:
            packed.append((i, host))
    if packed:
        offsets, total = [], 0
        for _, host in packed:
            offsets.append(total)
            total += (host.numel() + 3) // 4 * 4
        staging = pinned_staging(total)
        staging_np = staging.numpy()  # numpy slice copies: a memcpy each, without torch's per-op overhead
        for offset, (_, host) in zip(offsets, packed):
            staging_np[offset: offset + host.numel()] = host.numpy()
        on_device = staging.to(device, non_blocking=True)
        for offset, (i, host) in zip(offsets, packed):
            out[i] = on_device[offset: offset + host.numel()]
    return out


class WorkspaceTooSmall(ValueError):
    """The float workspace cannot hold a plan's split-KV partial states."""


def check_workspace(workspace: torch.Tensor, needed: int, wrapper: str) -> None:
    have = workspace.numel() * workspace.element_size()
    if needed > have:
        raise WorkspaceTooSmall(
            f"{wrapper}: this plan needs {needed} bytes of float workspace but the buffer has {have}; "
            f"allocate at least {needed} bytes (the wrapper's workspace_size() gives the worst case), "
            "or plan with disable_split_kv=True"
        )


def log_plan(wrapper: str, plan: AttentionPlan, workspace_bytes: int) -> None:
    logger = get_logger()
    if not logger.isEnabledFor(logging.INFO):  # the kernel name is built on demand: skip it when unlogged
        return
    logger.info(
        "%s.plan: kernel %s, batch %d, splits %d (chunk %d tokens), workspace %d bytes",
        wrapper, plan.spec.kernel_name, plan.qo_indptr.numel() - 1, plan.split.num_chunks,
        plan.split.kv_chunk_size, workspace_bytes,
    )


def run_plan_or_compiled(
    key: int, plan: AttentionPlan | None, wrapper: str, workspace: torch.Tensor, q: torch.Tensor,
    kv, *, k_scale: float, v_scale: float, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool,
    variant_args: dict | None = None, q_scale: float = 1.0, sinks: torch.Tensor | None = None,
):
    """``run_plan`` eagerly; under torch.compile one opaque custom op that finds the plan at run time."""
    if torch.compiler.is_compiling():
        if sinks is not None:
            raise NotImplementedError(
                f"{wrapper}.run(sinks=...) is not supported under torch.compile yet; call it outside the compiled "
                "region (torch.compiler.disable)"
            )
        if plan is not None and plan.spec.variant is not None:
            raise NotImplementedError(
                f"{wrapper}.run() with a custom variant is not supported under torch.compile yet; call it "
                "outside the compiled region (torch.compiler.disable)"
            )
        if plan is None:
            raise not_planned(wrapper)
        if variant_args:  # (eager's TypeError: variant plans are refused above, so this plan takes none)
            _launch_for(plan, wrapper, q, variant_args, None)
        from .compiled import run_compiled

        k, v = split_paged_kv_cache(kv, plan.kv_layout) if plan.page_size is not None else kv
        return run_compiled(key, q, k, v, head_dim_vo=plan.head_dim_vo, out_dtype=plan.o_dtype, k_scale=k_scale,
                            v_scale=v_scale, q_scale=q_scale, out=out, lse=lse, return_lse=return_lse,
                            q_repeat=plan.total_qo // plan.q_rows if plan.q_rows else 1)
    return run_plan(plan, wrapper, workspace, q, kv, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                    return_lse=return_lse, variant_args=variant_args, q_scale=q_scale, sinks=sinks)


def check_sinks(wrapper: str, sinks: torch.Tensor, num_qo_heads: int, device: torch.device) -> None:
    """Refuse a ``sinks`` argument that is not a contiguous float32 ``[num_qo_heads]`` tensor on ``device``."""
    if not isinstance(sinks, torch.Tensor):
        raise TypeError(f"{wrapper}: sinks must be a torch.Tensor (float32 [num_qo_heads]), got {type(sinks).__name__}")
    if sinks.dtype is not torch.float32:
        raise ValueError(f"{wrapper}: sinks has dtype {str(sinks.dtype).removeprefix('torch.')}; it must be float32 "
                         "(one natural-log sink logit per query head): pass sinks.float()")
    if tuple(sinks.shape) != (num_qo_heads,):
        raise ValueError(f"{wrapper}: sinks has shape {tuple(sinks.shape)}; it must be [num_qo_heads] = "
                         f"[{num_qo_heads}] (one sink logit per query head)")
    if sinks.device != device:
        raise ValueError(f"{wrapper}: sinks is on {sinks.device} but q is on {device}; move it with sinks.to(q.device)")
    if num_qo_heads > 1 and sinks.stride(0) != 1:
        raise ValueError(f"{wrapper}: sinks must be contiguous; pass sinks.contiguous()")


def _kv_signature(kv) -> tuple | None:
    """What the k/v checks depend on: shapes, strides, dtypes, devices (None: not tensors at all). Devices as
    torch.device, not get_device(): that is -1 for cpu and meta tensors alike."""
    if isinstance(kv, torch.Tensor):
        return kv.shape, kv.stride(), kv.dtype, kv.device
    try:
        k, v = kv
        return k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device
    except (TypeError, ValueError, AttributeError):
        return None


def _launch_for(plan: AttentionPlan | None, wrapper: str, q, variant_args: dict | None, sinks):
    """The launch this call takes (the plan's, or its sink twin's), after the checks that need no tensor shape."""
    if plan is None:
        raise not_planned(wrapper)
    if plan.variant_args is not None:
        plan.variant_args.fill(variant_args or {}, q.device, plan.total_qo)
    elif variant_args:
        raise unexpected_run_arguments(wrapper, variant_args, plan.options.op)
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"{wrapper}.run(): q must be a torch.Tensor, got {type(q).__name__}")
    if sinks is not None:
        check_sinks(f"{wrapper}.run()", sinks, plan.num_qo_heads, q.device)
        launch = plan.sink_launch_ready()
    elif plan.spec.use_sinks:
        raise ValueError(f"{wrapper}.run(): this plan applies attention sinks; pass sinks (float32 [num_qo_heads])")
    else:
        launch = plan.launch
    return launch


def _kv_pointers(plan: AttentionPlan, kv, device_index: int) -> tuple[int, int]:
    """This call's k and v base pointers (a one-tensor cache: its base plus the offsets found at the first call),
    checked against the kernel's alignment on the GPU."""
    if plan.kv_offsets is not None:
        base = kv.data_ptr()
        k_ptr, v_ptr = base + plan.kv_offsets[0], base + plan.kv_offsets[1]
    else:
        k_ptr, v_ptr = kv[0].data_ptr(), kv[1].data_ptr()
    if device_index >= 0 and (k_ptr | v_ptr) % plan.kv_pointer_alignment:
        k, v = split_paged_kv_cache(kv, plan.kv_layout) if plan.page_size is not None else kv
        check_kv_alignment(plan, k, v)
    return k_ptr, v_ptr


def run_plan(
    plan: AttentionPlan | None, wrapper: str, workspace: torch.Tensor, q: torch.Tensor, kv, *,
    k_scale: float, v_scale: float, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool,
    variant_args: dict | None = None, q_scale: float = 1.0, sinks: torch.Tensor | None = None,
    fixed_outputs: bool = False, head_scales: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Check q/kv/out/lse (and a variant's extra arguments) against ``plan`` and launch; returns out or (out, lse).

    ``fixed_outputs``: out/lse are buffers the caller allocated for this plan and never reshapes (a
    cascade's level states), so once checked they are not looked at again.

    ``sinks`` (float32 ``[num_qo_heads]``) runs the plan's kernel built with attention sinks: the output
    of head h is scaled by ``1 / (1 + exp(sinks[h] - lse))``, the returned lse is the keys' alone.

    ``kv`` is the paged cache as the caller gave it (paged plans) or the ``(k, v)`` pair (ragged).
    The checks depend only on the tensors' shapes, strides, dtypes and devices: a call with the
    signature of the previous one (every layer of a step) sets pointers and launches. ``q_scale``
    (FlashInfer's query dequantization scale) multiplies ``sm_scale`` for this call. ``head_scales``: an fp8
    query plan's device scales (``fp8_prefill.device_scales``; ``kernels.attention``), else None.
    """
    launch = _launch_for(plan, wrapper, q, variant_args, sinks)
    signature = (q.shape, q.stride(), q.dtype, q.device, _kv_signature(kv))
    if signature != plan.checked_signature:
        k, v = _check_inputs(plan, wrapper, workspace, q, kv)
        for prepared in plan.launches():
            prepared.set_layout(q, k, v)
        plan.kv_offsets = ((k.data_ptr() - kv.data_ptr(), v.data_ptr() - kv.data_ptr())
                           if isinstance(kv, torch.Tensor) else None)
        plan.extents = (byte_extent(q), byte_extent(k), byte_extent(v)) + plan.extents[3:]
        plan.checked_signature = signature
    device_index = q.get_device()  # -1: the cpu target
    if device_index >= 0 and not plan.use_cuda_graph and stream_capturing():
        raise RuntimeError(
            f"{wrapper}.run() is being captured into a CUDA graph, but the wrapper was built without "
            "use_cuda_graph=True: its plan lives in buffers a later plan() replaces, so replays would read "
            "stale or freed memory. Construct it with use_cuda_graph=True and fixed index buffers"
        )
    k_ptr, v_ptr = _kv_pointers(plan, kv, device_index)
    given = (out is not None, lse is not None)  # the caller's buffers (checked against q and the KV) or ours
    callers_outputs = (given[0] or given[1]) and not fixed_outputs  # (addresses: checked every call, not ours)
    if callers_outputs:
        claim_outputs(wrapper, out, lse)
    if out is None:
        out = torch.empty((plan.total_qo, plan.num_qo_heads, plan.head_dim_vo), dtype=plan.o_dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((plan.total_qo, plan.num_qo_heads), dtype=torch.float32, device=q.device)
    if not (fixed_outputs and plan.checked_outputs is not None):
        outputs = (out.shape, out.stride(), out.dtype, out.device,  # (out: the caller's or ours)
                   None if lse is None else (lse.shape, lse.stride(), lse.dtype, lse.device), given)
        if outputs != plan.checked_outputs:
            _check_outputs(plan, wrapper, q, kv, out, lse)
            plan.extents = plan.extents[:3] + (byte_extent(out), 0 if lse is None else byte_extent(lse))
            for prepared in plan.launches():
                prepared.set_outputs(out, lse)
            plan.checked_outputs = outputs
    if callers_outputs or plan.split.kv_chunk_size:
        pointers = (q.data_ptr(), k_ptr, v_ptr, out.data_ptr() if given[0] else None,
                    lse.data_ptr() if given[1] else None)
    if callers_outputs and (sinks is not None or outputs_meet_inputs(plan.extents, pointers)):
        refuse_outputs_over_inputs(f"{wrapper}.run()", q, kv, out if given[0] else None, lse if given[1] else None,
                                   sinks)
    if plan.split.kv_chunk_size:
        if workspace is not plan.checked_workspace:
            target_of(wrapper, (workspace, q))
            need = split_workspace_bytes(plan.split.num_chunks, plan.num_qo_heads, plan.head_dim_vo)
            check_workspace(workspace, need, wrapper)
            start = workspace.data_ptr()
            plan.checked_workspace, plan.workspace_region = workspace, (start, start + need)
        refuse_in_workspace(wrapper, plan.workspace_region, plan.extents, pointers)  # every call, as out's
    if plan.total_qo:  # an empty batch has nothing to launch (and no storage to point at)
        launch.launch(device_index, q.data_ptr(), k_ptr, v_ptr, out.data_ptr(),
                      lse.data_ptr() if lse is not None else None, k_scale, v_scale, q_scale, workspace,
                      sinks.data_ptr() if sinks is not None else None,
                      head_scales.data_ptr() if head_scales is not None else None)
    return (out, lse) if return_lse else out


def _check_inputs(plan: AttentionPlan, wrapper: str, workspace: torch.Tensor, q: torch.Tensor, kv):
    """Every check of q and the KV against the plan; returns the (k, v) views."""
    k, v = split_paged_kv_cache(kv, plan.kv_layout) if plan.page_size is not None else kv
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{wrapper}.run(): {name} must be a torch.Tensor, got {type(t).__name__}")
    target_of(wrapper, (workspace, q, k, v))  # raises when they are on different devices
    check_tensor("q", q, ndim=3)
    if q.dtype != plan.q_dtype:
        if q.dtype in (torch.float16, torch.bfloat16, torch.float32) or q.dtype in FP8_DTYPES:
            check_planned_dtype("q", q, plan.q_dtype, "q_data_type")
        given, planned = (str(d).removeprefix("torch.") for d in (q.dtype, plan.q_dtype))
        raise TypeError(f"q has dtype {given}; attention takes a float16, bfloat16 or float32 (cpu) query: cast q to "
                        f"the plan's {planned}")
    if tuple(q.shape) != (plan.q_rows, plan.num_qo_heads, plan.head_dim_qk):
        raise ValueError(
            f"q has shape {tuple(q.shape)}; the plan expects {(plan.q_rows, plan.num_qo_heads, plan.head_dim_qk)}"
        )
    if plan.page_size is not None:
        pages = check_kv_pair(k, v, plan.kv_layout, num_kv_heads=plan.num_kv_heads, head_dim_qk=plan.head_dim_qk,
                              head_dim_vo=plan.head_dim_vo, page_size=plan.page_size, dtype=plan.kv_dtype)
        check_page_pool(plan.index, pages)
    else:
        for name, t, dim in (("k", k, plan.head_dim_qk), ("v", v, plan.head_dim_vo)):
            check_tensor(name, t, ndim=3, dtypes=(plan.kv_dtype,))
            if t.shape[1:] != (plan.num_kv_heads, dim) or t.shape[0] < plan.total_kv:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; the plan expects "
                                 f"[>= {plan.total_kv}, {plan.num_kv_heads}, {dim}]")
    if q.is_cuda:
        check_kv_alignment(plan, k, v)
    return k, v


def _check_outputs(plan: AttentionPlan, wrapper: str, q: torch.Tensor, kv, out: torch.Tensor,
                   lse: torch.Tensor | None) -> None:
    """out / lse against the plan (checked when out's or lse's signature changes: a call of the previous signature
    is not looked at again; their addresses against the inputs', on every call: ``refuse_outputs_over_inputs``)."""
    o_shape = (plan.total_qo, plan.num_qo_heads, plan.head_dim_vo)
    target_of(wrapper, (q, out, lse))
    check_tensor("out", out, ndim=3, dtypes=(plan.o_dtype,))
    if tuple(out.shape) != o_shape:
        raise ValueError(f"out has shape {tuple(out.shape)}; expected {o_shape}")
    check_no_overlap("out", out)
    if lse is not None:
        check_tensor("lse", lse, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=False)
        if tuple(lse.shape) != o_shape[:2]:
            raise ValueError(f"lse has shape {tuple(lse.shape)}; expected {o_shape[:2]}")
        check_no_overlap("lse", lse)


def kv_alignment(plan: AttentionPlan) -> tuple[int, int]:
    """(pointer, stride) alignment in bytes the cuda kernels read k/v rows with (vector loads)."""
    elem = plan.kv_dtype.itemsize
    if plan.spec.op is Op.DECODE:
        load = 16 if (plan.head_dim_qk * elem) % 16 == 0 and (plan.head_dim_vo * elem) % 16 == 0 else 8
        return load, load
    return (8 if elem == 1 else 16), 8 * elem


def check_kv_alignment(plan: AttentionPlan, k: torch.Tensor, v: torch.Tensor) -> None:
    """Refuse k/v views whose rows do not start on the kernels' vector-load boundary, naming the fix."""
    pointer_bytes, stride_bytes = kv_alignment(plan)
    for name, t in (("k", k), ("v", v)):
        strides = [s * t.element_size() for s in t.stride()[:-1]]
        if t.data_ptr() % pointer_bytes or any(s % stride_bytes for s in strides):
            raise ValueError(
                f"{name} (dtype {str(t.dtype).removeprefix('torch.')}, strides {tuple(t.stride())} elements, "
                f"pointer offset {t.data_ptr() % pointer_bytes} bytes) is not aligned: the cuda kernels read each "
                f"row as {stride_bytes}-byte vectors, so the pointer must be a multiple of {pointer_bytes} bytes "
                f"and every stride but the last a multiple of {stride_bytes} bytes; pass {name}.contiguous() "
                "(or allocate the cache with padded rows)"
            )

"""The dedicated MLA kernel behind ``BatchMLAPagedAttentionWrapper``: choosing it, planning it, launching it.

``select_kernel`` decides from the plan's arguments, the device and the arch list the JIT builds for:
``"sm90"`` (``jitattn/kernels/mla.py``: H100/H200, a 16-bit or fp8 latent cache, ckv 512 / kpe 64, any head
count and query count per request, causal or not) or ``"prefill"`` (the paged prefill kernels at head
dims 576/512: every other case, the cpu target included). ``JITATTN_MLA_KERNEL`` forces a choice.

``KernelPlan`` holds what ``plan()`` computed -- the work list and index arrays on the device, uploaded
once, and the launch struct filled once -- so ``run()`` sets a few pointers and strides and calls the
module.
"""

from __future__ import annotations

import re

import numpy as np
import torch

from .. import env, hardware
from .batch import pinned_staging
from .checks import FP8_DTYPES, raw_stream, stream_capturing
from .specs import mla_kernel_spec
from ..kernels import mla as family
from ..kernels.mla_plan import MLAWork, graph_item_capacity, padded, plan_work, workspace_row_bytes
from ..spec import VariantSpec

_HOPPER = re.compile(r"^9\.0a(\+PTX)?$")


def unsupported_reason(device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim_ckv: int,
                       head_dim_kpe: int, capability: tuple[int, int] | None,
                       archs: tuple[str, ...] | None) -> str | None:
    """Why the sm90 MLA kernel cannot run this plan (None when it can). ``capability``: the device's compute
    capability (None off cuda); ``archs``: the arch list the JIT builds for (None: unknown)."""
    if device.type != "cuda":
        return "it is a cuda kernel (the cpu target runs MLA on the prefill kernels)"
    if capability != (9, 0):
        return f"it needs an sm_90 GPU (H100/H200); this one is sm_{capability[0]}{capability[1]}" if capability else \
            "it needs an sm_90 GPU (H100/H200)"
    if archs is None or not archs or not all(_HOPPER.match(a) for a in archs):
        shown = ";".join(archs) if archs else "unknown"
        return f"it is built for 9.0a only, and the arch list is {shown!r} (JITATTN_CUDA_ARCH_LIST)"
    if q_dtype not in (torch.float16, torch.bfloat16):
        return "it takes f16 or bf16 queries"
    if kv_dtype != q_dtype and kv_dtype not in FP8_DTYPES:
        return "it takes a latent cache of the queries' dtype or fp8 (e4m3 / e5m2)"
    if (head_dim_ckv, head_dim_kpe) != (family.CKV_DIM, family.KPE_DIM):
        return f"it takes head_dim_ckv={family.CKV_DIM}, head_dim_kpe={family.KPE_DIM}"
    return None


def layout_problem(q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                   out: torch.Tensor) -> str | None:
    """Why the sm90 MLA kernel cannot read or write these tensors in place (None when it can): the rules of its
    launch check -- q, ckv and kpe rows start on 16 bytes (16-byte ``cp.async`` pieces), out rows on 4 (pair
    stores). ``run()`` then takes the prefill kernels, which copy q and the keys and store out element-wise."""
    for name, t in (("q_nope", q_nope), ("q_pe", q_pe), ("ckv_cache", ckv), ("kpe_cache", kpe), ("out", out)):
        unit = 4 if name == "out" else 16
        strides = [s * t.element_size() for s in t.stride()[:-1]]
        if t.data_ptr() % unit or any(s % unit for s in strides):
            return (f"{name}'s rows do not start on {unit} bytes (strides {tuple(t.stride())} elements, pointer offset "
                    f"{t.data_ptr() % unit} bytes)")
    return None


def select_kernel(reason: str | None) -> str:
    """``"sm90"`` or ``"prefill"`` given ``unsupported_reason(...)`` and ``JITATTN_MLA_KERNEL``."""
    choice = env.mla_kernel()
    if choice == "prefill":
        return "prefill"
    if reason is None:
        return "sm90"
    if choice == "sm90":
        raise ValueError(f"JITATTN_MLA_KERNEL=sm90, but the sm90 MLA kernel cannot run this plan: {reason}; "
                         "set JITATTN_MLA_KERNEL=auto to fall back to the prefill kernels")
    return "prefill"


def device_facts(device: torch.device) -> tuple[tuple[int, int] | None, tuple[str, ...] | None]:
    """(compute capability, JIT arch list) of ``device``; (None, None) off cuda."""
    if device.type != "cuda":
        return None, None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return hardware.capability(index), hardware.known_arch_list()



def kernel_spec(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> VariantSpec:
    """The spec of the sm90 MLA kernel for queries / output of ``dtype`` and a latent cache of ``kv_dtype``."""
    return mla_kernel_spec(dtype, kv_dtype)


class GraphArrays:
    """The fixed device memory and launch shape of a CUDA-graph wrapper's sm90 plans (made by its first plan).

    A captured launch keeps its params: the pointers, the grid, the item and merge counts, the heads, the
    page size, causal, sm_scale. So every plan of the wrapper writes its work list and index arrays into this
    one buffer, padded to the capacities of ``graph_item_capacity`` with items and merges of a sentinel
    request with no query rows (index ``batch``: ``qo_indptr`` repeats its last entry, ``kv_len`` is 0), which
    the kernel skips; and a plan whose batch size, query count or baked settings differ is refused.
    """

    def __init__(self, device: torch.device, batch: int, total_q: int, pages: int, workspace_rows: int,
                 baked: tuple, num_sms: int) -> None:
        """``pages``: the most page indices a plan may give (the fixed ``kv_indices`` buffer's size);
        ``workspace_rows``: partial-state rows the workspace holds; ``baked``: the settings in the params."""
        self.batch, self.total_q, self.pages, self.baked = batch, total_q, pages, baked
        self.items, self.merges = graph_item_capacity(total_q, batch, baked[0], num_sms)
        if workspace_rows < 1:
            self.merges = 0  # nothing can split: no merge launch
        self.workspace_rows = workspace_rows
        self.grid = max(1, min(self.items, num_sms))
        # items, merges, qo_indptr (+ the sentinel), kv_indptr, kv_len (+ the sentinel), kv_indices
        self.sizes = [self.items * family.ITEM_INTS, self.merges * family.MERGE_INTS, batch + 2, batch + 1, batch + 1,
                      pages]
        self.buffer = torch.zeros(sum(_padded_size(n) for n in self.sizes) + 4, dtype=torch.int32, device=device)
        # the kernel of the captured launch, chosen by the first plan (``narrow_kernel``): the narrow one computes
        # any later plan's wider tiles as 16-row sub-tiles; the 64-row one computes every tile
        self.narrow: bool | None = None

    def refuse(self, batch: int, total_q: int, pages: int, baked: tuple) -> None:
        """Raise naming what differs from the captured launch's plan (nothing: return)."""
        if (batch, total_q) != (self.batch, self.total_q):
            raise ValueError(f"this plan has {batch} requests and {total_q} query tokens, but the CUDA-graph wrapper's "
                             f"sm90 kernel was sized by its first plan for {self.batch} and {self.total_q}: a captured "
                             "run() keeps them; use one wrapper per captured batch shape")
        if baked != self.baked:
            names = ("num_heads", "page_size", "causal", "sm_scale", "q_data_type", "kv_data_type")
            changed = [f"{n} {a!r} -> {b!r}" for n, a, b in zip(names, self.baked, baked) if a != b]
            raise ValueError(f"this plan changes {', '.join(changed)} from the CUDA-graph wrapper's first plan; a "
                             "captured run() keeps them: use one wrapper per setting")
        if pages > self.pages:
            raise ValueError(f"this plan references {pages} pages but the fixed kv_indices buffer holds {self.pages}")


def narrow_kernel(qo_lens: np.ndarray, num_heads: int, batch_invariant: bool = False) -> bool:
    """Whether a plan of these query lengths launches the narrow kernel: its tiles (heads x query tokens of a
    request, at most 64) hold at most ``TUNING["narrow_rows"]`` rows. ``batch_invariant``: decided by the head count
    alone (the rows of one query token), so a request takes the same kernel, hence the same bits, in any batch (the
    two kernels round differently); its wider tiles then run as 16-row sub-tiles."""
    limit = family.TUNING["narrow_rows"]
    if isinstance(limit, bool) or not isinstance(limit, int) or not 0 <= limit <= family.ROWS:
        raise ValueError(f"mla TUNING narrow_rows={limit!r} must be an int in [0, {family.ROWS}]")
    if batch_invariant:
        rows = num_heads
    else:
        rows = int(qo_lens.max()) * num_heads if qo_lens.size else 0
    return limit > 0 and min(rows, family.ROWS) <= limit


def _padded_size(n: int) -> int:
    return n + (-n) % 4  # 16-byte aligned starts (the kernel reads items as int4)


class KernelPlan:
    """One batch planned for the sm90 MLA kernel (made by ``plan()``, launched by ``run()``)."""

    def __init__(self, workspace: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, kv_lens: torch.Tensor, num_heads: int, page_size: int, causal: bool,
                 sm_scale: float, dtype: torch.dtype, kv_dtype: torch.dtype, split: bool = True,
                 graph: GraphArrays | None = None) -> None:
        """Host int32 ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_lens`` (already checked); ``split=False``:
        no split-KV (batch-invariant plans); ``graph``: a CUDA-graph wrapper's fixed arrays (checked against this
        plan by ``graph.refuse`` first)."""
        from ..jit import load

        device = workspace.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        capacity = workspace.numel() * workspace.element_size() // workspace_row_bytes(family.CKV_DIM)
        qo = qo_indptr.numpy()
        qo_lens = qo[1:] - qo[:-1]
        narrow = narrow_kernel(qo_lens, num_heads, batch_invariant=not split)
        if graph is not None:
            if graph.narrow is None:
                graph.narrow = narrow
            narrow = graph.narrow
        self.narrow = narrow
        self.work: MLAWork = plan_work(qo_lens, kv_lens.numpy(), num_heads, causal, hardware.num_sms(index),
                                       capacity, split=split)
        self.module = load(kernel_spec(dtype, kv_dtype))
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.device_index = index
        self.graph = graph
        batch = int(kv_lens.numel())
        if graph is None:
            launched = self.work
            parts = [launched.items.numpy().reshape(-1), launched.merges.numpy().reshape(-1), qo,
                     kv_indptr.numpy(), kv_lens.numpy(), kv_indices.numpy()]
            sizes = [int(a.size) for a in parts]
        else:  # the same memory and counts every plan; the sentinel request `batch` pads the lists
            launched = padded(self.work, graph.items, graph.merges, request=batch)
            parts = [launched.items.numpy().reshape(-1), launched.merges.numpy().reshape(-1), np.append(qo, qo[-1:]),
                     kv_indptr.numpy(), np.append(kv_lens.numpy(), 0), kv_indices.numpy()]
            sizes = graph.sizes
        # One upload: items, merges and the index arrays, as views of one device buffer (4 more ints: never empty).
        # Filled in page-locked memory and copied without the host waiting (see pinned_staging).
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + _padded_size(n))
        total = starts[-1] + 4
        host = pinned_staging(total) if device.type == "cuda" else torch.empty(total, dtype=torch.int32)
        buffer = host.numpy()
        for a, at, end in zip(parts, starts, starts[1:]):
            buffer[at: at + a.size] = a
            buffer[at + a.size: end] = 0  # the padding (never read), so no stale host bytes are uploaded
        buffer[starts[-1]:] = 0
        self._host, self._host_spans = host, ((starts[2], qo.size), (starts[3], kv_indptr.numel()),
                                              (starts[5], kv_indices.numel()))
        if graph is None:
            self._device_arrays = host.to(device, non_blocking=True)
        else:
            graph.buffer.copy_(host, non_blocking=True)  # ordered before any later launch or replay on the stream
            self._device_arrays = graph.buffer
        base = self._device_arrays.data_ptr()
        ptrs = [base + 4 * at for at in starts[:len(sizes)]]
        items, merges, qo, kvp, lens, indices = ptrs
        self._workspace = workspace
        self.params = self.module.params(
            "mla", q_nope=None, q_pe=None, ckv=None, kpe=None, o=None, lse=None,
            qo_indptr=qo, kv_indptr=kvp, kv_indices=indices, kv_len=lens, items=items, merges=merges,
            workspace=workspace.data_ptr(), num_items=launched.num_items, num_merges=launched.num_merges,
            workspace_rows=graph.workspace_rows if graph is not None else launched.workspace_rows,
            num_heads=num_heads, page_size=page_size,
            q_nope_stride_n=0, q_nope_stride_h=0, q_pe_stride_n=0, q_pe_stride_h=0,
            ckv_stride_page=0, ckv_stride_n=0, kpe_stride_page=0, kpe_stride_n=0,
            o_stride_n=0, o_stride_h=0, lse_stride_n=0, lse_stride_h=0,
            causal=int(causal), grid=graph.grid if graph is not None else launched.grid, narrow=int(narrow),
            sm_scale=sm_scale,
            k_scale=1.0, v_scale=1.0,
        )
        self._call = self.module.bind("mla", self.params)

    @property
    def host_arrays(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Host views of this plan's copies of qo_indptr, kv_indptr and kv_indices (the caller's may have changed
        since): what the prefill kernels are planned over when run() falls back to them."""
        return tuple(self._host[at: at + n] for at, n in self._host_spans)

    def launch(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor | None, k_scale: float, v_scale: float) -> None:
        """Launch on the current stream (tensors already checked against the plan)."""
        for name, t, what in (("q_nope", q_nope, "q_data_type"), ("q_pe", q_pe, "q_data_type"),
                              ("ckv_cache", ckv, "kv_data_type"), ("kpe_cache", kpe, "kv_data_type"),
                              ("out", out, "q_data_type")):
            want = self.kv_dtype if what == "kv_data_type" else self.dtype
            if t.dtype != want:
                raise TypeError(f"{name} is {str(t.dtype).removeprefix('torch.')}; the plan's {what} is "
                                f"{str(want).removeprefix('torch.')}")
            if t.get_device() != self.device_index:
                raise ValueError(f"{name} is on {t.device}; the plan is for cuda:{self.device_index}")
        self.relaunch(q_nope, q_pe, ckv, kpe, out, lse, k_scale, v_scale)

    def relaunch(self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
                 out: torch.Tensor, lse: torch.Tensor | None, k_scale: float, v_scale: float,
                 same_strides: bool = False) -> None:
        """``launch`` without its dtype and device checks: for tensors the caller found to be of the dtypes, devices,
        shapes and strides of an earlier ``launch`` of this plan. ``same_strides``: the struct already holds these
        tensors' strides (the caller compared them with the last launch's), so only the addresses are written."""
        if self.graph is None:
            if stream_capturing():
                raise RuntimeError("BatchMLAPagedAttentionWrapper.run() is being captured into a CUDA graph, but the "
                                   "wrapper was built without use_cuda_graph=True; build it with the fixed buffers")
            if self.work.num_items == 0:
                return  # no query rows: nothing to write
        elif self.graph.total_q == 0:
            return  # no query rows in any plan of this wrapper (the shape is fixed): capture and replays launch nothing
        p = self.params
        p.q_nope, p.q_pe = q_nope.data_ptr(), q_pe.data_ptr()
        # A cache of no pages (every request at kv_len 0) may have a null data pointer, which the kernel
        # refuses; no page is read then (run() checked the plan's highest page against the cache).
        p.ckv = ckv.data_ptr() or self._device_arrays.data_ptr()
        p.kpe = kpe.data_ptr() or self._device_arrays.data_ptr()
        p.o = out.data_ptr()
        p.lse = lse.data_ptr() if lse is not None else None
        if not same_strides:
            p.q_nope_stride_n, p.q_nope_stride_h = q_nope.stride()[:2]
            p.q_pe_stride_n, p.q_pe_stride_h = q_pe.stride()[:2]
            p.ckv_stride_page, p.ckv_stride_n = ckv.stride()[:2]
            p.kpe_stride_page, p.kpe_stride_n = kpe.stride()[:2]
            p.o_stride_n, p.o_stride_h = out.stride()[:2]
            if lse is not None:
                p.lse_stride_n, p.lse_stride_h = lse.stride()
        p.k_scale, p.v_scale = k_scale, v_scale
        self._call(raw_stream(self.device_index))

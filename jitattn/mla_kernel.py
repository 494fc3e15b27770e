"""The dedicated MLA kernel behind ``BatchMLAPagedAttentionWrapper``: choosing it, planning it, launching it.

``select_kernel`` decides from the plan's arguments, the device and the arch list the JIT builds for:
``"sm90"`` (``jitattn/families/mla.py``: H100/H200, a 16-bit or fp8 latent cache, ckv 512 / kpe 64, any head
count and query count per request, causal or not) or ``"prefill"`` (the paged prefill kernels at head
dims 576/512: every other case, the cpu target included). ``JITATTN_MLA_KERNEL`` forces a choice.

``KernelPlan`` holds what ``plan()`` computed -- the work list and index arrays on the device, uploaded
once, and the launch struct filled once -- so ``run()`` sets a few pointers and strides and calls the
module.
"""

from __future__ import annotations

import functools
import re

import torch

from . import env
from .attention.checks import raw_stream, stream_capturing
from .attention.specs import mla_kernel_spec
from .families import mla as family
from .mla_plan import MLAWork, plan_work, workspace_row_bytes
from .spec import VariantSpec

_HOPPER = re.compile(r"^9\.0a(\+PTX)?$")


def unsupported_reason(device: torch.device, q_dtype: torch.dtype, kv_dtype: torch.dtype, head_dim_ckv: int,
                       head_dim_kpe: int, use_cuda_graph: bool, capability: tuple[int, int] | None,
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
    if kv_dtype != q_dtype and kv_dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return "it takes a latent cache of the queries' dtype or fp8 (e4m3 / e5m2)"
    if (head_dim_ckv, head_dim_kpe) != (family.CKV_DIM, family.KPE_DIM):
        return f"it takes head_dim_ckv={family.CKV_DIM}, head_dim_kpe={family.KPE_DIM}"
    if use_cuda_graph:
        return "CUDA-graph plans (use_cuda_graph=True) are not in it yet"
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
    from .jit.toolchain import ToolchainError, cuda_arch_list

    try:
        archs = cuda_arch_list()
    except ToolchainError:
        archs = None
    return torch.cuda.get_device_capability(device), archs


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def kernel_spec(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> VariantSpec:
    """The spec of the sm90 MLA kernel for queries / output of ``dtype`` and a latent cache of ``kv_dtype``."""
    return mla_kernel_spec(dtype, kv_dtype)


class KernelPlan:
    """One batch planned for the sm90 MLA kernel (made by ``plan()``, launched by ``run()``)."""

    def __init__(self, workspace: torch.Tensor, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
                 kv_indices: torch.Tensor, kv_lens: torch.Tensor, num_heads: int, page_size: int, causal: bool,
                 sm_scale: float, dtype: torch.dtype, kv_dtype: torch.dtype, split: bool = True) -> None:
        """Host int32 ``qo_indptr``, ``kv_indptr``, ``kv_indices``, ``kv_lens`` (already checked); ``split=False``:
        no split-KV (batch-invariant plans)."""
        from .jit import load

        device = workspace.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        capacity = workspace.numel() * workspace.element_size() // workspace_row_bytes(family.CKV_DIM)
        qo_lens = (qo_indptr[1:] - qo_indptr[:-1]).tolist()
        self.work: MLAWork = plan_work(qo_lens, kv_lens.tolist(), num_heads, causal, _num_sms(index), capacity,
                                       split=split)
        self.module = load(kernel_spec(dtype, kv_dtype))
        self.dtype, self.kv_dtype = dtype, kv_dtype
        self.device_index = index
        # One upload: items, merges and the index arrays, as views of one device buffer.
        parts = [self.work.items.reshape(-1), self.work.merges.reshape(-1), qo_indptr, kv_indptr, kv_lens, kv_indices]
        sizes = [int(t.numel()) for t in parts]
        pad = [(-s) % 4 for s in sizes]  # 16-byte aligned starts (the kernel reads items as int4)
        host = torch.cat([torch.cat([t.to(torch.int32), torch.zeros(p, dtype=torch.int32)]) for t, p in zip(parts, pad)]
                         + [torch.zeros(4, dtype=torch.int32)])  # never empty: every pointer is valid
        self._device_arrays = host.to(device)
        base, ptrs = self._device_arrays.data_ptr(), []
        at = 0
        for s, p in zip(sizes, pad):
            ptrs.append(base + 4 * at)
            at += s + p
        items, merges, qo, kvp, lens, indices = ptrs
        self._workspace = workspace
        self.params = self.module.params(
            "mla", q_nope=None, q_pe=None, ckv=None, kpe=None, o=None, lse=None,
            qo_indptr=qo, kv_indptr=kvp, kv_indices=indices, kv_len=lens, items=items, merges=merges,
            workspace=workspace.data_ptr(), num_items=self.work.num_items, num_merges=self.work.num_merges,
            workspace_rows=self.work.workspace_rows, num_heads=num_heads, page_size=page_size,
            q_nope_stride_n=0, q_nope_stride_h=0, q_pe_stride_n=0, q_pe_stride_h=0,
            ckv_stride_page=0, ckv_stride_n=0, kpe_stride_page=0, kpe_stride_n=0,
            o_stride_n=0, o_stride_h=0, lse_stride_n=0, lse_stride_h=0,
            causal=int(causal), grid=self.work.grid, sm_scale=sm_scale, k_scale=1.0, v_scale=1.0,
        )
        self._call = self.module.bind("mla", self.params)

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
        if stream_capturing():
            raise RuntimeError("BatchMLAPagedAttentionWrapper.run() is being captured into a CUDA graph, but the "
                               "wrapper was built without use_cuda_graph=True; build it with the fixed buffers")
        if self.work.num_items == 0:
            return  # no query rows: nothing to write
        p = self.params
        p.q_nope, p.q_pe, p.ckv, p.kpe = q_nope.data_ptr(), q_pe.data_ptr(), ckv.data_ptr(), kpe.data_ptr()
        p.q_nope_stride_n, p.q_nope_stride_h = q_nope.stride()[:2]
        p.q_pe_stride_n, p.q_pe_stride_h = q_pe.stride()[:2]
        p.ckv_stride_page, p.ckv_stride_n = ckv.stride()[:2]
        p.kpe_stride_page, p.kpe_stride_n = kpe.stride()[:2]
        p.o = out.data_ptr()
        p.o_stride_n, p.o_stride_h = out.stride()[:2]
        if lse is not None:
            p.lse = lse.data_ptr()
            p.lse_stride_n, p.lse_stride_h = lse.stride()
        else:
            p.lse = None
        p.k_scale, p.v_scale = k_scale, v_scale
        self._call(raw_stream(self.device_index))

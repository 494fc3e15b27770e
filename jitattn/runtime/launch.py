"""One call into an attention module (decode or prefill family, any target).

Wrappers validate their inputs and then call ``launch_attention``; it only
translates tensors into the params struct of ``jitattn.kernels.attention``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ..abi import POS_ENCODING_CODES
from ..jit import Module
from ..spec import KVLayout, PosEncoding
from .checks import cpu_threads, current_cuda_device, raw_stream, stream_capturing
from .kv import kv_strides


@dataclass(frozen=True)
class AttentionScalars:
    """Run-time scalars of one plan (all already defaulted)."""

    causal: bool
    pos_encoding: PosEncoding
    window_left: int
    sm_scale: float
    logits_soft_cap: float  # <= 0: off
    rope_scale: float
    rope_theta: float


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def _placeholder(device: torch.device) -> int:
    """A small never-written buffer on ``device``: the address of every empty array (kernels read none of it)."""
    buffer = _PLACEHOLDERS.get(device)
    if buffer is None:
        buffer = _PLACEHOLDERS[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return buffer.data_ptr()


class PreparedAttention:
    """An attention launch whose plan-time fields are filled once; each call sets the tensors.

    This keeps ``run()`` to a handful of field writes and one ctypes call.
    """

    def __init__(
        self, module: Module, *, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor | None, kv_last_page_len: torch.Tensor | None, page_size: int,
        kv_layout: KVLayout, custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None,
        num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, scalars: AttentionScalars,
        split_indptr: torch.Tensor | None = None, kv_chunk_size: int = 0, variant_params: int | None = None,
        split_workspace_bytes: int = 0, split_counters: torch.Tensor | None = None,
    ) -> None:
        """``split_workspace_bytes``: what the plan's chunks occupy of the workspace (0: all of it). The cuda
        decode launch sizes its grid by the chunks the workspace holds, so passing exactly that many launches
        no block without a chunk. ``split_counters``: a zeroed int32 buffer of at least ``batch *
        num_kv_heads`` entries that the split-KV kernel counts finished chunks in (and leaves zeroed);
        allocated here when a split plan gives none."""
        self.module = module
        self.paged = kv_indices is not None
        self.sm_scale = scalars.sm_scale
        # Empty index arrays have no storage; their pointer must still be non-null.
        self.placeholder = _placeholder(qo_indptr.device)

        def _ptr(tensor: torch.Tensor | None) -> int | None:
            return None if tensor is None else (tensor.data_ptr() or self.placeholder)

        self.kv_layout = kv_layout
        batch = qo_indptr.shape[0] - 1
        too_small = split_counters is None or split_counters.numel() < batch * num_kv_heads
        if kv_chunk_size and qo_indptr.is_cuda and too_small:
            split_counters = torch.zeros(max(1, batch * num_kv_heads), dtype=torch.int32, device=qo_indptr.device)
        self._split_counters = split_counters if kv_chunk_size else None  # kept alive with the plan
        # The variant's struct pointer is a field only of modules built with a variant; the sinks
        # pointer only of modules built with use_sinks.
        variant_field = {"variant_params": variant_params} if module.spec.variant is not None else {}
        self.has_sinks = module.spec.use_sinks
        if self.has_sinks:
            variant_field["sinks"] = None
        self.params = module.params(
            "attention", **variant_field,
            q=None, k=None, v=None, o=None, lse=None,
            qo_indptr=_ptr(qo_indptr), kv_indptr=_ptr(kv_indptr), kv_indices=_ptr(kv_indices),
            kv_last_page_len=_ptr(kv_last_page_len), custom_mask=_ptr(custom_mask), mask_indptr=_ptr(mask_indptr),
            batch_size=batch, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, page_size=page_size if self.paged else 1,
            q_stride_n=0, q_stride_h=0, k_stride_page=0, k_stride_n=0, k_stride_h=0,
            v_stride_page=0, v_stride_n=0, v_stride_h=0, o_stride_n=0, o_stride_h=0, lse_stride_n=0, lse_stride_h=0,
            kv_paged=int(self.paged), causal=int(scalars.causal),
            pos_encoding=POS_ENCODING_CODES[scalars.pos_encoding.value], window_left=scalars.window_left,
            sm_scale=scalars.sm_scale, logits_soft_cap=scalars.logits_soft_cap,
            rope_rcp_scale=1.0 / scalars.rope_scale, rope_rcp_theta=1.0 / scalars.rope_theta,
            k_scale=1.0, v_scale=1.0, workspace=None, workspace_bytes=0,
            split_indptr=_ptr(split_indptr) if kv_chunk_size else None, kv_chunk_size=kv_chunk_size,
            split_counters=_ptr(self._split_counters), q_row_period=0, num_threads=0, q_rows=0, kv_rows=0,
            prior_v=None, prior_lse=None, prior_states=0, prior_rows=0, prior_pdl=0, short_items=0, head_scales=None,
        )
        self._scales = (1.0, 1.0, 1.0)  # (q_scale, k_scale, v_scale) the struct holds
        self.split = bool(kv_chunk_size)
        self.split_workspace_bytes = split_workspace_bytes
        self.call = module.bind("attention", self.params)

    def point_at(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                 kv_last_page_len: torch.Tensor, split_indptr: torch.Tensor | None) -> None:
        """Re-point the paged index arrays (and a split plan's chunk offsets) at another plan's, of the
        same kernel, options, batch, page size and split: decode plans keep their launch across steps this
        way. What runs set on the struct for the plan before (a cascade's prior states, a query period) is
        cleared, as in a freshly prepared launch; strides and pointers are set again by the next run."""
        p = self.params
        p.qo_indptr = qo_indptr.data_ptr() or self.placeholder
        p.kv_indptr = kv_indptr.data_ptr() or self.placeholder
        p.kv_indices = kv_indices.data_ptr() or self.placeholder
        p.kv_last_page_len = kv_last_page_len.data_ptr() or self.placeholder
        if self.split:
            p.split_indptr = split_indptr.data_ptr() or self.placeholder
        p.prior_v = p.prior_lse = None
        p.prior_states = p.prior_rows = p.prior_pdl = p.q_row_period = 0

    def set_prior(self, values: torch.Tensor, lses: torch.Tensor, rows: int) -> None:
        """Point the cuda decode kernel's prior states (see ``kernels.attention``) at ``values``
        ``[states * rows, heads, head_dim_vo]`` and ``lses`` ``[states * rows, heads]`` (contiguous);
        a launch merges the first ``params.prior_states`` of them (0, the default: none)."""
        self.params.prior_v, self.params.prior_lse = values.data_ptr(), lses.data_ptr()
        self.params.prior_rows = rows

    @contextlib.contextmanager
    def grid_at_most(self, blocks: int):
        """Within the ``with``, cuda launches of a persistent kernel (the sm90 prefill tier: one block per SM) take
        ``blocks`` blocks at most, leaving the other SMs to kernels another stream runs beside them; other kernels
        ignore it. The struct's ``num_threads`` carries it (on the cpu target, the launch's OpenMP threads)."""
        self.params.num_threads = max(0, int(blocks))
        try:
            yield self
        finally:
            self.params.num_threads = 0

    def set_layout(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Strides of q and the k/v views (once per tensor signature; ``launch`` then sets pointers only)."""
        p = self.params
        p.q_stride_n, p.q_stride_h = q.stride()[:2]
        p.q_rows, p.kv_rows = q.shape[0], k.shape[0]  # the tensors' extents (tokens; pages of a paged cache)
        p.k_stride_page, p.k_stride_n, p.k_stride_h = kv_strides(k, self.paged, self.kv_layout)
        p.v_stride_page, p.v_stride_n, p.v_stride_h = kv_strides(v, self.paged, self.kv_layout)

    def set_outputs(self, o: torch.Tensor, lse: torch.Tensor | None) -> None:
        """Strides of o and lse (once per output signature)."""
        p = self.params
        p.o_stride_n, p.o_stride_h = o.stride()[:2]
        p.lse_stride_n, p.lse_stride_h = lse.stride() if lse is not None else (0, 0)

    def launch(
        self, device_index: int, q: int, k: int, v: int, o: int, lse: int | None, k_scale: float, v_scale: float,
        q_scale: float, workspace: torch.Tensor | None, sinks: int | None = None, head_scales: int | None = None,
    ) -> None:
        """One launch with these pointers (strides as last set); ``device_index`` -1 is the cpu.

        ``sinks``: the float32 ``[num_qo_heads]`` sink logits (modules built with ``use_sinks`` only);
        ``head_scales``: device scales of an fp8 query's kernel (``kernels.attention``), else None."""
        if device_index >= 0 and device_index != current_cuda_device():
            # The module launches on (and reads attributes of) the current device.
            with torch.cuda.device(device_index):
                return self.launch(device_index, q, k, v, o, lse, k_scale, v_scale, q_scale, workspace, sinks,
                                   head_scales)
        p = self.params
        p.head_scales = head_scales
        if self.has_sinks:
            p.sinks = sinks
        # An empty KV pool has no storage (null pointer); the kernels then read no key, but
        # check for non-null pointers, so they get a valid address instead.
        p.q, p.k, p.v, p.o, p.lse = q, k or self.placeholder, v or self.placeholder, o, lse
        if (q_scale, k_scale, v_scale) != self._scales:  # usually the same every call: skip the struct writes
            p.sm_scale = self.sm_scale * q_scale
            p.k_scale, p.v_scale = k_scale, v_scale
            self._scales = (q_scale, k_scale, v_scale)
        if workspace is not None and self.split:
            have = workspace.numel() * workspace.element_size()
            p.workspace = workspace.data_ptr()
            p.workspace_bytes = min(have, self.split_workspace_bytes) if self.split_workspace_bytes else have
        if device_index < 0:
            p.num_threads = cpu_threads()
            self.call(None)
        else:
            self.call(raw_stream(device_index))

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor | None,
        k_scale: float = 1.0, v_scale: float = 1.0, workspace: torch.Tensor | None = None, q_scale: float = 1.0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Set every stride and launch (one-off launches; wrappers cache the strides per signature)."""
        self.set_layout(q, k, v)
        self.set_outputs(o, lse)
        self.launch(q.get_device(), q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(),
                    lse.data_ptr() if lse is not None else None, k_scale, v_scale, q_scale, workspace,
                    sinks.data_ptr() if sinks is not None else None)


def launch_attention(
    module: Module, *, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
    lse: torch.Tensor | None, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor | None, kv_last_page_len: torch.Tensor | None, page_size: int,
    kv_layout: KVLayout, custom_mask: torch.Tensor | None, mask_indptr: torch.Tensor | None,
    num_kv_heads: int, scalars: AttentionScalars, k_scale: float = 1.0, v_scale: float = 1.0,
    workspace: torch.Tensor | None = None, split_indptr: torch.Tensor | None = None, kv_chunk_size: int = 0,
    split_counters: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None, short_items: bool = False,
) -> None:
    """Launch ``module``'s attention entry on q's device and current stream (prepare + call in one).

    ``kv_indices is None`` means ragged KV (k/v ``[tokens, heads, dim]``);
    otherwise k/v are 4-D paged tensors in ``kv_layout``. ``split_counters``: see ``PreparedAttention``
    (pass one buffer to calls repeated in a loop; without it each split call allocates its own).
    ``short_items``: the cuda decode module's short-items layout (``kernels.decode.short_items_layout``).
    """
    prepared = PreparedAttention(
        module, qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_last_page_len=kv_last_page_len,
        page_size=page_size, kv_layout=kv_layout, custom_mask=custom_mask, mask_indptr=mask_indptr,
        num_qo_heads=q.shape[1], num_kv_heads=num_kv_heads, head_dim_qk=q.shape[2], head_dim_vo=o.shape[2],
        scalars=scalars, split_indptr=split_indptr if kv_chunk_size else None,
        kv_chunk_size=kv_chunk_size if split_indptr is not None else 0, split_counters=split_counters,
    )
    prepared.params.short_items = int(short_items)
    prepared(q, k, v, o, lse, k_scale, v_scale, workspace, sinks=sinks)


def write_mask_states(prepared: PreparedAttention, states: torch.Tensor) -> None:
    """Point ``prepared`` (an sm90 custom-mask kernel's launch) at ``states`` (a uint8 buffer, zeroed at least over
    the ``kernels.prefill_sm90.mask_states_bytes`` the plan needs: the words past the walked blocks are read, the
    tiles' ends raised) and write its blocks' states there with the module's ``mask_states`` entry (the attention
    entry's fields), on the current stream: the launches that follow on it read one byte per block instead of the
    tile's mask rows. A buffer shorter than the plan needs gets a header of 0: the kernel then classifies blocks
    from the mask rows itself, as it does without states: for a twin of another tier, or when called inside a CUDA
    graph capture (a sinks twin's first run; a captured write would replay over a later plan's states)."""
    params = prepared.params
    if "mask_states" not in prepared.module.entry_names or stream_capturing():
        params.workspace, params.workspace_bytes = None, 0
        return
    params.workspace, params.workspace_bytes = states.data_ptr(), states.numel()
    fields = prepared.module.params("mask_states", **{name: getattr(params, name) for name, _ in params._fields_})
    with torch.cuda.device(states.device):
        prepared.module.call("mask_states", fields, torch.cuda.current_stream().cuda_stream)

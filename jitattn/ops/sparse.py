"""Block-sparse attention (FlashInfer's ``flashinfer.sparse``) on the paged prefill wrapper.

A block-sparse pattern is planned as one paged-prefill batch (``jitattn.runtime.sparse_layout``): each block
row is a request, its selected column blocks its pages (the K/V tensors viewed as pages, never
copied), a per-block mask its custom mask. One launch of the paged prefill kernel computes it.

Causal, as FlashInfer's: within a block row, over that row's selected columns gathered in the order
the pattern lists them, aligned bottom-right (the row's last query sees every gathered column). With
sorted column blocks that end at the diagonal and ``R == C`` this is ordinary causal attention.
"""

from __future__ import annotations

import torch

from ..runtime.checks import (check_no_overlap, check_planned_dtype, check_tensor, named_refusals, not_planned,
                              refuse_outputs_over_inputs)
from ..runtime.grad import claim_outputs, no_backward
from ..runtime.options import check_flag, parse_pos_encoding, per_tensor_scale, positive_int, resolve_flag
from ..runtime.wrapper import NotCopyable, host_side, plan_arguments, workspace_target
from .prefill import BatchPrefillWithPagedKVCacheWrapper
from ..runtime.sparse_layout import (SparsePageTable, VariableGeometry, bsr_packed_mask, bsr_page_table, check_bsr,
                                     check_bsr_packed_mask, convert_bsr_mask_layout, variable_page_table)
from ..spec import PosEncoding

__all__ = ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "convert_bsr_mask_layout"]

# The plan-time options FlashInfer's forward() sets again (its defaults included).
_FORWARD_OPTIONS = ("pos_encoding_mode", "logits_soft_cap", "sm_scale", "rope_scale", "rope_theta")


def _no_positions(wrapper: str, pos_encoding_mode) -> None:
    if parse_pos_encoding(pos_encoding_mode) is not PosEncoding.NONE:
        raise ValueError(
            f"{wrapper}.plan(pos_encoding_mode={pos_encoding_mode!r}): a block row attends to its selected columns "
            "gathered end to end, so in-kernel RoPE/ALiBi would see gathered positions, not the tokens'; apply "
            "RoPE to q and k before run() and plan with pos_encoding_mode='NONE'"
        )


class _SparseWrapperBase(NotCopyable):
    """What both block-sparse wrappers share: the paged prefill wrapper they plan, the workspace,
    ``forward``'s re-plan."""

    _NAME = ""

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str) -> None:
        # its device is where the attention runs (checked here: the inner wrapper would name itself)
        _, self.device = workspace_target(float_workspace_buffer, self._NAME)
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, "NHD", backend=backend)
        self._plan_call: dict = {}  # the last plan()'s arguments (forward() re-plans with them)

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None,
                               vector_sparse_indices_buffer=None, vector_sparse_indptr_buffer=None) -> None:
        """Use another float workspace (same device); the int and vector-sparse buffers are not needed here."""
        workspace_target(float_workspace_buffer, f"{self._NAME}.reset_workspace_buffer")  # in this wrapper's name
        self._prefill.reset_workspace_buffer(float_workspace_buffer)

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

    def _check_planned(self) -> None:
        if self._prefill.current_plan is None or not self._plan_call:
            raise not_planned(self._NAME, first="plan() once per sparsity pattern")

    def _replan_for_forward(self, options: dict) -> None:
        """FlashInfer's ``forward`` sets these plan options (defaults included): plan again when they differ."""
        self._check_planned()
        changed = {name: value for name, value in options.items() if self._plan_call.get(name) != value}
        if changed:
            self.plan(**{**self._plan_call, **changed})


class BlockSparseAttentionWrapper(_SparseWrapperBase):
    """Attention with a block-sparse row (BSR) mask: ``M`` queries, ``N`` keys, blocks of ``R x C``.

    ``plan(indptr, indices, M, N, R, C, ...)``: block row i (rows ``i*R`` to ``min(M, (i+1)*R)``)
    attends to column blocks ``indices[indptr[i]:indptr[i+1]]`` (block j: columns ``j*C`` to
    ``min(N, (j+1)*C)``; ``C`` need not divide ``N``). ``mask`` ``[nnz, R, C]`` (bool, True: attend) masks
    inside each stored block; ``packed_mask`` is the same bit-packed in FlashInfer's layout (block row
    i's ``[rows, selected columns]`` bits row-major, little-endian, each block row from a byte) and wins
    over ``mask``. Either overrides ``causal``. ``o_data_type`` defaults to float16, as FlashInfer's.
    ``use_fp16_qk_reduction``, ``non_blocking``, ``backend`` and ``enable_pdl`` only tune speed.
    """

    _NAME = "BlockSparseAttentionWrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        super().__init__(float_workspace_buffer, backend)
        self.M: int | None = None
        self.N: int | None = None
        self.R: int | None = None
        self.C: int | None = None
        self._table: SparsePageTable | None = None

    @host_side
    def plan(
        self, indptr: torch.Tensor, indices: torch.Tensor, M: int, N: int, R: int, C: int, num_qo_heads: int,
        num_kv_heads: int, head_dim: int, mask: torch.Tensor | None = None, packed_mask: torch.Tensor | None = None,
        causal: bool = False, pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
        logits_soft_cap: float | None = None, sm_scale: float | None = None, rope_scale: float | None = None,
        rope_theta: float | None = None, q_data_type: str | torch.dtype = "float16",
        kv_data_type: str | torch.dtype | None = None, o_data_type: str | torch.dtype = "float16",
        non_blocking: bool = True, *, batch_invariant: bool | None = None,
    ) -> None:
        """Plan one sparsity pattern (see the class); later ``run()`` calls reuse it. ``batch_invariant`` (a
        jitattn extension) is accepted for a uniform API: the prefill kernels it runs on are batch-invariant."""
        call = plan_arguments(locals())
        self._table, self._plan_call = None, {}  # unplanned until the launch is planned
        _no_positions(self._NAME, pos_encoding_mode)
        positive_int(head_dim, "head_dim")  # (the prefill wrapper calls it head_dim_qk)
        geometry = check_bsr(indptr, indices, M, N, R, C)
        table = bsr_page_table(geometry, M, N, R, C)
        if packed_mask is not None:  # FlashInfer's precedence: with both given, the packed mask is used
            check_bsr_packed_mask(packed_mask, geometry)
        elif mask is not None:
            packed_mask = bsr_packed_mask(mask, geometry, R, C)
        self._prefill.plan(
            table.qo_indptr, table.kv_indptr, table.kv_indices, table.last_page_len, num_qo_heads, num_kv_heads,
            head_dim, table.page_size, packed_custom_mask=packed_mask, causal=causal,
            logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta,
            q_data_type=q_data_type, kv_data_type=kv_data_type, o_data_type=o_data_type,
            batch_invariant=batch_invariant,
        )
        self._table, self._plan_call = table, call
        self.M, self.N, self.R, self.C = int(M), int(N), int(R), int(C)

    begin_forward = plan

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q: torch.Tensor | None = None,
        scale_k: torch.Tensor | None = None, scale_v: torch.Tensor | None = None, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, logits_soft_cap: float | None = None, sm_scale: float | None = None,
        rope_scale: float | None = None, rope_theta: float | None = None,
    ) -> torch.Tensor:
        """Older spelling of ``run``: the options given here (defaults included) replace the planned ones."""
        self._replan_for_forward(dict(pos_encoding_mode=pos_encoding_mode, logits_soft_cap=logits_soft_cap,
                                      sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta))
        return self.run(q, k, v, scale_q, scale_k, scale_v)

    @no_backward
    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q: torch.Tensor | None = None,
        scale_k: torch.Tensor | None = None, scale_v: torch.Tensor | None = None, out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None, return_lse: bool = False, enable_pdl: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[M, num_qo_heads, head_dim]``, k/v ``[N, num_kv_heads, head_dim]`` -> out ``[M, num_qo_heads,
        head_dim]`` (and the natural-log lse ``[M, num_qo_heads]``). ``scale_q``/``scale_k``/``scale_v``: one
        per-tensor dequantization scale each (a float or a one-element tensor; per-head scales are refused)."""
        check_flag(enable_pdl, "enable_pdl")
        self._check_planned()
        return_lse = resolve_flag(return_lse, "return_lse")
        table = self._table
        claim_outputs(self._NAME, out, lse)
        for name, buffer in (("out", out), ("lse", lse)):
            if buffer is not None:  # its shape, dtype and device: checked with q's before the launch
                check_tensor(name, buffer, last_dim_contiguous=False)
        for name, t in (("k", k), ("v", v)):
            check_tensor(name, t, ndim=3)
            if t.shape[0] != self.N:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; the plan has N={self.N} keys: pass "
                                 f"[N, num_kv_heads, head_dim]")
        check_tensor("q", q, ndim=3)
        if q.shape[0] != self.M:
            raise ValueError(f"q has shape {tuple(q.shape)}; the plan has M={self.M} queries: pass "
                             "[M, num_qo_heads, head_dim]")
        pages = (k.unflatten(0, (table.num_pages, table.page_size)), v.unflatten(0, (table.num_pages, table.page_size)))
        scales = dict(q_scale=per_tensor_scale(scale_q, "scale_q"), k_scale=per_tensor_scale(scale_k, "scale_k"),
                      v_scale=per_tensor_scale(scale_v, "scale_v"))
        return named_refusals(self._NAME, "block rows' prefill over k / v as pages (q, k, v, out, lse)",
                              lambda: self._prefill.run(q, pages, **scales, out=out, lse=lse, return_lse=return_lse))


class VariableBlockSparseAttentionWrapper(_SparseWrapperBase):
    """Block-sparse attention with block sizes of its own per kv head (FlashInfer's variable-block wrapper).

    ``plan(block_mask_map [H_kv, MB, NB], block_row_sz [H_kv, MB], block_col_sz [H_kv, NB], ...)``: for kv
    head h (and the ``num_qo_heads // num_kv_heads`` query heads that read it) row block r (its
    ``block_row_sz[h, r]`` rows) attends to column block c (``block_col_sz[h, c]`` columns) where
    ``block_mask_map[h, r, c]``. Every head's row sizes sum to the same ``qo_len``, column sizes to the
    same ``kv_len``. Planned as one paged-prefill batch of page size 1 over the kv heads laid end to end.
    Causal: bottom-right over each (head, row block)'s selected columns, as FlashInfer's.
    ``use_fp16_qk_reduction``, ``non_blocking``, ``backend`` and ``enable_pdl`` only tune speed.
    """

    _NAME = "VariableBlockSparseAttentionWrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, backend: str = "auto") -> None:
        super().__init__(float_workspace_buffer, backend)
        self._geometry: VariableGeometry | None = None
        self._num_kv_heads = 0
        self._group = 0

    @host_side
    def plan(
        self, block_mask_map: torch.Tensor, block_row_sz: torch.Tensor, block_col_sz: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim: int, causal: bool = False, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, logits_soft_cap: float | None = None, sm_scale: float | None = None,
        rope_scale: float | None = None, rope_theta: float | None = None, non_blocking: bool = True,
        q_data_type: str | torch.dtype = "float16", kv_data_type: str | torch.dtype | None = None, *,
        batch_invariant: bool | None = None,
    ) -> None:
        """Plan one pattern (see the class); later ``run()`` calls reuse it. ``batch_invariant``: as the block-sparse
        wrapper's."""
        call = plan_arguments(locals())
        self._geometry, self._plan_call = None, {}  # unplanned until the launch is planned
        _no_positions(self._NAME, pos_encoding_mode)
        num_qo_heads, num_kv_heads = positive_int(num_qo_heads, "num_qo_heads"), positive_int(num_kv_heads,
                                                                                             "num_kv_heads")
        positive_int(head_dim, "head_dim")  # (the prefill wrapper calls it head_dim_qk)
        if num_qo_heads % num_kv_heads:
            raise ValueError(f"num_qo_heads={num_qo_heads} must be a multiple of num_kv_heads={num_kv_heads}")
        table, geometry = variable_page_table(block_mask_map, block_row_sz, block_col_sz, num_kv_heads)
        self._prefill.plan(
            table.qo_indptr, table.kv_indptr, table.kv_indices, table.last_page_len, num_qo_heads // num_kv_heads, 1,
            head_dim, 1, causal=causal, logits_soft_cap=logits_soft_cap, sm_scale=sm_scale, rope_scale=rope_scale,
            rope_theta=rope_theta, q_data_type=q_data_type, kv_data_type=kv_data_type,
            batch_invariant=batch_invariant,
        )
        self._geometry, self._plan_call = geometry, call
        self._num_kv_heads, self._group = num_kv_heads, num_qo_heads // num_kv_heads

    begin_forward = plan

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False, logits_soft_cap: float | None = None, sm_scale: float | None = None,
        rope_scale: float | None = None, rope_theta: float | None = None,
    ) -> torch.Tensor:
        """Older spelling of ``run``: the options given here (defaults included) replace the planned ones."""
        self._replan_for_forward(dict(pos_encoding_mode=pos_encoding_mode, logits_soft_cap=logits_soft_cap,
                                      sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta))
        return self.run(q, k, v)

    @no_backward
    def run(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None, return_lse: bool = False, enable_pdl: bool | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """q ``[num_qo_heads, qo_len, head_dim]``, k/v ``[num_kv_heads, kv_len, head_dim]`` (HND, as FlashInfer's)
        -> out ``[num_qo_heads, qo_len, head_dim]`` (and the natural-log lse ``[num_qo_heads, qo_len]``);
        ``out``/``lse`` buffers take those shapes."""
        check_flag(enable_pdl, "enable_pdl")
        self._check_planned()
        return_lse = resolve_flag(return_lse, "return_lse")
        plan = self._prefill.current_plan
        heads, group, qo_len, kv_len = self._num_kv_heads, self._group, self._geometry.qo_len, self._geometry.kv_len
        for name, t, shape, dtype in (("q", q, (heads * group, qo_len, plan.head_dim_qk), plan.q_dtype),
                                      ("k", k, (heads, kv_len, plan.head_dim_qk), plan.kv_dtype),
                                      ("v", v, (heads, kv_len, plan.head_dim_vo), plan.kv_dtype)):
            check_tensor(name, t, ndim=3)
            check_planned_dtype(name, t, dtype, "q_data_type" if name == "q" else "kv_data_type")
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; the plan expects {shape} "
                                 "(HND: [heads, tokens, head_dim])")
        _check_buffer("out", out, (heads * group, qo_len, plan.head_dim_vo), plan.o_dtype, q.device)
        _check_buffer("lse", lse, (heads * group, qo_len), torch.float32, q.device)
        # as every wrapper: out / lse over q, k or v would overwrite the caller's inputs, out over lse the results
        refuse_outputs_over_inputs(f"{self._NAME}.run()", q, (k, v), out, lse)
        # The kernel's batch: kv head h's queries are rows h * qo_len.. of [H_kv * qo_len, group, D] (a copy
        # when group > 1), its keys tokens h * kv_len.. of a one-head token pool (a view of contiguous k/v).
        q_rows = q.unflatten(0, (heads, group)).transpose(1, 2).reshape(heads * qo_len, group, q.shape[2])
        pool = (k.reshape(heads * kv_len, 1, k.shape[2]), v.reshape(heads * kv_len, 1, v.shape[2]))
        out_rows, lse_rows = named_refusals(self._NAME, "prefill of every kv head's rows (q, k, v)",
                                            lambda: self._prefill.run(q_rows, pool, return_lse=True))
        # Every size spelled out: with qo_len == 0 (or no row blocks) a -1 could be any size.
        result = out_rows.view(heads, qo_len, group, plan.head_dim_vo).transpose(1, 2)
        result = result.reshape(heads * group, qo_len, plan.head_dim_vo)
        result_lse = lse_rows.view(heads, qo_len, group).transpose(1, 2).reshape(heads * group, qo_len)
        result = result if out is None else out.copy_(result)
        result_lse = result_lse if lse is None else lse.copy_(result_lse)
        return (result, result_lse) if return_lse else result


def _check_buffer(name: str, buffer: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device) -> None:
    """Refuse a caller's ``out``/``lse`` buffer that is not a ``dtype`` tensor of ``shape`` on ``device``."""
    if buffer is None:
        return
    check_tensor(name, buffer, dtypes=(dtype,), last_dim_contiguous=False)
    if tuple(buffer.shape) != shape or buffer.device != device:
        raise ValueError(f"{name} is {tuple(buffer.shape)} on {buffer.device}; expected {shape} on {device}")
    check_no_overlap(name, buffer)

"""What every batch wrapper (decode, paged prefill, ragged prefill) shares.

Construction (target from the workspace, layout, backend, CUDA-graph buffers),
workspace replacement, the eager/compiled run dispatch and FlashInfer's older
method spellings. Each wrapper adds its own ``plan()`` and ``run()``.
"""

from __future__ import annotations

import torch

from .batch import AttentionPlan, run_plan, run_plan_or_compiled, workspace_target
from .checks import target_of
from .compiled import register_wrapper
from .options import fp8_scale, parse_kv_layout

# The index arrays a captured launch reads, which CUDA-graph mode needs in fixed caller buffers.
_GRAPH_ROLES = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")


class BatchWrapperBase:
    _NAME = ""

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool, backend: str,
        buffers: dict[str, torch.Tensor | None], buffer_args: dict[str, str],
    ) -> None:
        """``buffers``: the caller's fixed index buffers by role; ``buffer_args``: the argument naming each."""
        self._target, self._device = workspace_target(float_workspace_buffer, self._NAME)
        self._workspace = float_workspace_buffer
        self._kv_layout = parse_kv_layout(kv_layout)
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"backend={backend!r} is not supported; use 'auto'")
        self._use_cuda_graph = bool(use_cuda_graph)
        missing = [buffer_args[role] for role in _GRAPH_ROLES if role in buffer_args and buffers.get(role) is None]
        if self._use_cuda_graph and missing:
            raise ValueError(f"use_cuda_graph=True needs the fixed index buffers {', '.join(missing)} "
                             "(sized for the largest batch)")
        self._buffers = buffers
        self._plan: AttentionPlan | None = None
        self._op_key = register_wrapper(self)

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        target_of(self._NAME, (float_workspace_buffer, self._workspace))
        self._workspace = float_workspace_buffer

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

    def forward(self, *args, **kwargs) -> torch.Tensor:
        """Older spelling of ``run`` (plan-time options passed again here are ignored)."""
        return self.run(*args, **_run_kwargs(kwargs))

    def forward_return_lse(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Older spelling of ``run(..., return_lse=True)``."""
        return self.run(*args, return_lse=True, **_run_kwargs(kwargs))

    def _run(self, q, k, v, k_scale, v_scale, out, lse, return_lse, variant_args=None):
        return run_plan_or_compiled(
            self._op_key, self._plan, self._NAME, self._workspace, q, k, v, k_scale=fp8_scale(k_scale, "k_scale"),
            v_scale=fp8_scale(v_scale, "v_scale"), out=out, lse=lse, return_lse=return_lse, variant_args=variant_args,
        )

    def _run_eager(self, q, k, v, *, k_scale, v_scale, out, lse, return_lse):
        return run_plan(self._plan, self._NAME, self._workspace, q, k, v, k_scale=k_scale, v_scale=v_scale,
                        out=out, lse=lse, return_lse=return_lse)


def _run_kwargs(kwargs: dict) -> dict:
    return {k: kwargs[k] for k in ("k_scale", "v_scale", "out", "lse") if k in kwargs}

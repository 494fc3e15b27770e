"""``flashinfer.norm``: RMSNorm and its fused-add and Gemma forms (no LSE: the native functions themselves)."""

from __future__ import annotations

from ..ops.norm import fused_add_rmsnorm, gemma_fused_add_rmsnorm, gemma_rmsnorm, rmsnorm

__all__ = ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "rmsnorm"]

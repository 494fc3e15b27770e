"""``flashinfer.sparse`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations

from ..ops import sparse as native
from ..ops.sparse import convert_bsr_mask_layout
from .convention import returns_base2_bound

__all__ = ["BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper", "convert_bsr_mask_layout"]


class BlockSparseAttentionWrapper(native.BlockSparseAttentionWrapper):
    __doc__ = native.BlockSparseAttentionWrapper.__doc__
    run = returns_base2_bound(native.BlockSparseAttentionWrapper.run)


class VariableBlockSparseAttentionWrapper(native.VariableBlockSparseAttentionWrapper):
    __doc__ = native.VariableBlockSparseAttentionWrapper.__doc__
    run = returns_base2_bound(native.VariableBlockSparseAttentionWrapper.run)

"""``flashinfer.cascade`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`).

The merges take and return base-2 LSE; the shared-prefix wrappers return the output alone (their
merges are internal), so they are the native ones.
"""

from __future__ import annotations


import torch

from ..ops import cascade as native
from ..runtime import merge as native_merge
from ..runtime.checks import check_no_overlap, check_tensor
from ..runtime.grad import check_writable, refuse_grad_writes
from ..runtime.wrapper import returning_lse
from ..ops.cascade import BatchDecodeWithSharedPrefixPagedKVCacheWrapper, BatchPrefillWithSharedPrefixPagedKVCacheWrapper
from .convention import LOG2E, lse_to_natural, returns_base2

__all__ = ["BatchDecodeWithSharedPrefixPagedKVCacheWrapper", "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
           "MultiLevelCascadeAttentionWrapper", "merge_state", "merge_state_in_place", "merge_states"]


def _natural(name: str, lse, written: bool = False) -> torch.Tensor:
    """The caller's base-2 ``lse`` in natural log, its dtype checked first: the conversion would turn an
    integer tensor into a float one that the native merge takes (and an in-place merge writes back truncated).
    Another float dtype is read as float32, as FlashInfer's merges do, unless the merge writes it (``written``:
    FlashInfer's in-place merge would update a float32 copy and leave the caller's tensor as it was)."""
    if isinstance(lse, torch.Tensor):
        if not written and lse.is_floating_point() and lse.dtype != torch.float32:
            lse = lse.float()
        check_tensor(name, lse, dtypes=(torch.float32,), last_dim_contiguous=False)
    return lse_to_natural(name, lse)


def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor,
                s_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The state over the union of two disjoint key sets; ``s_a``, ``s_b`` and the result's LSE in base 2."""
    v, s = native_merge.merge_state(v_a, _natural("s_a", s_a), v_b, _natural("s_b", s_b))
    return v, s.mul_(LOG2E)


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
                         mask: torch.Tensor | None = None) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place (rows where ``mask`` is False keep theirs);
    ``s`` and ``s_other`` in base 2."""
    s_natural = _natural("s", s, written=True)
    if torch.compiler.is_compiling():  # (address and inference-mode checks do not trace: the grad rule alone)
        refuse_grad_writes("merge_state_in_place", s=s)
    else:
        check_no_overlap("s", s)  # before v is written: s is written back last (the native merge writes s_natural)
        check_writable("merge_state_in_place", s=s)
        if isinstance(v, torch.Tensor):  # (the native merge checks v against s_natural, a copy)
            native_merge.refuse_v_over_s(v, s)
    native_merge.merge_state_in_place(v, s_natural, v_other, _natural("s_other", s_other), mask)
    merged = s_natural.mul_(LOG2E)
    if mask is not None:  # rows left alone keep their exact bits (no round trip through natural log)
        merged = torch.where(mask.reshape(-1, *([1] * (s.dim() - 1))).to(torch.bool), merged, s)
    s.copy_(merged)


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``[seq_len, num_states, ...]`` states into one per row; ``s`` and the result's LSE in base 2."""
    v_merged, s_merged = native_merge.merge_states(v, _natural("s", s))
    return v_merged, s_merged.mul_(LOG2E)


class MultiLevelCascadeAttentionWrapper(native.MultiLevelCascadeAttentionWrapper):
    __doc__ = native.MultiLevelCascadeAttentionWrapper.__doc__
    run = returns_base2(native.MultiLevelCascadeAttentionWrapper.run)
    run_return_lse = returning_lse(run)
    forward = run
    forward_return_lse = run_return_lse

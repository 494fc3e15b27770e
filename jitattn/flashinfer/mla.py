"""``flashinfer.mla`` with FlashInfer's LSE convention: base 2 unless ``return_lse_base_on_e=True``."""

from __future__ import annotations


import torch

from ..ops import mla as native
from ..runtime.wrapper import returning_lse
from .convention import lse_to_base2

__all__ = ["BatchMLAPagedAttentionWrapper"]


class BatchMLAPagedAttentionWrapper(native.BatchMLAPagedAttentionWrapper):
    __doc__ = native.BatchMLAPagedAttentionWrapper.__doc__

    def run(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv_cache: torch.Tensor, kpe_cache: torch.Tensor,
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, return_lse: bool = False,
        profiler_buffer: torch.Tensor | None = None, kv_len: torch.Tensor | None = None,
        page_table: torch.Tensor | None = None, return_lse_base_on_e: bool = False, *,
        k_scale: float | torch.Tensor | None = None, v_scale: float | torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """As the native ``run``; the LSE (returned, or written into ``lse``) is base 2, or the natural log
        with ``return_lse_base_on_e=True``."""
        result = super().run(q_nope, q_pe, ckv_cache, kpe_cache, out, lse, return_lse, profiler_buffer, kv_len,
                             page_table, return_lse_base_on_e, k_scale=k_scale, v_scale=v_scale)
        return result if return_lse_base_on_e else lse_to_base2(result, lse)

    run_return_lse = returning_lse(run)

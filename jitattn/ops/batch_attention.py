"""``BatchAttention``: FlashInfer's unified plan/run for a mixed prefill + decode batch over a paged KV cache.

FlashInfer runs it on a persistent kernel of its own. Here the whole batch -- decode requests (one
query), chunked-prefill and prefill requests alike -- is one launch of the paged prefill wrapper, whose
kernels take any query count per request. The KV is described by page counts (``kv_indptr``) and token
counts (``kv_len_arr``) instead of last-page lengths; ``run`` returns ``(out, lse)``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runtime.options import refuse_unsupported
from ..page_table import check_indptr, to_host_int32
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["BatchAttention"]


def last_page_lens(kv_indptr: torch.Tensor, kv_len_arr: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each request's last-page length (host int32) from its page count and token count; a request's token
    count must need exactly its pages (``ceil(kv_len / page_size)``)."""
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size={page_size!r} must be a positive int")
    pages = np.diff(check_indptr("kv_indptr", kv_indptr).numpy().astype(np.int64))
    lens = to_host_int32("kv_len_arr", kv_len_arr).numpy().astype(np.int64)
    if lens.size != pages.size:
        raise ValueError(f"kv_len_arr has {lens.size} entries but kv_indptr describes {pages.size} requests; "
                         "pass one kv length per request")
    if lens.size and lens.min() < 0:
        r = int(np.flatnonzero(lens < 0)[0])
        raise ValueError(f"kv_len_arr[{r}] = {int(lens[r])} is negative")
    needed = -(-lens // page_size)
    if (needed != pages).any():
        r = int(np.flatnonzero(needed != pages)[0])
        raise ValueError(f"kv_len_arr[{r}] = {int(lens[r])} tokens fill {int(needed[r])} pages of {page_size}, but "
                         f"kv_indptr gives request {r} {int(pages[r])} pages; they must agree")
    return torch.from_numpy(np.where(pages > 0, lens - (pages - 1) * page_size, 0).astype(np.int32))


class BatchAttention:
    """Mixed prefill + decode attention over a paged KV cache, FlashInfer's ``BatchAttention``.

    ``device`` is where the attention runs (``"cuda"`` or ``"cpu"``); no workspace is needed (the batch
    never splits its KV). ``plan`` takes the paged prefill wrapper's batch description with the KV
    given as ``kv_len_arr`` (tokens per request); causal is bottom-right per request, as there.
    ``run(q, kv_cache)`` returns ``(out, lse)``, the LSE in natural log (``jitattn.flashinfer``'s
    ``BatchAttention`` returns FlashInfer's base 2). ``use_profiler`` / ``profiler_buffer`` (FlashInfer's
    in-kernel profiler) are refused: jitattn's kernels carry readable names for nsys / ncu instead.
    """

    _NAME = "BatchAttention"

    def __init__(self, kv_layout: str = "NHD", device: str = "cuda") -> None:
        try:
            where = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(f"{self._NAME}(device={device!r}): not a device; pass 'cuda' or 'cpu'") from exc
        if where.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"{self._NAME}(device={device!r}): no CUDA device is visible to torch; pass "
                               "device='cpu' to run on the cpu target")
        self.float_workspace_buffer = torch.empty(0, dtype=torch.uint8, device=where)
        self._prefill = BatchPrefillWithPagedKVCacheWrapper(self.float_workspace_buffer, kv_layout)
        self._kv_layout = kv_layout
        self._logits_soft_cap: float | None = None  # the planned cap (None: not planned)

    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len_arr: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, page_size: int,
        causal: bool = False, sm_scale: float | None = None, logits_soft_cap: float | None = None,
        q_data_type: torch.dtype = torch.bfloat16, kv_data_type: torch.dtype = torch.bfloat16,
        use_profiler: bool = False,
    ) -> None:
        """Plan one batch: request r's queries are rows ``qo_indptr[r]:qo_indptr[r+1]`` of q, its KV the
        ``kv_len_arr[r]`` tokens on pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``."""
        self._logits_soft_cap = None
        refuse_unsupported(f"{self._NAME}.plan", "profile with nsys / ncu (kernels carry readable names)",
                           use_profiler=True if use_profiler else None)
        last_page_len = last_page_lens(kv_indptr, kv_len_arr, page_size)
        self._prefill.plan(
            qo_indptr, kv_indptr, kv_indices, last_page_len, num_qo_heads, num_kv_heads, head_dim_qk, page_size,
            head_dim_vo=head_dim_vo, causal=causal, sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type, kv_data_type=kv_data_type,
        )
        self._logits_soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)

    def run(
        self, q: torch.Tensor, kv_cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
        out: torch.Tensor | None = None, lse: torch.Tensor | None = None, k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None, logits_soft_cap: float = 0.0,
        profiler_buffer: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[total_qo, num_qo_heads, head_dim_qk]`` -> (out ``[total_qo, num_qo_heads, head_dim_vo]``, lse
        ``[total_qo, num_qo_heads]``). ``k_scale`` multiplies the logits and ``v_scale`` the output (per-tensor
        floats or one-element tensors). ``logits_soft_cap``: 0 (the default) runs the planned cap; another
        value must equal it (the cap is planned)."""
        if self._logits_soft_cap is None:
            raise RuntimeError(f"{self._NAME}.run() called before plan(); call plan() once per batch first")
        refuse_unsupported(f"{self._NAME}.run", "profile with nsys / ncu (kernels carry readable names)",
                           profiler_buffer=profiler_buffer)
        cap = float(logits_soft_cap)
        if cap > 0 and cap != self._logits_soft_cap:
            planned = "no cap" if self._logits_soft_cap == 0 else f"logits_soft_cap={self._logits_soft_cap}"
            raise ValueError(f"{self._NAME}.run(logits_soft_cap={cap}) differs from the plan ({planned}); the cap is "
                             "part of the plan: pass it to plan()")
        return self._prefill.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=True)

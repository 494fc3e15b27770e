"""``BatchAttention``: FlashInfer's unified plan/run for a mixed prefill + decode batch over a paged KV cache.

FlashInfer runs it on a persistent kernel of its own. Here ``plan`` splits the batch: requests of one query
over some KV (decode) go to the decode wrapper, every other one (chunked prefill, prefill, speculative steps,
requests without KV) to the paged prefill wrapper, whose kernels take any query count per request; ``run``
launches each part that has requests, side by side when there are two (``runtime.side_by_side``: the prefill on
part of the SMs, the decodes on a second stream), and writes its rows of the one output (a view when the part's
rows are contiguous, else a gather and a scatter). A decode row on the prefill kernels costs the KV read at a
fraction of the decode kernel's bandwidth. The KV is described by page counts (``kv_indptr``) and token counts
(``kv_len_arr``) instead of last-page lengths; ``run`` returns ``(out, lse)``.
"""

from __future__ import annotations

import numpy as np
import torch

from ..runtime.checks import check_no_overlap, check_tensor, named_refusals, not_planned, refuse_outputs_over_inputs
from ..runtime.grad import claim_outputs, no_backward
from ..runtime.options import number, parse_dtype, positive_int, refuse_unsupported, resolve_batch_invariant
from ..runtime.side_by_side import prefill_blocks, side_by_side
from ..runtime.compiled import batch_attention_run_compiled, register_wrapper
from ..runtime.wrapper import NotCopyable, host_side
from ..page_table import check_indptr, check_page_table, to_host_int32
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper

__all__ = ["BatchAttention"]


def last_page_lens(kv_indptr: torch.Tensor, kv_len_arr: torch.Tensor, page_size: int) -> torch.Tensor:
    """Each request's last-page length (host int32) from its page count and token count; a request's token
    count must need exactly its pages (``ceil(kv_len / page_size)``)."""
    page_size = positive_int(page_size, "page_size")
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


def _batch_prefix(name: str, indptr: torch.Tensor, batch: int) -> torch.Tensor:
    """The first ``batch + 1`` entries of an indptr (host int32); fewer are refused."""
    host = to_host_int32(name, indptr)
    if host.numel() < batch + 1:
        raise ValueError(f"{name} has {host.numel()} entries, but kv_len_arr gives {batch} requests, which need "
                         f"{batch + 1}; pass batch_size + 1 entries ({name} buffers may be longer)")
    return host[: batch + 1]


class _Part:
    """The requests of a batch one wrapper runs: their query rows of the whole batch (a slice when contiguous,
    else a device index) and the sub-batch's page table (host int32)."""

    def __init__(self, selected: np.ndarray, qo_indptr: np.ndarray, kv_indptr: np.ndarray, kv_indices: np.ndarray,
                 last_page_len: np.ndarray, device: torch.device) -> None:
        """``selected``: a bool per request of the batch; the index arrays are the whole batch's (int64)."""
        qo_lens, pages = qo_indptr[1:] - qo_indptr[:-1], kv_indptr[1:] - kv_indptr[:-1]
        rows = np.flatnonzero(np.repeat(selected, qo_lens))  # the selected requests' query rows, in order
        first = int(rows[0]) if rows.size else 0
        contiguous = rows.size == 0 or rows[-1] - first + 1 == rows.size
        self.rows: slice | torch.Tensor = (slice(first, first + rows.size) if contiguous
                                           else torch.from_numpy(rows).to(device))
        as_i32 = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int32))  # noqa: E731
        self.qo_indptr = as_i32(np.concatenate([[0], np.cumsum(qo_lens[selected])]))
        self.kv_indptr = as_i32(np.concatenate([[0], np.cumsum(pages[selected])]))
        self.kv_indices = as_i32(kv_indices[: kv_indptr[-1]][np.repeat(selected, pages)])
        self.last_page_len = as_i32(last_page_len[selected])

    def take(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rows] if isinstance(self.rows, slice) else x.index_select(0, self.rows)

    def put(self, dest: torch.Tensor, part: torch.Tensor) -> None:
        if isinstance(self.rows, slice):
            if part.data_ptr() != dest[self.rows].data_ptr():
                dest[self.rows].copy_(part)
        else:
            dest.index_copy_(0, self.rows, part)


class BatchAttention(NotCopyable):
    """Mixed prefill + decode attention over a paged KV cache, FlashInfer's ``BatchAttention``.

    ``device`` is where the attention runs (``"cuda"`` or ``"cpu"``); the float workspace the decode part's
    split-KV needs is allocated by ``plan`` (FlashInfer's takes none either). ``plan`` takes the paged prefill
    wrapper's batch description with the KV given as ``kv_len_arr`` (tokens per request); causal is
    bottom-right per request, as there (a decode row sees its whole KV either way). ``run(q, kv_cache)``
    returns ``(out, lse)``, the LSE in natural log (``jitattn.flashinfer``'s ``BatchAttention`` returns
    FlashInfer's base 2). ``use_profiler`` / ``profiler_buffer`` (FlashInfer's in-kernel profiler) are
    refused: jitattn's kernels carry readable names for nsys / ncu instead.
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
        self._decode_workspace = torch.empty(0, dtype=torch.uint8, device=where)  # the decode part's split-KV
        self._decode = BatchDecodeWithPagedKVCacheWrapper(self._decode_workspace, kv_layout)
        self._decode_limits: tuple | None = None  # (heads, head_dim, page size, invariant), batch, KV tokens sized
        self._kv_layout = kv_layout
        self._device = where
        self._logits_soft_cap: float | None = None  # the planned cap (None: not planned)
        self._parts: list[tuple[_Part, object]] = []  # (rows, wrapper) of each part that has requests
        self._prefill_blocks = 0  # the prefill part's grid cap beside the decode part (runtime.side_by_side)
        self._shape: tuple[int, int, int, int] = (0, 0, 0, 0)  # query rows, heads, head_dim_qk, head_dim_vo
        self._head_dim_vo = 0  # (alone: under torch.compile the rows of _shape would be guards)
        self._op_key = register_wrapper(self)

    @host_side
    def plan(
        self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, kv_len_arr: torch.Tensor,
        num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, page_size: int,
        causal: bool = False, sm_scale: float | None = None, logits_soft_cap: float | None = None,
        q_data_type: torch.dtype = torch.bfloat16, kv_data_type: torch.dtype = torch.bfloat16,
        use_profiler: bool = False, *, batch_invariant: bool | None = None,
    ) -> None:
        """Plan one batch: request r's queries are rows ``qo_indptr[r]:qo_indptr[r+1]`` of q, its KV the
        ``kv_len_arr[r]`` tokens on pages ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``. ``batch_invariant`` (a
        jitattn extension): each request's bits independent of the rest of the batch, as the decode and prefill
        wrappers' (a request takes the decode or the prefill kernels by its own query count)."""
        self._logits_soft_cap, self._parts = None, []
        if q_data_type is None:  # None: the 16- or 32-bit KV's dtype, else (fp8 KV) this signature's default
            kv = None if kv_data_type is None else parse_dtype(kv_data_type, "kv_data_type")
            q_data_type = kv if kv in (torch.float16, torch.bfloat16, torch.float32) else torch.bfloat16
        refuse_unsupported(f"{self._NAME}.plan", "profile with nsys / ncu (kernels carry readable names)",
                           use_profiler=True if use_profiler else None)
        for name, value in (("num_qo_heads", num_qo_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim_qk", head_dim_qk), ("head_dim_vo", head_dim_vo)):
            positive_int(value, name)  # before the split into parts reads them
        # As FlashInfer's: the batch is kv_len_arr's; qo_indptr / kv_indptr may be longer (fixed buffers sized for the
        # largest batch) and are read up to it.
        kv_len_arr = to_host_int32("kv_len_arr", kv_len_arr)  # (one copy from a GPU)
        batch = kv_len_arr.numel()
        qo_indptr, kv_indptr = (_batch_prefix(name, t, batch) for name, t in (("qo_indptr", qo_indptr),
                                                                               ("kv_indptr", kv_indptr)))
        last_page_len = last_page_lens(kv_indptr, kv_len_arr, page_size)
        qo = check_indptr("qo_indptr", qo_indptr).numpy().astype(np.int64)
        kv_host, indices_host = to_host_int32("kv_indptr", kv_indptr), to_host_int32("kv_indices", kv_indices)
        kv = kv_host.numpy().astype(np.int64)
        if qo.size != kv.size:
            raise ValueError(f"qo_indptr describes {qo.size - 1} requests but kv_indptr {kv.size - 1}; pass one "
                             "entry per request to both")
        # the whole batch's page table, before the parts' wrappers check theirs (under their own names and positions)
        check_page_table(kv_host, indices_host, None, page_size, names=("kv_indptr", "kv_indices", "kv_len_arr"))
        indices = indices_host.numpy()
        # Decode rows: one query over some KV, when the decode kernels take the head dims (they have one).
        decode = ((qo[1:] - qo[:-1]) == 1) & (kv[1:] > kv[:-1]) & (int(head_dim_qk) == int(head_dim_vo))
        lpl = last_page_len.numpy()
        parts = [(_Part(~decode, qo, kv, indices, lpl, self._device), self._prefill),
                 (_Part(decode, qo, kv, indices, lpl, self._device), self._decode)]
        if not decode.any():  # the whole batch on the prefill kernels (also a batch of no requests)
            parts = parts[:1]
        elif decode.all():
            parts = parts[1:]
        for part, wrapper in parts:
            if wrapper is self._prefill:
                self._prefill.plan(
                    part.qo_indptr, part.kv_indptr, part.kv_indices, part.last_page_len, num_qo_heads, num_kv_heads,
                    head_dim_qk, page_size, head_dim_vo=head_dim_vo, causal=causal, sm_scale=sm_scale,
                    logits_soft_cap=logits_soft_cap, q_data_type=q_data_type, kv_data_type=kv_data_type,
                    fp8_upcast=False, batch_invariant=batch_invariant)  # its two-part launch reads the paged cache
            else:
                self._plan_decode(part, num_qo_heads, num_kv_heads, head_dim_qk, page_size, sm_scale,
                                  logits_soft_cap, q_data_type, kv_data_type, batch_invariant)
        self._parts = parts
        self._prefill_blocks = 0 if len(parts) < 2 else prefill_blocks(
            self._prefill.current_plan, np.diff(parts[0][0].qo_indptr.numpy()), self._decode.current_plan)
        self._shape = (int(qo[-1]), int(num_qo_heads), int(head_dim_qk), int(head_dim_vo))
        self._head_dim_vo = self._shape[3]
        self._logits_soft_cap = 0.0 if logits_soft_cap is None else float(logits_soft_cap)

    def _plan_decode(self, part: _Part, num_qo_heads, num_kv_heads, head_dim, page_size, sm_scale, logits_soft_cap,
                     q_data_type, kv_data_type, batch_invariant: bool | None) -> None:
        """The decode part, with a float workspace its split-KV fits (grown, never shrunk; sized again only for a
        batch beyond the limits it was last sized for, as ``workspace_size`` bounds every plan within them)."""
        batch, tokens = part.last_page_len.numel(), int(part.kv_indptr[-1]) * page_size  # the part's KV, at most
        invariant = resolve_batch_invariant(batch_invariant)  # (its own bound: chunks of a fixed length)
        shape = (num_qo_heads, num_kv_heads, head_dim, page_size, invariant)
        sized = self._decode_limits
        if sized is None or sized[0] != shape or batch > sized[1] or tokens > sized[2]:
            need = self._decode.workspace_size(batch, tokens, *shape[:4], batch_invariant=invariant)[0]
            if self._decode_workspace.numel() < need:
                self._decode_workspace = torch.empty(need, dtype=torch.uint8, device=self._device)
                self._decode.reset_workspace_buffer(self._decode_workspace)
            self._decode_limits = (shape, batch, tokens)
        self._decode.plan(part.kv_indptr, part.kv_indices, part.last_page_len, num_qo_heads, num_kv_heads, head_dim,
                          page_size, logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                          kv_data_type=kv_data_type, sm_scale=sm_scale, batch_invariant=invariant)

    @no_backward
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
            raise not_planned(self._NAME)
        refuse_unsupported(f"{self._NAME}.run", "profile with nsys / ncu (kernels carry readable names)",
                           profiler_buffer=profiler_buffer)
        self._check_run_cap(logits_soft_cap)
        if torch.compiler.is_compiling():  # one op (runtime/compiled.py): the parts' launches compose in Python
            return batch_attention_run_compiled(self._op_key, q, kv_cache, self._kv_layout, out, lse, k_scale, v_scale,
                                                self._head_dim_vo)
        for name, given in (("out", out), ("lse", lse)):
            if given is not None:  # a tensor; its shape, dtype and device are checked with q's below
                check_tensor(name, given, last_dim_contiguous=False)
        # The kernels write rows of buffers contiguous in their last dimension: other out / lse take the parts'
        # results through buffers of their own, whatever the batch (a part's rows a slice or not).
        direct = all(t is None or t.stride(-1) == 1 for t in (out, lse))
        if direct and len(self._parts) == 1 and self._parts[0][1] is self._prefill:
            return named_refusals(self._NAME, "batch on the paged prefill kernels (q, kv_cache, out, lse)",
                                  lambda: self._prefill.run(q, kv_cache, k_scale=k_scale, v_scale=v_scale, out=out,
                                                            lse=lse, return_lse=True))
        rows, heads, dqk, dvo = self._shape
        check_tensor("q", q, ndim=3)
        if tuple(q.shape) != (rows, heads, dqk):
            raise ValueError(f"q has shape {tuple(q.shape)}; the plan expects {(rows, heads, dqk)}")
        o_dtype = self._parts[0][1].current_plan.o_dtype
        self._check_outputs(q, out, lse, o_dtype)
        # (a part whose rows are not contiguous computes into its own buffers, then scatters into out / lse)
        refuse_outputs_over_inputs(f"{self._NAME}.run()", q, kv_cache, out, lse)
        if out is None:
            out = torch.empty((rows, heads, dvo), dtype=o_dtype, device=q.device)
        if lse is None:
            lse = torch.empty((rows, heads), dtype=torch.float32, device=q.device)

        def launch(part: _Part, wrapper):
            sliced = direct and isinstance(part.rows, slice)  # then the part writes its rows of out / lse in place
            which = "prefill" if wrapper is self._prefill else "decode"
            return named_refusals(self._NAME, f"{which} part (its rows of q, kv_cache, out, lse)", lambda: wrapper.run(
                part.take(q), kv_cache, k_scale=k_scale, v_scale=v_scale, out=out[part.rows] if sliced else None,
                lse=lse[part.rows] if sliced else None, return_lse=True))

        if len(self._parts) == 2:  # the prefill part on the SMs its estimate needs, the decode part beside it
            with self._prefill.current_plan.launch.grid_at_most(self._prefill_blocks):
                results = side_by_side(lambda: launch(*self._parts[0]), lambda: launch(*self._parts[1]), q.device)
        else:
            results = [launch(*self._parts[0])]
        for (part, _), (part_out, part_lse) in zip(self._parts, results):
            part.put(out, part_out)
            part.put(lse, part_lse)
        return out, lse

    run_natural_lse = run  # (not overridden by jitattn.flashinfer's base-2 run: the compiled op calls it)

    def _check_run_cap(self, logits_soft_cap) -> None:
        """``run``'s ``logits_soft_cap``: 0 / None (the planned cap) or the planned cap itself."""
        if logits_soft_cap is None:
            return
        cap = number(logits_soft_cap, "logits_soft_cap")
        if cap != 0 and cap != self._logits_soft_cap:  # NaN equals neither: refused
            planned = "no cap" if self._logits_soft_cap == 0 else f"logits_soft_cap={self._logits_soft_cap}"
            raise ValueError(f"{self._NAME}.run(logits_soft_cap={cap}) differs from the plan ({planned}); the cap is "
                             "part of the plan: pass it to plan() (run() takes 0 / None or the planned cap)")

    def _check_outputs(self, q: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None,
                       o_dtype: torch.dtype) -> None:
        """The caller's out / lse against the plan, before any part writes its rows of them (a part whose rows
        are not contiguous writes them by a scatter, which would fail half-way)."""
        claim_outputs(self._NAME, out, lse)
        rows, heads, _, dvo = self._shape
        for name, given, shape, dtype in (("out", out, (rows, heads, dvo), o_dtype),
                                          ("lse", lse, (rows, heads), torch.float32)):
            if given is None:
                continue
            check_tensor(name, given, dtypes=(dtype,), last_dim_contiguous=False)
            if tuple(given.shape) != shape:
                raise ValueError(f"{name} has shape {tuple(given.shape)}; the plan expects {shape}")
            if given.device != q.device:
                raise ValueError(f"{name} is on {given.device} but q is on {q.device}; pass {name} on q's device")
            check_no_overlap(name, given)

"""The ``ops`` suite's fp8 prefill rows (``ops_cases.Fp8Prefill``).

One ``single_prefill_with_kv_cache`` call of fp8 q, k and v with per-tensor scales (``SCALES``), timed as every row
(``Timer.measure``: CUDA events, L2 evicted before each call; the call plans its request each time, a host cost the
events hide and the plain-launch figure shows). ``params["path"]``: the sm90 fp8 kernel or the conversion to 16
bits. The error over the last ``REF_QUERIES`` queries (bottom-right causal: the last queries see every key) against
``jitattn.reference`` of the dequantized values; ``baseline``: the dense 16-bit twin's row. ``--peer flashinfer``:
FlashInfer's ``single_prefill_with_kv_cache`` on the same tensors (its Hopper backend, per-head scale tensors of
the same values).
"""

from __future__ import annotations

import torch

from .inputs import random_tensor, seed_of
from .ops import run_peer, time_beside_dense
from .ops_cases import Fp8Prefill
from .rows import REF_QUERIES, TORCH_DTYPES, Context, new_row, rel_err

SCALES = (0.25, 0.5, 1.5)  # scale_q, scale_k, scale_v


def _operands(case: Fp8Prefill, device: torch.device) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device=device).manual_seed(seed_of(case.name))
    dt, n, d = TORCH_DTYPES[case.dtype], case.seq, case.head_dim
    return tuple(random_tensor((n, h, d), dt, device, gen)
                 for h in (case.num_qo_heads, case.num_kv_heads, case.num_kv_heads))


def _call(lib, case: Fp8Prefill, q, k, v, per_head: bool = False):
    sq, sk, sv = SCALES
    if per_head:  # FlashInfer takes its fp8 scales as float32 tensors of one value per head
        sq, sk, sv = (torch.full((h,), s, dtype=torch.float32, device=q.device)
                      for h, s in ((case.num_qo_heads, sq), (case.num_kv_heads, sk), (case.num_kv_heads, sv)))
    o_dtype = TORCH_DTYPES[case.o_dtype]
    return lambda: lib.single_prefill_with_kv_cache(q, k, v, scale_q=sq, scale_k=sk, scale_v=sv, o_dtype=o_dtype,
                                                    causal=case.causal)


def _error(case: Fp8Prefill, q, k, v, out: torch.Tensor) -> float:
    from jitattn import reference

    m = min(case.seq, REF_QUERIES)
    sq, sk, sv = SCALES
    ref, _ = reference.single_attention(q[-m:].double() * sq, k.double() * sk, v.double() * sv, causal=case.causal)
    return rel_err([out[-m:]], [ref])


def run_fp8_prefill(case: Fp8Prefill, ctx: Context) -> list[dict]:
    import jitattn
    from jitattn.ops.prefill_fp8 import fp8_kernel_runs
    from jitattn.spec import KVLayout

    row = new_row(case)
    q, k, v = _operands(case, ctx.device)
    kernel = fp8_kernel_runs(q, k, v, KVLayout.NHD, None, None, case.causal, "NONE", -1, None)
    row["params"]["path"] = "the sm90 fp8 kernel" if kernel else "converted to 16 bits"
    fn = _call(jitattn, case, q, k, v)
    out = fn()
    ctx.sync()
    row["max_rel_err"] = _error(case, q, k, v, out)
    time_beside_dense(case, ctx, row, fn, lambda: run_peer(
        case, ctx, lambda fi: _call(fi, case, q, k, v, per_head=True), [out], row["time_us"],
        needs=("single_prefill_with_kv_cache",)))
    row["sdpa_na"] = f"compared with {case.dense}" if case.dense else "fp8 query"
    return [row]

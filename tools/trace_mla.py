"""Where the sm90 MLA kernel's time goes per KV block: clock64 stamps of both warpgroups (mla TUNING trace=1).

    python3 tools/trace_mla.py [CASE ...] [key=value ...]

``key=value``: other entries of ``jitattn.kernels.mla.TUNING`` for the traced build (e.g. ``lazy_rescale=0``). The
64-row kernel is traced, also where a plan would take the narrow kernel (16 heads): ``narrow_rows`` is 0.

Cases (latent cache as views of one 576-wide buffer, pages of 64, bf16 queries): h128 (64 x 4096 tokens, 128 heads:
the suite's mla/b64_s4096_p64), h16 (128 x 4096, 16 heads), h128_fp8 (h128 over an e4m3 cache). For each: the
launch's GPU time (tools/mla_tuning.py's timer: CUDA events around 20 back-to-back calls, median of 5 groups), then,
over KV blocks 8 .. 15 of every CTA's first item, each phase's p10 / p50 / p90 in SM cycles. Warpgroup 0 (S,
softmax, O[:, :256]): the block in (after the CTA barrier) -> S issued -> S done -> P shared -> P V issued (O
rescaled) -> P V done -> the next block in; warpgroup 1 (loads, O[:, 256:]): block in -> next block's loads issued
-> P received -> P V issued -> P V done -> next block in. With an fp8 cache the block-in stamps come before the
conversion into the tile, which falls in "S issue" and "loads issue". The period is block in to block in; the launch
time over the blocks per CTA gives the scale in microseconds. The traced build has the registers of the plain one
and no spills (ptxas), but the stamps between wgmma issue and wait may move instructions: compare its event time
with the plain kernel's.
"""

from __future__ import annotations

import ctypes
import math
import sys

import numpy as np
import torch

from jitattn.kernels import mla as family

family.TUNING["trace"] = 1
family.TUNING["narrow_rows"] = 0  # the stamps are the 64-row kernel's (the narrow kernel has none): every plan takes it

import jitattn  # noqa: E402
from jitattn.hardware import num_sms  # noqa: E402
from jitattn.runtime.mla_kernel import kernel_spec  # noqa: E402
from mla_tuning import median_call_us, mla_inputs  # noqa: E402

CTAS, COUNT, FIELDS = (family.TRACE[k] for k in ("kTraceCtas", "kTraceCount", "kTraceFields"))
CASES = {"h128": (64, 4096, 128, torch.bfloat16), "h16": (128, 4096, 16, torch.bfloat16),
         "h128_fp8": (64, 4096, 128, torch.float8_e4m3fn)}
PHASES = [("wg0 S issue", 0, 1), ("wg0 S wait", 1, 2), ("wg0 softmax, P shared", 2, 3),
          ("wg0 rescale, P V issue", 3, 4), ("wg0 P V wait", 4, 5), ("wg0 to next block", 5, None),
          ("wg1 loads issue", 6, 7), ("wg1 waits for P", 7, 8), ("wg1 rescale, P V issue", 8, 9),
          ("wg1 P V wait", 9, 10), ("wg1 to next block", 10, None)]


def run_case(name: str, batch: int, kv_len: int, heads: int, kv_dtype: torch.dtype) -> None:
    page = 64
    buf, indices, indptr, lens, q_nope, q_pe = mla_inputs(batch, kv_len, heads, kv_dtype, torch.bfloat16, page)
    out = torch.empty_like(q_nope)
    w = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device="cuda"))
    w.plan(torch.arange(batch + 1, dtype=torch.int32), indptr, indices, lens, heads, 512, 64, page, False,
           1.0 / math.sqrt(192), torch.bfloat16, kv_dtype)
    run = lambda: w.run(q_nope, q_pe, buf[..., :512], buf[..., 512:], out=out)  # noqa: E731
    launch = median_call_us(run)
    lib = ctypes.CDLL(str(jitattn.load(kernel_spec(torch.bfloat16, kv_dtype)).path))  # the loaded module
    assert lib.jitattn_mla_trace_clear() == 0
    run()
    torch.cuda.synchronize()
    raw = (ctypes.c_longlong * (CTAS * COUNT * FIELDS))()
    assert lib.jitattn_mla_trace(ctypes.byref(raw)) == CTAS
    t = np.frombuffer(raw, dtype=np.int64).reshape(CTAS, COUNT, FIELDS)
    ran = t[(t[:, :, 0] > 0).all(axis=1)]  # CTAs whose first item had every traced block
    blocks = int(ran[0, 0, 11]) if len(ran) else 0
    print(f"== {name}: {batch} x {kv_len} tokens, {heads} heads, {kv_dtype}; events {launch:.1f} us; "
          f"{len(ran)} CTAs traced, {blocks} blocks in their first item")
    if not len(ran):
        return
    period = (ran[:, 1:, 0] - ran[:, :-1, 0]).ravel()
    q = lambda x: " / ".join(f"{v:7.0f}" for v in np.quantile(x, [0.1, 0.5, 0.9]))  # noqa: E731
    print(f"  {'period (block in -> next)':28s} {q(period)}   cycles, p10 / p50 / p90")
    for label, a, b in PHASES:
        span = (ran[:, 1:, 0 if a < 6 else 6] - ran[:, :-1, a]) if b is None else (ran[:, :, b] - ran[:, :, a])
        print(f"  {label:28s} {q(span.ravel())}")
    tiles = batch * -(-heads // 64)  # the work items when no request is split (these cases' plans)
    per_cta = -(-tiles // min(tiles, num_sms(torch.cuda.current_device()))) * blocks
    print(f"  scale: ~{launch / per_cta:.2f} us a block ({tiles} items of {blocks} blocks, {per_cta} blocks per SM)")


def main() -> None:
    names = [a for a in sys.argv[1:] if "=" not in a]
    family.TUNING.update({k: int(v) for k, v in (a.split("=", 1) for a in sys.argv[1:] if "=" in a)})
    for name in names or list(CASES):
        if name not in CASES:
            raise SystemExit(f"unknown case {name!r}: {', '.join(CASES)}")
        run_case(name, *CASES[name])
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()

"""Host time per call of jitattn beside FlashInfer in one process: ``python -m jitattn.bench.host_peer``.

Tiny GPU work (4 requests of one page), so each number is the Python + launch cost a serving
loop pays per call: ``run()`` once per layer for decode, paged prefill and a two-level cascade,
and ``plan()`` / ``fast_decode_plan()`` once per step for a batch of 256 x 4096 tokens; the MLA
wrapper's ``run()`` and ``plan()`` alike. Each is the median of several rounds of back-to-back calls
(no device sync inside a round). FlashInfer columns are skipped when it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import statistics
import sys
import time
from typing import Callable

import torch


def host_us(fn: Callable[[], object], calls: int = 400, rounds: int = 7,
            summary: Callable[[list[float]], float] = statistics.median,
            sync: Callable[[], object] = torch.cuda.synchronize) -> float:
    """µs per call of ``fn``: ``summary`` over ``rounds`` of ``calls`` back-to-back calls, ``sync`` between rounds."""
    for _ in range(50):
        fn()
    sync()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
        sync()
    return summary(samples)


def _tiny(lib, ws, device: str = "cuda"):
    """(decode run, prefill run, cascade run) callables of library ``lib`` (jitattn or flashinfer)."""
    b, hq, hkv, d, ps = 4, 32, 8, 128, 16
    i32 = dict(dtype=torch.int32, device=device)
    indptr, indices = torch.arange(b + 1, **i32), torch.arange(b, **i32)
    last, qo = torch.full((b,), ps, **i32), torch.arange(b + 1, **i32)
    cache = torch.randn(16, 2, ps, hkv, d, dtype=torch.bfloat16, device=device)
    q = torch.randn(b, hq, d, dtype=torch.bfloat16, device=device)
    out = torch.empty_like(q)
    extra = dict(use_tensor_cores=True) if lib.__name__ == "flashinfer" else {}
    dec = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **extra)
    dec.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.bfloat16)
    pre = lib.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=True, q_data_type=torch.bfloat16)
    cas = lib.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    cas.plan([torch.tensor([0, b], **i32), qo], [torch.tensor([0, 2], **i32), indptr],
             [torch.tensor([8, 9], **i32), indices], [torch.tensor([ps], **i32), last], hq, hkv, d, ps,
             q_data_type=torch.bfloat16)
    return (lambda: dec.run(q, cache, out=out)), (lambda: pre.run(q, cache, out=out)), (lambda: cas.run(q, cache))


def _plans(lib, ws, device: str = "cuda"):
    """(plan, fast_decode_plan) callables for a batch of 256 x 4096 tokens."""
    b, pages, ps = 256, 256, 16
    indices = torch.randperm(b * pages + 64, dtype=torch.int64)[: b * pages].to(torch.int32)
    indptr = (torch.arange(b + 1) * pages).to(torch.int32)
    last = torch.full((b,), ps, dtype=torch.int32)
    dev = [t.to(device) for t in (indptr, indices, last)]
    extra = dict(use_tensor_cores=True) if lib.__name__ == "flashinfer" else {}
    dec = lib.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", **extra)
    plan = lambda: dec.plan(indptr, indices, last, 32, 8, 128, ps, q_data_type=torch.bfloat16)  # noqa: E731
    fast_fn = getattr(importlib.import_module(f"{lib.__name__}.decode"), "fast_decode_plan")
    fast = lambda: fast_fn(dec, *dev, 32, 8, 128, ps, q_data_type=torch.bfloat16,  # noqa: E731
                           global_override_indptr_cpu=indptr)
    return plan, fast


def _mla(lib, ws, device: str = "cuda"):
    """(plan, run) callables of the MLA wrapper at 128 heads, page 64 (two wrappers): ``plan()`` of a batch of
    256 x 4096 tokens, ``run()`` over 4 requests of one page."""
    heads, ckv, kpe, ps = 128, 512, 64, 64

    def planned(batch: int, pages: int):
        wrapper = lib.BatchMLAPagedAttentionWrapper(ws)
        indptr = (torch.arange(batch + 1) * pages).to(torch.int32)
        indices = torch.randperm(batch * pages + 64, dtype=torch.int64)[: batch * pages].to(torch.int32)
        lens, qo = torch.full((batch,), pages * ps, dtype=torch.int32), torch.arange(batch + 1, dtype=torch.int32)
        return wrapper, lambda: wrapper.plan(qo, indptr, indices, lens, heads, ckv, kpe, ps, False, 1 / 192 ** 0.5,
                                             torch.bfloat16, torch.bfloat16)

    _, plan = planned(256, 64)
    tiny, tiny_plan = planned(4, 1)
    tiny_plan()
    q_nope = torch.randn(4, heads, ckv, dtype=torch.bfloat16, device=device)
    q_pe = torch.randn(4, heads, kpe, dtype=torch.bfloat16, device=device)
    cache = torch.randn(300, ps, ckv + kpe, dtype=torch.bfloat16, device=device)  # one buffer, as SGLang keeps it
    out = torch.empty_like(q_nope)
    return plan, (lambda: tiny.run(q_nope, q_pe, cache[..., :ckv], cache[..., ckv:], out=out))


METHOD = ("host wall time per call (time.perf_counter), median of rounds of back-to-back eager calls with no "
          "device sync inside a round (no CUDA graph; tiny GPU work, so the figure is the Python + launch cost); "
          "run(): 4 requests of one page (decode and prefill with out= given), index arrays planned from the "
          "device; plan(): index arrays on the host; fast_decode_plan(): index arrays on the device with "
          "global_override_indptr_cpu on the host; MLA: 128 heads, page 64, the latent cache as views of one "
          "576-wide buffer")


def main() -> int:
    if any(a in ("-h", "--help") for a in sys.argv[1:]):
        print(__doc__.strip() + "\n\nusage: python -m jitattn.bench.host_peer [OUT.json]")
        return 0
    if not torch.cuda.is_available():
        print("jitattn.bench.host_peer times calls on a CUDA device; none is visible here", file=sys.stderr)
        return 2
    libs = ["jitattn"] + (["flashinfer"] if importlib.util.find_spec("flashinfer") else [])
    ws = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    results: dict[str, dict[str, float]] = {}
    for name in libs:
        lib = importlib.import_module(name)
        decode, prefill, cascade = _tiny(lib, ws)
        plan, fast = _plans(lib, ws)
        mla_plan, mla_run = _mla(lib, ws)
        results[name] = {
            "decode run()": host_us(decode), "paged prefill run()": host_us(prefill),
            "cascade run() (2 levels)": host_us(cascade, calls=200),
            "decode plan() b256 x 4096": host_us(plan, calls=20, rounds=5),
            "fast_decode_plan() b256 x 4096": host_us(fast, calls=20, rounds=5),
            "MLA run()": host_us(mla_run),
            "MLA plan() b256 x 4096": host_us(mla_plan, calls=20, rounds=5),
        }
    rows = list(results["jitattn"])
    print(f"{'host us per call':<34s}" + "".join(f"{n:>12s}" for n in libs) + ("   ratio" if len(libs) > 1 else ""))
    for row in rows:
        values = [results[n][row] for n in libs]
        ratio = f"   {values[0] / values[1]:.2f}x" if len(values) > 1 else ""
        print(f"{row:<34s}" + "".join(f"{v:12.1f}" for v in values) + ratio)
    print(f"timing: {METHOD}")
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump({"method": METHOD, **results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

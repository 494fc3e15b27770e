"""Flat paged decode over pages that every request shares, per decode TUNING.

Times (Timer.measure: CUDA events, L2 evicted before each call, no graphs, host index arrays) the
flat decode of the suite's two cascade cases (every request lists the shared pages, then its own),
an L2-resident case (128 requests on the same 64 pages) and three unshared llama8b rows, once per
tuning given as JSON on the command line (each in a subprocess: a tuning renders its own source);
with --peer, FlashInfer's decode on the same tables in the parent process.

    python tools/bench_shared_order.py '{}' '{"head_minor": 0}' --peer

--shapes adds rows of other head shapes (gemma-2 d256 with and without its soft cap, phi3 d96, gpt-oss d64).
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys

import torch

CASES = [  # name, batch, shared tokens, own tokens per request
    ("shared b128 8192+256", 128, 8192, 256),
    ("shared b32 32768+128", 32, 32768, 128),
    ("shared-L2 b128 1024+16", 128, 1024, 16),
    ("unshared b256 x 4096", 256, 0, 4096),
    ("unshared b64 x 2048", 64, 0, 2048),
    ("unshared b1 x 32768", 1, 0, 32768),
    ("unshared b128 x 256", 128, 0, 256),  # the cascade row's tails, alone
    ("skewed 1x32768 + 63x512", 64, 0, [32768] + [512] * 63),
]
HQ, HKV, D, PAGE = 32, 8, 128, 16
# With --shapes: rows of other head shapes, (name, batch, shared, own, (query heads, KV heads, head_dim, soft cap))
SHAPE_CASES = [
    ("gemma-2 d256 cap 50 b64 x 4096", 64, 0, 4096, (16, 8, 256, 50.0)),
    ("gemma-2 d256 b64 x 4096", 64, 0, 4096, (16, 8, 256, 0.0)),
    ("phi3 d96 b64 x 4096", 64, 0, 4096, (32, 32, 96, 0.0)),
    ("gpt-oss d64 b64 x 8192", 64, 0, 8192, (64, 8, 64, 0.0)),
]


def tables(batch: int, shared: int, own, gen: torch.Generator):
    """Every request lists the shared pages, then its own ``own`` tokens (an int, or one per request)."""
    own = [own] * batch if isinstance(own, int) else own
    p_shared, p_own = shared // PAGE, [(n + PAGE - 1) // PAGE for n in own]
    needed = p_shared + sum(p_own)
    pool = needed + needed // 4 + 1
    order = torch.randperm(pool, generator=gen)[:needed].to(torch.int32)
    s, rest = order[:p_shared], order[p_shared:]
    rows, at = [], 0
    for n in p_own:
        rows.append(torch.cat([s, rest[at:at + n]]))
        at += n
    indices = torch.cat(rows).contiguous()
    counts = torch.tensor([p_shared + n for n in p_own])
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32)
    last = torch.tensor([(n - 1) % PAGE + 1 for n in own], dtype=torch.int32)
    return pool, indptr, indices, last


def kv_bytes(batch: int, shared: int, own, hkv: int = HKV, d: int = D) -> int:
    own = [own] * batch if isinstance(own, int) else own
    return 4 * (batch * shared + sum(own)) * hkv * d


def run_cases(peer: bool) -> list[dict]:
    from jitattn.bench.timing import Timer

    dev = torch.device("cuda")
    timer = Timer(dev, scrub_bytes=4 * torch.cuda.get_device_properties(dev).L2_cache_size)
    rows = []
    cases = [c + ((HQ, HKV, D, 0.0),) for c in CASES] + (SHAPE_CASES if "--shapes" in sys.argv else [])
    for name, b, shared, own, (hq, hkv, d, cap) in cases:
        gen = torch.Generator().manual_seed(b * 7 + shared)
        pool, indptr, indices, last = tables(b, shared, own, gen)
        cache = torch.randn(pool, 2, PAGE, hkv, d, device=dev, dtype=torch.bfloat16)
        q = torch.randn(b, hq, d, device=dev, dtype=torch.bfloat16)
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
        if peer:
            import flashinfer

            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
            w.plan(indptr.cuda(), indices.cuda(), last.cuda(), hq, hkv, d, PAGE, q_data_type=torch.bfloat16,
                   logits_soft_cap=cap)
        else:
            import jitattn

            w = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, kv_layout="NHD")
            w.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=torch.bfloat16, logits_soft_cap=cap)
        out = torch.empty_like(q)
        t = timer.measure(functools.partial(w.run, q, cache, out=out), 0.4).median_us
        rows.append({"case": name, "us": t, "TB/s (per-request bytes)": kv_bytes(b, shared, own, hkv, d) / t / 1e6,
                     "out_sum": float(out.float().sum())})
        del cache, ws
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if "--child" in sys.argv:
        from jitattn.kernels import decode

        tuning = json.loads(args[0])
        unknown = set(tuning) - set(decode.TUNING)
        if unknown:
            sys.exit(f"unknown TUNING keys {sorted(unknown)} (jitattn.kernels.decode.TUNING has {sorted(decode.TUNING)})")
        decode.TUNING.update(tuning)
        print(json.dumps(run_cases(peer=False)))
        return
    results = {}
    for tuning in args or ["{}"]:
        child = [sys.executable, __file__, tuning, "--child"] + (["--shapes"] if "--shapes" in sys.argv else [])
        out = subprocess.run(child, capture_output=True, text=True)
        try:
            results[tuning] = json.loads(out.stdout.strip().splitlines()[-1])
        except Exception:
            results[tuning] = out.stderr[-2000:]
    if "--peer" in sys.argv:
        try:
            results["flashinfer"] = run_cases(peer=True)
        except Exception as exc:
            results["flashinfer"] = repr(exc)
    for key, rows in results.items():
        print(f"== {key}")
        if isinstance(rows, str):
            print(rows)
            continue
        for r in rows:
            print(f"  {r['case']:26s} {r['us']:9.1f} us  {r['TB/s (per-request bytes)']:6.2f} TB/s  sum {r['out_sum']:.4g}")


if __name__ == "__main__":
    main()

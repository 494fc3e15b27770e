"""The Python part of the host path, measurable without a GPU: ``python3 dev/host_python.py``.

The same tiny calls as ``jitattn.bench.host_peer`` (decode / paged prefill / two-level cascade ``run()``
over 4 requests of one page, ``plan()`` of 256 x 4096 tokens), on the cpu target with every compiled
entry point replaced by one no-op ctypes call: what is left is the Python jitattn runs per call. The cuda
path differs only in the launch itself (``raw_stream`` + ``cudaLaunchKernel`` instead of the OpenMP call)
and in ``plan()``'s upload (one pinned copy instead of clones). Run it single-threaded
(``OMP_NUM_THREADS=1``); the minimum of 15 rounds (a shared machine's interference only adds time).
"""

from __future__ import annotations

import ctypes
import time
from typing import Callable

import torch

import jitattn
import jitattn.jit.loader as loader

_NOOP = ctypes.pythonapi.Py_IsInitialized  # a ctypes call that does nothing


def host_us(fn: Callable[[], object], calls: int = 400, rounds: int = 15) -> float:
    for _ in range(50):
        fn()
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return min(samples)


def main() -> None:
    loader.Module.bind = lambda self, entry, params: (lambda stream: _NOOP())
    b, hq, hkv, d, ps = 4, 32, 8, 128, 16
    i32 = dict(dtype=torch.int32)
    ws = torch.empty(64 << 20, dtype=torch.uint8)
    indptr, indices = torch.arange(b + 1, **i32), torch.arange(b, **i32)
    last, qo = torch.full((b,), ps, **i32), torch.arange(b + 1, **i32)
    cache = torch.randn(16, 2, ps, hkv, d).to(torch.bfloat16)
    q = torch.randn(b, hq, d).to(torch.bfloat16)
    out = torch.empty_like(q)
    dec = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    dec.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=torch.bfloat16)
    pre = jitattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=True, q_data_type=torch.bfloat16)
    cas = jitattn.MultiLevelCascadeAttentionWrapper(2, ws, "NHD")
    cas.plan([torch.tensor([0, b], **i32), qo], [torch.tensor([0, 2], **i32), indptr],
             [torch.tensor([8, 9], **i32), indices], [torch.tensor([ps], **i32), last], hq, hkv, d, ps,
             q_data_type=torch.bfloat16)
    big_b, pages = 256, 256
    big_indices = torch.randperm(big_b * pages + 64)[: big_b * pages].to(torch.int32)
    big_indptr = (torch.arange(big_b + 1) * pages).to(torch.int32)
    big_last = torch.full((big_b,), ps, **i32)
    rows = {
        "decode run()": host_us(lambda: dec.run(q, cache, out=out)),
        "paged prefill run()": host_us(lambda: pre.run(q, cache, out=out)),
        "cascade run() (2 levels)": host_us(lambda: cas.run(q, cache)),
        "decode plan() b256 x 4096": host_us(lambda: dec.plan(big_indptr, big_indices, big_last, 32, 8, 128, ps,
                                                              q_data_type=torch.bfloat16), calls=40),
    }
    for name, us in rows.items():
        print(f"{name:<30s}{us:8.1f} us")
    print(f"cascade / decode run(): {rows['cascade run() (2 levels)'] / rows['decode run()']:.2f}x")


if __name__ == "__main__":
    main()

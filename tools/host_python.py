"""The Python part of the host path, measurable without a GPU: ``python3 tools/host_python.py``.

The same tiny calls as ``jitattn.bench.host_peer`` (decode / paged prefill / two-level cascade ``run()``
over 4 requests of one page, ``plan()`` of 256 x 4096 tokens), on the cpu target with every compiled
entry point replaced by one no-op ctypes call: what is left is the Python jitattn runs per call. The cuda
path differs only in the launch itself (``raw_stream`` + ``cudaLaunchKernel`` instead of the OpenMP call)
and in ``plan()``'s upload (one pinned copy instead of clones). Run it single-threaded
(``OMP_NUM_THREADS=1``); the minimum of 15 rounds (a shared machine's interference only adds time).
"""

from __future__ import annotations

import ctypes
import sys
from typing import Callable

import torch

import jitattn
import jitattn.jit.loader as loader
from jitattn.bench.host_peer import _plans, _tiny
from jitattn.bench.host_peer import host_us as peer_host_us

_NOOP = ctypes.pythonapi.Py_IsInitialized  # a ctypes call that does nothing


def host_us(fn: Callable[[], object], calls: int = 400) -> float:
    return peer_host_us(fn, calls, rounds=15, summary=min, sync=lambda: None)


def main() -> None:
    loader.Module.bind = lambda self, entry, params: (lambda stream: _NOOP())
    ws = torch.empty(64 << 20, dtype=torch.uint8)
    decode, prefill, cascade = _tiny(jitattn, ws, "cpu")
    plan, _ = _plans(jitattn, ws, "cpu")
    rows = {
        "decode run()": host_us(decode), "paged prefill run()": host_us(prefill),
        "cascade run() (2 levels)": host_us(cascade), "decode plan() b256 x 4096": host_us(plan, calls=40),
    }
    for name, us in rows.items():
        print(f"{name:<30s}{us:8.1f} us")
    print(f"cascade / decode run(): {rows['cascade run() (2 levels)'] / rows['decode run()']:.2f}x")


if __name__ == "__main__":
    if sys.argv[1:]:  # it takes no arguments: -h / --help (or anything else) prints how to run it
        print(__doc__)
        sys.exit(0 if sys.argv[1:] in (["-h"], ["--help"]) else 2)
    main()

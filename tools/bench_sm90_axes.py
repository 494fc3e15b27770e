"""The sm90 tier's soft cap and sliding window against its plain kernel, same run (the target: every
axis within 5% of plain):

    JITATTN_PREFILL_TIER=sm90 python3 tools/bench_sm90_axes.py [--batch 8 --seq 4096 --dims 128,64,256]

llama8b shapes (32 / 8 heads, bf16, ragged KV, qo_len = kv_len = seq per request). Rows per head_dim:
plain causal and non-causal; soft cap 30 with each ``SM90_TUNING["soft_cap_tanh"]`` (0: ex2 + rcp,
1: tanh.approx); windows of 1024 and seq / 2 (causal). TFLOP/s count 4 * visible (query, key) pairs
* qo heads * head_dim, so a windowed kernel that skips its blocks reads about as fast as plain
("vs plain" is that ratio: 1.00 = no cost). Correctness is the tests' job
(tests/test_prefill_sm90_axes.py); every spec is pre-built in parallel first. Times: bench_tier's
CUDA-event median of 20 after 3 warm-ups."""

from __future__ import annotations

import argparse
import os

import torch

import jitattn
import jitattn.jit
from jitattn.runtime.specs import attention_spec
from jitattn.kernels import prefill_sm90
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from bench_tier import _time as median_ms  # the same CUDA-event median timer (tools/ is on sys.path when run)


def visible_pairs(s: int, causal: bool, window: int) -> int:
    """(query, key) pairs one request of s queries over s keys sees."""
    total = 0
    for i in range(s):
        hi = i + 1 if causal else s
        lo = max(0, i - window) if window >= 0 else 0
        total += hi - lo
    return total


def spec(d: int, hq: int, hkv: int, causal: bool, window: int, cap: float | None):
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
        head_dim_qk=d, head_dim_vo=d, num_qo_heads=hq, num_kv_heads=hkv, pos_encoding=PosEncoding.NONE,
        use_sliding_window=window >= 0, use_logits_soft_cap=cap is not None,
        mask_mode=MaskMode.CAUSAL if causal else MaskMode.NONE, kv_layout=KVLayout.NHD, kv_storage=KVStorage.RAGGED,
    )


def rows(s: int) -> list[tuple[str, bool, int, float | None, int]]:
    """(name, causal, window_left, soft cap, SM90_TUNING soft_cap_tanh)"""
    return [("plain causal", True, -1, None, 0), ("plain non-causal", False, -1, None, 0),
            ("soft cap 30 causal, tanh 0", True, -1, 30.0, 0), ("soft cap 30 causal, tanh 1", True, -1, 30.0, 1),
            ("soft cap 30 non-causal, tanh 0", False, -1, 30.0, 0),
            ("soft cap 30 non-causal, tanh 1", False, -1, 30.0, 1),
            ("window 1024 causal", True, 1024, None, 0), (f"window {s // 2} causal", True, s // 2, None, 0),
            ("window 1024 non-causal", False, 1024, None, 0),
            ("window 1024 + soft cap 30 causal, tanh 0", True, 1024, 30.0, 0)]


def with_tanh(tanh: int, fn):
    """fn() rendered (and built) with SM90_TUNING soft_cap_tanh = tanh."""
    defaults = dict(prefill_sm90.SM90_TUNING)
    prefill_sm90.SM90_TUNING.update(soft_cap_tanh=tanh)
    jitattn.jit._registry.clear()
    try:
        return fn()
    finally:
        prefill_sm90.SM90_TUNING.clear()
        prefill_sm90.SM90_TUNING.update(defaults)
        jitattn.jit._registry.clear()


def time_row(q, k, v, indptr, d, causal, window, cap) -> float:
    w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
    w.plan(indptr, indptr, q.shape[1], k.shape[1], d, causal=causal, window_left=window, logits_soft_cap=cap,
           q_data_type=q.dtype)
    return median_ms(lambda: w.run(q, k, v))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--dims", default="128,64,256")
    args = ap.parse_args()
    b, s, hq, hkv, dtype = args.batch, args.seq, 32, 8, torch.bfloat16
    indptr = torch.arange(0, b * s + 1, s, dtype=torch.int32)
    dims = list(map(int, args.dims.split(",")))
    os.environ.setdefault("JITATTN_PREFILL_TIER", "sm90")
    for tanh in (0, 1):  # pre-build every spec in parallel
        specs = [spec(d, hq, hkv, c, w, cap) for d in dims for _, c, w, cap, t in rows(s) if t == tanh]
        with_tanh(tanh, lambda: jitattn.jit.build_many(specs, jobs=os.cpu_count()))  # noqa: B023
    for d in dims:
        gen = torch.Generator().manual_seed(d)
        q = torch.randn(b * s, hq, d, generator=gen).to(dtype).cuda()
        k = torch.randn(b * s, hkv, d, generator=gen).to(dtype).cuda()
        v = torch.randn(b * s, hkv, d, generator=gen).to(dtype).cuda()
        plain_rate = {}
        print(f"head_dim {d}, b{b} x {s}, {hq}/{hkv} heads, bf16, tier {os.environ['JITATTN_PREFILL_TIER']}")
        for name, causal, window, cap, tanh in rows(s):
            ms = with_tanh(tanh, lambda: time_row(q, k, v, indptr, d, causal, window, cap))  # noqa: B023
            rate = 4 * b * visible_pairs(s, causal, window) * hq * d / ms / 1e9
            if window < 0 and cap is None:
                plain_rate[causal] = rate
            print(f"  {name:42s} {ms:7.3f} ms  {rate:6.1f} TFLOP/s  vs plain {rate / plain_rate[causal]:4.2f}")


if __name__ == "__main__":
    main()

"""Times the cuda prefill tiers through the public wrapper (and cuDNN / flash SDPA in the same run).

python3 tools/bench_tier.py [--quick]   (on the GPU machine; JITATTN_CACHE_DIR somewhere writable)

Per config: the sm90 and sm80 tiers (JITATTN_PREFILL_TIER), median of 20 CUDA-event-timed runs
after 3 warm-ups, TFLOP/s with causal FLOPs counted as half, and the sm90 output's rel L2
difference from the sm80 tier's (a cross-check; the tests compare with the float reference).
"""

from __future__ import annotations

import os
import statistics
import sys

import torch

import jitattn
import jitattn.jit
from jitattn.kernels import prefill_sm90
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

CONFIGS = {  # name: (head_dim, hq, hkv, causal, qo_lens[, kv_lens])
    "llama8b causal b8x4096": (128, 32, 8, True, [4096] * 8),
    "llama8b non-causal b8x4096": (128, 32, 8, False, [4096] * 8),
    "ragged 16 lens 128..8192 causal": (128, 32, 8, True, [128, 4000, 777, 2048, 130, 3333, 1, 8192, 256, 1500, 640,
                                                           5000, 99, 3000, 2222, 512]),
    "d64 causal b16x2048": (64, 32, 8, True, [2048] * 16),
    "d256 causal b4x4096": (256, 32, 8, True, [4096] * 4),
    "append qo16 kv4096 b32 causal": (128, 32, 8, True, [16] * 32, [4096] * 32),
    "append qo128 kv4096 b32 causal": (128, 32, 8, True, [128] * 32, [4096] * 32),
}


def _spec(d, hq, hkv, causal):
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
        head_dim_qk=d, head_dim_vo=d, num_qo_heads=hq, num_kv_heads=hkv, pos_encoding=PosEncoding.NONE,
        use_sliding_window=False, use_logits_soft_cap=False, mask_mode=MaskMode.CAUSAL if causal else MaskMode.NONE,
        kv_layout=KVLayout.NHD, kv_storage=KVStorage.RAGGED,
    )


def _time(fn, reps=20, warm=3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _flops(d, hq, causal, qo_lens, kv_lens) -> float:
    """4 * hq * d per visible (query, key) pair; causal equal lengths: about half (n (n + 1) / 2)."""
    pairs = sum(q * k - (q * (q - 1) // 2 if causal else 0) for q, k in zip(qo_lens, kv_lens))
    return 4.0 * hq * d * pairs


# column -> (JITATTN_PREFILL_TIER, KV block overrides of the sm90 tier: distinct sources, distinct entries)
# (and "unpacked": GQA heads not packed into the tile rows)
TIERS = {"sm90": ("sm90", {}, False), "sm90 kv176": ("sm90", {128: 176}, False),
         "sm90 unpacked": ("sm90", {}, True), "sm80": ("sm80", {}, False)}
_DEFAULT_BLOCKS = dict(prefill_sm90.SM90_KV_BLOCK)
_DEFAULT_PACK = prefill_sm90.sm90_pack


def _use(column: str) -> None:
    tier, blocks, unpacked = TIERS[column]
    os.environ["JITATTN_PREFILL_TIER"] = tier
    prefill_sm90.SM90_KV_BLOCK.clear()
    prefill_sm90.SM90_KV_BLOCK.update({**_DEFAULT_BLOCKS, **blocks})
    prefill_sm90.sm90_pack = (lambda spec: 1) if unpacked else _DEFAULT_PACK
    jitattn.jit._registry.clear()


def main() -> None:
    quick = "--quick" in sys.argv
    configs = dict(list(CONFIGS.items())[:2]) if quick else CONFIGS
    for column in TIERS:  # pre-build every spec of every column in parallel
        _use(column)
        jitattn.jit.build_many([_spec(*c[:4]) for c in configs.values()], jobs=os.cpu_count())
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (d, hq, hkv, causal, lens, *kv) in configs.items():
        kv_lens = kv[0] if kv else lens
        indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32)
        n, nk = sum(lens), sum(kv_lens)
        q = torch.randn(n, hq, d, device="cuda", generator=gen).to(torch.bfloat16)
        k = torch.randn(nk, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(nk, hkv, d, device="cuda", generator=gen).to(torch.bfloat16)
        flops = _flops(d, hq, causal, lens, kv_lens)
        row, outs = {"config": name}, {}
        for tier in TIERS:
            _use(tier)
            w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device="cuda"))
            w.plan(indptr, kv_indptr, hq, hkv, d, causal=causal, q_data_type=torch.bfloat16)
            out = torch.empty(n, hq, d, dtype=torch.bfloat16, device="cuda")
            ms = _time(lambda: w.run(q, k, v, out=out))
            outs[tier] = out.float()
            row[tier] = flops / (ms * 1e-3) / 1e12
        diff = (outs["sm90"] - outs["sm80"]).norm() / outs["sm80"].norm()
        row["rel_l2_vs_sm80"] = float(diff)
        if len(set(lens)) == 1 and lens == kv_lens:  # SDPA on [b, h, s, d]
            b, s = len(lens), lens[0]
            qs = q.view(b, s, hq, d).transpose(1, 2)
            ks = k.view(b, s, hkv, d).transpose(1, 2)
            vs = v.view(b, s, hkv, d).transpose(1, 2)
            from torch.nn.attention import SDPBackend, sdpa_kernel
            for label, backend in (("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION), ("sdpa_flash", SDPBackend.FLASH_ATTENTION)):
                try:
                    with sdpa_kernel(backend):
                        fn = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                            qs, ks, vs, is_causal=causal, enable_gqa=True)
                        row[label] = flops / (_time(fn) * 1e-3) / 1e12
                except Exception as exc:  # a backend that does not take this shape
                    row[label] = f"n/a ({type(exc).__name__})"
        rows.append(row)
        print(row, flush=True)
    print(f"\nsm90 KV blocks {_DEFAULT_BLOCKS}; 'sm90 kv176': 176 for head_dim 128")
    print("| config | sm90 | sm90 kv176 | sm90 unpacked | sm80 | sdpa cuDNN | sdpa flash | rel L2 sm90 vs sm80 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    fmt = lambda x: f"{x:.0f}" if isinstance(x, float) else (x or "-")  # noqa: E731
    for r in rows:
        print(f"| {r['config']} | {fmt(r['sm90'])} | {fmt(r['sm90 kv176'])} | {fmt(r['sm90 unpacked'])} | {fmt(r['sm80'])} | {fmt(r.get('sdpa_cudnn'))} | "
              f"{fmt(r.get('sdpa_flash'))} | {r['rel_l2_vs_sm80']:.1e} |")


if __name__ == "__main__":
    main()

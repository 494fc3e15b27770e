"""Small launches of every cuda kernel family, for compute-sanitizer (memcheck, racecheck, synccheck, initcheck).

    python3 tools/sanitize.py --build                 # builds every case's kernels (one child process per case)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 JITATTN_ASSERT_NO_COMPILE=1 \\
        compute-sanitizer --tool memcheck python3 tools/sanitize.py [--only NAME,...]
    python3 tools/sanitize.py --list

Each case is a public call on small, ragged shapes (lengths off every block and page boundary, empty and
one-token requests, splits, every tier and layout a spec takes on an H100 / H200) with random inputs; it prints
the case's name and whether every output is finite. ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` gives each tensor an
allocation of its own, so memcheck sees a read past a tensor rather than into its neighbour in torch's pool.
``DEV=cpu`` runs the same calls on the cpu target (a check of the script itself, no sanitizer).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import subprocess
import sys
from typing import Callable

import torch

import jitattn

DEV = os.environ.get("DEV", "cuda")
BF16, F16, E4M3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn
CASES: dict[str, Callable[[], list[torch.Tensor]]] = {}


def case(fn: Callable[[], list[torch.Tensor]]) -> Callable[[], list[torch.Tensor]]:
    CASES[fn.__name__] = fn
    return fn


def rand(*shape: int, dtype: torch.dtype = BF16, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g).to(dtype).to(DEV)


def workspace() -> torch.Tensor:
    return torch.empty(64 << 20, dtype=torch.uint8, device=DEV)


def indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def paged(lens: list[int], page: int, hkv: int, d: int, dtype: torch.dtype = BF16, spare: int = 3):
    """A cache of the requests' pages in shuffled order (``spare`` pages nobody owns) and its index arrays."""
    pages = [max(1, -(-n // page)) for n in lens]
    pool = sum(pages) + spare
    cache = rand(pool, 2, page, hkv, d, dtype=F16 if dtype.itemsize == 1 else dtype).to(dtype)
    g = torch.Generator().manual_seed(page + d)
    indices = torch.randperm(pool, generator=g)[:sum(pages)].to(torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in lens], dtype=torch.int32)
    return cache, indptr(pages), indices, last


# ---- decode ---------------------------------------------------------------------------------------------------------

def _decode(lens, hq, hkv, d, page, dtype=BF16, kv_dtype=None, **plan):
    kv_dtype = kv_dtype or dtype
    cache, ind, idx, last = paged(lens, page, hkv, d, kv_dtype)
    w = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(ind, idx, last, hq, hkv, d, page, q_data_type=dtype, kv_data_type=kv_dtype, **plan)
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_dtype.itemsize == 1 else {}
    return list(w.run(rand(len(lens), hq, d, dtype=dtype), cache, return_lse=True, **scales))


@case
def decode_d128_g4():
    return _decode([1, 17, 300, 2050, 64], 32, 8, 128, 16)


@case
def decode_split_b1():
    return _decode([9000], 32, 8, 128, 16)


@case
def decode_short_items():
    return _decode([96 + i % 40 for i in range(128)], 32, 8, 128, 16)


@case
def decode_d64_g8_page1():
    return _decode([1, 33, 700], 64, 8, 64, 1, dtype=F16)


@case
def decode_d96_d256_cap():
    return _decode([5, 400], 32, 32, 96, 16) + _decode([130, 7], 16, 8, 256, 16, logits_soft_cap=30.0)


@case
def decode_fp8_rope_window():
    return _decode([3, 999], 32, 8, 128, 16, kv_dtype=E4M3) + \
        _decode([40, 1500], 32, 8, 128, 16, pos_encoding_mode="ROPE_LLAMA") + \
        _decode([40, 5000], 32, 8, 128, 16, window_left=100)


# ---- prefill (the sm90 tier on an H100 / H200; the sm80 tier by JITATTN_PREFILL_TIER) ------------------------------

def _ragged(qo, kv, hq, hkv, d, dv=None, dtype=BF16, **plan):
    dv = dv or d
    w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(workspace(), "NHD")
    w.plan(indptr(qo), indptr(kv), hq, hkv, d, head_dim_vo=dv, q_data_type=dtype, **plan)
    q, k, v = rand(sum(qo), hq, d, dtype=dtype), rand(sum(kv), hkv, d, dtype=dtype), rand(sum(kv), hkv, dv, dtype=dtype)
    return list(w.run(q, k, v, return_lse=True))


def _paged_prefill(qo, kv, hq, hkv, d, page, dtype=BF16, kv_dtype=None, **plan):
    cache, ind, idx, last = paged(kv, page, hkv, d, kv_dtype or dtype)
    w = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace(), "NHD")
    w.plan(indptr(qo), ind, idx, last, hq, hkv, d, page, q_data_type=dtype, kv_data_type=kv_dtype or dtype, **plan)
    return list(w.run(rand(sum(qo), hq, d, dtype=dtype), cache, return_lse=True))


@case
def prefill_ragged_dims():
    return _ragged([70, 1, 0, 200], [90, 5, 3, 200], 4, 2, 64, causal=True, dtype=F16) + \
        _ragged([130, 7], [77, 300], 8, 2, 128) + _ragged([65], [129], 4, 4, 256, causal=True) + \
        _ragged([100, 3], [260, 3], 8, 8, 192, dv=128, causal=True)


@case
def prefill_ragged_axes():
    return _ragged([300, 1, 0], [700, 500, 3], 8, 2, 128, causal=True, window_left=40, logits_soft_cap=30.0) + \
        _ragged([200, 9], [600, 9], 4, 4, 64, window_left=100) + \
        _ragged([150, 20], [150, 400], 8, 2, 128, causal=True, pos_encoding_mode="ALIBI")


@case
def prefill_custom_mask():
    qo, kv = [37, 80], [100, 80]
    mask = torch.cat([(torch.rand(q * k, generator=torch.Generator().manual_seed(q)) < 0.3) for q, k in zip(qo, kv)])
    return _ragged(qo, kv, 8, 2, 128, custom_mask=mask.to(DEV))


@case
def prefill_paged_pages():
    return _paged_prefill([70, 1, 200], [90, 5, 333], 8, 2, 128, 16, causal=True) + \
        _paged_prefill([130, 7], [77, 300], 4, 4, 64, 1, dtype=F16) + \
        _paged_prefill([64, 50], [1000, 50], 32, 8, 128, 64, causal=True)


@case
def prefill_sinks():
    cache, ind, idx, last = paged([90, 300], 16, 2, 128)
    w = jitattn.BatchAttentionWithAttentionSinkWrapper(workspace(), "NHD", q_data_type=BF16, kv_data_type=BF16,
                                                       head_dim_qk=128, head_dim_vo=128, window_left=50)
    w.plan(indptr([30, 300]), ind, idx, last, 8, 2, 128, 16, causal=True, window_left=50, q_data_type=BF16)
    return [w.run(rand(330, 8, 128), cache, rand(8, dtype=torch.float32))]


@case
def prefill_fp8():
    q, k, v = (rand(333, h, 128, dtype=F16, seed=h).to(E4M3) for h in (8, 2, 2))
    return [jitattn.single_prefill_with_kv_cache(q, k, v, scale_q=0.5, scale_k=0.25, scale_v=2.0, causal=c,
                                                 o_dtype=BF16) for c in (False, True)]


@case
def prefill_rope_sm80_tier():
    os.environ["JITATTN_PREFILL_TIER"] = "sm80"
    try:
        return _ragged([70, 130], [90, 200], 8, 2, 128, causal=True) + \
            _paged_prefill([33, 1], [90, 40], 8, 2, 128, 16, pos_encoding_mode="ROPE_LLAMA") + \
            _paged_prefill([33, 9], [90, 40], 8, 2, 128, 16, kv_dtype=E4M3)
    finally:
        del os.environ["JITATTN_PREFILL_TIER"]


@case
def prefill_rope_fp8kv_sm90():
    return _paged_prefill([33, 1], [90, 40], 8, 2, 128, 16, pos_encoding_mode="ROPE_LLAMA") + \
        _paged_prefill([33, 9], [90, 40], 8, 2, 128, 16, kv_dtype=E4M3)


# ---- MLA, cascade, mixed batches ------------------------------------------------------------------------------------

def _mla(qo, kv, heads, page, kv_dtype=BF16):
    pages = [max(1, -(-n // page)) for n in kv]
    buf = rand(sum(pages) + 2, page, 576, dtype=F16 if kv_dtype.itemsize == 1 else kv_dtype).to(kv_dtype)
    idx = torch.randperm(sum(pages) + 2, generator=torch.Generator().manual_seed(page))[:sum(pages)].to(torch.int32)
    w = jitattn.BatchMLAPagedAttentionWrapper(workspace())
    w.plan(indptr(qo), indptr(pages), idx, torch.tensor(kv, dtype=torch.int32), heads, 512, 64, page, True,
           1 / 192 ** 0.5, BF16, kv_dtype)
    q = rand(sum(qo), heads, 576)
    scales = {"k_scale": 0.5, "v_scale": 2.0} if kv_dtype.itemsize == 1 else {}
    return list(w.run(q[..., :512], q[..., 512:], buf[..., :512], buf[..., 512:], return_lse=True, **scales))


@case
def mla_wide_narrow_split():
    return _mla([1, 1, 1], [1, 100, 1000], 128, 64) + _mla([2, 1], [300, 65], 16, 16) + \
        _mla([1], [20000], 128, 64) + _mla([4, 1], [70, 3000], 16, 1)


@case
def mla_narrow():
    return _mla([1, 1, 1], [1, 100, 1000], 16, 64) + _mla([1], [20000], 16, 16) + \
        _mla([1, 1], [100, 1000], 16, 64, E4M3)


@case
def mla_fp8():
    return _mla([1, 1], [100, 1000], 128, 64, E4M3) + _mla([1, 2], [700, 9], 16, 64, E4M3)


@case
def cascade_two_levels():
    b, shared, own = 6, 700, [1, 30, 200, 17, 64, 5]
    page = 16
    sp = -(-shared // page)
    cache = rand(sp + sum(-(-n // page) for n in own) + 2, 2, page, 8, 128)
    own_pages = [-(-n // page) for n in own]
    idx_shared = torch.arange(sp, dtype=torch.int32)
    idx_own = torch.arange(sp, sp + sum(own_pages), dtype=torch.int32)
    w = jitattn.MultiLevelCascadeAttentionWrapper(2, workspace(), "NHD")
    w.plan([torch.tensor([0, b], dtype=torch.int32), indptr([1] * b)], [torch.tensor([0, sp], dtype=torch.int32),
           indptr(own_pages)], [idx_shared, idx_own],
           [torch.tensor([(shared - 1) % page + 1], dtype=torch.int32),
            torch.tensor([(n - 1) % page + 1 for n in own], dtype=torch.int32)], 32, 8, 128, page, q_data_type=BF16)
    return list(w.run(rand(b, 32, 128), cache, return_lse=True))


@case
def block_sparse_pod_batch():
    M = N = 8 * 64
    g = torch.Generator().manual_seed(1)
    dense = torch.rand(8, 8, generator=g) < 0.3
    dense[:, 0] = True
    ind = indptr(dense.sum(1).tolist())
    idx = dense.nonzero()[:, 1].to(torch.int32)
    bs = jitattn.BlockSparseAttentionWrapper(workspace())
    bs.plan(ind, idx, M, N, 64, 64, 8, 2, 128, q_data_type=BF16)
    out = [bs.run(rand(M, 8, 128), rand(N, 2, 128), rand(N, 2, 128))]
    cache, kind, kidx, last = paged([300, 1, 70], 16, 2, 128)
    pod = jitattn.PODWithPagedKVCacheWrapper(workspace(), "NHD")
    pod.plan(kind, kidx, last, 8, 2, 128, 16, q_data_type=BF16)
    out += list(pod.run(rand(200, 8, 128), rand(200, 2, 128), rand(200, 2, 128), rand(3, 8, 128), cache,
                        causal_p=True))
    cache, kind, kidx, last = paged([300, 1, 70, 500], 16, 2, 128)
    ba = jitattn.BatchAttention("NHD", device=DEV)
    ba.plan(indptr([100, 1, 1, 37]), kind, kidx, torch.tensor([300, 1, 70, 500], dtype=torch.int32), 8, 2, 128, 128,
            16, causal=True, q_data_type=BF16, kv_data_type=BF16)
    return out + list(ba.run(rand(139, 8, 128), cache))


# ---- the ops beside attention ---------------------------------------------------------------------------------------

@case
def ops_rope_norm_act_append_merge():
    q, k = rand(77, 32, 128), rand(77, 8, 128)
    pos = torch.randint(0, 4000, (77,), generator=torch.Generator().manual_seed(2)).to(DEV)
    out = list(jitattn.apply_rope_pos_ids(q, k, pos)) + list(jitattn.apply_rope_pos_ids(q, k, pos, interleave=True))
    qs, ks = q[:, :, :100], k[:, :, :100]  # rows off 16 bytes: the element path
    out += list(jitattn.apply_rope_pos_ids(qs.contiguous()[:, :, 2:], ks.contiguous()[:, :, 2:], pos, rotary_dim=64))
    cos_sin = rand(4096, 128, dtype=torch.float32)
    qf, kf = q.reshape(77, -1).clone(), k.reshape(77, -1).clone()
    jitattn.apply_rope_with_cos_sin_cache_inplace(pos, qf, kf, 128, cos_sin)
    x, res, wt = rand(33, 4096), rand(33, 4096, seed=1), rand(4096, seed=2)
    out += [qf, kf, jitattn.rmsnorm(x, wt)]
    jitattn.fused_add_rmsnorm(x, res, wt)
    out += [x, res, jitattn.silu_and_mul(rand(33, 2 * 1000))]
    cache, ind, idx, last = paged([20, 1, 40], 16, 8, 128, spare=5)
    batch, positions = jitattn.get_batch_indices_positions(indptr([20, 1, 40]).to(DEV),
                                                           jitattn.get_seq_lens(ind.to(DEV), last.to(DEV), 16), 61)
    jitattn.append_paged_kv_cache(rand(61, 8, 128), rand(61, 8, 128, seed=3), batch, positions, cache, idx.to(DEV),
                                  ind.to(DEV), last.to(DEV))
    v, s = rand(19, 5, 8, 128), rand(19, 5, 8, dtype=torch.float32)
    return out + [cache] + list(jitattn.merge_states(v, s))


def run(names: list[str]) -> int:
    bad = 0
    for name in names:
        outs = CASES[name]()
        if DEV == "cuda":
            torch.cuda.synchronize()
        finite = all(bool(torch.isfinite(t.float()).all()) for t in outs if t.is_floating_point())
        bad += not finite
        print(f"{name}: {len(outs)} outputs, finite: {finite}", flush=True)
    return bad


def build(names: list[str], jobs: int) -> int:
    """Each case once in a child process, ``jobs`` at a time: the kernels land in the cache in parallel."""
    def child(name: str) -> tuple[str, int, str]:
        p = subprocess.run([sys.executable, __file__, "--only", name], capture_output=True, text=True)
        return name, p.returncode, (p.stdout + p.stderr).strip().splitlines()[-1:] or [""]
    failed = 0
    with cf.ThreadPoolExecutor(jobs) as ex:
        for name, rc, tail in ex.map(child, names):
            failed += rc != 0
            print(f"{name}: rc {rc} {tail[0]}", flush=True)
    return failed


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated case names (default: all)")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--build", action="store_true", help="run each case in a child process, in parallel")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1))
    args = ap.parse_args(argv)
    names = args.only.split(",") if args.only else list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown}; --list shows them")
    if args.list:
        print("\n".join(CASES))
        return 0
    return 1 if (build(names, args.jobs) if args.build else run(names)) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""One call of a benchmark case inside a CUDA profiler range, for Nsight Compute:

    ncu --profile-from-start off --set full -o OUT/decode_b1 python3 tools/profile_ncu.py decode_b1

Cases (the suite's decode and prefill rows; llama8b shapes 32 / 8 heads d128 bf16 page 16 unless said): decode_b1 (1
x 32768), decode_b256 (256 x 4096), sdpa_b1 / sdpa_b256 / sdpa_gptoss1024 (PyTorch SDPA on contiguous KV, the rows'
peer), fi_b1 / fi_b256 (FlashInfer's tensor-core decode on the same tables; PEER=1), phi3 (MHA d96 b64 x 4096),
paged16 / paged64 / ragged (sm90 prefill causal b8 x 4096), ragged_d64 (causal b16 x 2048, d64), mla128 (MLA b64 x
4096, 128 heads, page 64), mla16 (MLA b128 x 4096, 16 heads, page 64), mla128_fp8 / mla16_fp8 (the same over an e4m3
latent cache), fi_mla128 / fi_mla16 (FlashInfer's MLA on the same tables; PEER=1), flat_shared (decode b128 over
8192 shared + 256 own tokens each: the cascade row's flat twin), window128 (gpt-oss prefill with its 128-key
window: 64 / 8 heads d64, ragged causal b8 x 4096; tiles of a few KV blocks, where the tile's fixed cost shows),
decode_window128 / decode_gptoss1024 (gpt-oss decode, b64 x 8192 with
the 128-key window / b64 x 1024, page 16), fp8_prefill / bf16_prefill (the sm90 fp8 kernel, q, k, v e4m3, non-causal
1 x 8192 ragged, and its bf16 twin: the suite's ops/fp8_prefill_noncausal_s8192 and its dense row), fi_bf16_prefill
(FlashInfer's ragged prefill on bf16_prefill's data; PEER=1), suite:NAME (any decode or prefill row of
``python -m jitattn.bench`` by its name, on the suite's own data and plan, e.g.
suite:variants/verify_custom_tree_b32_q64_s4160).
Warm-up calls (the JIT build, the plan) run before the range; one call runs inside it.
``DECODE_TUNING='{"max_stages": 2}'`` renders the decode kernels with those overrides of
``jitattn.kernels.decode.TUNING`` (their own cache entries), to profile a layout beside the default;
``MLA_TUNING='{"narrow_rows": 0}'`` the same for ``jitattn.kernels.mla.TUNING``.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

import jitattn

HQ, HKV, D = 32, 8, 128


def paged_batch(lens: list[int], page: int, gen: torch.Generator, dev: torch.device):
    """A llama8b-shaped paged cache for requests of ``lens`` tokens, its pages in random order:
    (cache [pages, 2, page, HKV, D], kv_indptr, kv_indices, kv_last_page_len), the tables on the host."""
    pages = [-(-n // page) for n in lens]
    pool = sum(pages)
    cache = torch.randn(pool, 2, page, HKV, D, generator=gen).to(torch.bfloat16).to(dev)
    indices = torch.randperm(pool, generator=gen).to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in lens], dtype=torch.int32)
    return cache, indptr, indices, last


def ragged_prefill(b: int, n: int, hq: int, d: int, gen: torch.Generator, dev: torch.device, ws: torch.Tensor,
                   **plan_kw):
    """A causal ragged prefill of ``b`` requests of ``n`` tokens (``hq`` / HKV heads, head_dim ``d``, bf16), planned
    with ``plan_kw``; returns the call that runs it."""
    q = torch.randn(b * n, hq, d, generator=gen).to(torch.bfloat16).to(dev)
    k = torch.randn(b * n, HKV, d, generator=gen).to(torch.bfloat16).to(dev)
    v = torch.randn(b * n, HKV, d, generator=gen).to(torch.bfloat16).to(dev)
    qo = torch.arange(b + 1, dtype=torch.int32) * n
    out = torch.empty_like(q)
    w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    w.plan(qo, qo, hq, HKV, d, causal=True, q_data_type=torch.bfloat16, **plan_kw)
    return lambda: w.run(q, k, v, out=out)


def suite_case(name: str, dev: torch.device):
    """The benchmark suite's attention row ``name``: its data and its plan through the public wrapper."""
    from jitattn.bench.configs import Attn, select
    from jitattn.bench.inputs import jitattn_fn, make_attn_data

    try:
        found = [c for c in select(only=[name]) if c.name == name and isinstance(c, Attn)]
    except ValueError:  # no row of that name
        found = []
    if not found:
        raise SystemExit(f"no decode or prefill row named {name!r} (python -m jitattn.bench --list)")
    return jitattn_fn(make_attn_data(found[0], dev), dev)


def case_fn(name: str):
    dev = torch.device(os.environ.get("PROFILE_DEVICE", "cuda"))  # cpu: a smoke run of the script
    if name.startswith("suite:"):
        return suite_case(name.removeprefix("suite:"), dev)
    gen = torch.Generator().manual_seed(0)
    ws = torch.empty(512 << 20, dtype=torch.uint8, device=dev)
    if name in ("decode_b1", "decode_b256"):
        lens = [32768] if name == "decode_b1" else [4096] * 256
        cache, indptr, indices, last = paged_batch(lens, 16, gen, dev)
        q = torch.randn(len(lens), HQ, D, generator=gen).to(torch.bfloat16).to(dev)
        out = torch.empty_like(q)
        w = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, last, HQ, HKV, D, 16, q_data_type=torch.bfloat16)
        return lambda: w.run(q, cache, out=out)
    if name in ("fi_b1", "fi_b256"):  # FlashInfer's tensor-core decode on decode_b1 / _b256's tables (PEER=1)
        import flashinfer

        lens = [32768] if name == "fi_b1" else [4096] * 256
        cache, indptr, indices, last = paged_batch(lens, 16, gen, dev)
        q = torch.randn(len(lens), HQ, D, generator=gen).to(torch.bfloat16).to(dev)
        out = torch.empty_like(q)
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=True)
        w.plan(indptr.to(dev), indices.to(dev), last.to(dev), HQ, HKV, D, 16, q_data_type=torch.bfloat16)
        return lambda: w.run(q, cache, out=out)
    if name == "flat_shared":
        b, shared, own, page = 128, 8192, 256, 16
        cache, _, perm, _ = paged_batch([shared + b * own], page, gen, dev)
        p_sh, p_own = shared // page, own // page
        table = torch.cat([perm[:p_sh].unsqueeze(0).expand(b, -1), perm[p_sh:].view(b, p_own)], dim=1)
        indptr = (torch.arange(b + 1) * (p_sh + p_own)).to(torch.int32)
        last = torch.full((b,), page, dtype=torch.int32)
        q = torch.randn(b, HQ, D, generator=gen).to(torch.bfloat16).to(dev)
        out = torch.empty_like(q)
        w = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, table.reshape(-1).contiguous(), last, HQ, HKV, D, page, q_data_type=torch.bfloat16)
        return lambda: w.run(q, cache, out=out)
    if name in ("sdpa_b1", "sdpa_b256", "sdpa_gptoss1024"):
        b, n, hq, d = {"sdpa_b1": (1, 32768, HQ, D), "sdpa_b256": (256, 4096, HQ, D),
                       "sdpa_gptoss1024": (64, 1024, 64, 64)}[name]
        q = torch.randn(b, hq, 1, d, generator=gen).to(torch.bfloat16).to(dev)
        k = torch.randn(b, HKV, n, d, generator=gen).to(torch.bfloat16).to(dev)
        v = torch.randn(b, HKV, n, d, generator=gen).to(torch.bfloat16).to(dev)
        return lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if name == "phi3":  # MHA d96, b64 x 4096 (the suite's decode/phi3_d96_b64_s4096)
        b, n, h, d, page = 64, 4096, 32, 96, 16
        cache = torch.randn(b * n // page, 2, page, h, d, dtype=torch.bfloat16, device=dev)  # 3.2 GB: made there
        indices = torch.randperm(b * n // page, generator=gen).to(torch.int32)
        indptr = (torch.arange(b + 1) * (n // page)).to(torch.int32)
        last = torch.full((b,), page, dtype=torch.int32)
        q = torch.randn(b, h, d, generator=gen).to(torch.bfloat16).to(dev)
        out = torch.empty_like(q)
        w = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, last, h, h, d, page, q_data_type=torch.bfloat16)
        return lambda: w.run(q, cache, out=out)
    if name == "ragged_d64":  # the suite's prefill/d64_causal_b16_s2048 (32 / 8 heads, d64, causal)
        return ragged_prefill(16, 2048, HQ, 64, gen, dev, ws)
    if name == "window128":  # the suite's prefill/gptoss_causal_b8_s4096_window128
        return ragged_prefill(8, 4096, 64, 64, gen, dev, ws, window_left=127)
    if name in ("decode_window128", "decode_gptoss1024"):  # the suite's decode/gptoss_window128_b64_s8192, _b64_s1024
        b, n, hq, d, page = 64, 8192 if name == "decode_window128" else 1024, 64, 64, 16
        window = 127 if name == "decode_window128" else -1
        cache = torch.randn(b * n // page, 2, page, HKV, d, generator=gen).to(torch.bfloat16).to(dev)
        indices = torch.randperm(b * n // page, generator=gen).to(torch.int32)
        indptr = (torch.arange(b + 1) * (n // page)).to(torch.int32)
        last = torch.full((b,), page, dtype=torch.int32)
        q = torch.randn(b, hq, d, generator=gen).to(torch.bfloat16).to(dev)
        out = torch.empty_like(q)
        w = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, last, hq, HKV, d, page, window_left=window, q_data_type=torch.bfloat16)
        return lambda: w.run(q, cache, out=out)
    if name in ("paged16", "paged64", "ragged"):
        b, n = 8, 4096
        if name == "ragged":
            return ragged_prefill(b, n, HQ, D, gen, dev, ws)
        q = torch.randn(b * n, HQ, D, generator=gen).to(torch.bfloat16).to(dev)
        qo = torch.arange(b + 1, dtype=torch.int32) * n
        out = torch.empty_like(q)
        page = 16 if name == "paged16" else 64
        cache, indptr, indices, last = paged_batch([n] * b, page, gen, dev)
        w = jitattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(qo, indptr, indices, last, HQ, HKV, D, page, causal=True, q_data_type=torch.bfloat16)
        return lambda: w.run(q, cache, out=out)
    if name in ("fp8_prefill", "bf16_prefill", "fi_bf16_prefill"):  # ops/fp8_prefill_noncausal_s8192, its dense twin
        n, dtype = 8192, torch.float8_e4m3fn if name == "fp8_prefill" else torch.bfloat16  # (1 x 8192)
        q, k, v = (torch.randn(n, h, D, generator=gen).to(dtype).to(dev) for h in (HQ, HKV, HKV))
        indptr = torch.tensor([0, n], dtype=torch.int32)
        out = torch.empty(n, HQ, D, dtype=torch.bfloat16, device=dev)
        if name == "fi_bf16_prefill":  # FlashInfer's ragged prefill on the same data (PEER=1)
            import flashinfer

            w = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
            w.plan(indptr.to(dev), indptr.to(dev), HQ, HKV, D, q_data_type=dtype)
            return lambda: w.run(q, k, v, out=out)
        w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indptr, HQ, HKV, D, q_data_type=dtype, kv_data_type=dtype, o_data_type=torch.bfloat16)
        return lambda: w.run(q, k, v, out=out)
    if name in ("mla128", "mla16", "fi_mla128", "fi_mla16", "mla128_fp8", "mla16_fp8"):  # fi_: FlashInfer's (PEER=1)
        from mla_tuning import mla_inputs

        b, n, page, heads = (64, 4096, 64, 128) if "mla128" in name else (128, 4096, 64, 16)
        kv = torch.float8_e4m3fn if name.endswith("_fp8") else torch.bfloat16
        buf, indices, indptr, lens, q_nope, q_pe = mla_inputs(b, n, heads, kv, torch.bfloat16, page)
        out = torch.empty_like(q_nope)
        if name.startswith("fi_"):
            import flashinfer

            w = flashinfer.mla.BatchMLAPagedAttentionWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=dev))
            w.plan(torch.arange(b + 1, dtype=torch.int32, device=dev), indptr.to(dev), indices.to(dev), lens.to(dev),
                   heads, 512, 64, page, False, 1.0 / math.sqrt(192), torch.bfloat16, torch.bfloat16)
            return lambda: w.run(q_nope, q_pe, buf[..., :512], buf[..., 512:], out=out)
        w = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=dev))
        w.plan(torch.arange(b + 1, dtype=torch.int32), indptr, indices, lens, heads, 512, 64, page, False,
               1.0 / math.sqrt(192), torch.bfloat16, kv)
        return lambda: w.run(q_nope, q_pe, buf[..., :512], buf[..., 512:], out=out)
    raise SystemExit(f"unknown case {name!r}")


def main() -> None:
    import importlib

    for family in ("decode", "mla"):
        tuning = os.environ.get(f"{family.upper()}_TUNING", "").strip()
        if not tuning:
            continue
        table = importlib.import_module(f"jitattn.kernels.{family}").TUNING
        overrides = json.loads(tuning)
        unknown = set(overrides) - set(table)
        if unknown:
            sys.exit(f"{family.upper()}_TUNING: unknown keys {sorted(unknown)} ({family}.TUNING has {sorted(table)})")
        table.update(overrides)
    fn = case_fn(sys.argv[1])
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        return
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()

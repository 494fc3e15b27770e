"""Benchmark of the cuda paged-decode kernel: ``python -m jitattn.bench.decode_cuda``.

Cases (bf16, 32 query / 8 KV heads, head_dim 128, page 16, pages in random
order from a pool larger than L2):

- batch 64 x kv 2048, no split-KV;
- batch 1 x kv 32768, split-KV at a few chunk sizes (and without, for scale).

Each jitattn launch is captured in a CUDA graph and timed by CUDA events
around every replay (median of many, after warm-up). Bytes counted: K and V
once (2 * tokens * H_kv * D * 2) plus q and o. Beside it: torch SDPA
(``enable_gqa=True``) on the same KV gathered into contiguous tensors, and a
device-to-device copy measured in the same run as the bandwidth ceiling
(bytes read + written).

``--tuning JSON`` overrides ``jitattn.kernels.decode.TUNING`` (a distinct
rendered source, hence a distinct cache entry); ``--sweep`` runs a few such
layouts in subprocesses and prints one line each.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import torch
import torch.nn.functional as F

from .ceilings import copy_gbs
from .timing import Timer, events_median_us, graphed

H_QO, H_KV, D, PAGE = 32, 8, 128, 16


def _median_us(fn, iters: int = 100, warmup: int = 10) -> float:
    return events_median_us(fn, iters=iters, warmup=warmup)


_graphed = graphed


def copy_ceiling_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy GB/s (bytes read + written), as in the suite's ceilings."""
    return copy_gbs(Timer(torch.device("cuda", torch.cuda.current_device())), nbytes)["gbps"]


class Problem:
    def __init__(self, batch: int, kv_len: int, pool_factor: float = 2.0, seed: int = 0, layout: str = "nhd"):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.batch, self.kv_len, self.layout = batch, kv_len, layout
        pages_per = -(-kv_len // PAGE)
        needed = batch * pages_per
        pool = max(int(needed * pool_factor), needed + 1)
        # [pages, 2, page, H_kv, D] (NHD) or [pages, 2, H_kv, page, D] (HND): k and v are the halves of one 5-D cache.
        shape = (pool, 2, PAGE, H_KV, D) if layout == "nhd" else (pool, 2, H_KV, PAGE, D)
        self.cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
        self.kv_indices = torch.randperm(pool, device="cuda", generator=gen)[:needed].to(torch.int32)
        self.kv_indptr = torch.arange(0, needed + 1, pages_per, dtype=torch.int32, device="cuda")
        self.kv_last_page_len = torch.full((batch,), (kv_len - 1) % PAGE + 1, dtype=torch.int32, device="cuda")
        self.q = torch.randn((batch, H_QO, D), device="cuda", dtype=torch.bfloat16, generator=gen)
        self.o = torch.empty_like(self.q)
        self.lse = torch.empty((batch, H_QO), device="cuda", dtype=torch.float32)
        self.qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device="cuda")

    @property
    def bytes(self) -> int:
        return 2 * self.batch * self.kv_len * H_KV * D * 2 + 2 * self.q.numel() * 2

    def jitattn_fn(self, chunk: int = 0):
        import jitattn
        from jitattn.runtime.launch import AttentionScalars, launch_attention
        from jitattn.kernels.decode import split_workspace_bytes
        from jitattn.spec import KVLayout, PosEncoding, VariantSpec

        spec = VariantSpec(
            op="decode", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", head_dim_qk=D,
            head_dim_vo=D, group_size=H_QO // H_KV, pos_encoding="none", use_sliding_window=False,
            use_logits_soft_cap=False, kv_layout=self.layout, kv_storage="paged",
        )
        module = jitattn.load(spec)
        workspace = split_indptr = counters = None
        if chunk:
            counters = torch.zeros(self.batch * H_KV, dtype=torch.int32, device="cuda")
            n = -(-self.kv_len // chunk)
            split_indptr = torch.arange(0, self.batch * n + 1, n, dtype=torch.int32, device="cuda")
            workspace = torch.empty(split_workspace_bytes(self.batch * n, H_QO, D), dtype=torch.uint8, device="cuda")
        scalars = AttentionScalars(False, PosEncoding.NONE, -1, 1.0 / math.sqrt(D), 0.0, 1.0, 1e4)
        k, v = self.cache[:, 0], self.cache[:, 1]

        def fn():
            launch_attention(
                module, q=self.q, k=k, v=v, o=self.o, lse=self.lse, qo_indptr=self.qo_indptr,
                kv_indptr=self.kv_indptr, kv_indices=self.kv_indices, kv_last_page_len=self.kv_last_page_len,
                page_size=PAGE, kv_layout=KVLayout.parse(self.layout, "kv_layout"), custom_mask=None, mask_indptr=None, num_kv_heads=H_KV,
                scalars=scalars, workspace=workspace, split_indptr=split_indptr, kv_chunk_size=chunk,
                split_counters=counters,
            )

        return fn

    def check(self) -> float:
        """Max abs error of the last jitattn output against SDPA in fp32 (a sanity check)."""
        k, v = self.contiguous_kv()
        ref = F.scaled_dot_product_attention(self.q.float().unsqueeze(2), k.float(), v.float(), enable_gqa=True)
        return (ref.squeeze(2) - self.o.float()).abs().max().item()

    def contiguous_kv(self):
        pages = self.kv_indices.long().view(self.batch, -1)
        cache = self.cache if self.layout == "nhd" else self.cache.transpose(2, 3)
        kv = cache[pages]  # [B, pages, 2, page, H, D]
        kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, self.batch, H_KV, -1, D)[:, :, :, : self.kv_len]
        return kv[0].contiguous(), kv[1].contiguous()

    def sdpa_fn(self):
        k, v = self.contiguous_kv()
        q = self.q.unsqueeze(2)
        return lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)


def _row(name: str, us: float, nbytes: int, ceiling: float) -> str:
    gbs = nbytes / (us * 1e-6) / 1e9
    return f"{name:44s} {us:9.1f} us {gbs:8.0f} GB/s {100 * gbs / ceiling:6.1f}% of copy"


def main_cases(ceiling: float, quick: bool = False) -> list[str]:
    rows = []
    big = Problem(64, 2048)
    fn = big.jitattn_fn()
    us = _median_us(_graphed(fn), iters=200)
    rows.append(_row("jitattn decode b64 x kv2048 (no split)", us, big.bytes, ceiling))
    err = big.check()
    rows.append(f"{'  max |o - sdpa_fp32|':44s} {err:.2e}")
    if quick:
        return rows
    for chunk in (512, 1024):
        us = _median_us(_graphed(big.jitattn_fn(chunk)), iters=200)
        rows.append(_row(f"jitattn decode b64 x kv2048 split {chunk}", us, big.bytes, ceiling))
    us = _median_us(big.sdpa_fn(), iters=100)
    rows.append(_row("torch SDPA b64 x kv2048 (contiguous KV)", us, big.bytes, ceiling))
    del big
    torch.cuda.empty_cache()
    hnd = Problem(64, 2048, layout="hnd")
    us = _median_us(_graphed(hnd.jitattn_fn()), iters=200)
    rows.append(_row("jitattn decode b64 x kv2048 HND (no split)", us, hnd.bytes, ceiling))
    rows.append(f"{'  max |o - sdpa_fp32|':44s} {hnd.check():.2e}")
    del hnd
    torch.cuda.empty_cache()

    long = Problem(1, 32768, pool_factor=4.0)
    for chunk in (0, 256, 512, 1024, 2048):
        fn = long.jitattn_fn(chunk)
        us = _median_us(_graphed(fn), iters=200)
        label = f"split {chunk}" if chunk else "no split"
        rows.append(_row(f"jitattn decode b1 x kv32768 {label}", us, long.bytes, ceiling))
        if chunk == 512:
            rows.append(f"{'  max |o - sdpa_fp32|':44s} {long.check():.2e}")
    us = _median_us(long.sdpa_fn(), iters=100)
    rows.append(_row("torch SDPA b1 x kv32768 (contiguous KV)", us, long.bytes, ceiling))
    return rows


SWEEP = [
    {},
    {"mma": 0},
    {"mma_blocks_per_sm": 3},
    {"mma_blocks_per_sm": 4},
    {"max_stages": 2},
    {"max_stages": 8},
    {"head_minor": 0},
]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tuning", default="", help="JSON overrides of jitattn.kernels.decode.TUNING")
    parser.add_argument("--quick", action="store_true", help="only the batch-64 case, no SDPA")
    parser.add_argument("--ceiling", type=float, default=0.0, help="copy GB/s (measured when 0)")
    parser.add_argument("--sweep", action="store_true", help="time the SWEEP layouts in subprocesses")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("decode_cuda benchmark: needs a CUDA device")
    from jitattn.kernels import decode

    if args.tuning:
        tuning = json.loads(args.tuning)
        unknown = set(tuning) - set(decode.TUNING)
        if unknown:
            sys.exit(f"decode_cuda benchmark: unknown TUNING keys {sorted(unknown)}")
        decode.TUNING.update(tuning)
    ceiling = args.ceiling or copy_ceiling_gbs()
    print(f"device: {torch.cuda.get_device_name()}; copy ceiling {ceiling:.0f} GB/s (read + write)", flush=True)
    if args.sweep:
        for tuning in SWEEP:
            cmd = [sys.executable, "-m", "jitattn.bench.decode_cuda", "--quick", "--ceiling", str(ceiling),
                   "--tuning", json.dumps(tuning)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            lines = [ln for ln in out.stdout.splitlines() if "us" in ln or "max" in ln]
            print(f"sweep {json.dumps(tuning)}: " + (" | ".join(lines) or out.stderr[-800:]), flush=True)
        return
    if args.tuning:
        from jitattn.spec import VariantSpec

        layout = decode.cuda_layout(VariantSpec(
            op="decode", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16", head_dim_qk=D,
            head_dim_vo=D, group_size=H_QO // H_KV, pos_encoding="none", use_sliding_window=False,
            use_logits_soft_cap=False, kv_layout="nhd", kv_storage="paged"))
        print("layout:", layout, flush=True)
    for row in main_cases(ceiling, quick=args.quick):
        print(row, flush=True)


if __name__ == "__main__":
    main()

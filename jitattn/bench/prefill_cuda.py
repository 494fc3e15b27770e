"""Prefill on the cuda target: jitattn's tensor-core kernel vs torch SDPA (flash, cuDNN).

Run: ``python -m jitattn.bench.prefill_cuda [--batch 8 --seq 4096 ...]`` on a CUDA machine.

Ragged causal prefill (qo_len = kv_len = ``--seq`` per request, bottom-right
causal; ``--no-causal`` for full attention), ``--heads``/``--kv-heads`` GQA,
bf16, NHD ``[tokens, heads, dim]``.
FLOPs = 4 * (unmasked (query, key) pairs) * H_qo * head_dim. The same data
goes to ``torch.nn.functional.scaled_dot_product_attention`` as contiguous
``[batch, heads, seq, dim]`` tensors under ``sdpa_kernel(FLASH_ATTENTION)``
and ``sdpa_kernel(CUDNN_ATTENTION)`` (``enable_gqa=True``; K/V are expanded to
all query heads if a backend refuses it, which the table says). The bf16 GEMM
ceiling is an 8192^3 ``torch.matmul`` measured in the same run. Times are the
median of ``--iters`` launches timed with CUDA events after warm-up.

``--tunings`` also times other layouts of the jitattn sm80-tier kernel (overrides of
``jitattn.kernels.prefill.TUNING``; each is its own cache entry); the wrapper row runs the tier
``JITATTN_PREFILL_TIER`` selects (sm90 on Hopper for this spec by default).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Callable

import torch

import jitattn
from jitattn.runtime.launch import AttentionScalars, launch_attention
from jitattn.kernels import prefill as prefill_family
from jitattn.jit import Module
from jitattn.jit.build_and_publish import build_entry
from jitattn.jit.cache import find_entry
from jitattn.jit.key import build_inputs
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec

from .ceilings import gemm_tflops as _gemm
from .timing import Timer, events_median_us

DEFAULT_TUNINGS = [
    {},
    {"stages": 3},
    {"mma_q_max_dim": 0},
    {"warps": 8, "blocks_per_sm": 1},
]


def _median_ms(fn: Callable[[], object], iters: int, warmup: int = 5) -> float:
    """Median ms of ``fn``, each call timed alone by CUDA events (it includes its launch latency)."""
    return events_median_us(fn, iters=iters, warmup=warmup, sync_each=True) / 1e3


def module_with(spec: VariantSpec, tuning: dict[str, int]) -> Module:
    """The sm80-tier module of ``spec`` rendered with ``tuning`` over the default layout (built if
    cold; the tunings are of that tier, so it is pinned even where the sm90 tier would be chosen)."""
    saved = dict(prefill_family.TUNING)
    saved_tier = os.environ.get("JITATTN_PREFILL_TIER")
    prefill_family.TUNING.update(tuning)
    os.environ["JITATTN_PREFILL_TIER"] = "sm80"
    try:
        plan = build_inputs(spec)
    finally:
        prefill_family.TUNING.clear()
        prefill_family.TUNING.update(saved)
        if saved_tier is None:
            del os.environ["JITATTN_PREFILL_TIER"]
        else:
            os.environ["JITATTN_PREFILL_TIER"] = saved_tier
    entry = find_entry(plan) or build_entry(plan, jobs=4)
    return Module(spec, entry / "lib.so", plan.entries)


def gemm_tflops(iters: int) -> float:
    """bf16 8192^3 torch.matmul TFLOP/s on random data, as in the suite's ceilings."""
    return _gemm(Timer(torch.device("cuda", torch.cuda.current_device())), 8192, torch.bfloat16)["tflops"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-causal", dest="causal", action="store_false", help="full (non-causal) attention")
    ap.add_argument("--tunings", type=str, default=json.dumps(DEFAULT_TUNINGS),
                    help="JSON list of TUNING overrides to time ([{}] for the default only)")
    return ap.parse_args(argv)


def _tuning_rows(args, q, k, v, indptr, out, causal: bool) -> list[tuple[str, float, str]]:
    """One row per TUNING override of the prefill layout, launched directly (no wrapper), checked against ``out``."""
    H, HKV, D = args.heads, args.kv_heads, args.head_dim
    dev = q.device
    spec = VariantSpec(op=Op.PREFILL, target=Target.CUDA, q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16",
                       head_dim_qk=D, head_dim_vo=D, group_size=H // HKV, pos_encoding=PosEncoding.NONE,
                       use_sliding_window=False, use_logits_soft_cap=False,
                       mask_mode=MaskMode.CAUSAL if causal else MaskMode.NONE,
                       kv_layout=KVLayout.NHD, kv_storage=KVStorage.RAGGED)
    scalars = AttentionScalars(causal=causal, pos_encoding=PosEncoding.NONE, window_left=-1, sm_scale=D**-0.5,
                               logits_soft_cap=0.0, rope_scale=1.0, rope_theta=1e4)
    qo_dev, kv_dev = indptr.to(dev), indptr.to(dev)
    rows = []
    for tuning in json.loads(args.tunings):
        label = "jitattn " + (json.dumps(tuning, separators=(",", ":")) if tuning else "{} (default)")
        try:
            layout = prefill_family.cuda_layout(spec, tuning)
            module = module_with(spec, tuning)
        except Exception as exc:  # a layout that does not fit is reported, not fatal
            rows.append((label, float("nan"), f"failed: {str(exc).splitlines()[0][:80]}"))
            continue
        o2 = torch.empty_like(out)

        def run(module=module, o2=o2):
            launch_attention(module, q=q, k=k, v=v, o=o2, lse=None, qo_indptr=qo_dev, kv_indptr=kv_dev,
                             kv_indices=None, kv_last_page_len=None, page_size=1, kv_layout=KVLayout.NHD,
                             custom_mask=None, mask_indptr=None, num_kv_heads=HKV, scalars=scalars)

        run()
        diff = (o2.float() - out.float()).abs().max().item()
        ms = _median_ms(run, args.iters)
        note = (f"cta_q {layout['kCtaQ']} cta_kv {layout['kCtaKV']} stages {layout['kStages']} "
                f"warps {layout['kWarps']} smem {layout['kSmemBytes'] >> 10} KiB; max|diff| {diff:.1e}")
        rows.append((label, ms, note))
    return rows


def _sdpa_rows(args, q, k, v, out, causal: bool) -> list[tuple[str, float, str]]:
    """torch SDPA's flash and cuDNN backends on the same data ([B, H, S, D] contiguous), K/V expanded to every
    head where a backend refuses GQA."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    B, S, H, HKV, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    qs = q.view(B, S, H, D).transpose(1, 2).contiguous()
    ks = k.view(B, S, HKV, D).transpose(1, 2).contiguous()
    vs = v.view(B, S, HKV, D).transpose(1, 2).contiguous()
    ref = out.view(B, S, H, D).transpose(1, 2).float()
    rows = []
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)):
        note = ""
        try:
            with sdpa_kernel(backend):
                fn = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=True)  # noqa: E731
                res = fn()
        except Exception:
            ke = ks.repeat_interleave(H // HKV, dim=1)
            ve = vs.repeat_interleave(H // HKV, dim=1)
            note = "K/V expanded to all heads; "
            try:
                with sdpa_kernel(backend):
                    fn = lambda: F.scaled_dot_product_attention(qs, ke, ve, is_causal=causal)  # noqa: E731
                    res = fn()
            except Exception as exc:
                rows.append((f"torch SDPA {name}", float("nan"), f"unavailable: {str(exc).splitlines()[0][:80]}"))
                continue
        diff = (res.float() - ref).abs().max().item()

        def timed(fn=fn, backend=backend):
            with sdpa_kernel(backend):
                return fn()

        ms = _median_ms(timed, args.iters)
        rows.append((f"torch SDPA {name}", ms, note + f"max|diff| vs jitattn {diff:.1e}"))
    return rows


def _report(rows: list[tuple[str, float, str]], flops: float, iters: int) -> None:
    gemm = gemm_tflops(iters)
    best_jit = min((ms for name, ms, _ in rows if name.startswith("jitattn") and ms == ms), default=float("nan"))
    print(f"\nbf16 GEMM ceiling (8192^3 torch.matmul): {gemm:.0f} TFLOP/s")
    print(f"{'kernel':58s} {'ms':>8s} {'TFLOP/s':>8s} {'/GEMM':>6s} {'jit/x':>6s}  notes")
    for name, ms, note in rows:  # jit/x: best jitattn TFLOP/s over this row's
        tf = flops / ms / 1e9 if ms == ms else float("nan")
        print(f"{name:58s} {ms:8.3f} {tf:8.1f} {tf / gemm:6.2f} {ms / best_jit:6.2f}  {note}")
    summary = {name: flops / ms / 1e9 for name, ms, _ in rows if ms == ms}
    best = flops / best_jit / 1e9
    parts = [f"jitattn best {best:.0f} TFLOP/s ({best / gemm:.2f} of GEMM)"]
    for name in ("torch SDPA flash", "torch SDPA cudnn"):
        if name in summary:
            parts.append(f"{best / summary[name]:.2f}x {name} ({summary[name]:.0f})")
    print("; ".join(parts))


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    torch.manual_seed(0)
    B, S, H, HKV, D = args.batch, args.seq, args.heads, args.kv_heads, args.head_dim
    dtype = torch.bfloat16
    dev = torch.device("cuda")
    q = torch.randn(B * S, H, D, device=dev, dtype=dtype)
    k = torch.randn(B * S, HKV, D, device=dev, dtype=dtype)
    v = torch.randn(B * S, HKV, D, device=dev, dtype=dtype)
    indptr = torch.arange(0, (B + 1) * S, S, dtype=torch.int32)
    causal = args.causal
    pairs = B * S * (S + 1) // 2 if causal else B * S * S
    flops = 4 * pairs * H * D
    print(f"ragged {'causal' if causal else 'non-causal'} prefill: batch {B} x {S}, {H}/{HKV} heads, head_dim {D}, bf16; "
          f"{flops / 1e12:.2f} TFLOP per call; {torch.cuda.get_device_name()}")

    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=dev))
    wrapper.plan(indptr, indptr, H, HKV, D, causal=causal, q_data_type=dtype)
    out = wrapper.run(q, k, v)
    ms = _median_ms(lambda: wrapper.run(q, k, v, out=out), args.iters)
    rows = [("jitattn (wrapper, default layout)", ms, "")]
    rows += _tuning_rows(args, q, k, v, indptr, out, causal)
    rows += _sdpa_rows(args, q, k, v, out, causal)
    _report(rows, flops, args.iters)


if __name__ == "__main__":
    main()

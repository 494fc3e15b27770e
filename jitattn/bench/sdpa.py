"""torch SDPA on the same data as a jitattn case (the peer column)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch

from .configs import Attn
from .rows import BudgetExceeded, Context, cuda_ok, first_line, rate_of
from .inputs import AttnData


# --------------------------------------------------------------------------- #
# torch SDPA on the same data
# --------------------------------------------------------------------------- #
def sdpa_unsupported(case: Attn) -> str | None:
    if case.logits_soft_cap > 0:
        return "SDPA has no logits soft cap"
    if case.pos_encoding != "NONE":
        return f"SDPA has no in-kernel {case.pos_encoding}"
    if case.kv_dtype in ("e4m3", "e5m2"):
        return "SDPA takes no fp8 KV"
    if case.custom_mask:
        return "custom mask: compared with the plain kernel"
    if case.op == "prefill" and case.causal and any(q != k for q, k in zip(case.queries, case.kv_lens)):
        return "SDPA's is_causal is top-left"
    if case.op == "prefill" and case.window_left >= 0:
        return "window: compared with the plain kernel"
    return None


def sdpa_groups(data: AttnData) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q, k, v) per group of equal-length requests, ``[G, H, L, D]`` contiguous (KV inside the window)."""
    case = data.case
    groups: dict[tuple[int, int], list[int]] = {}
    for r, key in enumerate(zip(case.queries, case.kv_lens)):
        groups.setdefault(key, []).append(r)
    qo_off = data.qo_offsets
    out = []
    for (qo_len, kv_len), reqs in groups.items():
        if data.cache is not None:
            idx = torch.stack([data.table.pages(r) for r in reqs]).to(data.cache.device).long()  # [G, P]
            kv = data.cache[idx]  # [G, P, 2, page, H, D]
            g, p = idx.shape
            kv = kv.permute(2, 0, 4, 1, 3, 5).reshape(2, g, case.num_kv_heads, p * case.page_size, case.head_dim)
            k, v = kv[0], kv[1]
            del kv
        else:
            kv_off = data.kv_offsets
            k = torch.stack([data.k[kv_off[r]:kv_off[r] + kv_len] for r in reqs]).transpose(1, 2)
            v = torch.stack([data.v[kv_off[r]:kv_off[r] + kv_len] for r in reqs]).transpose(1, 2)
        lo = kv_len - (case.window_left + 1) if case.op == "decode" and case.window_left >= 0 else 0
        k, v = k[:, :, max(0, lo):kv_len].contiguous(), v[:, :, max(0, lo):kv_len].contiguous()
        if case.op == "decode":
            q = data.q[torch.tensor(reqs, device=data.q.device)].unsqueeze(2)
        else:
            q = torch.stack([data.q[qo_off[r]:qo_off[r + 1]] for r in reqs]).transpose(1, 2).contiguous()
        out.append((q, k, v))
    return out


def sdpa_backends(case: Attn, ctx: Context) -> list[tuple[str, object]]:
    from torch.nn.attention import SDPBackend

    if case.op == "decode":
        return [("default", None)]
    return [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION)]


def _sdpa_call(groups, causal: bool, backend, gqa: bool) -> Callable[[], None]:
    import torch.nn.functional as F
    from torch.nn.attention import sdpa_kernel

    def call():
        for q, k, v in groups:
            F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)

    if backend is None:
        return call

    def with_backend():
        with sdpa_kernel(backend):
            call()

    return with_backend


def _first_call(fn: Callable[[], None], ctx: Context) -> None:
    """Call ``fn`` once; on failure raise with the reason SDPA gave as a warning (why no kernel fits)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            fn()
            ctx.sync()
        except Exception as exc:
            reasons = " | ".join(str(w.message).splitlines()[0][:160] for w in caught[:3])
            raise RuntimeError(f"{first_line(exc)}" + (f" ({reasons})" if reasons else "")) from exc


def run_sdpa(case: Attn, groups, ctx: Context, jit_time_us: float | None, nbytes=None, flops=None) -> dict:
    """{backend: {time_us, rate, fraction, speedup, note} | {error} | {n/a}} for the case's SDPA backends."""
    results = {}
    gqa = case.num_qo_heads != case.num_kv_heads
    causal = case.op == "prefill" and case.causal
    nbytes = case.bytes if nbytes is None else nbytes
    flops = case.flops if flops is None else flops
    for name, backend in sdpa_backends(case, ctx):
        if name == "cudnn" and not ctx.cuda:
            results[name] = {"n/a": "cuDNN needs CUDA"}
            continue
        try:
            ctx.check_budget(f"SDPA {name}")
            note = ""
            fn = _sdpa_call(groups, causal, backend, gqa)
            try:
                _first_call(fn, ctx)
            except Exception as exc:  # a backend without GQA: expand K/V to every query head
                if not gqa:
                    raise
                group = case.num_qo_heads // case.num_kv_heads
                expanded = [(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1))
                            for q, k, v in groups]
                fn = _sdpa_call(expanded, causal, backend, False)
                _first_call(fn, ctx)
                note = f"K/V expanded to all heads (with enable_gqa: {first_line(exc)[:120]})"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                timing = ctx.timer.measure(fn, ctx.measure_s)
            rate, unit, ceiling, fraction = rate_of(case.kind, nbytes, flops, timing.median_us, ctx.ceilings)
            results[name] = {
                "time_us": timing.median_us, "timing": timing.to_dict(), "rate": rate, "rate_unit": unit,
                "fraction": fraction, "note": note,
                "speedup": (timing.median_us / jit_time_us) if jit_time_us else None,
            }
            del fn
        except BudgetExceeded as exc:
            results[name] = {"error": str(exc)}
        except Exception as exc:
            results[name] = {"error": first_line(exc)}
            if ctx.cuda and not cuda_ok():
                raise
    return results

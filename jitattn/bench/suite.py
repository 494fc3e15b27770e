"""The benchmark suite behind ``python -m jitattn.bench`` (see ``__main__`` for the options).

Order of a run: select the cases; pre-build every kernel they need in
parallel (``jitattn.build_many``); measure the ceilings (``ceilings``);
then each case, one after another, each inside its own ``try``: a failure
becomes that row's ``error`` and the suite goes on. A case that runs past
its time budget skips its remaining stages (noted in the row); once the
run's deadline has passed the remaining cases are listed as skipped. If a
case leaves the CUDA context unusable (an illegal address, say), the
remaining cases run in a fresh child process and their rows are merged.

Each attention row: jitattn's median time through the public wrappers
(``plan`` once, ``run`` timed; see ``timing.Timer``), the case's bytes and
FLOPs (``configs``), the achieved rate and its fraction of the ceiling
(bandwidth rows: read-stream; compute rows: GEMM), torch SDPA on the same
data where it can express the case, the speedup (SDPA time / jitattn time),
and the max relative error ``max|o - ref| / max|ref|`` against
``jitattn.reference`` (float64, on the device) over a small slice: the
first two requests (prefill: their last 128 queries, exact under
bottom-right causal).
"""

from __future__ import annotations

import datetime as _dt
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from . import ceilings as ceilings_mod
from . import configs
from .configs import MLA, Attn, Cascade, Case, Jit
from .timing import Timer

SCHEMA = "jitattn-bench/1"
REF_REQUESTS = 2
REF_QUERIES = 128
TORCH_DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
                "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


class BudgetExceeded(Exception):
    pass


@dataclass
class Context:
    device: torch.device
    timer: Timer
    ceilings: dict
    measure_s: float
    case_budget_s: float
    deadline: float  # time.monotonic() after which no new case starts
    quick: bool = False
    failed_specs: dict = field(default_factory=dict)  # VariantSpec -> error text
    plain_rows: dict = field(default_factory=dict)  # name -> row, for the variants
    case_deadline: float = math.inf

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def target(self) -> str:
        return "cuda" if self.cuda else "cpu"

    def time_left(self) -> float:
        return self.case_deadline - time.monotonic()

    def check_budget(self, stage: str) -> None:
        if self.time_left() <= 0:
            raise BudgetExceeded(f"case time budget ({self.case_budget_s:.0f} s) used up before {stage}")

    def sync(self) -> None:
        self.timer.sync()


# --------------------------------------------------------------------------- #
# Rows
# --------------------------------------------------------------------------- #
def new_row(case: Case, name: str | None = None) -> dict:
    return {
        "name": name or case.name, "suite": case.suite, "kind": case.kind, "status": "ok",
        "params": case.params(), "time_us": None, "timing": None,
        "bytes": getattr(case, "bytes", None), "flops": getattr(case, "flops", None),
        "rate": None, "rate_unit": None, "ceiling": None, "fraction": None,
        "sdpa": None, "sdpa_na": None, "baseline": None, "max_rel_err": None,
        "note": getattr(case, "note", "") or "", "error": None, "seconds": None,
    }


def rate_of(kind: str, nbytes: int | None, flops: int | None, time_us: float, ceilings: dict) -> tuple:
    """(rate, unit, ceiling name, fraction) of a bandwidth or compute row."""
    if kind == "bandwidth" and nbytes:
        rate = nbytes / (time_us * 1e-6) / 1e9
        ceiling = ceilings.get("read_stream", {}).get("gbps")
        return rate, "GB/s", "read_stream", (rate / ceiling if ceiling else None)
    if kind == "compute" and flops:
        rate = flops / (time_us * 1e-6) / 1e12
        ceiling = ceilings.get("gemm", {}).get("tflops")
        return rate, "TFLOP/s", "gemm", (rate / ceiling if ceiling else None)
    return None, None, None, None


def set_time(row: dict, timing, ctx: Context) -> None:
    row["time_us"] = timing.median_us
    row["timing"] = timing.to_dict()
    row["rate"], row["rate_unit"], row["ceiling"], row["fraction"] = rate_of(
        row["kind"], row["bytes"], row["flops"], timing.median_us, ctx.ceilings)


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def rel_err(got: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    """max |got - ref| / max |ref| over the slices (inf when got has NaN/inf)."""
    num, den = 0.0, 0.0
    for g, r in zip(got, ref):
        g64, r64 = g.to(torch.float64), r.to(device=g.device, dtype=torch.float64)
        if not bool(torch.isfinite(g64).all()):
            return math.inf
        num = max(num, float((g64 - r64).abs().max()))
        den = max(den, float(r64.abs().max()))
    return num / den if den > 0 else num


# --------------------------------------------------------------------------- #
# Attention data (decode / prefill, paged / ragged)
# --------------------------------------------------------------------------- #
def _seed(name: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(name)) % (2**31)


def _rand(shape, dtype: torch.dtype, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return (torch.randn(shape, dtype=torch.bfloat16, device=device, generator=gen) * 2).to(dtype)
    return torch.randn(shape, dtype=dtype, device=device, generator=gen)


def _indptr(lens: list[int]) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32)


@dataclass
class PageTable:
    indptr: torch.Tensor  # host int32
    indices: torch.Tensor  # host int32
    last: torch.Tensor  # host int32
    page_size: int

    def pages(self, r: int) -> torch.Tensor:
        return self.indices[int(self.indptr[r]):int(self.indptr[r + 1])]


def random_page_table(kv_lens, page_size: int, pool: int, gen: torch.Generator) -> PageTable:
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    needed = sum(pages_per)
    order = torch.randperm(pool, generator=gen)[:needed].to(torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    return PageTable(_indptr(pages_per), order, last, page_size)


def pool_pages(needed: int) -> int:
    """A pool a quarter larger than the pages in use, so the pages used are scattered."""
    return needed + needed // 4 + 1


@dataclass
class AttnData:
    case: Attn
    q: torch.Tensor
    out: torch.Tensor
    cache: torch.Tensor | None = None  # paged: [pool, 2, page, H_kv, D]
    table: PageTable | None = None
    k: torch.Tensor | None = None  # ragged: [tokens, H_kv, D]
    v: torch.Tensor | None = None
    custom_mask: torch.Tensor | None = None  # flat bool (host)

    @property
    def qo_offsets(self) -> list[int]:
        return _indptr(list(self.case.queries)).tolist()

    @property
    def kv_offsets(self) -> list[int]:
        return _indptr(list(self.case.kv_lens)).tolist()

    def request_kv(self, r: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Request r's keys and values, contiguous ``[kv_len, H_kv, D]``."""
        n = self.case.kv_lens[r]
        if self.cache is None:
            s = self.kv_offsets[r]
            return self.k[s:s + n], self.v[s:s + n]
        pages = self.table.pages(r).to(self.cache.device).long()
        kv = self.cache[pages]  # [P, 2, page, H, D]
        return (kv[:, 0].reshape(-1, *kv.shape[3:])[:n], kv[:, 1].reshape(-1, *kv.shape[3:])[:n])


def causal_mask_rows(qo_len: int, kv_len: int, first_row: int = 0) -> torch.Tensor:
    """Bool [qo_len - first_row, kv_len]: rows ``first_row..`` of the bottom-right causal pattern."""
    i = torch.arange(first_row, qo_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    return j <= (kv_len - qo_len) + i


def make_attn_data(case: Attn, device: torch.device) -> AttnData:
    gen_host = torch.Generator().manual_seed(_seed(case.name))
    gen = torch.Generator(device=device).manual_seed(_seed(case.name))
    dt, kvdt = TORCH_DTYPES[case.dtype], TORCH_DTYPES[case.kv_dtype]
    total_q = sum(case.queries)
    q = _rand((total_q, case.num_qo_heads, case.head_dim), dt, device, gen)
    out = torch.empty_like(q)
    data = AttnData(case, q, out)
    if case.storage == "paged":
        needed = sum((n + case.page_size - 1) // case.page_size for n in case.kv_lens)
        pool = pool_pages(needed)
        data.table = random_page_table(case.kv_lens, case.page_size, pool, gen_host)
        data.cache = _rand((pool, 2, case.page_size, case.num_kv_heads, case.head_dim), kvdt, device, gen)
    else:
        total_kv = sum(case.kv_lens)
        data.k = _rand((total_kv, case.num_kv_heads, case.head_dim), kvdt, device, gen)
        data.v = _rand((total_kv, case.num_kv_heads, case.head_dim), kvdt, device, gen)
    if case.custom_mask:
        data.custom_mask = torch.cat([causal_mask_rows(q_, k_).reshape(-1)
                                      for q_, k_ in zip(case.queries, case.kv_lens)])
    return data


def _plan_kwargs(case: Attn) -> dict:
    return dict(pos_encoding_mode=case.pos_encoding, window_left=case.window_left,
                logits_soft_cap=case.logits_soft_cap or None, q_data_type=TORCH_DTYPES[case.dtype],
                kv_data_type=TORCH_DTYPES[case.kv_dtype])


def jitattn_fn(data: AttnData, device: torch.device) -> Callable[[], object]:
    """Plan once through the public wrapper; the returned callable runs one step into ``data.out``."""
    import jitattn

    case = data.case
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    if case.op == "decode":
        wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        need = wrapper.workspace_size(case.batch, max(case.kv_lens), case.num_qo_heads, case.num_kv_heads,
                                      case.head_dim, case.page_size)[0]
        if need > workspace.numel():
            workspace = torch.empty(need, dtype=torch.uint8, device=device)
            wrapper.reset_workspace_buffer(workspace)
        t = data.table
        wrapper.plan(t.indptr, t.indices, t.last, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                     case.page_size, **_plan_kwargs(case))
        return lambda: wrapper.run(data.q, data.cache, out=data.out)
    qo_indptr = _indptr(list(case.queries))
    mask = dict(custom_mask=data.custom_mask) if data.custom_mask is not None else {}
    if case.storage == "paged":
        wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
        t = data.table
        wrapper.plan(qo_indptr, t.indptr, t.indices, t.last, case.num_qo_heads, case.num_kv_heads, case.head_dim,
                     case.page_size, causal=case.causal, **mask, **_plan_kwargs(case))
        return lambda: wrapper.run(data.q, data.cache, out=data.out)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(workspace, kv_layout="NHD")
    wrapper.plan(qo_indptr, _indptr(list(case.kv_lens)), case.num_qo_heads, case.num_kv_heads, case.head_dim,
                 causal=case.causal, **mask, **_plan_kwargs(case))
    return lambda: wrapper.run(data.q, data.k, data.v, out=data.out)


def reference_error(data: AttnData) -> float:
    """Max relative error of ``data.out`` on the first requests (prefill: their last queries)."""
    from jitattn import reference

    case = data.case
    got, ref = [], []
    qo_off = data.qo_offsets
    for r in range(min(REF_REQUESTS, case.batch)):
        k, v = data.request_kv(r)
        qo_len, kv_len = case.queries[r], case.kv_lens[r]
        m = min(REF_QUERIES, qo_len)
        first = qo_off[r + 1] - m
        mask = causal_mask_rows(qo_len, kv_len, qo_len - m).to(data.q.device) if case.custom_mask else None
        o, _ = reference.single_attention(
            data.q[first:qo_off[r + 1]], k, v, causal=case.causal, window_left=case.window_left,
            logits_soft_cap=case.logits_soft_cap or None, pos_encoding_mode=case.pos_encoding, custom_mask=mask)
        got.append(data.out[first:qo_off[r + 1]])
        ref.append(o)
    return rel_err(got, ref)


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
            raise RuntimeError(f"{_first_line(exc)}" + (f" ({reasons})" if reasons else "")) from exc


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
                note = f"K/V expanded to all heads (with enable_gqa: {_first_line(exc)[:120]})"
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
            results[name] = {"error": _first_line(exc)}
            if ctx.cuda and not cuda_ok():
                raise
    return results


# --------------------------------------------------------------------------- #
# Case runners
# --------------------------------------------------------------------------- #
def specs_of(case: Case, target: str) -> list:
    """The kernel specs a case loads (the wrappers' own spec function), for the pre-build."""
    from jitattn.attention.specs import attention_spec, merge_spec
    from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

    tgt = Target.parse(target, "target")

    def attn(c: Attn):
        mask = MaskMode.CUSTOM if c.custom_mask else (MaskMode.CAUSAL if c.causal else MaskMode.NONE)
        return attention_spec(
            Op.DECODE if c.op == "decode" else Op.PREFILL, tgt, q_dtype=TORCH_DTYPES[c.dtype],
            kv_dtype=TORCH_DTYPES[c.kv_dtype], o_dtype=TORCH_DTYPES[c.dtype], head_dim_qk=c.head_dim,
            head_dim_vo=c.head_dim, num_qo_heads=c.num_qo_heads, num_kv_heads=c.num_kv_heads,
            pos_encoding=PosEncoding.parse(c.pos_encoding, "pos_encoding"), use_sliding_window=c.window_left >= 0,
            use_logits_soft_cap=c.logits_soft_cap > 0, mask_mode=mask if c.op == "prefill" else MaskMode.NONE,
            kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED if c.storage == "paged" else KVStorage.RAGGED)

    if isinstance(case, Attn):
        return [attn(case)]
    if isinstance(case, Cascade):
        level = Attn(case.name, "prefill", (case.shared_len,), qo_lens=(case.batch,), num_qo_heads=case.num_qo_heads,
                     num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, page_size=case.page_size,
                     dtype=case.dtype, kv_dtype=case.dtype)
        return [attn(level), attn(case.flat()), merge_spec(tgt, TORCH_DTYPES[case.dtype])]
    if isinstance(case, Jit) and case.what in ("run_overhead", "plan"):
        return [attn(_jit_decode_case(case))]
    return []


def _jit_decode_case(case: Jit) -> Attn:
    return Attn(case.name, "decode", (case.kv_len,) * case.batch)


def _check_specs(case: Case, ctx: Context) -> None:
    for spec in specs_of(case, ctx.target):
        if spec in ctx.failed_specs:
            raise RuntimeError(f"build of {spec.uri} failed in the pre-build: {ctx.failed_specs[spec]}")


def run_attn(case: Attn, ctx: Context) -> list[dict]:
    row = new_row(case)
    try:
        _check_specs(case, ctx)
        data = make_attn_data(case, ctx.device)
        fn = jitattn_fn(data, ctx.device)
        data.out.fill_(float("nan"))  # poison: every element must be written
        fn()
        ctx.sync()
        row["max_rel_err"] = reference_error(data)
        ctx.check_budget("timing")
        set_time(row, ctx.timer.measure(fn, ctx.measure_s), ctx)
        if case.plain:
            row["baseline"] = _baseline(row, ctx.plain_rows.get(case.plain), case.plain)
        if not case.sdpa:
            row["sdpa_na"] = f"compared with {case.plain}" if case.plain else "the variants' plain kernel"
        elif (why := sdpa_unsupported(case)) is not None:
            row["sdpa_na"] = why
        else:
            ctx.check_budget("SDPA")
            groups = sdpa_groups(data)
            del fn
            row["sdpa"] = run_sdpa(case, groups, ctx, row["time_us"])
            del groups
    except BudgetExceeded as exc:
        row["note"] = _join(row["note"], str(exc))
    if case.suite == "variants" and not case.plain:
        ctx.plain_rows[case.name] = row
    return [row]


def _baseline(row: dict, plain: dict | None, plain_name: str) -> dict:
    if plain is None or plain.get("rate") is None:
        return {"name": plain_name, "error": "plain case did not run"}
    return {"name": plain_name, "time_us": plain["time_us"], "rate": plain["rate"], "rate_unit": plain["rate_unit"],
            "ratio": row["rate"] / plain["rate"] if row.get("rate") else None,
            "what": "rate of this variant / rate of the plain kernel (1.0 = free)"}


def run_cascade(case: Cascade, ctx: Context) -> list[dict]:
    import jitattn
    from jitattn import reference

    row = new_row(case)
    flat_case = case.flat()
    flat_row = new_row(flat_case)
    flat_row["suite"] = "cascade"
    flat_row["note"] = "flat paged decode over the same page table (shared pages listed per request; L2 serves repeats)"
    try:
        _check_specs(case, ctx)
        if case.shared_len % case.page_size:
            raise ValueError("the shared prefix must fill whole pages")
        dev, dt = ctx.device, TORCH_DTYPES[case.dtype]
        gen_host = torch.Generator().manual_seed(_seed(case.name))
        gen = torch.Generator(device=dev).manual_seed(_seed(case.name))
        b, page = case.batch, case.page_size
        p_shared, p_unique = case.shared_len // page, (case.unique_len + page - 1) // page
        needed = p_shared + b * p_unique
        pool = pool_pages(needed)
        order = torch.randperm(pool, generator=gen_host)[:needed].to(torch.int32)
        shared, unique = order[:p_shared], order[p_shared:].view(b, p_unique)
        cache = _rand((pool, 2, page, case.num_kv_heads, case.head_dim), dt, dev, gen)
        q = _rand((b, case.num_qo_heads, case.head_dim), dt, dev, gen)
        last_u = (case.unique_len - 1) % page + 1
        i32 = dict(dtype=torch.int32)
        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, workspace, kv_layout="NHD")
        wrapper.plan(
            [torch.tensor([0, b], **i32), torch.arange(b + 1, **i32)],
            [torch.tensor([0, p_shared], **i32), torch.arange(0, b * p_unique + 1, p_unique, **i32)],
            [shared.clone(), unique.reshape(-1).clone()],
            [torch.tensor([page], **i32), torch.full((b,), last_u, **i32)],
            case.num_qo_heads, case.num_kv_heads, case.head_dim, page, causal=False, q_data_type=dt)

        def fn():
            return wrapper.run(q, cache)

        # Flat decode over the same pages: each request lists the shared pages, then its own.
        flat_indices = torch.cat([shared.unsqueeze(0).expand(b, -1), unique], dim=1).reshape(-1).contiguous()
        per = p_shared + p_unique
        table = PageTable(torch.arange(0, b * per + 1, per, **i32), flat_indices, torch.full((b,), last_u, **i32), page)
        flat_data = AttnData(flat_case, q, torch.empty_like(q), cache=cache, table=table)
        flat_fn = jitattn_fn(flat_data, dev)

        out = fn()
        ctx.sync()
        got, ref = [], []
        for r in range(min(REF_REQUESTS, b)):
            k, v = flat_data.request_kv(r)
            o, _ = reference.single_attention(q[r:r + 1], k, v)
            got.append(out[r:r + 1])
            ref.append(o)
        row["max_rel_err"] = rel_err(got, ref)
        flat_data.out.fill_(float("nan"))
        flat_fn()
        ctx.sync()
        flat_row["max_rel_err"] = rel_err([flat_data.out[:REF_REQUESTS]],
                                          [torch.cat(ref)] if ref else [])
        ctx.check_budget("timing")
        set_time(row, ctx.timer.measure(fn, ctx.measure_s), ctx)
        ctx.check_budget("flat decode")
        set_time(flat_row, ctx.timer.measure(flat_fn, ctx.measure_s), ctx)
        flat_row["sdpa_na"] = "see the cascade row"
        row["baseline"] = {"name": flat_row["name"], "time_us": flat_row["time_us"],
                           "speedup": flat_row["time_us"] / row["time_us"],
                           "what": "flat decode time / cascade time"}
        ctx.check_budget("SDPA")
        groups = sdpa_groups(flat_data)
        row["sdpa"] = run_sdpa(flat_case, groups, ctx, row["time_us"], nbytes=case.bytes, flops=case.flops)
        row["note"] = _join(row["note"], "SDPA on contiguous KV per request (prefix copied into each)")
        del groups
    except BudgetExceeded as exc:
        row["note"] = _join(row["note"], str(exc))
    return [row, flat_row]


def run_mla(case: MLA, ctx: Context) -> list[dict]:
    row = new_row(case)
    row["status"] = "skipped"
    row["error"] = "not implemented yet (MLA kernels do not exist in jitattn)"
    return [row]


# ---- jit / host-side rows ---------------------------------------------------
_IMPORT_CHILD = (
    "import json, time\n"
    "t0 = time.perf_counter()\nimport torch\nt1 = time.perf_counter()\nimport jitattn\nt2 = time.perf_counter()\n"
    "print(json.dumps({'torch_s': t1 - t0, 'jitattn_s': t2 - t1}))\n"
)
_LOAD_CHILD = (
    "import json, sys, time\n"
    "import jitattn\nfrom jitattn.jit import compile_count\nfrom jitattn.spec import VariantSpec\n"
    "loads = []\n"
    "for text in sys.argv[1:]:\n"
    "    spec = VariantSpec.from_dict(json.loads(text))\n"
    "    t = time.perf_counter()\n    jitattn.load(spec)\n"
    "    loads.append({'uri': spec.uri, 's': time.perf_counter() - t})\n"
    "print(json.dumps({'loads': loads, 'compiles': compile_count()}))\n"
)


def _child_json(code: str, args: list[str], env: dict, timeout: float) -> dict:
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(env)
    env["PYTHONPATH"] = repo_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                          timeout=max(5.0, timeout))
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        raise RuntimeError(f"child exited {proc.returncode}: {' | '.join(tail)[:300]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _host_row(case: Jit, name: str, seconds: float, note: str) -> dict:
    row = new_row(case, name)
    row["time_us"] = seconds * 1e6
    row["note"] = note
    return row


def run_jit(case: Jit, ctx: Context) -> list[dict]:
    if case.what == "import":
        runs = 1 if ctx.quick else 3
        results = [_child_json(_IMPORT_CHILD, [], os.environ, ctx.time_left()) for _ in range(runs)]
        jit_s = sorted(r["jitattn_s"] for r in results)[len(results) // 2]
        torch_s = sorted(r["torch_s"] for r in results)[len(results) // 2]
        return [_host_row(case, case.name, jit_s,
                          f"`import jitattn` in a fresh process after `import torch` ({torch_s:.2f} s, not counted); "
                          f"median of {runs}")]
    if case.what == "build":
        return _run_build(case, ctx)
    decode = _jit_decode_case(case)
    if case.what == "run_overhead":
        data = make_attn_data(decode, ctx.device)
        fn = jitattn_fn(data, ctx.device)
        t = ctx.timer.host_us(fn, budget_s=min(0.5, ctx.measure_s))
        row = _host_row(case, case.name, t.median_us * 1e-6,
                        "host time per wrapper.run() (no sync between calls), batch 1 x 16 tokens"
                        + ("" if ctx.cuda else "; includes the tiny cpu kernel itself"))
        row["timing"] = t.to_dict()
        return [row]
    # plan(): host index tensors, batch 256; fast_plan: fast_decode_plan with device index tensors and a
    # host copy of indptr, as SGLang calls it every step
    import jitattn

    workspace = torch.empty(128 << 20, dtype=torch.uint8, device=ctx.device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace, kv_layout="NHD")
    needed = decode.batch * ((max(decode.kv_lens) + decode.page_size - 1) // decode.page_size)
    t = random_page_table(decode.kv_lens, decode.page_size, pool_pages(needed), torch.Generator().manual_seed(0))
    on_device = [x.to(ctx.device) for x in (t.indptr, t.indices, t.last)]

    def plan():
        if case.what == "fast_plan":
            jitattn.fast_decode_plan(wrapper, *on_device, decode.num_qo_heads, decode.num_kv_heads, decode.head_dim,
                                     decode.page_size, global_override_indptr_cpu=t.indptr, **_plan_kwargs(decode))
        else:
            wrapper.plan(t.indptr, t.indices, t.last, decode.num_qo_heads, decode.num_kv_heads, decode.head_dim,
                         decode.page_size, **_plan_kwargs(decode))

    for _ in range(3):
        plan()
    times = []
    stop = time.perf_counter() + min(1.0, ctx.measure_s * 2)
    while len(times) < 5 or (time.perf_counter() < stop and len(times) < 200):
        t0 = time.perf_counter()
        plan()
        times.append(time.perf_counter() - t0)
    times.sort()
    row = _host_row(case, case.name, times[len(times) // 2],
                    ("fast_decode_plan() with device index tensors and global_override_indptr_cpu"
                     if case.what == "fast_plan" else "wrapper.plan() with host int32 index tensors")
                    + f" ({int(t.indptr[-1])} pages), median of {len(times)}")
    return [row]


def _build_specs(ctx: Context) -> list:
    decode = Attn("jit/decode", "decode", (16,))
    prefill = Attn("jit/prefill", "prefill", (16,), qo_lens=(16,), causal=True, storage="ragged")
    return [specs_of(decode, ctx.target)[0], specs_of(prefill, ctx.target)[0]]


def _run_build(case: Jit, ctx: Context) -> list[dict]:
    specs = _build_specs(ctx)
    env = dict(os.environ)
    root = tempfile.mkdtemp(prefix="jitattn-bench-cold-")
    env["JITATTN_CACHE_DIR"] = root
    for name in ("JITATTN_CACHE_PATH", "JITATTN_ASSERT_NO_COMPILE"):
        env.pop(name, None)
    if ctx.cuda:
        from jitattn.jit.toolchain import cuda_arch_list

        env["JITATTN_CUDA_ARCH_LIST"] = ";".join(cuda_arch_list())
    args = [s.canonical_json() for s in specs]
    rows = []
    try:
        cold = _child_json(_LOAD_CHILD, args, env, min(240.0, ctx.time_left()))
        warm = _child_json(_LOAD_CHILD, args, env, min(120.0, ctx.time_left()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for label, result, what in (("cold_build", cold, "cold build: render + compile + link + publish + load, "
                                 "empty cache"),
                                ("warm_load", warm, "warm load: render + key + checksum + dlopen, populated cache")):
        for kind, load in zip(("decode", "prefill"), result["loads"]):
            rows.append(_host_row(case, f"jit/{label}_{kind}", load["s"],
                                  f"{what}; {load['uri']}; fresh process (compiles there: {result['compiles']})"))
    return rows


# --------------------------------------------------------------------------- #
# Orchestration
# --------------------------------------------------------------------------- #
def cuda_ok() -> bool:
    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
        return True
    except Exception:
        return False


def _join(a: str, b: str) -> str:
    return f"{a}; {b}" if a and b else (a or b)


def run_case(case: Case, ctx: Context) -> list[dict]:
    """Every row of one case; never raises (a failure is the rows' error)."""
    started = time.monotonic()
    ctx.case_deadline = started + ctx.case_budget_s
    try:
        if isinstance(case, Attn):
            rows = run_attn(case, ctx)
        elif isinstance(case, Cascade):
            rows = run_cascade(case, ctx)
        elif isinstance(case, MLA):
            rows = run_mla(case, ctx)
        else:
            rows = run_jit(case, ctx)
    except Exception as exc:  # the row records it; the suite goes on
        rows = []
        for name in configs.row_names(case):
            row = new_row(case, name)
            row["status"] = "error"
            row["error"] = _first_line(exc)
            row["traceback"] = traceback.format_exc(limit=6)
            rows.append(row)
        if isinstance(case, Attn) and case.suite == "variants" and not case.plain:
            ctx.plain_rows[case.name] = rows[0]
    finally:
        ctx.case_deadline = math.inf
        gc.collect()
        if ctx.cuda:
            try:
                torch.cuda.empty_cache()
            except Exception:
                pass
    elapsed = time.monotonic() - started
    for row in rows:
        row["seconds"] = elapsed
    return rows


def skipped_rows(case: Case, why: str) -> list[dict]:
    rows = []
    for name in configs.row_names(case):
        row = new_row(case, name)
        row["status"] = "skipped"
        row["error"] = why
        rows.append(row)
    return rows


def environment(device: torch.device) -> dict:
    import platform

    import jitattn

    info = {"torch": torch.__version__, "python": platform.python_version(), "jitattn": jitattn.__version__,
            "host": platform.node(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    try:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        commit = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                timeout=5)
        dirty = subprocess.run(["git", "-C", repo, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5)
        if commit.returncode == 0:
            info["git"] = commit.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:
        pass
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, sms=props.multi_processor_count, memory_gib=props.total_memory / 2**30,
                    l2_bytes=getattr(props, "L2_cache_size", None), cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}")
    else:
        info["device"] = platform.processor() or platform.machine()
    return info


def prebuild(cases: list[Case], target: str, jobs: int, log: Callable[[str], None]) -> tuple[dict, dict]:
    """Build every spec the cases load, in parallel; returns (summary, {spec: error})."""
    import jitattn

    specs = []
    for case in cases:
        try:
            specs += specs_of(case, target)
        except Exception as exc:  # an invalid spec shows up again as the row's error
            log(f"  (no spec for {case.name}: {_first_line(exc)})")
    specs = list(dict.fromkeys(specs))
    started = time.perf_counter()
    results = jitattn.build_many(specs, jobs=jobs) if specs else []
    failed = {r.spec: (r.error or "").strip().splitlines()[0][:300] if r.error else "failed"
              for r in results if r.status == "failed"}
    summary = {"specs": len(results), "built": sum(r.status == "built" for r in results),
               "cached": sum(r.status == "cached" for r in results), "failed": {s.uri: e for s, e in failed.items()},
               "seconds": time.perf_counter() - started, "jobs": jobs}
    return summary, failed


def run(opts) -> dict:
    """Run the selected cases; returns the JSON document (also written to ``opts.json`` as rows finish)."""
    from . import report

    t_start = time.monotonic()
    log = report.printer(opts)
    target = opts.target
    if target == "auto":
        target = "cuda" if torch.cuda.is_available() else "cpu"
    if target == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--target cuda: no CUDA device is visible")
    device = torch.device("cuda", torch.cuda.current_device()) if target == "cuda" else torch.device("cpu")
    cases = configs.select(opts.suite, opts.only, opts.quick)
    if target == "cpu":
        cases = [c.small() for c in cases]
    measure_s = opts.measure_s if opts.measure_s else (
        (0.3 if opts.quick else 0.5) if target == "cuda" else (0.1 if opts.quick else 0.3))
    deadline_s = opts.deadline if opts.deadline else (100.0 if opts.quick else 210.0)
    doc = {
        "schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target,
        "note": ("cuda target at the issue's sizes" if target == "cuda" else
                 f"no CUDA device: the cpu target at small sizes (~1/{configs.CPU_SCALE} of the tokens, fewer "
                 "requests; same names); the GEMM ceiling is float32"),
        "args": {"suite": opts.suite, "only": opts.only, "quick": opts.quick, "measure_s": measure_s,
                 "case_budget_s": opts.case_budget, "deadline_s": deadline_s},
        "environment": environment(device),
        "method": {
            "timing": ("median of CUDA-event-timed calls after warm-up; before each call a read-only pass over "
                       "4x L2 evicts L2 (every call reads its KV from DRAM) and hides host launch overhead"
                       if target == "cuda" else "median of time.perf_counter()-timed calls after warm-up"),
            "speedup": "SDPA time / jitattn time (> 1: jitattn is faster)",
            "max_rel_err": "max|o - ref| / max|ref| vs jitattn.reference in float64, first 2 requests "
                           "(prefill: their last 128 queries)",
            "fraction": "bandwidth rows: rate / read_stream ceiling; compute rows: rate / gemm ceiling",
        },
        "prebuild": None, "ceilings": None, "rows": [],
    }
    log(f"jitattn bench: target {target} ({doc['environment'].get('device')}); {len(cases)} cases; "
        f"{doc['note']}")
    ctx_failed: dict = {}
    if not opts.no_prebuild:
        jobs = opts.jobs or min(16, os.cpu_count() or 1)
        doc["prebuild"], ctx_failed = prebuild(cases, target, jobs, log)
        pb = doc["prebuild"]
        log(f"pre-build: {pb['specs']} specs ({pb['built']} built, {pb['cached']} cached, {len(pb['failed'])} failed) "
            f"in {pb['seconds']:.1f} s with {jobs} jobs")
        for uri, err in pb["failed"].items():
            log(f"  FAILED {uri}: {err}")
    scrub = 0
    if target == "cuda":
        l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or (60 << 20)
        scrub = max(4 * l2, 128 << 20)
    timer = Timer(device, scrub)
    if opts.ceilings_json:
        doc["ceilings"] = json.loads(opts.ceilings_json)
    else:
        try:
            doc["ceilings"] = ceilings_mod.measure(timer, opts.quick)
        except Exception as exc:
            doc["ceilings"] = {"error": _first_line(exc)}
    log(report.ceilings_line(doc["ceilings"]))
    ctx = Context(device=device, timer=timer, ceilings=doc["ceilings"], measure_s=measure_s,
                  case_budget_s=opts.case_budget, deadline=t_start + deadline_s, quick=opts.quick,
                  failed_specs=ctx_failed)
    remaining: list[Case] = []
    for i, case in enumerate(cases):
        if time.monotonic() > ctx.deadline:
            for c in cases[i:]:
                doc["rows"] += skipped_rows(c, f"skipped: the run's time budget ({deadline_s:.0f} s) was used up")
            break
        rows = run_case(case, ctx)
        for row in rows:
            doc["rows"].append(row)
            log(report.row_line(row, len(doc["rows"])))
        report.write_json(doc, opts.json)
        if ctx.cuda and any(r["status"] == "error" for r in rows) and not cuda_ok():
            remaining = cases[i + 1:]
            log(f"the CUDA context is unusable after {case.name}; running the {len(remaining)} remaining cases "
                "in a fresh process")
            break
    if remaining:
        doc["rows"] += _resume_in_child(remaining, opts, doc, t_start + deadline_s - time.monotonic(), log, target)
    doc["elapsed_s"] = time.monotonic() - t_start
    report.write_json(doc, opts.json)
    return doc


def _resume_in_child(cases: list[Case], opts, doc: dict, seconds_left: float, log, target: str = "cuda") -> list[dict]:
    """Run ``cases`` in a fresh ``python -m jitattn.bench`` process (same ceilings); returns its rows."""
    depth = int(os.environ.get("JITATTN_BENCH_DEPTH", "0"))
    if depth >= 3 or seconds_left <= 5:
        return [r for c in cases for r in skipped_rows(c, "skipped: the CUDA context was lost")]
    names = [c.name for c in cases]
    fd, path = tempfile.mkstemp(prefix="jitattn-bench-child-", suffix=".json")
    os.close(fd)
    cmd = [sys.executable, "-m", "jitattn.bench", "--suite", "all", "--only", ",".join(names), "--json", path,
           "--ceilings-json", json.dumps(doc["ceilings"]), "--no-prebuild", "--deadline", f"{seconds_left:.0f}",
           "--case-budget", str(opts.case_budget), "--target", target, "--child"]
    if opts.quick:
        cmd.append("--quick")
    if opts.measure_s:
        cmd += ["--measure-s", str(opts.measure_s)]
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, JITATTN_BENCH_DEPTH=str(depth + 1))
    env["PYTHONPATH"] = repo_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    try:
        subprocess.run(cmd, env=env, timeout=seconds_left + 30)
        with open(path) as f:
            rows = json.load(f)["rows"]
    except Exception as exc:
        log(f"child run failed: {_first_line(exc)}")
        rows = []
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    have = {r["name"] for r in doc["rows"]}
    rows = [r for r in rows if r["name"] not in have]
    got = {r["name"] for r in rows}
    for case in cases:
        for r in skipped_rows(case, "skipped: the child process did not report it"):
            if r["name"] not in got:
                rows.append(r)
    return rows

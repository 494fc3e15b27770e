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
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Callable

import torch

from . import ceilings as ceilings_mod
from . import configs, report
from .configs import MLA, Attn, Cascade, Case
from .timing import Timer
from .rows import (
    BudgetExceeded, Context, SCHEMA, TORCH_DTYPES, cuda_ok, error_summary, first_line, join_notes, new_row, rel_err,
    set_time,
)
from .inputs import check_prebuilt, jitattn_fn, make_attn_data, random_tensor, reference_error, seed_of, specs_of
from .cascade import run_cascade
from .sdpa import run_sdpa, sdpa_groups, sdpa_unsupported
from .host import run_jit
from .peers import run_flashinfer, run_flashinfer_mla
from .ops import run_block_sparse, run_rope
from .ops_fp8 import run_fp8_prefill
from .ops_cases import BlockSparse, Fp8Prefill, Mixed, Rope
from .ops_mixed import run_mixed


# --------------------------------------------------------------------------- #
# Case runners (the cascade's: cascade.py)
# --------------------------------------------------------------------------- #


def run_attn(case: Attn, ctx: Context) -> list[dict]:
    row = new_row(case)
    try:
        check_prebuilt(case, ctx.target, ctx.failed_specs)
        data = make_attn_data(case, ctx.device)
        fn = jitattn_fn(data, ctx.device)
        data.out.fill_(float("nan"))  # poison: every element must be written
        fn()
        ctx.sync()
        row["max_rel_err"] = reference_error(data)
        ctx.check_budget("timing")
        set_time(row, ctx.timer.measure(fn, ctx.measure_s), ctx, fn)
        if case.plain:
            row["baseline"] = _baseline(row, ctx.plain_rows.get(case.plain), case.plain)
        if not case.sdpa:
            row["sdpa_na"] = f"compared with {case.plain}" if case.plain else "the variants' plain kernel"
        elif not ctx.sdpa:
            row["sdpa_na"] = "not timed (--no-sdpa)"
        elif (why := sdpa_unsupported(case)) is not None:
            row["sdpa_na"] = why
        else:
            ctx.check_budget("SDPA")
            groups = sdpa_groups(data)
            del fn
            row["sdpa"] = run_sdpa(case, groups, ctx, row["time_us"])
            del groups
        if "flashinfer" in ctx.peers:
            row["peers"] = {"flashinfer": run_flashinfer(case, data, ctx, row["time_us"])}
    except BudgetExceeded as exc:
        row["note"] = join_notes(row["note"], str(exc))
    if not case.plain:  # a case others are compared with (variants, sink and batch-invariant twins)
        ctx.plain_rows[case.name] = row
    return [row]


def _baseline(row: dict, plain: dict | None, plain_name: str) -> dict:
    if plain is None or plain.get("rate") is None:
        return {"name": plain_name, "error": "plain case did not run"}
    return {"name": plain_name, "time_us": plain["time_us"], "rate": plain["rate"], "rate_unit": plain["rate_unit"],
            "ratio": row["rate"] / plain["rate"] if row.get("rate") else None,
            "what": "rate of this variant / rate of the plain kernel (1.0 = free)"}


def run_mla(case: MLA, ctx: Context) -> list[dict]:
    """MLA decode through BatchMLAPagedAttentionWrapper (the sm90 MLA kernel on an H100/H200, else the prefill kernels).

    The latent cache is one ``[pages, page_size, ckv + kpe]`` buffer (ckv/kpe as slices: no copy); an fp8
    cache is read with per-tensor ``k_scale``/``v_scale``. The error is checked on the first request against
    ``jitattn.reference``. Every row carries ``tflops`` and ``tb_per_s`` (the headline rate is the case's
    kind); ``--peer flashinfer`` adds FlashInfer's MLA wrapper on the same data.
    """
    import jitattn
    from jitattn import reference

    row = new_row(case)
    dtype, kv_dtype = TORCH_DTYPES[case.dtype], TORCH_DTYPES[case.cache_dtype]
    fp8 = kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    k_scale, v_scale = (0.5, 1.5) if fp8 else (None, None)
    gen = torch.Generator(device=ctx.device).manual_seed(seed_of(case.name))  # tensors on the device
    gen_host = torch.Generator().manual_seed(seed_of(case.name))  # the page order
    pages_per = (case.kv_len + case.page_size - 1) // case.page_size
    pool = case.batch * pages_per + 1
    buffer = random_tensor((pool, case.page_size, case.ckv_dim + case.kpe_dim), kv_dtype, ctx.device, gen)
    ckv, kpe = buffer[..., :case.ckv_dim], buffer[..., case.ckv_dim:]
    indices = torch.randperm(pool, generator=gen_host)[: case.batch * pages_per].to(torch.int32)
    indptr = (torch.arange(case.batch + 1) * pages_per).to(torch.int32)
    lens = torch.full((case.batch,), case.kv_len, dtype=torch.int32)
    tokens, causal = case.batch * case.q_len, case.q_len > 1
    q_nope = random_tensor((tokens, case.num_heads, case.ckv_dim), dtype, ctx.device, gen)
    q_pe = random_tensor((tokens, case.num_heads, case.kpe_dim), dtype, ctx.device, gen)
    out = torch.full((tokens, case.num_heads, case.ckv_dim), float("nan"), dtype=dtype, device=ctx.device)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8, device=ctx.device))
    scale = 1.0 / math.sqrt(192)
    qo_indptr = (torch.arange(case.batch + 1) * case.q_len).to(torch.int32)
    wrapper.plan(qo_indptr, indptr, indices, lens, case.num_heads, case.ckv_dim, case.kpe_dim, case.page_size, causal,
                 scale, dtype, kv_dtype)

    def fn():
        return wrapper.run(q_nope, q_pe, ckv, kpe, out=out, k_scale=k_scale, v_scale=v_scale)

    try:
        fn()
        ctx.sync()
        pages = indices[:pages_per].long().to(ctx.device)
        # gathered as bytes (indexing is defined for every dtype that way), then widened exactly
        first = buffer.view(torch.uint8)[pages].view(kv_dtype) if fp8 else buffer[pages]
        keys = first.float().reshape(-1, case.ckv_dim + case.kpe_dim)[: case.kv_len].unsqueeze(1)
        values = keys[..., : case.ckv_dim]
        q = torch.cat([q_nope[:case.q_len], q_pe[:case.q_len]], dim=-1)  # the first request's query tokens
        ref, _ = reference.single_attention(q, keys, values, causal=causal, sm_scale=scale, k_scale=k_scale,
                                            v_scale=v_scale)
        row["max_rel_err"] = rel_err([out[:case.q_len]], [ref])
        ctx.check_budget("timing")
        set_time(row, ctx.timer.measure(fn, ctx.measure_s), ctx, fn)
        seconds = row["time_us"] * 1e-6
        row["tflops"], row["tb_per_s"] = case.flops / seconds / 1e12, case.bytes / seconds / 1e12
        row["sdpa_na"] = "MLA"  # compared with FlashInfer's numbers and the targets (the note)
        kernel = ("the sm90 MLA kernel" if getattr(wrapper, "kernel", "prefill") == "sm90"
                  else "the paged prefill kernel at head dims 576/512")
        row["note"] = join_notes(join_notes(f"{row['tflops']:.4g} TFLOP/s, {row['tb_per_s']:.3g} TB/s", row["note"]), kernel)
        twin = ctx.plain_rows.get(case.twin) if case.twin else None
        if case.twin:
            if twin is None or twin.get("time_us") is None:
                row["baseline"] = {"name": case.twin, "error": "the twin row did not run"}
            else:  # per FLOP: the fp8 row has its twin's FLOPs, the multi-token rows more
                ratio = (case.flops / row["time_us"]) / (twin["flops"] / twin["time_us"])
                row["baseline"] = {"name": case.twin, "time_us": twin["time_us"], "speed_ratio": ratio,
                                   "what": "this row's FLOPs per second / the twin's (> 1: this row is faster)"}
                row["note"] = join_notes(row["note"], f"{ratio:.2f}x the FLOP rate of {case.twin}")
        if "flashinfer" in ctx.peers:
            tensors = (qo_indptr, indptr, indices, lens, q_nope, q_pe, ckv, kpe)
            row["peers"] = {"flashinfer": run_flashinfer_mla(case, tensors, out, ctx, row["time_us"])}
    except BudgetExceeded as exc:
        row["note"] = join_notes(row["note"], str(exc))
    ctx.plain_rows[case.name] = row  # an fp8 row compares itself with its bf16 twin
    return [row]


# --------------------------------------------------------------------------- #
# Orchestration
# --------------------------------------------------------------------------- #


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
        elif isinstance(case, Rope):
            rows = run_rope(case, ctx)
        elif isinstance(case, BlockSparse):
            rows = run_block_sparse(case, ctx)
        elif isinstance(case, Fp8Prefill):
            rows = run_fp8_prefill(case, ctx)
        elif isinstance(case, Mixed):
            rows = run_mixed(case, ctx)
        else:
            rows = run_jit(case, ctx)
    except Exception as exc:  # the row records it; the suite goes on
        rows = []
        for name in configs.row_names(case):
            row = new_row(case, name)
            row["status"] = "error"
            row["error"] = first_line(exc)
            row["traceback"] = traceback.format_exc(limit=6)
            rows.append(row)
        if isinstance(case, Attn) and not case.plain:
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
    # the knobs that choose kernels and tunings (JITATTN_PREFILL_FP8_UPCAST, JITATTN_DEV_SM90_TUNING, ...); not the
    # machine's paths
    paths = {"JITATTN_CACHE_DIR", "JITATTN_CACHE_PATH", "JITATTN_TEST_CACHE_DIR", "JITATTN_NVCC", "JITATTN_CXX"}
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("JITATTN_") and k not in paths}
    if knobs:
        info["knobs"] = knobs
    return info


def prebuild(cases: list[Case], target: str, jobs: int, log: Callable[[str], None]) -> tuple[dict, dict]:
    """Build every spec the cases load, in parallel; returns (summary, {spec: error})."""
    import jitattn

    specs = []
    for case in cases:
        try:
            specs += specs_of(case, target)
        except Exception as exc:  # an invalid spec shows up again as the row's error
            log(f"  (no spec for {case.name}: {first_line(exc)})")
    specs = list(dict.fromkeys(specs))
    started = time.perf_counter()
    results = jitattn.build_many(specs, jobs=jobs) if specs else []
    failed = {r.spec: error_summary(r.error) if r.error and r.error.strip() else "failed"
              for r in results if r.status == "failed"}
    summary = {"specs": len(results), "built": sum(r.status == "built" for r in results),
               "cached": sum(r.status == "cached" for r in results), "failed": {s.uri: e for s, e in failed.items()},
               "seconds": time.perf_counter() - started, "jobs": jobs}
    return summary, failed


def _device(opts) -> tuple[str, torch.device]:
    target = opts.target
    if target == "auto":
        target = "cuda" if torch.cuda.is_available() else "cpu"
    if target == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--target cuda: no CUDA device is visible here; use --target cpu (or auto)")
    return target, torch.device("cuda", torch.cuda.current_device()) if target == "cuda" else torch.device("cpu")


def _new_doc(opts, target: str, device: torch.device, measure_s: float, deadline_s: float) -> dict:
    """The run's JSON document before any row: arguments, environment, how every figure was measured."""
    return {
        "schema": SCHEMA, "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": target,
        "note": ("cuda target at full sizes" if target == "cuda" else
                 f"no CUDA device: the cpu target at small sizes (~1/{configs.CPU_SCALE} of the tokens, fewer "
                 "requests; same names); the GEMM ceiling is float32"),
        "args": {"suite": opts.suite, "only": opts.only, "quick": opts.quick, "measure_s": measure_s,
                 "case_budget_s": opts.case_budget, "deadline_s": deadline_s},
        "environment": environment(device),
        "method": {
            "timing": ("time_us: median of CUDA-event-timed calls after warm-up (events, not do_bench); before "
                       "each call read-only passes over 4x L2 evict L2 (every call reads its KV from DRAM) and keep "
                       "the GPU busy while the host enqueues the call, so host launch cost is hidden as under a "
                       "CUDA-graph replay (no graph is captured); plain_launch_us: wall time per call of 50 "
                       "back-to-back eager launches synchronised at the end (L2 warm, host cost included: what a "
                       "loop without graphs sees); index arrays are planned from the host (plan()), the "
                       "jit/fast_plan row from device arrays"
                       if target == "cuda" else "median of time.perf_counter()-timed calls after warm-up"),
            "speedup": "SDPA (or peer) time / jitattn time (> 1: jitattn is faster)",
            "peers": ("FlashInfer through its public wrappers, planned once on the same data, timed as jitattn"
                      if "flashinfer" in (getattr(opts, "peer", None) or ()) else "none (--peer flashinfer adds it)"),
            "host": "jit/* rows: host time per call from time.perf_counter() around calls without a device sync",
            "max_rel_err": "max|o - ref| / max|ref| vs jitattn.reference in float64, first 2 requests "
                           "(prefill: their last 128 queries)",
            "fraction": "bandwidth rows: rate / read_stream ceiling (ops/rope_*: / copy ceiling); compute rows: "
                        "rate / gemm ceiling",
        },
        "prebuild": None, "ceilings": None, "rows": [],
    }


def _prebuild_step(opts, cases: list[Case], target: str, doc: dict, log) -> dict:
    """Build every spec of ``cases`` in parallel first; returns the failed specs' errors by uri."""
    if opts.no_prebuild:
        return {}
    jobs = opts.jobs or min(16, os.cpu_count() or 1)
    doc["prebuild"], failed = prebuild(cases, target, jobs, log)
    pb = doc["prebuild"]
    log(f"pre-build: {pb['specs']} specs ({pb['built']} built, {pb['cached']} cached, {len(pb['failed'])} failed) "
        f"in {pb['seconds']:.1f} s with {jobs} jobs")
    for uri, err in pb["failed"].items():
        log(f"  FAILED {uri}: {err}")
    return failed


def _timer_and_ceilings(opts, target: str, device: torch.device, doc: dict, log) -> Timer:
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
            doc["ceilings"] = {"error": first_line(exc)}
    log(report.ceilings_line(doc["ceilings"]))
    return timer


def _run_cases(cases: list[Case], ctx: Context, doc: dict, opts, log, deadline_s: float) -> list[Case]:
    """Each case's rows into ``doc`` (written as they finish); returns the cases left when the CUDA context broke."""
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
            log(f"the CUDA context is unusable after {case.name}; running the {len(cases) - i - 1} remaining cases "
                "in a fresh process")
            return cases[i + 1:]
    return []


def run(opts) -> dict:
    """Run the selected cases; returns the JSON document (also written to ``opts.json`` as rows finish)."""
    t_start = time.monotonic()
    log = report.printer(opts)
    target, device = _device(opts)
    cases = configs.select(opts.suite, opts.only, opts.quick)
    if target == "cpu":
        cases = [c.small() for c in cases]
    measure_s = opts.measure_s if opts.measure_s else (
        (0.3 if opts.quick else 0.5) if target == "cuda" else (0.1 if opts.quick else 0.3))
    deadline_s = opts.deadline if opts.deadline else (100.0 if opts.quick else 210.0)
    doc = _new_doc(opts, target, device, measure_s, deadline_s)
    log(f"jitattn bench: target {target} ({doc['environment'].get('device')}); {len(cases)} cases; "
        f"{doc['note']}")
    failed = _prebuild_step(opts, cases, target, doc, log)
    timer = _timer_and_ceilings(opts, target, device, doc, log)
    ctx = Context(device=device, timer=timer, ceilings=doc["ceilings"], measure_s=measure_s,
                  case_budget_s=opts.case_budget, deadline=t_start + deadline_s, quick=opts.quick,
                  failed_specs=failed, peers=tuple(getattr(opts, "peer", None) or ()),
                  sdpa=not getattr(opts, "no_sdpa", False))
    remaining = _run_cases(cases, ctx, doc, opts, log, deadline_s)
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
    if getattr(opts, "no_sdpa", False):
        cmd.append("--no-sdpa")
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
        log(f"child run failed: {first_line(exc)}")
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

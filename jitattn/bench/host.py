"""Host-side rows: ``import jitattn``, cold builds and warm loads, ``run()`` overhead, ``plan()`` time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from .configs import Attn, Jit
from .rows import Context, new_row
from .inputs import (
    jit_decode_case, jitattn_fn, make_attn_data, plan_kwargs, pool_pages, random_page_table, specs_of,
)


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
    decode = jit_decode_case(case)
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
                                     decode.page_size, global_override_indptr_cpu=t.indptr, **plan_kwargs(decode))
        else:
            wrapper.plan(t.indptr, t.indices, t.last, decode.num_qo_heads, decode.num_kv_heads, decode.head_dim,
                         decode.page_size, **plan_kwargs(decode))

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
        # A process's first load also sets up what every later one reuses (the toolchain's identity, the template
        # environment): each kernel's warm load is timed second, in a process that loaded the other first.
        warm = _child_json(_LOAD_CHILD, args, env, min(120.0, ctx.time_left()))
        swapped = _child_json(_LOAD_CHILD, args[::-1], env, min(120.0, ctx.time_left()))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for kind, load in zip(("decode", "prefill"), cold["loads"]):
        rows.append(_host_row(case, f"jit/cold_build_{kind}", load["s"],
                              f"cold build: render + compile + link + publish + load, empty cache; {load['uri']}; "
                              f"fresh process (compiles there: {cold['compiles']})"))
    for kind, result in (("decode", swapped), ("prefill", warm)):  # (swapped: the prefill's load, then the decode's)
        (first, load), other = result["loads"], "prefill" if kind == "decode" else "decode"
        rows.append(_host_row(case, f"jit/warm_load_{kind}", load["s"],
                              f"warm load: render + key + checksum + dlopen, populated cache; {load['uri']}; the "
                              f"second load of a fresh process (its first, the {other}'s, took "
                              f"{first['s'] * 1e3:.1f} ms with the process's one-time setup; compiles there: "
                              f"{result['compiles']})"))
    return rows

"""The examples run end to end (on the GPU when one is visible, else on the cpu target)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import child_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("name", ["quickstart.py", "custom_variant.py", "serving_loop.py"])
def test_example_runs_and_matches_its_reference(name):
    proc = subprocess.run([sys.executable, str(EXAMPLES / name)], env=child_env(), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "error" in proc.stdout


@pytest.mark.parametrize("flags", [[], ["--no-cascade", "--rate", "200", "--chunk", "32"]], ids=["cascade", "flat"])
def test_serve_example_reports_its_measurements(flags, tmp_path):
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve.py"), "--device", "cpu", "--num-requests", "8",
                           "--json", str(out), *flags], env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for metric in ("output tokens/s", "TTFT", "TPOT", "KV saved at peak"):
        assert metric in proc.stdout
    import json

    results = json.loads(out.read_text())
    assert results["kv_bytes_saved_peak"] > 0 and results["prompt_tokens_reused"] > 0
    assert (results["cascade_steps"] > 0) == ("--no-cascade" not in flags)


def test_serve_example_p99_is_a_nearest_rank_percentile(tmp_path):
    """Two requests one at a time: the second waits for the first, so its TTFT is the larger and the p99 (by the
    nearest rank, the largest of fewer than 100) is above the mean (the index int(0.99 (n - 1)) took the smaller).
    A --json that is a directory is refused before the run."""
    out = tmp_path / "serve.json"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve.py"), "--device", "cpu", "--num-requests", "2",
                           "--max-batch-size", "1", "--output-len", "4", "--json", str(out)], env=child_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    import json

    results = json.loads(out.read_text())
    assert results["ttft_p99_ms"] > results["ttft_mean_ms"]
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve.py"), "--device", "cpu", "--json", str(tmp_path)],
                          env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "is a directory; give a file name" in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--num-pages", "100000000000"], "a KV pool of 100000000000 pages does not fit in cpu's memory"),
])
def test_serve_example_refuses_a_pool_that_does_not_fit(flags, message):
    """It ended in the allocator's traceback (a pool past the address space: refused whatever the overcommit)."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve.py"), "--device", "cpu", "--num-requests", "2",
                           *flags], env=child_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


def test_serve_example_under_torchrun_with_tensor_parallelism():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(EXAMPLES / "serve.py"), "--tp", "2", "--device", "cpu", "--num-requests", "6"],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tp 2" in proc.stdout and proc.stdout.count("output tokens/s") == 1  # rank 0 reports


def test_serve_bench_writes_one_table_with_the_tree_workload(tmp_path):
    """A prefix tree (--branches) on the cpu: the cascade rows reach three levels; the table has the on/off ratio."""
    out = tmp_path / "serving.md"
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve_bench.py"), "--out", str(out), "--device", "cpu",
                           "--num-requests", "6", "--system-prompt-len", "40", "--branches", "2", "--branch-len", "20",
                           "--output-len", "4"], env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| custom")]
    assert [(r[1], r[2]) for r in rows] == [("on", "off"), ("off", "off")]
    assert rows[0][4].endswith("x") and rows[0][10] == "3" and rows[1][10] == "0"
    assert float(rows[0][7]) > 0 and rows[0][8].endswith("x") and rows[1][8] == ""  # decode step ms, on / off
    assert rows[0][11] == "n/a"  # the roofline needs the cuda ceilings


def test_serve_bench_presets_and_roofline() -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import serve
        import serve_bench
    finally:
        sys.path.remove(str(EXAMPLES))
    assert set(serve_bench.PRESETS) == {"system-2k", "system-16k", "agent-fork", "no-sharing", "agent-fork-wide"}
    for flags in serve_bench.PRESETS.values():
        serve.parse_args(flags)  # every preset is valid serve.py input
    fork = serve.parse_args(serve_bench.PRESETS["agent-fork"])
    work = serve.workload(fork, 1000)
    prompts = [p for _, p, _ in work]
    assert len(work) == 128 and all(p[:8192] == prompts[0][:8192] for p in prompts)
    assert len({tuple(p[8192:8192 + 2048]) for p in prompts}) == 4  # four branches
    assert all(64 <= len(p) - 8192 - 2048 <= 256 for p in prompts)
    wide = [p for _, p, _ in serve.workload(serve.parse_args(serve_bench.PRESETS["agent-fork-wide"]), 1000)]
    assert len(wide) == 128 and len({tuple(p[32768:32768 + 512]) for p in wide}) == 32  # 32 branches of 4
    # 10 steps over 1 GB of weights and 1M KV tokens of 128 KiB at 4 TB/s: bytes bound the floor (1 GFLOP each)
    row = {"decode_s": 0.1, "dtype": "bfloat16", "decode_steps": 10, "weight_bytes": 10**9, "decode_kv_tokens": 10**6,
           "kv_bytes_per_token": 131072, "decode_tokens": 640, "decode_pairs": 640 * 8192,
           "attention_flops_per_pair": 4 * 32 * 128 * 32}
    ideal = (10 * 10**9 + 10**6 * 131072) / 4e12
    peaks = {"read_gbps": 4000.0, "gemm_tflops": 800.0}
    assert serve_bench.roofline_fraction(row, peaks) == pytest.approx(ideal / 0.1)
    # a cascade over the same tokens reading 1/100 of the KV: the attention's FLOPs (each query against its whole
    # context, 640 x 8192 pairs of 524k FLOPs) bound the floor now
    cascade = dict(row, decode_kv_tokens=10**4)
    flops = 2 * (10**9 // 2) * 640 + 640 * 8192 * 4 * 32 * 128 * 32
    assert flops / 800e12 > (10 * 10**9 + 10**4 * 131072) / 4e12
    assert serve_bench.roofline_fraction(cascade, peaks) == pytest.approx(flops / 800e12 / 0.1)
    assert serve_bench.roofline_fraction(row, None) is None
    with pytest.raises(SystemExit):  # --json is one serve.py run's file: each of the bench's runs would rewrite it
        serve_bench.main(["--out", "/tmp/b.md", "--device", "cpu", "--json", "/tmp/cuda/r.json"])
    # flags on the command line override the preset's, --prompt-len its --prompt-len-range too
    flags = serve_bench.with_overrides(serve_bench.PRESETS["no-sharing"], ["--prompt-len", "8", "--num-requests", "2"])
    parsed = serve.parse_args(flags)
    assert parsed.num_requests == 2 and parsed.prompt_len == 8 and "--prompt-len-range" not in flags


def test_serve_bench_sweeps_the_shared_prefix(tmp_path):
    """--sweep-prefix: one row per (request count, prefix, cascade on / off); the PNG where matplotlib is."""
    out, png = tmp_path / "sweep.md", tmp_path / "sweep.png"
    command = [sys.executable, str(EXAMPLES / "serve_bench.py"), "--out", str(out), "--sweep-prefix", "32,64",
               "--sweep-requests", "3", "--device", "cpu", "--plot", str(png)]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if not has_matplotlib:  # refused before the sweep (it used to say so after it, and exit 0)
        proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and "matplotlib is not installed" in proc.stderr and not out.exists()
        command = command[:-2]
    proc = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = [line.split(" | ") for line in out.read_text().splitlines() if line.startswith("| 3 |")]
    assert [(r[1], r[2]) for r in rows] == [("32", "on"), ("32", "off"), ("64", "on"), ("64", "off")]
    assert all(float(r[4]) > 0 for r in rows) and rows[0][6].endswith("x |")
    assert png.exists() == has_matplotlib and (not has_matplotlib or png.stat().st_size > 0)


def test_serve_bench_repeated_rows_are_medians_with_their_spread() -> None:
    sys.path.insert(0, str(EXAMPLES))
    try:
        import serve_bench
    finally:
        sys.path.remove(str(EXAMPLES))
    runs = [{"decode_s": s, "decode_steps": 10, "output_tokens_per_s": t, "tag": i}
            for i, (s, t) in enumerate([(0.30, 90.0), (0.10, 120.0), (0.20, 80.0)])]
    row = serve_bench.median_run(runs)
    assert row["tag"] == 2 and row["output_tokens_per_s"] == 90.0 and row["repeats"] == 3
    assert row["step_ms_range"] == pytest.approx((10.0, 30.0)) and row["tok_s_range"] == (80.0, 120.0)
    assert serve_bench.median_run(runs[:2])["tag"] == 1  # an even count: the lower middle run
    assert serve_bench._spread((1.0, 2.5), 2) == " (1.00-2.50)" and serve_bench._spread((3.0, 3.0), 2) == ""
    none = serve_bench.median_run([{"decode_s": 0.0, "decode_steps": 0, "output_tokens_per_s": 5.0}])
    assert none["step_ms_range"] is None


def test_serve_bench_refuses_no_runs(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve_bench.py"), "--out", str(tmp_path / "x.md"),
                           "--repeat", "0", "--device", "cpu"], env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "--repeat 0" in proc.stderr


@pytest.mark.parametrize("script, flags, message", [
    ("serve.py", ["--num-requests", "0"], "argument --num-requests: 0 must be >= 1"),
    ("serve.py", ["--page-size", "0"], "argument --page-size: 0 must be >= 1"),
    ("serve.py", ["--rate", "nan"], "argument --rate: nan must be a finite number >= 0"),
    ("serve.py", ["--dtype", "foo"], "argument --dtype: invalid choice"),
    ("serve.py", ["--layers", "0"], "argument --layers: 0 must be >= 1"),
    ("serve.py", ["--cascade-depth", "0"], "argument --cascade-depth: 0 must be >= 1"),  # named the engine's keyword
    ("serve.py", ["--device", "cpu", "--kv-memory-fraction", "5"],
     "argument --kv-memory-fraction: 5 must be in (0, 1]"),
    ("serve_bench.py", ["--out", "x.md", "--no-cascade"], "--no-cascade: the bench sets cascade and graphs per row"),
    ("serve_bench.py", ["--out", "x.md", "--sweep-prefix", "a,b"], "argument --sweep-prefix: invalid"),
    ("serve_bench.py", ["--out", "x.md", "--sweep-requests", "0"], "argument --sweep-requests: 0 must be >= 1"),
    ("serve_bench.py", ["--out", "no/such/dir/x.md", "--preset", "system-2k"], "dir does not exist; create it"),
    ("serve_bench.py", ["--out", "", "--preset", "system-2k"], "--out: the path is empty"),
    ("serve_bench.py", ["--out", ".", "--preset", "system-2k"], "--out .: is a directory; give a file name"),
    ("serve_bench.py", ["--out", "x.md", "--graphs"], "--graphs: the bench sets cascade and graphs per row"),
    ("serve_bench.py", ["--out", "x.md", "--plot", "p.png"], "--plot belongs to the sweep: give --sweep-prefix"),
    ("serve_bench.py", ["--out", "x.md", "--sweep-requests", "3"], "--sweep-requests belongs to the sweep"),
    ("serve_bench.py", ["--out", "x.md", "--sweep-prefix", "32", "--num-requests", "3"],
     "--num-requests: each sweep point sets the request count"),  # it overrode the point's, mislabelling the rows
    ("serve_bench.py", ["--out", "x.md", "--sweep-prefix", "32", "--output-len=4"], "--output-len=4: each sweep"),
    ("serve.py", ["--seed", "99999999999999999999"], "argument --seed: 99999999999999999999 must be in [0, 2^63)"),
])
def test_serving_examples_refuse_bad_flags_before_running(script, flags, message, tmp_path):
    """Each used to end in a raw traceback (an empty max(), a division by zero, torch's own messages) or to be
    ignored (--layers 0, a negative or NaN --rate), some only after the whole run."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / script), *flags], env=child_env(), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.parametrize("flags, message", [
    (["--system-prompt-len", "1000000000"], "would not fit in half this host's memory as token lists"),
    (["--num-requests", "1000000000"], "1000000000 requests of up to"),
    (["--page-size", "1000000000"], "the KV pool these requests need (4 pages of 1000000000 tokens"),
    (["--graphs"], "--graphs replays CUDA graphs of the decode step: it needs --device cuda"),
    (["--prompt-len-range", "0", "0"], "MAX >= 1 (a prompt has a token of its own)"),  # it became 1-token prompts
])
def test_serve_refuses_a_workload_the_host_cannot_hold_naming_the_flags(flags, message, tmp_path):
    """A billion-token prompt or a billion requests grew the process toward the memory's end with no output (the
    token lists were built first); a pool too large for memory was blamed on --num-pages, which was not given."""
    proc = subprocess.run([sys.executable, str(EXAMPLES / "serve.py"), "--device", "cpu", "--model", "tiny",
                           "--num-requests", "2", *flags], env=child_env(), capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "--num-pages 4" not in proc.stderr

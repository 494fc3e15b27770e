"""The examples run end to end (on the GPU when one is visible, else on the cpu target)."""

from __future__ import annotations

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


def test_serve_example_under_torchrun_with_tensor_parallelism():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(EXAMPLES / "serve.py"), "--tp", "2", "--device", "cpu", "--num-requests", "6"],
                          env=child_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "tp 2" in proc.stdout and proc.stdout.count("output tokens/s") == 1  # rank 0 reports

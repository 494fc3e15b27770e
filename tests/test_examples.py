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

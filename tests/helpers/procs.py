"""Run ``load_spec.py`` in child processes with a controlled environment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
LOAD_SPEC = Path(__file__).resolve().parent / "load_spec.py"

# Variables a child must not inherit from the test process unless a test sets them.
_SCRUB = ("JITATTN_CACHE_PATH", "JITATTN_ASSERT_NO_COMPILE", "JITATTN_CXX", "CXX", "JITATTN_LOG_LEVEL")


def child_env(**overrides: str | None) -> dict[str, str]:
    """os.environ (whose JITATTN_CACHE_DIR the fixtures set) with jitattn importable.

    ``overrides``: NAME=value sets a variable, NAME=None removes it.
    """
    env = dict(os.environ)
    for name in _SCRUB:
        env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", "1")
    for name, value in overrides.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


def load_command(spec, *extra: str) -> list[str]:
    return [sys.executable, str(LOAD_SPEC), json.dumps(spec.to_dict()), *extra]


def run_load(spec, *extra: str, env: dict[str, str] | None = None, timeout: float = 120) -> dict:
    """Load ``spec`` in a new process; returns its JSON report (fails the test on a non-zero exit)."""
    proc = subprocess.run(
        load_command(spec, *extra), env=env or child_env(), capture_output=True, text=True, timeout=timeout,
    )
    return parse_report(proc.returncode, proc.stdout, proc.stderr)


def parse_report(returncode: int, stdout: str, stderr: str) -> dict:
    assert returncode == 0, f"child failed (rc={returncode}):\n{stderr[-4000:]}"
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert lines, f"child printed no report:\nstdout={stdout!r}\nstderr={stderr[-2000:]}"
    return json.loads(lines[-1])


def load_at_once(spec, count: int, tmp_path: Path, *extra: str, timeout: float = 120) -> list[dict]:
    """Start ``count`` processes that load ``spec``, release them together, return their reports.

    Each child signals readiness with a file and waits for a shared "go" file, so
    the loads really race (the cache's lock must make exactly one of them build).
    """
    import time

    go = tmp_path / "go"
    children = []
    try:
        for i in range(count):
            ready = tmp_path / f"ready-{i}"
            proc = subprocess.Popen(load_command(spec, *extra, "--ready", str(ready), "--go", str(go)),
                                    env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            children.append((ready, proc))
        deadline = time.monotonic() + timeout
        while not all(ready.exists() for ready, _ in children):
            assert all(proc.poll() is None for _, proc in children), "a child died before the start signal"
            assert time.monotonic() < deadline, "children did not get ready"
            time.sleep(0.01)
        go.touch()  # all ask at once
        reports = []
        for _, proc in children:
            out, err = proc.communicate(timeout=timeout)
            reports.append(parse_report(proc.returncode, out, err))
        return reports
    finally:
        for _, proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

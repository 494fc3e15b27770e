"""A first run that works as written: the test suite's cache (reused when asked, cleaned up otherwise),
a clean import (numpy declared), and the README/CI commands the first run follows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from jitattn.jit import build_many
from jitattn.spec import VariantSpec

from helpers.procs import REPO, child_env

SPEC = VariantSpec("merge", "cpu", o_dtype="f32")

PROBE = '''
import json, os
import jitattn, jitattn.jit
from jitattn.spec import VariantSpec

def test_session_cache(tmp_path):
    jitattn.load(VariantSpec("merge", "cpu", o_dtype="f32"))
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps({"session": os.environ["JITATTN_CACHE_DIR"],
                            "compiles": jitattn.jit.compile_count()}) + "\\n")

def test_private_cache(fresh_cache):
    with open(os.environ["PROBE_OUT"], "a") as f:
        f.write(json.dumps({"private": os.environ["JITATTN_CACHE_DIR"]}) + "\\n")
'''


def _run_probe(tmp_path: Path, **env: str | None) -> tuple[dict, subprocess.CompletedProcess]:
    """Run a two-test file under this repo's tests/conftest.py in a new pytest process."""
    probe = tmp_path / "probe" / "test_probe.py"
    probe.parent.mkdir(exist_ok=True)
    probe.write_text(PROBE)
    out = tmp_path / "probe.jsonl"
    out.unlink(missing_ok=True)
    temp = tmp_path / "tmpdir"
    temp.mkdir(exist_ok=True)
    child = child_env(PROBE_OUT=str(out), TMPDIR=str(temp), **env)
    child["PYTHONPATH"] = os.pathsep.join([str(REPO / "tests"), child["PYTHONPATH"]])
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider",
         "--rootdir", str(probe.parent), str(probe)],
        env=child, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report: dict = {}
    for line in out.read_text().splitlines():
        report.update(json.loads(line))
    return report, proc


def test_the_suite_reuses_a_warmed_cache_when_asked(tmp_path, monkeypatch):
    warmed = tmp_path / "warmed"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(warmed))
    [result] = build_many([SPEC])
    assert result.status in ("built", "cached")
    report, proc = _run_probe(tmp_path, JITATTN_TEST_CACHE_DIR=str(warmed), JITATTN_CACHE_DIR=None)
    assert report["session"] == str(warmed)
    assert report["compiles"] == 0, "the warmed entry was rebuilt"
    assert report["private"] != str(warmed), "a test asking for a fresh cache got the shared one"
    assert warmed.is_dir() and "reused from JITATTN_TEST_CACHE_DIR" in proc.stdout


def test_the_temporary_cache_of_a_test_run_is_removed(tmp_path):
    report, proc = _run_probe(tmp_path, JITATTN_TEST_CACHE_DIR=None, JITATTN_CACHE_DIR=None)
    session = Path(report["session"])
    assert session.parent == tmp_path / "tmpdir" and session.name.startswith("jitattn-test-cache-")
    assert report["compiles"] == 1
    assert not session.exists(), "the suite left its temporary cache behind"
    assert list((tmp_path / "tmpdir").glob("jitattn-test-cache-*")) == []


def test_numpy_is_declared_and_import_prints_nothing():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(re.match(r"numpy\b", dep) for dep in project["dependencies"])
    proc = subprocess.run([sys.executable, "-c", "import jitattn, jitattn_cache.cli"], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_the_readme_gives_exact_torch_commands_and_ci_hands_its_warm_cache_to_the_tests():
    readme = (REPO / "README.md").read_text()
    assert "python3 -m pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in readme
    assert re.search(r"CUDA machine.*\n?.*`python3 -m pip install torch==2\.13\.0`", readme)
    assert "JITATTN_TEST_CACHE_DIR" in readme and "JITATTN_DEBUG" in readme
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    warm = next(i for i, line in enumerate(ci) if line.startswith("jitattn-cache warm"))
    reuse = next(i for i, line in enumerate(ci) if "JITATTN_TEST_CACHE_DIR=" in line)
    tests = next(i for i, line in enumerate(ci) if line.startswith("python3 -m pytest"))
    assert warm < reuse < tests
    assert any("wall time" in line for line in ci)


def test_every_package_of_the_source_tree_ships_in_the_wheel():
    """pyproject lists its packages by hand: a new folder of modules left off it imports in a source checkout and
    an editable install, and is missing from a built wheel."""
    packages = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(init.parent.relative_to(REPO).parts) for top in ("jitattn", "jitattn_cache")
               for init in (REPO / top).rglob("__init__.py")}
    assert on_disk <= packages, f"not in pyproject's [tool.setuptools] packages: {sorted(on_disk - packages)}"

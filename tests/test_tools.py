"""The developer tools under tools/ refuse bad input with a message before doing work, and never destroy what
they would replace (each case once ended in a traceback, a silent wrong table, or an overwritten archive)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.procs import child_env

TOOLS = Path(__file__).resolve().parents[1] / "tools"


def _tool(name: str, *args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOLS / name), *args], env={**child_env(), **(env or {})},
                          capture_output=True, text=True, timeout=timeout)


def test_ncu_stalls_names_a_file_it_cannot_read(tmp_path) -> None:
    (tmp_path / "one.csv").write_text("x\n")
    for path, message in ((tmp_path / "missing.csv", "No such file"), (tmp_path / "one.csv", "not an ncu source")):
        proc = _tool("ncu_stalls.py", str(path))
        assert proc.returncode == 1 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_sass_stats_checks_its_arguments_before_compiling(tmp_path) -> None:
    (tmp_path / "file").write_text("x")
    for args, message in ((["--jobs", "0"], "--jobs 0: give at least 1"),
                          (["--against", str(tmp_path / "none")], "no such directory"),
                          ([], "a file; name a directory")):
        out = str(tmp_path / ("file" if not args else "out"))
        proc = _tool("sass_stats.py", out, *args)
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_prebuild_cache_keeps_the_archive_when_nothing_builds(tmp_path) -> None:
    archive = tmp_path / "good.tar.xz"
    archive.write_bytes(b"an earlier archive")
    proc = _tool("prebuild_cache.py", str(archive), "--bench", "nosuch", env={"JITATTN_CUDA_ARCH_LIST": "9.0a"})
    assert proc.returncode == 1 and "left as it was" in proc.stderr and archive.read_bytes() == b"an earlier archive"
    for args, message in (([str(tmp_path / "no" / "x.tar.xz")], "name an archive in an existing directory"),
                          ([str(archive), "tests/nosuch.py"], "tests/nosuch.py: no such file"),
                          ([str(archive), "--env", "FOO"], "give NAME=VALUE")):
        proc = _tool("prebuild_cache.py", *args, env={"JITATTN_CUDA_ARCH_LIST": "9.0a"})
        assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the message of a machine without CUDA")
def test_host_peer_says_it_needs_cuda() -> None:
    proc = subprocess.run([sys.executable, "-m", "jitattn.bench.host_peer"], env=child_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "none is visible here" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "jitattn.bench.host_peer", "--help"], env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: python -m jitattn.bench.host_peer" in proc.stdout


def test_profile_plan_names_an_unknown_kind() -> None:
    proc = _tool("profile_plan.py", env={"KIND": "foo", "DEV": "cpu"}, timeout=120)
    assert proc.returncode == 1 and "KIND='foo': give KIND=decode" in proc.stderr, proc.stderr


def test_prebuild_cache_takes_test_paths_from_the_working_directory(tmp_path) -> None:
    (tmp_path / "test_here.py").write_text("GPU_SPECS = []\n")
    proc = subprocess.run([sys.executable, str(TOOLS / "prebuild_cache.py"), "out.tar.xz", "test_here.py"],
                          env={**child_env(), "JITATTN_CUDA_ARCH_LIST": "9.0a"}, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    # found (not "no such file"), loaded in the child (which runs from the repository root), nothing to build
    assert proc.returncode == 1 and "no kernel built" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out.tar.xz").exists()


def test_tools_without_arguments_print_their_usage() -> None:
    for name in ("gen_wgmma.py", "profile_plan.py"):
        proc = _tool(name, "--help", timeout=120)
        assert proc.returncode == 0 and "python3 tools/" in proc.stdout, (name, proc.stdout)
        proc = _tool(name, "--bogus", timeout=120)
        assert proc.returncode == 2 and "python3 tools/" in proc.stdout, (name, proc.stdout)


def test_profile_plan_names_an_unknown_sort() -> None:
    proc = _tool("profile_plan.py", env={"SORT": "bogus", "DEV": "cpu"}, timeout=120)
    assert proc.returncode == 1 and "SORT='bogus': give one of" in proc.stderr and "tottime" in proc.stderr


def test_sass_loop_says_nvdisasm_is_missing(tmp_path) -> None:
    (tmp_path / "k.cubin").write_bytes(b"not a cubin")
    proc = _tool("sass_loop.py", str(tmp_path / "k.cubin"), env={"PATH": str(Path(sys.executable).parent)})
    assert proc.returncode == 1 and "nvdisasm" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_bench_settings_fails_when_nothing_was_timed(tmp_path) -> None:
    proc = _tool("bench_settings.py", str(tmp_path / "ab.json"), "", "X=1", "--only", "nosuch", "--rounds", "1")
    assert proc.returncode == 1 and "no setting timed any row" in proc.stderr, proc.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the message of a machine without CUDA")
def test_sweep_decode_split_says_it_needs_cuda() -> None:
    proc = _tool("sweep_decode_split.py", timeout=120)
    assert proc.returncode == 2 and "no CUDA device here" in proc.stderr, proc.stderr

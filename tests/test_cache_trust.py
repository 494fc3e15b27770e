"""The cache's one trust rule (jitattn.jit.trust), on every path that builds, writes or loads.

Every directory from the cache root down to an entry (and locks/, tmp/, the
private build dir) must be owned by the user (or root) and not writable by
group or others. The same rule refuses a cold build, a warm load in a new
process, and is what ``doctor`` and ``verify`` report, each violation with the
command that fixes it.
"""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

import jitattn
from jitattn.jit import CacheError, build_many, compile_count
from jitattn.jit import trust
from jitattn.jit.key import SCHEMA, build_inputs
from jitattn.spec import VariantSpec
from jitattn_cache.cli import main

from helpers.procs import child_env, load_command

SPEC = VariantSpec("merge", "cpu", o_dtype="bf16")
# Paths under the cache root that the rule covers, relative to it.
PLACES = ["", SCHEMA, f"{SCHEMA}/tmp", f"{SCHEMA}/locks"]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _make_world_writable(path: Path) -> None:
    path.chmod(stat.S_IMODE(path.stat().st_mode) | stat.S_IWOTH)


def _run_fix(message: str, path: Path) -> None:
    """Run the fix command the message gives for ``path`` (it must work when pasted)."""
    commands = [line.split("fix:", 1)[1].strip() for line in message.splitlines() if "fix:" in line]
    matching = [c for c in commands if shlex.split(c)[-1] == str(path)]
    assert matching, f"no fix command for {path} in:\n{message}"
    subprocess.run(matching[0], shell=True, check=True)


@pytest.mark.parametrize("place", PLACES, ids=["root", "schema", "tmp", "locks"])
def test_a_world_writable_dir_is_refused_before_a_cold_build(place, fresh_cache):
    build_inputs(SPEC)  # renders; creates nothing
    (fresh_cache / SCHEMA / "tmp").mkdir(parents=True)
    (fresh_cache / SCHEMA / "locks").mkdir()
    target = fresh_cache / place
    _make_world_writable(target)
    before = compile_count()
    with pytest.raises(CacheError) as info:
        jitattn.load(SPEC)
    message = str(info.value)
    assert f"{target} is writable by other users" in message
    assert f"chmod go-w {target}" in message
    assert compile_count() == before, "nothing may be compiled into an untrusted cache"
    assert not (fresh_cache / SCHEMA / build_inputs(SPEC).name).exists()
    _run_fix(message, target)
    jitattn.load(SPEC)  # the printed fix is enough


@pytest.mark.parametrize("place", PLACES, ids=["root", "schema", "tmp", "locks"])
def test_a_world_writable_dir_is_refused_on_the_load_path_too(place, fresh_cache):
    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    target = fresh_cache / place
    _make_world_writable(target)
    proc = subprocess.run(load_command(SPEC), env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, "a new process loaded a kernel from an untrusted cache"
    assert f"{target} is writable by other users" in proc.stderr and f"chmod go-w {target}" in proc.stderr


def test_an_entry_dir_owned_by_another_user_is_refused_with_the_chown(fresh_cache):
    if os.geteuid() != 0:
        pytest.skip("giving a directory to another user needs root")
    [result] = build_many([SPEC])
    entry = fresh_cache / SCHEMA / build_inputs(SPEC).name
    os.chown(entry, 4321, 4321)
    jitattn.jit._registry.clear()
    with pytest.raises(CacheError) as info:
        jitattn.load(SPEC)
    assert f"{entry} is owned by uid 4321" in str(info.value)
    _run_fix(str(info.value), entry)
    jitattn.load(SPEC)


def test_the_private_build_dir_is_checked_before_anything_is_written_into_it(fresh_cache, monkeypatch):
    import tempfile

    real_mkdtemp = tempfile.mkdtemp
    made = []

    def permissive_mkdtemp(*args, **kwargs):
        path = real_mkdtemp(*args, **kwargs)
        os.chmod(path, 0o777)  # as if another user had been able to prepare it
        made.append(Path(path))
        return path

    monkeypatch.setattr(tempfile, "mkdtemp", permissive_mkdtemp)
    with pytest.raises(CacheError) as info:
        jitattn.load(SPEC)
    assert made and f"{made[0]} is writable by other users" in str(info.value)
    assert not made[0].exists(), "the refused build dir is removed"
    assert not (fresh_cache / SCHEMA / build_inputs(SPEC).name).exists()


@pytest.mark.parametrize("place", [SCHEMA, f"{SCHEMA}/tmp"], ids=["schema", "tmp"])
def test_doctor_and_verify_report_each_violation_with_its_fix(place, fresh_cache, monkeypatch, capsys):
    for name in ("JITATTN_MAX_JOBS", "MAX_JOBS", "JITATTN_CUDA_ARCH_LIST", "JITATTN_NVCC"):
        monkeypatch.delenv(name, raising=False)
    [result] = build_many([SPEC])
    assert result.status == "built"
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 0 and "UNSAFE" not in out
    target = fresh_cache / place
    entry = fresh_cache / SCHEMA / build_inputs(SPEC).name
    _make_world_writable(target)
    _make_world_writable(entry)
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 1
    for path in (target, entry):
        assert f"UNSAFE {path}: {path} is writable by other users" in out
        assert f"fix: chmod go-w {path}" in out
    assert "2 unsafe path(s)" in out
    rc, out, _ = _cli(capsys, "doctor")
    assert rc == 1
    lines = [line for line in out.splitlines() if "unsafe:" in line]
    assert any(str(target) in line for line in lines) and any(str(entry) in line for line in lines), out
    assert f"fix: chmod go-w {target}" in out and f"fix: chmod go-w {entry}" in out
    for path in (target, entry):
        _run_fix(out, path)
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 0 and "UNSAFE" not in out


def test_violations_lists_owner_and_mode_problems_of_each_path_once(tmp_path):
    root = tmp_path / "root"
    leaf = root / "a" / "b"
    leaf.mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    (root / "a").chmod(0o700)
    assert trust.chain_violations(root, leaf, root / "a") == []
    (root / "a").chmod(0o775)
    found = trust.chain_violations(root, leaf, root / "a")
    assert [v.path for v in found] == [root / "a"]
    assert found[0].fix == f"chmod go-w {root / 'a'}"
    (root / "a").chmod(0o1777)  # a shared sticky directory such as /tmp: a private directory under it, no chmod
    [sticky] = trust.chain_violations(root, leaf, root / "a")
    assert "chmod" not in sticky.fix and "mkdir -m 700" in sticky.fix and str(root / "a") in sticky.fix
    (root / "a").chmod(0o700)
    link = root / "link"
    link.symlink_to(leaf)
    assert "symbolic link" in trust.violations(link)[0].reason
    assert trust.violations(link, follow_links=True) == []


def test_an_entry_on_an_unsafe_path_is_never_loaded_nor_exported(fresh_cache, monkeypatch, capsys, tmp_path):
    """verify used to load every entry's library to check it (running its constructors as you) even one it had
    just listed as UNSAFE, info called it ok, and an export of the whole cache bundled it (an import elsewhere
    then trusted it); an export naming it by spec already refused it."""
    import jitattn.jit.admin as admin

    [result] = build_many([SPEC])
    assert result.status == "built"
    entry = fresh_cache / SCHEMA / build_inputs(SPEC).name
    _make_world_writable(entry)
    loaded = []
    real = admin.library_problem
    monkeypatch.setattr(admin, "library_problem", lambda path, uri: loaded.append(path) or real(path, uri))
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 1 and not loaded
    assert f"BAD {entry}: on an unsafe path ({entry}: {entry} is writable by other users" in out
    assert "--fix removes" not in out and "1 of them need a permission fix (above), not a removal" in out
    rc, out, _ = _cli(capsys, "info", SPEC.uri)
    assert rc == 1 and f"status: BAD: on an unsafe path ({entry}: {entry} is writable by other users" in out
    bundle = tmp_path / "b.tar.gz"
    rc, _, err = _cli(capsys, "export", str(bundle))
    assert rc == 1 and f"{entry}: on an unsafe path" in err and not bundle.exists()
    rc, out, _ = _cli(capsys, "verify", "--fix")  # a permission problem: reported with its fix, the entry kept
    assert rc == 1 and f"fix: chmod go-w {entry}" in out and "not removed: a permission problem" in out
    assert (entry / "manifest.json").exists() and not loaded
    entry.chmod(0o755)
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 0 and loaded  # safe again: loaded and checked


@pytest.mark.parametrize("place", [SCHEMA, f"{SCHEMA}/locks"], ids=["schema", "locks"])
def test_a_file_where_a_cache_directory_belongs_is_named_with_its_fix(place, fresh_cache, capsys):
    """doctor and verify name a file in a cache directory's place with its fix (they stopped at 'Not a directory'),
    a build says the same, and clear does not report success over it."""
    target = fresh_cache / place
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text("")
    for command in ("doctor", "verify"):
        rc, message, err = _cli(capsys, command)
        assert rc == 1 and f"{target} is in the jitattn cache's way: it exists but is not a directory" in message, \
            message + err
    with pytest.raises(CacheError, match="is in the jitattn cache's way"):
        jitattn.jit.load(SPEC)
    if place == SCHEMA:
        rc, out, err = _cli(capsys, "clear")
        assert rc == 1 and f"{target} is in the jitattn cache's way" in err and "removed" not in out
    _run_fix(message, target)
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 0 and "UNSAFE" not in out

"""`jitattn-cache` behaviours a user leans on: honest counts under concurrency, a Ctrl-C that stops
at once, --version, the `list` alias, and invalid settings flagged where they are shown."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import jitattn
from jitattn.jit.key import SCHEMA
from jitattn.jit.cache import entry_dirs
from jitattn_cache.cli import main

from helpers.procs import child_env

SPECS = ["merge_cpu_bf16", "append_cpu_bf16"]


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _gated_compiler(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A c++ wrapper whose compile steps record their pid in ``started/`` and wait for ``go`` (60 s at most)."""
    gxx = shutil.which("g++") or shutil.which("c++")
    started, go = tmp_path / "started", tmp_path / "go"
    started.mkdir()
    wrapper = tmp_path / "gated-c++"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -c "*) touch "{started}/$$"; i=0; '
        f'while [ ! -e "{go}" ] && [ $i -lt 600 ]; do sleep 0.1; i=$((i+1)); done ;; esac\n'
        f'exec "{gxx}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper, started, go


def _warm(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jitattn_cache", "warm", "-q", *argv], env=env,
                            stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, start_new_session=True)


def _wait_for(condition, what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def test_concurrent_warms_report_built_by_me_versus_built_by_another_process(fresh_cache, tmp_path):
    wrapper, started, go = _gated_compiler(tmp_path)
    env = child_env(JITATTN_CXX=str(wrapper), JITATTN_LOG_LEVEL="info")
    builder = _warm(["--spec", SPECS[0]], env, tmp_path / "builder.log")
    _wait_for(lambda: any(started.iterdir()), "the first warm to reach its compiler")
    waiters = [_warm(["--spec", SPECS[0]], env, tmp_path / f"waiter{i}.log") for i in range(3)]
    _wait_for(lambda: all("waiting for another process" in (tmp_path / f"waiter{i}.log").read_text()
                          for i in range(3)), "the other warms to wait for the build lock")
    go.touch()
    outputs = [p.communicate(timeout=120)[0] for p in [builder, *waiters]]
    assert [p.returncode for p in [builder, *waiters]] == [0] * 4, outputs
    assert "1 built, 0 already cached" in outputs[0] and "another process" not in outputs[0]
    for out in outputs[1:]:
        assert "0 built, 1 built by another process meanwhile, 0 already cached, 0 failed" in out, out
    assert len(list(started.iterdir())) == 1, "exactly one compile"


@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_to_warm_stops_the_compilers_and_exits_within_a_second(stop, fresh_cache, tmp_path):
    wrapper, started, go = _gated_compiler(tmp_path)
    env = child_env(JITATTN_CXX=str(wrapper))
    proc = _warm(["-j", "2", *[a for s in SPECS for a in ("--spec", s)]], env, tmp_path / "warm.log")
    try:
        _wait_for(lambda: len(list(started.iterdir())) == 2, "two compiles to be running")
        compilers = [int(p.name) for p in started.iterdir()]
        sent = time.monotonic()
        os.kill(proc.pid, stop)  # the warm process only, not its process group
        proc.communicate(timeout=30)
        seconds = time.monotonic() - sent
    finally:
        go.touch()  # never leave a wrapper waiting if the test fails
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = (tmp_path / "warm.log").read_text()
    assert proc.returncode == 130, err
    print(f"warm stopped {seconds:.2f} s after {stop.name}")
    assert seconds < 1.5, f"warm took {seconds:.1f} s to stop after {stop.name}"
    assert "stopped 2 running compile(s)" in err
    for pid in compilers:
        try:
            state = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            continue
        assert "State:\tZ" in state, f"compiler {pid} still runs after the interrupt"
    time.sleep(0.5)  # had the builds gone on, their compiler would have published by now
    assert entry_dirs(fresh_cache / SCHEMA) == [], "an interrupted build was published"
    assert list((fresh_cache / SCHEMA / "tmp").iterdir()) == []
    failed = fresh_cache / SCHEMA / "failed"
    assert not failed.exists() or not any(failed.iterdir())


def test_version_and_the_list_alias(fresh_cache, capsys):
    rc, out, _ = _cli(capsys, "--version")
    assert rc == 0 and out.strip() == f"jitattn-cache (jitattn) {jitattn.__version__}"
    rc, out, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0])
    assert rc == 0
    rc, listed, _ = _cli(capsys, "list")
    rc2, ls, _ = _cli(capsys, "ls")
    assert rc == rc2 == 0 and listed == ls and SPECS[0] in listed and "1 entries" in listed


@pytest.mark.parametrize("field, value", [("uri", 5), ("target", None), ("archs", 5), ("machine", 7),
                                          ("built_at", 3), ("built_at", "9999-12-31T23:59:59-05:00"),
                                          ("built_at", "0001-01-01T00:00:00+05:00")])
def test_ls_lists_an_entry_whose_manifest_holds_odd_types(field, value, fresh_cache, capsys):
    import json

    rc, _, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0])
    manifest = entry_dirs(fresh_cache / SCHEMA)[0] / "manifest.json"
    data = json.loads(manifest.read_text())
    data[field] = value
    if field == "archs":
        data["target"] = "cuda"
    manifest.write_text(json.dumps(data))
    rc, out, err = _cli(capsys, "ls")
    assert rc == 0 and SPECS[0] in out and "1 entries" in out, (out, err)
    rc, out, err = _cli(capsys, "ls", "--json")
    assert rc == 0 and [e["uri"] for e in json.loads(out)] == [SPECS[0]], (out, err)


@pytest.mark.parametrize("name, value, wrong", [
    ("MAX_JOBS", "abc", "is not a positive integer"),
    ("JITATTN_MAX_JOBS", "0", "is not a positive integer"),
    ("JITATTN_CUDA_ARCH_LIST", "9.0a;sm90", "'sm90' is not an arch"),
    ("JITATTN_CUDA_ARCH_LIST", "7.0", "'7.0' is older than the kernels' sm_80"),
    ("JITATTN_CUDA_ARCH_LIST", ";;", "';;' names no arch"),  # nvcc's default arch without -gencode
    ("JITATTN_LOG_LEVEL", "verbose", "is not a level jitattn knows"),
    ("JITATTN_ASSERT_NO_COMPILE", "maybe", "is neither on nor off"),
    ("JITATTN_DEBUG", "2", "is neither on nor off"),
])
def test_show_config_and_doctor_flag_an_invalid_setting(name, value, wrong, fresh_cache, monkeypatch, capsys):
    for other in ("MAX_JOBS", "JITATTN_MAX_JOBS", "JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST",
                  "JITATTN_LOG_LEVEL", "JITATTN_ASSERT_NO_COMPILE", "JITATTN_DEBUG", "JITATTN_NVCC"):
        monkeypatch.delenv(other, raising=False)
    rc, out, _ = _cli(capsys, "show-config")
    assert rc == 0 and "INVALID" not in out
    monkeypatch.setenv(name, value)
    rc, out, err = _cli(capsys, "show-config")
    assert rc == 1
    flagged = [line for line in out.splitlines() if "INVALID" in line]
    assert len(flagged) == 1 and f"{name}={value!r}" in flagged[0] and wrong in flagged[0], out
    assert "1 invalid setting" in err
    rc, out, _ = _cli(capsys, "doctor")
    assert rc == 1
    line = next(line for line in out.splitlines() if "invalid setting" in line)
    assert "FAIL" in line and f"{name}={value!r}" in line and wrong in line


def test_a_cache_dir_of_an_unknown_users_home_is_an_invalid_setting(monkeypatch, capsys):
    """JITATTN_CACHE_DIR=~nosuchuser/x: pathlib's 'Could not determine home directory' came as a traceback from
    every load and every command, show-config and doctor included."""
    import jitattn.jit
    from jitattn.spec import VariantSpec

    monkeypatch.setenv("JITATTN_CACHE_DIR", "~jitattn_no_such_user/x")
    rc, out, err = _cli(capsys, "show-config")
    assert rc == 1 and "names no user" in out and "1 invalid setting" in err
    rc, out, err = _cli(capsys, "doctor")
    assert rc != 0 and "names no user" in out + err
    jitattn.jit._registry.clear()
    with pytest.raises(jitattn.jit.CacheError, match="JITATTN_CACHE_DIR=.*names no user here; give the path"):
        jitattn.jit.load(VariantSpec("merge", "cpu", o_dtype="f32"))


@pytest.mark.parametrize("under", ["", "sub"], ids=["the-file", "under-the-file"])
def test_a_cache_dir_at_or_under_a_file_is_refused_by_every_command(under, tmp_path, monkeypatch, capsys):
    """ls said '0 entries', clear 'removed 0 entries' and verify gave a bare 'Not a directory' for a cache dir that
    is (or is under) a regular file; each now says what is wrong, as a load does."""
    import jitattn.jit
    from jitattn.spec import VariantSpec

    afile = tmp_path / "afile"
    afile.write_text("")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(afile / under) if under else str(afile))
    for command in ("ls", "verify", "clear"):
        rc, out, err = _cli(capsys, command)
        assert rc != 0 and ("is not a directory" in err or "is a file" in err), (command, out, err)
    rc, out, err = _cli(capsys, "warm", "--spec", SPECS[0], "--spec", SPECS[1])
    assert rc == 2 and err.count("JITATTN_CACHE_DIR") == 1 and "failed" not in out + err, (out, err)
    jitattn.jit._registry.clear()
    with pytest.raises(jitattn.jit.CacheError, match="JITATTN_CACHE_DIR"):
        jitattn.jit.load(VariantSpec("merge", "cpu", o_dtype="f32"))


def test_the_writable_cache_named_in_cache_path_too_is_listed_once(fresh_cache, monkeypatch, capsys):
    rc, _, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0])
    monkeypatch.setenv("JITATTN_CACHE_PATH", os.pathsep.join([str(fresh_cache), str(fresh_cache)]))
    rc, out, err = _cli(capsys, "ls")
    assert rc == 0 and out.count(SPECS[0]) == 1 and "1 entries" in out and " rw" in out, (out, err)


@pytest.mark.parametrize("argv, message", [
    (["prune", "--older-than", "1000000000d"], "is too long"),
    (["warm", "--preset", "llama-3-8b", "--arch", "7.0", "--dry-run"], "older than the kernels' sm_80"),
])
def test_out_of_range_arguments_are_usage_errors(argv, message, fresh_cache, capsys):
    """A duration past timedelta's range ended in an OverflowError traceback; an arch below the kernels' was
    listed as cold specs that every build then failed."""
    rc, _, err = _cli(capsys, *argv)
    assert rc == 2 and message in err and "Traceback" not in err


def test_a_reader_that_stops_reading_ends_the_cli_quietly(fresh_cache):
    """`jitattn-cache presets | head -1`: exit 0, no "Broken pipe" line (what was read had been printed)."""
    cli = subprocess.Popen([sys.executable, "-m", "jitattn_cache", "presets"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, env=child_env())
    cli.stdout.close()  # the reader is gone before the first line
    err = cli.stderr.read().decode()
    assert cli.wait(timeout=60) == 0 and "Broken pipe" not in err, err


def test_export_refuses_a_pipe_or_device_it_would_replace(fresh_cache, tmp_path, capsys):
    fifo = tmp_path / "bundle"
    os.mkfifo(fifo)
    rc, _, err = _cli(capsys, "export", str(fifo))
    assert rc == 2 and "not a regular file" in err and fifo.is_fifo()


@pytest.mark.parametrize("kind", ["dangling link", "file"])
def test_doctor_names_a_cache_dir_that_is_a_dangling_link_or_a_file(kind, tmp_path, monkeypatch, capsys):
    root = tmp_path / "cache"
    if kind == "file":
        root.write_text("")
    else:
        root.symlink_to(tmp_path / "nowhere")
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    _, out, _ = _cli(capsys, "doctor")
    line = next(line for line in out.splitlines() if "cache dir" in line)
    assert "FAIL" in line and ("symbolic link to nothing" if kind != "file" else "is not a directory") in line
    assert "chmod" not in out


def test_a_json_spec_that_is_not_an_object_is_named_as_such(fresh_cache, capsys):
    rc, _, err = _cli(capsys, "warm", "--dry-run", "--spec", "[1]")
    assert rc == 2 and "must be one JSON object" in err


@pytest.mark.parametrize("value, message", [
    ("   ", "is blank"),
    ("/tmp/" + "a" * 300, "is too long for the file system"),
    ("loop", "a symbolic link to nothing (a dangling link or a loop)"),
], ids=["blank", "too-long", "link-loop"])
def test_an_unusable_cache_dir_setting_is_named_before_any_use(value, message, tmp_path, monkeypatch, capsys):
    """A blank JITATTN_CACHE_DIR made a directory named by spaces in the working directory; a name too long for the
    file system raised OSError from inside the setting's own check (ls exited 0); a link loop got chmod advice; warm
    exited 2 on it, ls / verify / clear 1."""
    import jitattn.jit
    from jitattn.spec import VariantSpec

    if value == "loop":
        value = str(tmp_path / "loop")
        os.symlink(value, value)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JITATTN_CACHE_DIR", value)
    rc, out, err = _cli(capsys, "show-config")
    assert rc == 1 and message in out and "1 invalid setting" in err
    for argv in (["ls"], ["verify"], ["clear"], ["prune", "--max-size", "1G"], ["info", "x"],
                 ["warm", "--dry-run", "--preset", "llama-3-8b", "--target", "cpu"]):
        rc, out, err = _cli(capsys, *argv)  # every command the same way: a bad setting (ls and clear exited 1)
        assert rc == 2 and message in err and "Traceback" not in err, (argv, rc, err)
    jitattn.jit._registry.clear()
    with pytest.raises(jitattn.jit.CacheError, match=re.escape(message)):
        jitattn.jit.load(VariantSpec("merge", "cpu", o_dtype="f32"))
    assert sorted(p.name for p in tmp_path.iterdir()) == (["loop"] if "loop" in message else [])


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_a_config_or_spec_file_that_is_not_a_regular_file_is_refused(kind, fresh_cache, tmp_path):
    """A FIFO given to --config or --spec @FILE blocked forever; /dev/zero read until memory ran out."""
    path = "/dev/zero"
    if kind == "fifo":
        path = str(tmp_path / "fifo")
        os.mkfifo(path)
    for argv in (["--config", path, "--target", "cpu"], ["--spec", "@" + path]):
        cli = subprocess.run([sys.executable, "-m", "jitattn_cache", "warm", "--dry-run", *argv], capture_output=True,
                             text=True, timeout=60, env=child_env())
        assert cli.returncode == 2 and "not a regular file" in cli.stderr, (argv, cli.stderr)


def test_import_refuses_a_blank_destination(fresh_cache, tmp_path, monkeypatch, capsys):
    """`import B --to ''` imported into ./v1 of the working directory."""
    rc, _, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0])
    bundle = tmp_path / "b.tar.gz"
    rc, _, err = _cli(capsys, "export", str(bundle), "--spec", SPECS[0])
    assert rc == 0, err
    monkeypatch.chdir(tmp_path)
    rc, _, err = _cli(capsys, "import", str(bundle), "--to", "")
    assert rc == 2 and "is blank" in err and not (tmp_path / SCHEMA).exists()


def test_verify_fix_reports_an_entry_it_cannot_remove_and_checks_the_rest(fresh_cache, monkeypatch, capsys):
    """An entry whose directory refused the removal ended verify --fix with a bare errno line and no summary."""
    import jitattn.jit.admin as admin

    rc, _, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0], "--spec", SPECS[1])
    for entry in entry_dirs(fresh_cache / SCHEMA):
        (entry / "manifest.json").write_text("[1, 2]")  # both bad

    def refuse(base, path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(admin, "remove_entry", refuse)
    rc, out, err = _cli(capsys, "verify", "--fix")
    assert rc == 1 and out.count("BAD ") == 2 and out.count("not removed: Permission denied") == 2, (out, err)
    assert "2 bad, 0 removed" in out


def test_prune_counts_entries_without_a_readable_manifest_apart(fresh_cache, capsys):
    """prune said '0 entries, 0 B left' over an entry whose manifest was missing."""
    rc, _, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0])
    (entry_dirs(fresh_cache / SCHEMA)[0] / "manifest.json").unlink()
    rc, out, err = _cli(capsys, "prune", "--max-size", "0")
    assert rc == 0 and "not counted: 1 entries without a readable manifest" in err and "verify --fix" in err


def test_doctor_names_a_schema_directory_a_build_cannot_write(fresh_cache, monkeypatch, capsys):
    """doctor said 0 problems while v1/locks refused every build's lock (os.access: root passes any mode)."""
    rc, _, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0])
    locks = fresh_cache / SCHEMA / "locks"
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == locks else real(path, mode, **kw))
    rc, out, _ = _cli(capsys, "doctor")
    line = next(line for line in out.splitlines() if "cache dir" in line)
    assert rc == 1 and "FAIL" in line and f"{locks}" in line and "every cold build fails" in line


def test_clear_and_prune_refuse_a_schema_dir_that_is_a_link(fresh_cache, tmp_path, capsys):
    """clear and prune went through a linked v1 that every load refuses, deleting the entries where the link
    pointed."""
    rc, _, _ = _cli(capsys, "warm", "-q", "--spec", SPECS[0])
    real = tmp_path / "elsewhere"
    (fresh_cache / SCHEMA).rename(real)
    (fresh_cache / SCHEMA).symlink_to(real)
    for command in (["clear"], ["prune", "--max-size", "0"]):
        rc, _, err = _cli(capsys, *command)
        assert rc == 1 and "is a symbolic link" in err and "nothing removed" in err, command
    assert len(entry_dirs(real)) == 1


@pytest.mark.parametrize("kind", ["file", "link"])
def test_ls_says_when_the_writable_cache_cannot_be_used(kind, fresh_cache, tmp_path, capsys):
    """ls listed '0 entries' and exited 0 over a v1 that was a file (or a link every load refuses)."""
    fresh_cache.mkdir()
    if kind == "file":
        (fresh_cache / SCHEMA).write_text("")
    else:
        (tmp_path / "elsewhere").mkdir()
        (fresh_cache / SCHEMA).symlink_to(tmp_path / "elsewhere")
    rc, out, err = _cli(capsys, "ls")
    assert rc == 1 and "the writable cache cannot be used" in err, (out, err)

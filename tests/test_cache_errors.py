"""Every failure of the cache says what went wrong, where, and what to do -- and leaves it usable.

Disk-full and read-only cases run on a real small tmpfs when this process may
mount one (root in a container); the same paths are also driven by injected
``OSError`` so they are tested everywhere.
"""

from __future__ import annotations

import contextlib
import errno
import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import jitattn
import jitattn.jit
from jitattn import AttentionVariant, VariantParam
from jitattn.jit import BuildError, CacheError, CompileDisabledError, build_many, compile_count
from jitattn.jit.key import SCHEMA, build_inputs
from jitattn.jit.cache import find_entry
from jitattn.spec import VariantSpec
from jitattn_cache.cli import main

cache_module = importlib.import_module("jitattn.jit.build_and_publish")  # the build sequence under test

SPEC = VariantSpec("merge", "cpu", o_dtype="f16")


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _entry(root: Path, spec: VariantSpec = SPEC) -> Path:
    return root / SCHEMA / build_inputs(spec).name


def _leftovers(root: Path) -> list[str]:
    tmp = root / SCHEMA / "tmp"
    return sorted(p.name for p in tmp.iterdir()) if tmp.is_dir() else []


def _failed(root: Path) -> list[str]:
    failed = root / SCHEMA / "failed"
    return sorted(p.name for p in failed.iterdir()) if failed.is_dir() else []


@contextlib.contextmanager
def _tmpfs(path: Path, size: str):
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip()}); the injected-error tests cover this")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _assert_one_readable_write_error(message: str, where: Path) -> None:
    assert message.startswith("could not write"), message
    assert str(where) in message
    assert "free on that filesystem" in message
    assert "prune" in message and "JITATTN_CACHE_DIR" in message
    assert "Nothing was published" in message
    assert "shutil.Error" not in message and "[Errno" not in message
    assert len(message.splitlines()) == 1


# -- disk full ---------------------------------------------------------------------------------


def test_a_full_disk_during_the_build_is_one_cache_error_and_leaves_nothing(tmp_path, monkeypatch):
    with _tmpfs(tmp_path / "small", "16k") as mount:
        root = mount / "cache"
        monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
        jitattn.jit._registry.clear()
        with pytest.raises(CacheError) as info:
            jitattn.load(SPEC)
        message = str(info.value)
        _assert_one_readable_write_error(message, root / SCHEMA / "tmp")
        assert "No space left on device" in message
        assert not _entry(root).exists()
        assert _leftovers(root) == [] and _failed(root) == []
        assert find_entry(build_inputs(SPEC)) is None


def _enospc(path) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.mark.parametrize("point", ["sources", "manifest", "publish"])
def test_a_write_failure_at_each_step_is_one_cache_error_and_the_cache_stays_usable(point, fresh_cache,
                                                                                      monkeypatch):
    entry = _entry(fresh_cache)
    if point == "sources":
        def fail(work_dir, *args, **kwargs):
            raise _enospc(work_dir / "build.ninja")

        monkeypatch.setattr(cache_module, "write_ninja", fail)
    elif point == "manifest":
        def fail(work_dir, *args, **kwargs):
            raise _enospc(work_dir / "manifest.json.partial")

        monkeypatch.setattr(cache_module, "_write_manifest", fail)
    else:
        real_replace = os.replace

        def fail(src, dst, *args, **kwargs):
            if Path(dst) == entry:
                raise _enospc(dst)
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(CacheError) as info:
        jitattn.load(SPEC)
    message = str(info.value)
    _assert_one_readable_write_error(message, fresh_cache / SCHEMA)
    assert SPEC.uri in message
    assert not entry.exists(), "no partial entry"
    assert _leftovers(fresh_cache) == [] and _failed(fresh_cache) == []
    monkeypatch.undo()
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(fresh_cache))
    jitattn.load(SPEC)  # the next attempt builds normally
    assert (entry / "manifest.json").is_file()


def test_a_kept_failed_build_is_dropped_once_the_entry_exists(fresh_cache, monkeypatch):
    real_run_ninja = cache_module.run_ninja

    def fails_once(work_dir, jobs, source_path):
        raise BuildError(f"compile failed for {source_path}:\nthe test's compiler failure\n"
                         f"(rendered source: {source_path})")

    monkeypatch.setattr(cache_module, "run_ninja", fails_once)
    with pytest.raises(BuildError) as info:
        jitattn.load(SPEC)
    name = build_inputs(SPEC).name
    assert _failed(fresh_cache) == [name]
    assert str(fresh_cache / SCHEMA / "failed" / name) in str(info.value)
    monkeypatch.setattr(cache_module, "run_ninja", real_run_ninja)
    jitattn.load(SPEC)
    assert _failed(fresh_cache) == [], "a stale failure copy survived the successful build"
    # Also when the entry was published by someone else: the copy goes as soon as we see the entry.
    (fresh_cache / SCHEMA / "failed" / name).mkdir(parents=True)
    entry = _entry(fresh_cache)
    _, built = cache_module.build_or_find_entry(build_inputs(SPEC))
    assert not built and _failed(fresh_cache) == [] and entry.is_dir()


def test_a_ninja_killed_by_a_signal_is_not_kept_as_a_compile_failure(fresh_cache, monkeypatch, tmp_path):
    # A Ctrl-C landing between ninja's fork and its setsid kills ninja before the interrupted process has
    # cancelled anything (seen once in CI). SIGKILL stands in for SIGINT here: a shell started with SIGINT
    # ignored (a background job) could not send itself one.
    ninja = tmp_path / "ninja"
    ninja.write_text("#!/bin/sh\nkill -KILL $$\nsleep 5\n")
    ninja.chmod(0o755)
    monkeypatch.setattr(importlib.import_module("jitattn.jit.build"), "ninja_path", lambda: str(ninja))
    with pytest.raises(BuildError, match="killed by SIGKILL.*nothing was published") as info:
        jitattn.load(SPEC)
    assert "compile failed" not in str(info.value)
    assert _failed(fresh_cache) == [] and _leftovers(fresh_cache) == []
    assert not _entry(fresh_cache).exists()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_build_past_its_time_limit_is_stopped_with_its_compiler(fresh_cache, monkeypatch, tmp_path):
    """A hung compiler held a load (and a serving process's first request) forever. Past JITATTN_BUILD_TIMEOUT the
    build is stopped, its compiler (in a process group of its own, as ninja starts them) killed with it, nothing kept
    or published, and the error says what to do; a bad setting is refused before anything starts."""
    pid_file = tmp_path / "compiler.pid"
    ninja = tmp_path / "ninja"
    ninja.write_text(f"#!/bin/sh\necho '[1/2] compiling attention.cpp'\n"
                     f"setsid sh -c 'echo $$ > {pid_file}; exec sleep 60' &\nwait\n")
    ninja.chmod(0o755)
    monkeypatch.setattr(importlib.import_module("jitattn.jit.build"), "ninja_path", lambda: str(ninja))
    monkeypatch.setenv("JITATTN_BUILD_TIMEOUT", "abc")
    with pytest.raises(ValueError, match="JITATTN_BUILD_TIMEOUT='abc' is not a number of seconds"):
        jitattn.load(SPEC)
    assert not pid_file.exists()
    monkeypatch.setenv("JITATTN_BUILD_TIMEOUT", "1.5")
    with pytest.raises(BuildError, match=r"did not finish in 1.5 s \(JITATTN_BUILD_TIMEOUT\) and was stopped; "
                                         r"nothing was published") as info:
        jitattn.load(SPEC)
    assert "compiling attention.cpp" in str(info.value) and "compile failed" not in str(info.value)
    assert not _alive(int(pid_file.read_text()))
    assert _failed(fresh_cache) == [] and _leftovers(fresh_cache) == []
    assert not _entry(fresh_cache).exists()


# -- compile errors in snippets -------------------------------------------------------------------


def _cpu_spec(variant: AttentionVariant) -> VariantSpec:
    return VariantSpec(op="prefill", target="cpu", q_dtype="f32", kv_dtype="f32", o_dtype="f32", variant=variant)


@pytest.mark.parametrize("hook, snippet, params, why", [
    ("logits_mask", "allowed", (VariantParam("allowed", "u8", rank=1),),
     "the snippet is not a number (a tensor parameter needs its index: name[i])"),
    ("logits_transform", '"hello"', (), "the snippet is not a number"),
], ids=["mask-of-a-pointer", "string"])
def test_a_snippet_of_the_wrong_type_is_refused_at_its_hook(hook, snippet, params, why, fresh_cache):
    """A tensor parameter named without its index is a pointer, never null: as a mask it hid nothing, silently (it
    was converted to true); other types failed in the generated header, unnamed (2026-12-06 sweep)."""
    variant = AttentionVariant("badtype", params=params, **{hook: snippet})
    with pytest.raises(BuildError) as info:
        jitattn.load(_cpu_spec(variant))
    message = str(info.value)
    assert message.startswith("variant 'badtype' does not compile") and f"  {hook}: {why}" in message
    assert f"    | {snippet}\n" in message


@pytest.mark.parametrize("snippet, line, shown", [
    ("logits * (2.0f +", 1, "logits * (2.0f +"),
    ("logits *\n  (2.0f +\n  1.0f", 3, "  1.0f"),
])
def test_an_unfinished_snippet_is_reported_at_its_hook_and_line_with_the_full_log(snippet, line, shown,
                                                                                   fresh_cache):
    variant = AttentionVariant("unfinished", logits_transform=snippet)
    with pytest.raises(BuildError) as info:
        jitattn.load(_cpu_spec(variant))
    message = str(info.value)
    assert "variant 'unfinished' does not compile" in message
    assert f"logits_transform, line {line}: " in message
    assert f"    | {shown}\n" in message
    caret = message.split(f"    | {shown}\n", 1)[1].splitlines()[0]
    assert caret.index("^") == len("    | ") + len(shown), "the caret points just past the snippet's end"
    assert "variant.h:" not in message, "a diagnostic was left pointing into the generated header"
    assert "JITATTN_DEBUG=1" in message
    log = Path(re.search(r"\(full log: (\S+)\)", message).group(1))
    assert log.is_file() and "error" in log.read_text()
    assert len(message.splitlines()) < 20


# -- read-only caches -----------------------------------------------------------------------------


def _assert_read_only_message(err: str, root: Path) -> None:
    assert "read-only" in err and str(root) in err
    assert "Errno" not in err and "Traceback" not in err


@pytest.mark.parametrize("command", [("clear",), ("prune", "--max-size", "0")])
def test_clear_and_prune_on_a_read_only_filesystem_name_the_path(command, tmp_path, monkeypatch, capsys):
    with _tmpfs(tmp_path / "ro", "4m") as mount:
        root = mount / "cache"
        monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
        [result] = build_many([SPEC])
        assert result.status == "built", result.error
        jitattn.jit._registry.clear()
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        rc, out, err = _cli(capsys, *command)
        assert rc == 1
        _assert_read_only_message(err, root)
        assert _entry(root).is_dir()


@pytest.mark.parametrize("command", [("clear",), ("prune", "--max-size", "0")])
@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_clear_and_prune_refused_by_permissions_name_the_path(command, code, fresh_cache, monkeypatch, capsys):
    [result] = build_many([SPEC])
    assert result.status == "built"

    def refuse(src, dst, *args, **kwargs):
        raise OSError(code, os.strerror(code), str(src))

    monkeypatch.setattr(os, "replace", refuse)
    rc, out, err = _cli(capsys, *command)
    assert rc == 1
    _assert_read_only_message(err, fresh_cache)
    assert str(_entry(fresh_cache)) in err


# -- printed commands work when pasted ------------------------------------------------------------

DOC_MASK = AttentionVariant(
    "docmask", logits_mask="doc_ids[kv_idx] == doc_ids[kv_len - qo_len + q_idx] && scale > 0.5f",
    params=(VariantParam("doc_ids", "i32", rank=1), VariantParam("scale", "f32")),
)


@pytest.mark.parametrize("spec", [SPEC, _cpu_spec(DOC_MASK)], ids=["plain", "custom-variant"])
def test_the_compile_disabled_hint_is_a_command_that_works(spec, fresh_cache, monkeypatch, capsys):
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    with pytest.raises(CompileDisabledError) as info:
        jitattn.load(spec)
    match = re.search(r"pre-build it in a process without that setting \((jitattn-cache warm .+)\), or unset",
                      str(info.value))
    assert match, str(info.value)
    argv = shlex.split(match.group(1))  # what a shell makes of the pasted text
    assert argv[0] == "jitattn-cache"
    monkeypatch.delenv("JITATTN_ASSERT_NO_COMPILE")
    rc, out, err = _cli(capsys, *argv[1:], "-q")
    assert rc == 0, err
    assert "1 built" in out
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    before = compile_count()
    jitattn.load(spec)  # warm now, with compiles forbidden
    assert compile_count() == before


def test_a_relative_cache_dir_is_taken_from_the_working_directory(tmp_path, monkeypatch):
    """JITATTN_CACHE_DIR=relcache: builds land in ./relcache (ninja runs in the build's own directory, so a relative
    root used to name sources that were not there: a 'compile failed' for a working toolchain)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("JITATTN_CACHE_DIR", "relcache")
    jitattn.jit._registry.clear()
    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    assert _entry(tmp_path / "relcache").is_dir()


def test_a_cache_under_a_path_with_a_space_and_a_quote_builds(tmp_path, monkeypatch):
    """The include directories and the compiler sit in ninja's command lines: they are quoted for the shell that
    runs them (unquoted, a space split the path and every build failed as a 'compile failed')."""
    root = tmp_path / "it's a cache"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    jitattn.jit._registry.clear()
    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    assert jitattn.jit.load(SPEC) is not None and _entry(root).is_dir()


def _published(fresh_cache, spec: VariantSpec = SPEC) -> tuple[Path, dict]:
    """``spec``'s entry, built but not loaded in this process (glibc would hand a later load of the same path the
    library it mapped then, whatever the file holds now)."""
    import json

    [result] = build_many([spec])
    assert result.status == "built", result.error
    entry = _entry(fresh_cache, spec)
    return entry, json.loads((entry / "manifest.json").read_text())


@pytest.mark.parametrize("manifest", ["[1, 2]", "42", "null", "library-elsewhere", "library-null"])
def test_a_manifest_that_is_not_ours_is_rebuilt_and_reported(manifest, fresh_cache, capsys):
    """A manifest that is JSON but not an object, or that names another file than the loader opens, is a bad entry:
    the next load rebuilds it (before: an AttributeError from every load and every CLI command, or a checksum of
    one file and a load of another), and verify reports it."""
    import json
    import shutil

    entry, good = _published(fresh_cache)
    text = manifest
    if manifest.startswith("library"):
        shutil.copy(entry / "lib.so", entry / "real.so")
        text = json.dumps({**good, "library": None if manifest == "library-null" else "real.so"})
        (entry / "lib.so").unlink()  # a new file: the build's own check mapped this one into the process
        (entry / "lib.so").write_bytes(b"not a library")
    (entry / "manifest.json").write_text(text)
    rc, out, _ = _cli(capsys, "verify")
    assert rc != 0 and "BAD" in out
    assert _cli(capsys, "ls")[0] == 0
    jitattn.jit.load(SPEC)  # rebuilt
    assert json.loads((entry / "manifest.json").read_text())["library"] == "lib.so"
    assert _cli(capsys, "verify")[0] == 0


def test_an_entry_whose_library_is_another_modules_is_a_clear_error_and_verify_fix_removes_it(fresh_cache, capsys):
    """Checksum and manifest consistent, library of another module (or built against libraries this machine lacks):
    load raises a CacheError naming the entry and the fix instead of a raw ctypes error; verify --fix removes it
    and the next load rebuilds."""
    import hashlib
    import json
    import shutil

    other, _ = _published(fresh_cache, VariantSpec("merge", "cpu", o_dtype="f32"))
    entry, good = _published(fresh_cache)
    (entry / "lib.so").unlink()  # a new file: the build's own check mapped this one into the process
    shutil.copy(other / "lib.so", entry / "lib.so")
    digest = hashlib.sha256((entry / "lib.so").read_bytes()).hexdigest()
    (entry / "manifest.json").write_text(json.dumps({**good, "sha256": digest}))
    with pytest.raises(CacheError, match="passes its checksum but does not load here.*verify --fix"):
        jitattn.jit.load(SPEC)
    [result] = build_many([SPEC])  # warm and info said "cached" / "ok" (they checked the checksum alone)
    assert result.status == "failed" and "does not load here" in result.error
    rc, out, _ = _cli(capsys, "info", SPEC.uri)
    assert rc == 1 and "status: BAD: its library does not load here" in out
    rc, out, _ = _cli(capsys, "verify", "--fix")
    assert "does not load here" in out and "removed" in out and not entry.exists()
    # the next load, in a process of its own (this one has the bad library mapped under the entry's path)
    code = ("import jitattn.jit; from jitattn.spec import VariantSpec; "
            "jitattn.jit.load(VariantSpec('merge', 'cpu', o_dtype='f16'))")
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy(), timeout=300)
    verify = subprocess.run([sys.executable, "-m", "jitattn_cache", "verify"], env=os.environ.copy(), timeout=300,
                            capture_output=True, text=True)
    assert verify.returncode == 0 and entry.exists(), verify.stdout


def test_warm_builds_in_the_writable_cache_what_a_read_only_layer_has_that_does_not_load(fresh_cache, tmp_path,
                                                                                          monkeypatch):
    """A layer's entry built against libraries this machine lacks: warm said "already cached" and every load then
    built it anyway (or refused under JITATTN_ASSERT_NO_COMPILE=1, saying it was not in the cache)."""
    import hashlib
    import json
    import shutil

    other, _ = _published(fresh_cache, VariantSpec("merge", "cpu", o_dtype="f32"))
    entry, good = _published(fresh_cache)
    layer = tmp_path / "layer"
    shutil.copytree(fresh_cache, layer, ignore=shutil.ignore_patterns("locks", "tmp"))
    layer_entry = layer / entry.relative_to(fresh_cache)
    (layer_entry / "lib.so").unlink()
    shutil.copy(other / "lib.so", layer_entry / "lib.so")
    digest = hashlib.sha256((layer_entry / "lib.so").read_bytes()).hexdigest()
    (layer_entry / "manifest.json").write_text(json.dumps({**good, "sha256": digest}))
    shutil.rmtree(entry)
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    [result] = build_many([SPEC])
    assert result.status == "failed" and f"its cache entry {layer_entry} (a read-only layer) does not load here" \
        in result.error and "JITATTN_ASSERT_NO_COMPILE=1 forbids" in result.error
    monkeypatch.delenv("JITATTN_ASSERT_NO_COMPILE")
    [result] = build_many([SPEC])
    assert result.status == "built" and (entry / "lib.so").exists(), result
    [result] = build_many([SPEC])
    assert result.status == "cached", result


def test_clear_removes_what_killed_builds_left_but_not_a_running_builds_directory(fresh_cache, capsys):
    """A build whose process was killed leaves tmp/<entry>.<id> (its compiler may even finish into it): clear removes
    such directories while no build of that entry holds its lock; a running build's is kept."""
    import filelock

    from jitattn.jit.cache import entry_lock

    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    base = fresh_cache / SCHEMA
    name = build_inputs(SPEC).name
    other = build_inputs(VariantSpec("merge", "cpu", o_dtype="f32")).name
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid whose process has ended: a killed import's staging
    killed_import, running_import = f"import-{gone.pid}-k1", f"import-{os.getpid()}-r1"
    for leftover in (f"{name}.killed1", f"{name}.trash-0badc0de", f"{other}.running", killed_import, running_import):
        (base / "tmp" / leftover / "obj").mkdir(parents=True)
        (base / "tmp" / leftover / "obj" / "x.o").write_bytes(b"\0" * 64)
    running = filelock.FileLock(entry_lock(base, other).lock_file)
    running.acquire()
    try:
        rc, out, _ = _cli(capsys, "clear")
    finally:
        running.release()
    assert rc == 0 and "3 directories that killed builds or imports left" in out
    assert sorted(_leftovers(fresh_cache)) == sorted([f"{other}.running", running_import])


def test_threads_waiting_for_a_build_that_fails_get_its_error_without_compiling_again(fresh_cache):
    """Six threads ask at once for a variant that does not compile: one compile, six clear BuildErrors (each waiting
    thread used to compile it again in turn: N builds of a broken cuda spec). A later call tries again."""
    import threading

    broken = _cpu_spec(AttentionVariant("brokenthreads", logits_transform="logits * no_such_function(2.0f)"))
    errors, barrier = [], threading.Barrier(6)

    def ask() -> None:
        barrier.wait()
        try:
            jitattn.jit.load(broken)
        except BuildError as exc:
            errors.append(str(exc))

    before = compile_count()
    threads = [threading.Thread(target=ask) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(errors) == 6 and all("no_such_function" in e for e in errors)
    assert compile_count() == before + 1
    with pytest.raises(BuildError):
        jitattn.jit.load(broken)
    assert compile_count() == before + 2


def test_an_entry_cleared_between_its_lookup_and_its_load_is_built_again(fresh_cache, monkeypatch, capsys):
    """`jitattn-cache clear` (or prune) in another shell right after a load found the entry: the load looks it up
    again (and builds it) instead of calling a removed library a damaged one."""
    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    looked_up = []

    def then_cleared(plan):
        entry = find_entry(plan)
        if not looked_up:
            looked_up.append(entry)
            assert _cli(capsys, "clear")[0] == 0
        return entry

    monkeypatch.setattr(jitattn.jit, "find_entry", then_cleared)
    before = compile_count()
    module = jitattn.jit.load(SPEC)
    assert looked_up[0] is not None and module.path == looked_up[0] / "lib.so"  # the same entry, built again
    assert compile_count() == before + 1


def test_things_in_the_caches_way_are_named_with_the_command_that_removes_them(fresh_cache, monkeypatch):
    """A directory as a build lock raised a raw IsADirectoryError from inside filelock; a file where tmp/ belongs
    said only 'cannot create the jitattn cache (File exists)'."""
    [result] = build_many([SPEC])
    entry = fresh_cache / SCHEMA / build_inputs(SPEC).name
    (entry / "manifest.json").unlink()  # the next load rebuilds it, under its lock
    lock = fresh_cache / SCHEMA / "locks" / f"{entry.name}.lock"
    lock.unlink(missing_ok=True)
    lock.mkdir()
    jitattn.jit._registry.clear()
    with pytest.raises(CacheError, match=rf"cannot take the build lock {re.escape(str(lock))} .*rm -rf"):
        jitattn.load(SPEC)
    # The same in a locks/ this user cannot write (root's override stood in for): "rm" alone would fail there.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False if Path(path) == lock.parent
                        else real_access(path, mode, **kw))
    with pytest.raises(CacheError, match=rf"its directory {re.escape(str(lock.parent))} is not writable for you; "
                                         rf"fix it \(chmod u\+rwx .*\), remove it \(rm -rf {re.escape(str(lock))}\)"):
        jitattn.load(SPEC)
    monkeypatch.setattr(os, "access", real_access)
    lock.rmdir()
    tmp = fresh_cache / SCHEMA / "tmp"
    tmp.rmdir()
    tmp.touch()
    with pytest.raises(CacheError, match=rf"{re.escape(str(tmp))} is in the jitattn cache's way.*\(rm "):
        jitattn.load(SPEC)
    tmp.unlink()
    jitattn.load(SPEC)


def test_a_fifo_in_an_entry_reads_as_damaged_instead_of_blocking(fresh_cache):
    [result] = build_many([SPEC])
    entry = fresh_cache / SCHEMA / build_inputs(SPEC).name
    (entry / "lib.so").unlink()
    os.mkfifo(entry / "lib.so")  # open() of it would wait for a writer for good
    jitattn.jit._registry.clear()
    import threading

    loader = threading.Thread(target=jitattn.load, args=(SPEC,), daemon=True)  # (a hang fails, not stalls, the run)
    loader.start()
    loader.join(timeout=60)
    assert not loader.is_alive(), "load() blocked on the FIFO"
    assert (entry / "lib.so").is_file()  # found damaged and rebuilt


def test_a_cache_dir_that_build_files_cannot_name_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "a|b"))
    rc, _, err = _cli(capsys, "warm", "-q", "--spec", SPEC.uri)
    assert rc == 2 and "holds a '|' or a newline" in err


def _denied_below(monkeypatch, folder: Path) -> None:
    """Make this process unable to list ``folder`` or look at anything in it (as for a user without read and search
    access; the tests may run as root, which the mode bits do not stop)."""
    real_iterdir, real_stat = Path.iterdir, os.stat

    def iterdir(self):
        if self == folder:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real_iterdir(self)

    def stat(path, *args, **kwargs):
        if folder in Path(path).parents:
            raise PermissionError(errno.EACCES, "Permission denied", str(path))
        return real_stat(path, *args, **kwargs)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    monkeypatch.setattr(os, "stat", stat)


def test_a_cache_folder_it_cannot_read_is_named_with_its_fix(fresh_cache, tmp_path, monkeypatch, capsys):
    """A read-only layer (or its entry) this user cannot read: verify and ls reported 0 entries (or 'ok'), doctor
    'safe', and warm, info, load and doctor failed with a bare '[Errno 13] Permission denied'."""
    import shutil

    entry, _ = _published(fresh_cache)
    layer = tmp_path / "layer"
    shutil.copytree(fresh_cache, layer, ignore=shutil.ignore_patterns("locks", "tmp"))
    shutil.rmtree(entry)
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    _denied_below(monkeypatch, layer / SCHEMA)
    for command in (("verify",), ("ls",), ("info", SPEC.uri)):
        rc, _, err = _cli(capsys, *command)
        assert rc == 1 and f"cannot read {layer / SCHEMA} (Permission denied): give yourself read and search " \
            f"access to it (chmod -R u+rX {layer / SCHEMA})" in err, (command, err)
    rc, out, _ = _cli(capsys, "doctor")
    assert rc == 1 and f"[FAIL] read-only layer: cannot read {layer / SCHEMA}" in out
    with pytest.raises(CacheError, match=rf"cannot read {re.escape(str(layer / SCHEMA / entry.name))} \(Permission"):
        find_entry(build_inputs(SPEC))
    monkeypatch.undo()
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    _denied_below(monkeypatch, layer / SCHEMA / entry.name)  # the layer lists, its entry cannot be looked into
    rc, out, _ = _cli(capsys, "verify")
    assert rc == 1 and f"UNSAFE {layer / SCHEMA / entry.name}/lib.so: " in out and \
        f"fix: chmod u+rx {layer / SCHEMA / entry.name}" in out


def test_removal_takes_only_entries_and_a_link_in_an_entrys_place(fresh_cache, tmp_path, capsys):
    """admin.remove_entry deleted any directory it was given; clear left a link in an entry's place as a dangling
    tmp/*.trash-* link for good."""
    import shutil

    from jitattn.jit.admin import remove_entry, writable_root

    victim = tmp_path / "victim"
    victim.mkdir()
    with pytest.raises(ValueError, match="is not a cache entry of"):
        remove_entry(writable_root(), victim)
    assert victim.is_dir()
    entry, _ = _published(fresh_cache)
    shutil.rmtree(entry)
    entry.symlink_to(victim)
    rc, _, _ = _cli(capsys, "clear")
    assert rc == 0 and not os.path.lexists(entry) and victim.is_dir()
    assert not list((fresh_cache / SCHEMA / "tmp").iterdir())


@pytest.mark.parametrize("jobs", [0, -1, 1.5, True])
def test_build_many_refuses_a_job_count_that_is_not_a_positive_int(jobs):
    with pytest.raises(ValueError, match=r"jobs is a positive int"):
        build_many([SPEC], jobs=jobs)


def test_a_layer_spelt_as_the_writable_cache_is_listed_once(fresh_cache, monkeypatch, capsys):
    _published(fresh_cache)
    monkeypatch.setenv("JITATTN_CACHE_PATH", f"{fresh_cache}/../{fresh_cache.name}")
    rc, out, _ = _cli(capsys, "ls")
    assert rc == 0 and "1 entries" in out and " rw" in out


def test_clear_names_a_directory_in_a_lock_files_place_with_its_fix(fresh_cache, capsys):
    entry, _ = _published(fresh_cache)
    lock = fresh_cache / SCHEMA / "locks" / f"{entry.name}.lock"
    if lock.exists():
        lock.unlink()
    lock.mkdir(parents=True)
    rc, _, err = _cli(capsys, "clear")
    assert rc == 1 and f"cannot change {lock}: Is a directory" in err and f"remove it (rm -rf {lock})" in err


def test_a_locks_directory_that_refuses_the_lock_is_named_with_its_chmod(fresh_cache, monkeypatch):
    """With locks/ unwritable the error said to remove a lock file that did not exist."""
    import filelock

    [result] = build_many([SPEC])
    entry = fresh_cache / SCHEMA / build_inputs(SPEC).name
    (entry / "manifest.json").unlink()  # the next load rebuilds it, under its lock
    locks = fresh_cache / SCHEMA / "locks"
    (locks / f"{entry.name}.lock").unlink(missing_ok=True)

    def refused(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", self.lock_file)

    real_access = os.access
    monkeypatch.setattr(filelock.FileLock, "acquire", refused)  # as an unwritable locks/ does (root passes any mode)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == locks else real_access(p, mode, **kw))
    jitattn.jit._registry.clear()
    with pytest.raises(CacheError, match=rf"its directory {re.escape(str(locks))} is not writable.*chmod u\+rwx"):
        jitattn.load(SPEC)

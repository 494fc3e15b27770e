"""The cache's publish protocol, end to end on the cpu target (merge family).

Each test gets an empty cache (``fresh_cache``); work that must happen in
another process (warm loads, races, kills) runs ``tests/helpers/load_spec.py``,
which reports its own ``compile_count()``.

This process never rewrites a library file in place: it has the libraries it
built mapped (the build checks each one loads), so corruption is simulated by
replacing the file, which leaves the mapped inode alone.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import logging
import os
import re
import shutil
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

import jitattn
import jitattn.jit
from jitattn import reference
from jitattn.jit import BuildError, CacheError, CompileDisabledError, build_many, compile_count
from jitattn.jit.key import SCHEMA, build_inputs
from jitattn.jit.cache import entry_problem, find_entry, foreign_entry_problem
from jitattn.jit.toolchain import probe
from jitattn.spec import Target, VariantSpec

from helpers.procs import child_env, load_at_once, load_command, run_load

key_module = importlib.import_module("jitattn.jit.key")  # where the sources are rendered for a build

SPEC = VariantSpec("merge", "cpu", o_dtype="f32")
NO_COMPILER = dict(JITATTN_CXX="/nonexistent/bin/c++", JITATTN_NVCC="/nonexistent/bin/nvcc")


def _entry(root: Path, spec: VariantSpec = SPEC) -> Path:
    return root / SCHEMA / build_inputs(spec).name


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _leftovers(root: Path, spec: VariantSpec = SPEC) -> list[Path]:
    return sorted((root / SCHEMA / "tmp").glob(build_inputs(spec).name + ".*"))


def _published(root: Path) -> list[str]:
    base = root / SCHEMA
    if not base.is_dir():
        return []
    return sorted(p.name for p in base.iterdir() if p.name not in ("locks", "tmp", "failed"))


def _replace_file(path: Path, data: bytes) -> None:
    """Give ``path`` new contents through a new inode (see the module docstring)."""
    scratch = path.with_name(path.name + ".scratch")
    scratch.write_bytes(data)
    os.replace(scratch, path)


def _merge_matches_reference(dtype=torch.float32) -> None:
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    v_a, v_b = (torch.randn(6, 4, 72, generator=g).to(dtype) for _ in range(2))
    s_a, s_b = (torch.randn(6, 4, generator=g) * 4 for _ in range(2))
    v, s = jitattn.merge_state(v_a, s_a, v_b, s_b)
    v_ref, s_ref = reference.merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(v.float(), v_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s, s_ref, atol=1e-5, rtol=1e-5)


# -- end to end ------------------------------------------------------------------

def test_cold_load_builds_publishes_and_runs_correctly(fresh_cache):
    before = compile_count()
    started = time.perf_counter()
    module = jitattn.load(SPEC)
    cold = time.perf_counter() - started
    print(f"\ncold build + load of {SPEC.uri}: {cold * 1e3:.0f} ms")
    assert compile_count() == before + 1
    assert jitattn.load(SPEC) is module  # a second call is a registry hit
    assert set(module.entry_names) == {"merge_state", "merge_states"}

    plan = build_inputs(SPEC)
    entry = fresh_cache / "v1" / f"{SPEC.uri}-{plan.key[:16]}"
    assert module.path == entry / "lib.so"
    assert {"build.ninja", "lib.so", "manifest.json", "sources"} <= {p.name for p in entry.iterdir()}
    assert {p.name: p.read_text() for p in (entry / "sources").iterdir()} == plan.sources
    assert _published(fresh_cache) == [entry.name]
    assert _leftovers(fresh_cache) == []

    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["uri"] == SPEC.uri and manifest["key"] == plan.key
    assert manifest["spec"] == SPEC.to_dict()
    assert manifest["sha256"] == _sha256(entry / "lib.so")
    toolchain = probe(Target.CPU)
    assert manifest["toolchain"]["compiler"] == os.path.basename(toolchain.compiler)
    assert manifest["toolchain"]["version"] == toolchain.version and toolchain.version
    assert manifest["exports"] == ["jitattn_merge_state", "jitattn_merge_states"]

    assert stat.S_IMODE(fresh_cache.stat().st_mode) == 0o700
    assert stat.S_IMODE((fresh_cache / "v1").stat().st_mode) == 0o700
    _merge_matches_reference()
    assert compile_count() == before + 1


def test_a_new_process_loads_the_warm_entry_with_no_compiler(fresh_cache):
    module = jitattn.load(SPEC)
    report = run_load(SPEC, "--check", env=child_env(**NO_COMPILER))
    print(f"\nwarm load of {SPEC.uri} in a new process: {report['seconds'] * 1e3:.2f} ms")
    assert report["compile_count"] == 0
    assert report["path"] == str(module.path)
    assert report["max_err"] < 1e-5


@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_assert_no_compile_refuses_a_cold_spec_naming_it(value, fresh_cache, monkeypatch):
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", value)
    before = compile_count()
    with pytest.raises(CompileDisabledError) as info:
        jitattn.load(SPEC)
    assert SPEC.uri in str(info.value) and "JITATTN_ASSERT_NO_COMPILE" in str(info.value)
    [result] = build_many([SPEC])
    assert result.status == "failed" and SPEC.uri in result.error
    assert compile_count() == before
    assert _published(fresh_cache) == []


def test_assert_no_compile_says_when_the_entry_is_there_but_damaged(fresh_cache, monkeypatch):
    """A corrupted entry is not 'not in the cache': the refusal names the entry and what is wrong with it."""
    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    entry = fresh_cache / SCHEMA / build_inputs(SPEC).name
    library = entry / "lib.so"
    library.unlink()  # a new file (a loaded library must not change in place)
    library.write_bytes(b"corrupted")
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    jitattn.jit._registry.clear()
    with pytest.raises(CompileDisabledError, match="its cache entry .* is damaged \\(library checksum"):
        jitattn.load(SPEC)


def test_assert_no_compile_allows_a_warm_spec(fresh_cache, monkeypatch):
    jitattn.load(SPEC)
    jitattn.jit._registry.clear()  # as a new process would: the cache, not the registry, must answer
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    before = compile_count()
    module = jitattn.load(SPEC)
    assert module.path == _entry(fresh_cache) / "lib.so"
    [result] = build_many([SPEC])
    assert result.status == "cached"
    _merge_matches_reference()
    assert compile_count() == before


# -- concurrency and faults ----------------------------------------------------------

def test_eight_processes_asking_for_one_cold_spec_build_it_once(fresh_cache, tmp_path):
    reports = load_at_once(SPEC, 8, tmp_path, "--check")
    assert sum(r["compile_count"] for r in reports) == 1, [r["compile_count"] for r in reports]
    assert {r["path"] for r in reports} == {str(_entry(fresh_cache) / "lib.so")}
    assert max(r["max_err"] for r in reports) < 1e-5
    assert _published(fresh_cache) == [_entry(fresh_cache).name]
    assert _leftovers(fresh_cache) == []


def _slow_compiler(tmp_path: Path, marker: Path) -> Path:
    """A c++ wrapper that, when asked to compile, touches ``marker`` and sleeps before running g++."""
    gxx = shutil.which("g++") or shutil.which("c++")
    wrapper = tmp_path / "slow-c++"
    wrapper.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -c "*) touch "{marker}"; sleep 60 ;; esac\n'
        f'exec "{gxx}" "$@"\n'
    )
    wrapper.chmod(0o755)
    return wrapper


def test_a_builder_killed_mid_build_leaves_nothing_that_loads(fresh_cache, tmp_path):
    marker = tmp_path / "compiling"
    wrapper = _slow_compiler(tmp_path, marker)
    builder = subprocess.Popen(
        load_command(SPEC), env=child_env(JITATTN_CXX=str(wrapper)), start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not marker.exists():
            assert builder.poll() is None, f"builder exited early: {builder.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "the build never reached the compiler"
            time.sleep(0.01)
    finally:
        # The builder, ninja and the sleeping compiler share the builder's process group.
        os.killpg(builder.pid, signal.SIGKILL)
        builder.communicate()
    assert builder.returncode == -signal.SIGKILL

    plan = build_inputs(SPEC)
    entry = _entry(fresh_cache)
    assert not (entry / "manifest.json").exists()
    assert find_entry(plan) is None
    assert _leftovers(fresh_cache), "expected the killed build's temp dir (was the kill really mid-build?)"

    # The next request (the lock died with its holder) rebuilds cleanly.
    report = run_load(SPEC, "--check", timeout=120)
    assert report["compile_count"] == 1
    assert report["max_err"] < 1e-5
    assert entry_problem(entry, plan.key) is None
    assert _leftovers(fresh_cache) == []


def test_a_corrupted_library_is_detected_by_checksum_and_rebuilt_in_a_new_process(fresh_cache, caplog):
    [result] = build_many([SPEC])
    assert result.status == "built"
    plan = build_inputs(SPEC)
    library = _entry(fresh_cache) / "lib.so"
    data = bytearray(library.read_bytes())
    middle = len(data) // 2
    data[middle:middle + 16] = bytes(b ^ 0xFF for b in data[middle:middle + 16])
    _replace_file(library, bytes(data))

    with caplog.at_level(logging.WARNING, logger="jitattn"):
        assert find_entry(plan) is None
    assert "checksum" in caplog.text

    report = run_load(SPEC, "--check")
    assert report["compile_count"] == 1
    assert report["path"] == str(library)
    assert report["max_err"] < 1e-5
    manifest = json.loads((library.parent / "manifest.json").read_text())
    assert manifest["sha256"] == _sha256(library)
    assert bytes(data) != library.read_bytes()
    assert _leftovers(fresh_cache) == []


def _truncate_library(entry: Path) -> None:
    _replace_file(entry / "lib.so", (entry / "lib.so").read_bytes()[:1000])


def _remove_library(entry: Path) -> None:
    (entry / "lib.so").unlink()


def _garbage_manifest(entry: Path) -> None:
    _replace_file(entry / "manifest.json", b'{"schema": "v1", "key": ')


def _manifest_of_another_key(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["key"] = "0" * 64
    _replace_file(entry / "manifest.json", json.dumps(manifest).encode())


def _manifest_of_another_schema(entry: Path) -> None:
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["schema"] = "v0"
    _replace_file(entry / "manifest.json", json.dumps(manifest).encode())


@pytest.mark.parametrize("damage", [_truncate_library, _remove_library, _garbage_manifest, _manifest_of_another_key,
                                    _manifest_of_another_schema],
                         ids=["truncated-library", "missing-library", "half-written-manifest", "foreign-manifest",
                              "edited-schema"])
def test_a_damaged_entry_is_not_loaded_and_is_rebuilt(damage, fresh_cache):
    assert build_many([SPEC])[0].status == "built"
    entry = _entry(fresh_cache)
    damage(entry)
    plan = build_inputs(SPEC)
    assert find_entry(plan) is None
    assert foreign_entry_problem(entry) is not None  # `jitattn-cache verify` reports what loads skip
    before = compile_count()
    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    assert compile_count() == before + 1
    assert entry_problem(entry, plan.key) is None
    assert _leftovers(fresh_cache) == []


@pytest.mark.parametrize("layout", ["under-a-regular-file", "a-read-only-dir", "inside-a-read-only-dir"])
def test_an_unwritable_cache_dir_gives_a_cache_error_naming_jitattn_cache_dir(layout, fresh_cache, tmp_path,
                                                                                monkeypatch):
    if layout == "under-a-regular-file":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory\n")
        root = blocker / "cache"
    else:
        if os.geteuid() == 0:
            pytest.skip("root ignores permission bits; the regular-file case covers this as root")
        read_only = tmp_path / "read-only"
        read_only.mkdir()
        root = read_only if layout == "a-read-only-dir" else read_only / "cache"
        read_only.chmod(0o500)  # restored below so tmp_path can be cleaned up
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    try:
        with pytest.raises(CacheError) as info:
            jitattn.load(SPEC)
        assert "JITATTN_CACHE_DIR" in str(info.value)
        assert str(root) in str(info.value)
        [result] = build_many([SPEC])
        assert result.status == "failed" and "JITATTN_CACHE_DIR" in result.error
    finally:
        if layout != "under-a-regular-file":
            (tmp_path / "read-only").chmod(0o700)


def test_a_compile_error_shows_the_compiler_message_and_the_rendered_source(fresh_cache, monkeypatch):
    real_render = key_module.render

    def broken_render(spec):
        return {name: text + ("\n#error boom from the test\n" if name.endswith(".cpp") else "")
                for name, text in real_render(spec).items()}

    monkeypatch.setattr(key_module, "render", broken_render)
    with pytest.raises(BuildError) as info:
        jitattn.load(SPEC)
    message = str(info.value)
    assert "boom from the test" in message  # the compiler's own words
    match = re.search(r"rendered source: (\S+)\)", message)
    assert match, message
    source = Path(match.group(1))
    assert source.is_file(), f"{source} named in the error does not exist"
    assert "#error boom from the test" in source.read_text()
    assert f"{source}:" in message  # the compiler's file:line points at the file that exists
    plan = build_inputs(SPEC)
    assert find_entry(plan) is None
    assert _published(fresh_cache) == []
    assert _leftovers(fresh_cache) == []


# -- read-only layers and safety ----------------------------------------------------------

@pytest.fixture(scope="module")
def built_layer(tmp_path_factory) -> Path:
    """A cache root holding one published entry for SPEC (tests copy it before changing it)."""
    root = tmp_path_factory.mktemp("layer") / "cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JITATTN_CACHE_DIR", str(root))
        mp.delenv("JITATTN_CACHE_PATH", raising=False)
        [result] = build_many([SPEC])
    assert result.status == "built", result.error
    return root


def _snapshot(root: Path) -> dict[str, tuple]:
    return {
        str(p.relative_to(root)): (p.stat().st_mode, p.stat().st_mtime_ns, _sha256(p) if p.is_file() else None)
        for p in [root, *root.rglob("*")]
    }


def test_a_read_only_layer_is_searched_first_and_never_written(built_layer, tmp_path, fresh_cache):
    layer = tmp_path / "A"
    shutil.copytree(built_layer, layer)
    writable = tmp_path / "B"
    writable.mkdir(mode=0o700)
    before = _snapshot(layer)
    env = child_env(
        JITATTN_CACHE_PATH=os.pathsep.join([str(tmp_path / "missing-layer"), str(layer)]),
        JITATTN_CACHE_DIR=str(writable), **NO_COMPILER,
    )
    report = run_load(SPEC, "--check", env=env)
    assert report["compile_count"] == 0
    assert report["path"] == str(_entry(layer) / "lib.so")
    assert report["max_err"] < 1e-5
    assert _published(writable) == []
    assert _snapshot(layer) == before


def test_a_damaged_layer_entry_is_rebuilt_in_the_writable_root_and_the_layer_left_alone(built_layer, tmp_path,
                                                                                        fresh_cache, monkeypatch):
    layer = tmp_path / "A"
    shutil.copytree(built_layer, layer)
    _garbage_manifest(_entry(layer))
    before = _snapshot(layer)
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    [result] = build_many([SPEC])
    assert result.status == "built", result.error
    assert entry_problem(_entry(fresh_cache), build_inputs(SPEC).key) is None
    assert _snapshot(layer) == before
    assert jitattn.load(SPEC).path == _entry(fresh_cache) / "lib.so"


def test_a_layer_entry_that_does_not_load_here_is_built_in_the_writable_root(built_layer, tmp_path, fresh_cache,
                                                                             monkeypatch):
    """A layer imported from another machine can hold a library whose checksum matches but that links a library
    this one lacks: its every load raised, and `verify --fix` cannot remove it from a read-only layer."""
    import json

    gxx = shutil.which("g++") or shutil.which("c++")
    if gxx is None:
        pytest.skip("needs a C++ compiler")
    layer = tmp_path / "A"
    shutil.copytree(built_layer, layer)
    entry = _entry(layer)
    dep = tmp_path / "dep"
    dep.mkdir()
    (dep / "d.c").write_text("int missing_dep(void) { return 1; }\n")
    (dep / "u.c").write_text("int missing_dep(void); int use(void) { return missing_dep(); }\n")
    subprocess.run([gxx, "-shared", "-fPIC", "-o", str(dep / "libjadep.so"), str(dep / "d.c")], check=True)
    library = entry / "lib.so"
    library.unlink()
    subprocess.run([gxx, "-shared", "-fPIC", "-o", str(library), str(dep / "u.c"), f"-L{dep}", "-ljadep"], check=True)
    (dep / "libjadep.so").unlink()  # the library it links is not on this machine
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["sha256"] = _sha256(library)  # a consistent entry: only its load fails
    (entry / "manifest.json").write_text(json.dumps(manifest))
    before = _snapshot(layer)
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    jitattn.jit._registry.clear()
    module = jitattn.load(SPEC)
    assert module.path == _entry(fresh_cache) / "lib.so" and _snapshot(layer) == before


@pytest.mark.parametrize("what, bit", [
    ("layer", stat.S_IWGRP),
    ("layer", stat.S_IWOTH),
    ("layer-schema-dir", stat.S_IWGRP),
    ("entry", stat.S_IWGRP),
    ("entry", stat.S_IWOTH),
    ("library", stat.S_IWGRP),
    ("writable-root", stat.S_IWGRP),
    ("entry-owned-by-another-user", None),
], ids=lambda v: {stat.S_IWGRP: "g+w", stat.S_IWOTH: "o+w"}.get(v, v) if not isinstance(v, str) else v)
def test_a_cache_other_users_can_change_is_refused(what, bit, built_layer, tmp_path, fresh_cache, monkeypatch):
    layer = tmp_path / "A"
    shutil.copytree(built_layer, layer)
    entry = _entry(layer)
    if what == "writable-root":
        monkeypatch.setenv("JITATTN_CACHE_DIR", str(layer))
    else:
        monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    target = {"layer": layer, "layer-schema-dir": layer / SCHEMA, "entry": entry, "library": entry / "lib.so",
              "writable-root": layer, "entry-owned-by-another-user": entry}[what]
    if bit is None:
        if os.geteuid() != 0:
            pytest.skip("giving a directory to another user needs root")
        os.chown(target, 4321, 4321)
    else:
        target.chmod(stat.S_IMODE(target.stat().st_mode) | bit)
    before = compile_count()
    with pytest.raises(CacheError) as info:
        jitattn.load(SPEC)
    message = str(info.value)
    assert str(target) in message, message
    assert ("writable by other users" in message) if bit else ("owned by uid 4321" in message)
    assert compile_count() == before


# -- build_many ---------------------------------------------------------------------

def test_build_many_builds_each_cold_spec_once_then_reports_cached(fresh_cache):
    specs = [VariantSpec("merge", "cpu", o_dtype=d) for d in ("f32", "f16", "bf16")]
    finished = []
    before = compile_count()
    results = build_many(specs + [specs[0]], jobs=2, on_done=finished.append)
    assert [r.spec for r in results] == specs  # duplicates dropped, input order kept
    assert [r.status for r in results] == ["built"] * 3, [r.error for r in results]
    assert compile_count() == before + 3
    assert sorted(r.spec.uri for r in finished) == sorted(s.uri for s in specs)
    for spec in specs:
        assert entry_problem(_entry(fresh_cache, spec), build_inputs(spec).key) is None
    again = build_many(specs, jobs=2)
    assert [r.status for r in again] == ["cached"] * 3
    assert compile_count() == before + 3


def test_build_many_reports_failures_and_raises_when_asked(fresh_cache, monkeypatch):
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "not-an-arch")
    cuda_spec = VariantSpec("merge", "cuda", o_dtype="bf16")
    results = build_many([SPEC, cuda_spec], jobs=2)
    assert [r.status for r in results] == ["built", "failed"]
    assert "not-an-arch" in results[1].error
    with pytest.raises(BuildError) as info:
        build_many([SPEC, cuda_spec], raise_on_error=True)
    assert cuda_spec.uri in str(info.value) and "1 of 2" in str(info.value)


def test_a_wait_behind_a_held_lock_warns_with_the_lock_file(fresh_cache, monkeypatch, caplog):
    """A builder that was stopped or hangs holds its entry's lock for good: the process waiting for it says so at
    WARNING (the INFO line is hidden by default), naming the lock file, instead of waiting in silence."""
    import threading

    import filelock

    from jitattn.jit import cache as jit_cache

    build = importlib.import_module("jitattn.jit.build_and_publish")
    monkeypatch.setattr(build, "LOCK_WARN_SECONDS", 0.5)
    spec = VariantSpec("merge", "cpu", o_dtype="f32")
    plan = build_inputs(spec)
    holder = filelock.FileLock(str(jit_cache.entry_lock(jit_cache.writable_root(), plan.name).lock_file))
    holder.acquire()
    loader = threading.Thread(target=jitattn.jit.load, args=(spec,))
    with caplog.at_level(logging.WARNING, logger="jitattn"):
        loader.start()
        deadline = time.monotonic() + 30
        while not any("still waiting" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.1)
        holder.release()
        loader.join(timeout=120)
    warned = [r.getMessage() for r in caplog.records if "still waiting" in r.getMessage()]
    assert warned and plan.name in warned[0] and ".lock" in warned[0]
    assert not loader.is_alive() and find_entry(plan) is not None

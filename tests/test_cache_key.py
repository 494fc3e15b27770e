"""The cache key changes exactly when something that shapes the binary changes.

Keyed: the canonical spec, the rendered sources, the headers they include
(transitively), compile and link flags, the CUDA arch list, the schema and
ABI versions. Not keyed: mtimes, where the package or the cache lives, which
PATH entry or symlink names the compiler.

Template and header edits happen in a private copy of the templates tree that
the engine is pointed at; the checkout is never touched.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import jitattn.jit.key as key_module
import jitattn.jit.templates as templates
import jitattn.jit.toolchain as tc
from jitattn.jit.key import build_inputs, compute_key
from jitattn.spec import Target, VariantSpec

from helpers.procs import child_env, parse_report

# ``jitattn.jit.render`` is the function (re-exported by jitattn.jit); the module is here:
render = importlib.import_module("jitattn.jit.render")

CPU = VariantSpec("merge", "cpu", o_dtype="f32")
CUDA = VariantSpec("merge", "cuda", o_dtype="bf16")
SPECS = {"cpu": CPU, "cuda": CUDA}

REAL_TEMPLATES = templates.template_root()


@pytest.fixture(autouse=True)
def _cuda_arch_list(monkeypatch):
    # cuda specs need an arch list to be keyed on a machine without a GPU.
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    render._environment.cache_clear()
    yield
    render._environment.cache_clear()


def _use_templates(monkeypatch, root: Path) -> None:
    """Point render, include lookup and the build at the templates tree ``root``."""
    monkeypatch.setattr(templates, "template_root", lambda: root)
    monkeypatch.setattr(render, "template_root", lambda: root)
    render._environment.cache_clear()


def _copy_templates(dest: Path) -> Path:
    shutil.copytree(REAL_TEMPLATES, dest)
    return dest


def _key(spec: VariantSpec) -> str:
    return build_inputs(spec).key


def _append(path: Path, text: str) -> None:
    path.write_text(path.read_text() + text)


# -- stability ----------------------------------------------------------------

@pytest.mark.parametrize("which", ["cpu", "cuda"])
def test_key_is_stable_across_calls(which):
    spec = SPECS[which]
    first = build_inputs(spec)
    second = build_inputs(spec)
    assert first.key == second.key
    assert len(first.key) == 64 and int(first.key, 16) >= 0
    assert first.name == f"{spec.uri}-{first.key[:16]}"
    assert compute_key(spec, first.sources, first.headers, first.cflags, first.ldflags, first.archs) == first.key


def test_key_does_not_depend_on_dict_insertion_order():
    plan = build_inputs(CPU)
    reversed_sources = dict(reversed(list(plan.sources.items())))
    assert list(reversed_sources) != list(plan.sources)
    assert compute_key(CPU, reversed_sources, plan.headers, plan.cflags, plan.ldflags, plan.archs) == plan.key


_KEYS_IN_CHILD = """
import json, sys
from jitattn.jit.key import build_inputs
from jitattn.spec import VariantSpec
print(json.dumps({"keys": [build_inputs(VariantSpec.from_dict(d)).key for d in json.loads(sys.argv[1])]}))
"""


def test_key_is_stable_across_processes(tmp_path):
    specs = [CPU, CUDA]
    proc = subprocess.run(
        [sys.executable, "-c", _KEYS_IN_CHILD, json.dumps([s.to_dict() for s in specs])],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
        env=child_env(PYTHONHASHSEED="4242", JITATTN_CUDA_ARCH_LIST="9.0a", TORCH_CUDA_ARCH_LIST=None),
    )
    assert parse_report(proc.returncode, proc.stdout, proc.stderr)["keys"] == [_key(s) for s in specs]


# -- what changes the key --------------------------------------------------------

def _edit_cpu_template(mp, root):
    _append(root / "cpu" / "merge.cpp.jinja", "// an edit that reaches the rendered source\n")


def _edit_cuda_template(mp, root):
    _append(root / "cuda" / "merge.cu.jinja", "// an edit that reaches the rendered source\n")


def _edit_cpu_header(mp, root):
    _append(root / "cpu" / "include" / "jitattn" / "cpu_common.h", "// header edit\n")


def _edit_cuda_header(mp, root):
    _append(root / "cuda" / "include" / "jitattn" / "cuda_common.cuh", "// header edit\n")


def _nested_header(relative: bool):
    """A header included by another header; editing the inner one must change the key."""

    def setup(mp, root):
        inc = root / "cpu" / "include" / "jitattn"
        include_line = '#include "extra.h"\n' if relative else '#include "jitattn/extra.h"\n'
        _append(inc / "cpu_common.h", include_line)
        (inc / "extra.h").write_text("#pragma once\n// version 1\n")

    def edit(mp, root):
        _append(root / "cpu" / "include" / "jitattn" / "extra.h", "// version 2\n")

    return setup, edit


def _add_cpu_flag(mp, root):
    mp.setattr(tc, "CPU_FLAGS", tc.CPU_FLAGS + ("-DJITATTN_EXTRA=1",))


def _change_cpu_opt_level(mp, root):
    mp.setattr(tc, "CPU_FLAGS", tuple("-O2" if f == "-O3" else f for f in tc.CPU_FLAGS))


def _add_cpu_link_flag(mp, root):
    mp.setattr(tc, "CPU_LINK_FLAGS", tc.CPU_LINK_FLAGS + ("-Wl,--as-needed",))


def _add_cuda_flag(mp, root):
    mp.setattr(tc, "CUDA_FLAGS", tc.CUDA_FLAGS + ("--use_fast_math",))


def _arch_list(value):
    def change(mp, root):
        mp.setenv("JITATTN_CUDA_ARCH_LIST", value)
    return change


def _schema(mp, root):
    mp.setattr(key_module, "SCHEMA", "v999")


def _abi(mp, root):
    mp.setattr(key_module, "ABI_VERSION", key_module.ABI_VERSION + 1)


_nested_setup, _nested_edit = _nested_header(relative=False)
_nested_rel_setup, _nested_rel_edit = _nested_header(relative=True)


def _noop(mp, root):
    pass


# (id, spec, setup applied before the baseline, the change)
CHANGES_KEY = [
    ("cpu-template-text", "cpu", _noop, _edit_cpu_template),
    ("cuda-template-text", "cuda", _noop, _edit_cuda_template),
    ("cpu-header-text", "cpu", _noop, _edit_cpu_header),
    ("cuda-header-text", "cuda", _noop, _edit_cuda_header),
    ("header-included-by-a-header", "cpu", _nested_setup, _nested_edit),
    ("header-included-relative-to-a-header", "cpu", _nested_rel_setup, _nested_rel_edit),
    ("cpu-compile-flag-added", "cpu", _noop, _add_cpu_flag),
    ("cpu-compile-flag-changed", "cpu", _noop, _change_cpu_opt_level),
    ("cpu-link-flag", "cpu", _noop, _add_cpu_link_flag),
    ("cuda-compile-flag", "cuda", _noop, _add_cuda_flag),
    ("arch-list-8.0-vs-9.0a", "cuda", _noop, _arch_list("8.0")),
    ("arch-list-added-arch", "cuda", _noop, _arch_list("8.0;9.0a")),
    ("arch-list-plus-ptx", "cuda", _noop, _arch_list("9.0a+PTX")),
    ("schema-version", "cpu", _noop, _schema),
    ("abi-version", "cpu", _noop, _abi),
]


@pytest.mark.parametrize("which, setup, change", [c[1:] for c in CHANGES_KEY], ids=[c[0] for c in CHANGES_KEY])
def test_key_changes_when_a_keyed_input_changes(which, setup, change, tmp_path, monkeypatch):
    root = _copy_templates(tmp_path / "templates")
    _use_templates(monkeypatch, root)
    setup(monkeypatch, root)
    render._environment.cache_clear()
    before = _key(SPECS[which])
    change(monkeypatch, root)
    render._environment.cache_clear()
    assert _key(SPECS[which]) != before


@pytest.mark.parametrize("spec, other", [
    (CPU, CPU.replace(o_dtype="f16")),
    (CPU, CPU.replace(o_dtype="bf16")),
    (CUDA, CUDA.replace(target="cpu")),
    (CUDA, CUDA.replace(o_dtype="f16")),
], ids=["o_dtype-f32-f16", "o_dtype-f32-bf16", "target", "cuda-o_dtype"])
def test_key_changes_with_a_spec_field(spec, other):
    assert _key(spec) != _key(other)


def test_spec_field_reaches_the_key_even_with_identical_sources():
    plan = build_inputs(CPU)
    other = CPU.replace(o_dtype="f16")
    assert compute_key(other, plan.sources, plan.headers, plan.cflags, plan.ldflags, plan.archs) != plan.key


# -- what does not change the key ---------------------------------------------------

def _touch_everything(mp, root):
    future = 2_000_000_000
    for path in [root, *root.rglob("*")]:
        os.utime(path, (future, future))


def _jinja_comment(mp, root):
    # A template edit that renders to the same text changes no binary, so no key.
    _append(root / "cpu" / "merge.cpp.jinja", "{# a note for template authors #}")


def _edit_other_target_template(mp, root):
    _append(root / "cuda" / "merge.cu.jinja", "// cuda only\n")


def _edit_other_target_header(mp, root):
    _append(root / "cuda" / "include" / "jitattn" / "cuda_common.cuh", "// cuda only\n")


def _unincluded_header(mp, root):
    (root / "cpu" / "include" / "jitattn" / "unused.h").write_text("// nobody includes this\n")


def _cache_dir(mp, root):
    mp.setenv("JITATTN_CACHE_DIR", str(root.parent / "another-cache"))
    mp.setenv("JITATTN_CACHE_PATH", str(root.parent / "a-layer"))


def _jobs(mp, root):
    mp.setenv("JITATTN_MAX_JOBS", "1")


def _symlinked_cxx(mp, root):
    link = root.parent / "bin" / "my-g++"
    link.parent.mkdir()
    link.symlink_to(shutil.which("g++"))
    mp.setenv("JITATTN_CXX", str(link))


def _cxx_on_another_path(mp, root):
    # The same compiler reached through a different PATH entry.
    bindir = root.parent / "other-bin"
    bindir.mkdir()
    (bindir / "c++").symlink_to(os.path.realpath(shutil.which("g++")))
    mp.delenv("JITATTN_CXX", raising=False)
    mp.delenv("CXX", raising=False)
    mp.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")


def _symlinked_nvcc(mp, root):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not installed")
    link = root.parent / "cuda-bin" / "nvcc"
    link.parent.mkdir()
    link.symlink_to(nvcc)
    mp.setenv("JITATTN_NVCC", str(link))
    mp.setenv("PATH", f"{link.parent}{os.pathsep}{os.environ['PATH']}")


def _arch_for_cpu_spec(mp, root):
    mp.setenv("JITATTN_CUDA_ARCH_LIST", "8.0;8.6")


def _arch_spelling(mp, root):
    mp.setenv("JITATTN_CUDA_ARCH_LIST", " 9.0a; ")


def _torch_arch_variable(mp, root):
    mp.delenv("JITATTN_CUDA_ARCH_LIST")
    mp.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")


KEEPS_KEY = [
    ("touch-every-file", "cpu", _touch_everything),
    ("touch-every-file-cuda", "cuda", _touch_everything),
    ("template-edit-that-renders-the-same", "cpu", _jinja_comment),
    ("other-target-template-edit", "cpu", _edit_other_target_template),
    ("other-target-header-edit", "cpu", _edit_other_target_header),
    ("header-nobody-includes", "cpu", _unincluded_header),
    ("different-cache-dir-and-layers", "cpu", _cache_dir),
    ("different-cache-dir-and-layers-cuda", "cuda", _cache_dir),
    ("max-jobs", "cpu", _jobs),
    ("cxx-through-a-symlink", "cpu", _symlinked_cxx),
    ("cxx-through-another-PATH-entry", "cpu", _cxx_on_another_path),
    ("nvcc-through-a-symlink-and-PATH", "cuda", _symlinked_nvcc),
    ("cuda-arch-list-for-a-cpu-spec", "cpu", _arch_for_cpu_spec),
    ("arch-list-whitespace-and-separators", "cuda", _arch_spelling),
    ("TORCH_CUDA_ARCH_LIST-instead-of-JITATTN", "cuda", _torch_arch_variable),
]


@pytest.mark.parametrize("which, change", [c[1:] for c in KEEPS_KEY], ids=[c[0] for c in KEEPS_KEY])
def test_key_is_unchanged_by_unkeyed_inputs(which, change, tmp_path, monkeypatch):
    root = _copy_templates(tmp_path / "templates")
    _use_templates(monkeypatch, root)
    before = _key(SPECS[which])
    change(monkeypatch, root)
    render._environment.cache_clear()
    assert _key(SPECS[which]) == before


@pytest.mark.parametrize("which", ["cpu", "cuda"])
def test_reinstalled_copy_of_the_templates_elsewhere_keeps_the_key(which, tmp_path, monkeypatch):
    """A reinstall of the same package (same files, new path, new mtimes) rebuilds nothing."""
    original = _key(SPECS[which])
    keys = []
    for place in ("site-a/jitattn/templates", "elsewhere/venv/lib/templates"):
        root = tmp_path / place
        root.parent.mkdir(parents=True)
        shutil.copytree(REAL_TEMPLATES, root, copy_function=shutil.copy)  # copy: fresh mtimes
        _use_templates(monkeypatch, root)
        plan = build_inputs(SPECS[which])
        assert all(str(tmp_path) not in text for text in plan.sources.values())
        keys.append(plan.key)
    assert keys == [original, original]


@pytest.mark.parametrize("change", [_symlinked_cxx, _cxx_on_another_path], ids=["symlink", "PATH"])
def test_the_same_compiler_by_another_name_resolves_to_one_toolchain(change, tmp_path, monkeypatch):
    """Key aside, the build command itself (compiler path in build.ninja) is the same."""
    monkeypatch.delenv("JITATTN_CXX", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("JITATTN_CXX", "g++")
    before = tc.probe(Target.CPU)
    (tmp_path / "templates").mkdir()
    change(monkeypatch, tmp_path / "templates")
    after = tc.probe(Target.CPU)
    assert after.compiler == before.compiler
    assert after.version == before.version


def test_nested_headers_are_part_of_the_plan(tmp_path, monkeypatch):
    root = _copy_templates(tmp_path / "templates")
    _use_templates(monkeypatch, root)
    _nested_rel_setup(monkeypatch, root)
    plan = build_inputs(CPU)
    assert set(plan.headers) == {"jitattn/cpu_common.h", "jitattn/extra.h"}

"""The cuda target renders, compiles with nvcc and loads on a machine without a GPU.

A build box (CI, a container image build) has nvcc but no device: it must be
able to pre-build cuda entries for an arch it names, and a cuda library must
load without a driver (it links only the static CUDA runtime).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time

import pytest

import jitattn
import jitattn.jit
from jitattn.jit import Module, compile_count, render
from jitattn.jit.key import build_inputs
from jitattn.spec import VariantSpec

from helpers.procs import child_env, run_load

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")

SPEC = VariantSpec("merge", "cuda", o_dtype="bf16")


@pytest.fixture
def hopper_arch(monkeypatch):
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)


def test_cuda_merge_renders_for_the_named_arch(hopper_arch):
    sources = render(SPEC)
    assert set(sources) == {"params.h", "kernel.cu"}
    assert f"{SPEC.kernel_name}_pair" in sources["kernel.cu"]
    plan = build_inputs(SPEC)
    assert plan.archs == ("9.0a",)
    assert "-gencode=arch=compute_90a,code=sm_90a" in plan.cflags


def test_cuda_merge_compiles_with_nvcc_and_loads_without_a_gpu(hopper_arch, fresh_cache):
    before = compile_count()
    started = time.perf_counter()
    module = jitattn.load(SPEC)
    seconds = time.perf_counter() - started
    print(f"\ncold nvcc build + load of {SPEC.uri} (sm_90a): {seconds:.2f} s")
    assert compile_count() == before + 1
    assert isinstance(module, Module)
    assert set(module.entry_names) == {"merge_state", "merge_states"}

    entry = module.path.parent
    manifest = json.loads((entry / "manifest.json").read_text())
    assert manifest["archs"] == ["9.0a"]
    assert "nvcc" in manifest["toolchain"]["compiler"]
    assert "release" in manifest["toolchain"]["version"]
    # Profilers show the kernel under its readable name.
    assert f"{SPEC.kernel_name}_pair".encode() in module.path.read_bytes()

    readelf = shutil.which("readelf")
    if readelf is not None:
        dynamic = subprocess.run([readelf, "-d", str(module.path)], capture_output=True, text=True).stdout
        needed = [line for line in dynamic.splitlines() if "(NEEDED)" in line]
        assert needed, dynamic
        assert not any("libcuda.so" in line or "libcudart" in line for line in needed), needed

    report = run_load(SPEC, env=child_env(
        JITATTN_CUDA_ARCH_LIST="9.0a", JITATTN_ASSERT_NO_COMPILE="1",
        JITATTN_CXX="/nonexistent/bin/c++", JITATTN_NVCC="/nonexistent/bin/nvcc",
    ))
    print(f"warm load of {SPEC.uri} in a new process: {report['seconds'] * 1e3:.2f} ms")
    assert report["compile_count"] == 0
    assert report["path"] == str(module.path)
    assert sorted(report["entries"]) == ["merge_state", "merge_states"]

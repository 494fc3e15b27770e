"""JITATTN_DEBUG=1: custom-variant parameter reads are bounds-checked and reported, not a segfault.

The checks live in the rendered ``variant.h``, so a debug build has its own
cache key, and without the variable the sources are exactly what they were.
Run on the cpu target; for cuda the debug render is built with the local nvcc
(no GPU needed) to prove it compiles and exports the fault reader.
"""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys
import textwrap

import pytest
import torch

import jitattn
import jitattn.jit
from jitattn import AttentionVariant, VariantParam
from jitattn.jit import KernelError, build_many
from jitattn.jit.key import build_inputs
from jitattn.jit.render import render
from jitattn.spec import VariantSpec

from helpers.procs import REPO, child_env

HQ, HKV, DIM = 4, 2, 32
DOC_MASK = AttentionVariant(
    "docmask",
    logits_mask="doc_ids[doc_start[request] + kv_idx] == doc_ids[doc_start[request] + kv_len - qo_len + q_idx]",
    params=(VariantParam("doc_ids", "i32", rank=1), VariantParam("doc_start", "i64", rank=1)),
)
GATE = AttentionVariant(
    "gate", output_transform="out * gate[request * gate_size1 + qo_head] + (bias ? bias[qo_head] : 0.0f)",
    params=(VariantParam("gate", "f32", rank=2), VariantParam("bias", "f32", rank=1, optional=True)),
)


def _spec(variant: AttentionVariant, target: str = "cpu") -> VariantSpec:
    return VariantSpec(op="prefill", target=target, q_dtype="f32", kv_dtype="f32", o_dtype="f32", variant=variant)


@pytest.fixture
def debug(monkeypatch, fresh_cache):
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    return fresh_cache


def _ragged(variant: AttentionVariant, qo_len: int = 3, kv_len: int = 5):
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8))
    indptr = lambda n: torch.tensor([0, n], dtype=torch.int32)  # noqa: E731
    wrapper.plan(indptr(qo_len), indptr(kv_len), HQ, HKV, DIM, q_data_type=torch.float32, variant=variant)
    qkv = (torch.randn(qo_len, HQ, DIM), torch.randn(kv_len, HKV, DIM), torch.randn(kv_len, HKV, DIM))
    return wrapper, qkv


def test_debug_mode_is_part_of_the_key_and_leaves_the_normal_render_alone(monkeypatch):
    spec = _spec(DOC_MASK)
    monkeypatch.delenv("JITATTN_DEBUG", raising=False)
    normal_sources, normal_key = render(spec), build_inputs(spec).key
    monkeypatch.setenv("JITATTN_DEBUG", "0")
    assert render(spec) == normal_sources and build_inputs(spec).key == normal_key
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    debug_sources = render(spec)
    assert "JitattnChecked" in debug_sources["variant.h"] and "JitattnChecked" not in normal_sources["variant.h"]
    assert {n: t for n, t in debug_sources.items() if n != "variant.h"} == \
        {n: t for n, t in normal_sources.items() if n != "variant.h"}
    assert build_inputs(spec).key != normal_key, "a debug build must not share the fast build's entry"
    plain = VariantSpec("merge", "cpu", o_dtype="f32")  # no variant: nothing to check, nothing changes
    monkeypatch.delenv("JITATTN_DEBUG")
    plain_key = build_inputs(plain).key
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    assert build_inputs(plain).key == plain_key


def test_the_warm_command_of_a_debug_build_sets_debug(monkeypatch):
    """The command a CompileDisabledError prints built the fast entry when pasted: the debug one kept missing."""
    spec, plain = _spec(DOC_MASK), VariantSpec("merge", "cpu", o_dtype="f32")
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    assert jitattn.jit.warm_command(spec).startswith("JITATTN_DEBUG=1 jitattn-cache warm --spec ")
    assert jitattn.jit.warm_command(plain).startswith("jitattn-cache warm --spec ")  # no variant: one entry
    monkeypatch.delenv("JITATTN_DEBUG")
    assert jitattn.jit.warm_command(spec).startswith("jitattn-cache warm --spec ")


def test_setting_debug_between_loads_in_one_process_loads_the_debug_build(monkeypatch, fresh_cache):
    """Settings are read when used: a process that loaded the fast build and then sets JITATTN_DEBUG=1 gets the
    checked build (its own entry) from the next load, and the fast one back once it is unset."""
    spec = _spec(DOC_MASK)
    monkeypatch.delenv("JITATTN_DEBUG", raising=False)
    fast = jitattn.jit.load(spec)
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    checked = jitattn.jit.load(spec)
    assert checked.path != fast.path and checked._fault is not None and fast._fault is None
    monkeypatch.setenv("JITATTN_DEBUG", "0")
    assert jitattn.jit.load(spec) is fast


@pytest.mark.parametrize("name", ["JITATTN_DEBUG", "JITATTN_ASSERT_NO_COMPILE"])
def test_an_on_off_setting_of_another_value_is_an_error(name, monkeypatch, fresh_cache):
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match=f"{name}='maybe' is neither on nor off; set it to 1 or 0"):
        jitattn.jit.load(_spec(DOC_MASK))


def test_an_out_of_bounds_read_is_reported_with_hook_parameter_and_index(debug, monkeypatch):
    wrapper, (q, k, v) = _ragged(DOC_MASK)
    doc_ids = torch.zeros(5, dtype=torch.int32)
    start = int(torch.randint(1, 1000, ()).item())
    with pytest.raises(KernelError) as info:
        wrapper.run(q, k, v, doc_ids=doc_ids, doc_start=torch.tensor([start], dtype=torch.int64))
    message = str(info.value)
    assert "variant 'docmask': logits_mask read doc_ids[" in message
    index = int(message.split("doc_ids[", 1)[1].split("]", 1)[0])
    assert start <= index < start + 5, message  # doc_start[0] + a kv or query position
    assert "out of bounds (doc_ids has 5 elements, valid indices 0..4)" in message
    assert "JITATTN_DEBUG=1" in message
    # The fault is cleared once reported: an in-bounds launch runs and agrees with the fast build.
    doc_start = torch.zeros(1, dtype=torch.int64)
    doc_ids = torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32)
    checked = wrapper.run(q, k, v, doc_ids=doc_ids, doc_start=doc_start)
    monkeypatch.delenv("JITATTN_DEBUG")
    jitattn.jit._registry.clear()
    fast_wrapper, _ = _ragged(DOC_MASK)
    fast = fast_wrapper.run(q, k, v, doc_ids=doc_ids, doc_start=doc_start)
    torch.testing.assert_close(checked, fast, atol=0, rtol=0)


def test_a_two_dimensional_tensor_is_checked_over_its_elements(debug):
    wrapper, (q, k, v) = _ragged(GATE)
    gate = torch.ones(1, HQ - 1)  # one head short: the last head's read runs past the end
    with pytest.raises(KernelError) as info:
        wrapper.run(q, k, v, gate=gate)
    message = str(info.value)
    assert f"output_transform read gate[{HQ - 1}] out of bounds (gate has {HQ - 1} elements" in message


def test_reading_an_omitted_optional_tensor_is_reported(debug):
    reads_bias = AttentionVariant("rbias", output_transform="out + bias[qo_head]",
                                  params=(VariantParam("bias", "f32", rank=1, optional=True),))
    wrapper, (q, k, v) = _ragged(reads_bias)
    with pytest.raises(KernelError, match=r"output_transform read bias\[\d\], but bias is empty or was omitted"):
        wrapper.run(q, k, v)
    out = wrapper.run(q, k, v, bias=torch.arange(HQ, dtype=torch.float32))
    assert out.shape == q.shape


def test_the_process_survives_an_index_that_would_crash_it(debug, tmp_path):
    script = tmp_path / "oob.py"
    script.write_text(textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(REPO / "tests")!r})
        from test_cache_debug_variant import DOC_MASK, _ragged
        wrapper, (q, k, v) = _ragged(DOC_MASK)
        try:
            wrapper.run(q, k, v, doc_ids=torch.zeros(5, dtype=torch.int32),
                        doc_start=torch.tensor([1 << 40], dtype=torch.int64))
        except Exception as exc:
            print(type(exc).__name__, exc)
    """))
    proc = subprocess.run([sys.executable, str(script)], env=child_env(JITATTN_DEBUG="1"), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("KernelError") and f"doc_ids[{1 << 40}" in proc.stdout


def _has_nvcc() -> bool:
    from jitattn.jit.toolchain import ToolchainError, probe
    from jitattn.spec import Target

    try:
        probe(Target.CUDA)
        return True
    except ToolchainError:
        return False


@pytest.mark.skipif(not _has_nvcc(), reason="needs nvcc")
@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_the_cuda_debug_render_compiles_for_sm90a(op, debug, monkeypatch):
    from jitattn.runtime.specs import attention_spec
    from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    variant = DOC_MASK if op == "decode" else GATE
    spec = attention_spec(
        Op(op), Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
        head_dim_qk=64, head_dim_vo=64, num_qo_heads=8, num_kv_heads=2, pos_encoding=PosEncoding.NONE,
        use_sliding_window=False, use_logits_soft_cap=False,
        mask_mode=MaskMode.NONE if op == "decode" else MaskMode.CAUSAL, kv_layout=KVLayout.NHD,
        kv_storage=KVStorage.PAGED, variant=variant,
    )
    plan = build_inputs(spec)
    assert "__device__ JitattnFault" in plan.sources["variant.h"]
    assert "-gencode=arch=compute_90a,code=sm_90a" in plan.cflags
    [result] = build_many([spec])
    assert result.status == "built", result.error
    from jitattn.jit.cache import find_entry

    library = ctypes.CDLL(str(find_entry(plan) / "lib.so"))
    assert hasattr(library, "jitattn_variant_debug_fault")
    manifest = json.loads((find_entry(plan) / "manifest.json").read_text())
    assert manifest["archs"] == ["9.0a"]


def test_a_debug_build_error_says_the_debug_accessors_take_no_pointer_arithmetic(debug):
    """A snippet that adds to a tensor parameter compiles as a pointer, not as a debug build's checked accessor:
    the error says so (instead of suggesting the JITATTN_DEBUG=1 that is already set)."""
    from jitattn.jit import BuildError

    shifted = AttentionVariant("ptrarith", logits_transform="logits + *(bias + qo_head)",
                               params=(VariantParam("bias", "f32", rank=1),))
    with pytest.raises(BuildError, match="(?s)JITATTN_DEBUG=1 build.*write x\\[i\\] for \\*\\(x \\+ i\\)"):
        _ragged(shifted)

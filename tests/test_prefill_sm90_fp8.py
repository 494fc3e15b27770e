"""The sm90 tier's fp8 kernel on the host (q, k, v of one fp8 dtype): which specs may have an fp8 query, that only
the sm90 tier takes them (a clear error elsewhere), its layout (V^T's stages, the extra barriers, the producer's
registers), and that it renders and compiles for sm_90a without a GPU. Its numbers are tests/test_fp8_prefill.py's
GPU tests."""

from __future__ import annotations

import shutil

import pytest
import torch

import jitattn
from jitattn.jit import render
from jitattn.kernels import prefill, prefill_sm90
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec

e4m3, e5m2, bf16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16


def _spec(d=128, dtype=e4m3, kv_dtype=None, o_dtype=bf16, causal=True, storage=KVStorage.RAGGED,
          pos=PosEncoding.NONE, window=False, soft_cap=False, mask=None, hq=32, hkv=8):
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=dtype, kv_dtype=kv_dtype or dtype, o_dtype=o_dtype, head_dim_qk=d,
        head_dim_vo=d, num_qo_heads=hq, num_kv_heads=hkv, pos_encoding=pos, use_sliding_window=window,
        use_logits_soft_cap=soft_cap, mask_mode=mask or (MaskMode.CAUSAL if causal else MaskMode.NONE),
        kv_layout=KVLayout.NHD, kv_storage=storage)


SUPPORTED = {
    "e4m3_causal_g4": _spec(),
    "e5m2_full_g1_f16": _spec(dtype=e5m2, causal=False, hq=8, hkv=8, o_dtype=torch.float16),
    "e4m3_window_cap_f32": _spec(window=True, soft_cap=True, o_dtype=torch.float32),
    "e4m3_alibi_sinks": _spec(pos=PosEncoding.ALIBI).replace(use_sinks=True),
    "e4m3_paged": _spec(storage=KVStorage.PAGED),
}
UNSUPPORTED = {
    "d64": (_spec(d=64), "head_dim 128"),
    "d256": (_spec(d=256, hq=16, hkv=2), "head_dim 128"),
    "custom_mask": (_spec(mask=MaskMode.CUSTOM), "custom mask"),
    "rope": (_spec(pos=PosEncoding.ROPE_LLAMA), "RoPE"),
}


@pytest.fixture
def tier_env(monkeypatch):
    monkeypatch.delenv("JITATTN_PREFILL_TIER", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    return monkeypatch


def test_an_fp8_query_is_a_cuda_prefill_specs_only():
    assert _spec().q_dtype.is_fp8
    with pytest.raises(ValueError, match="fp8 queries are only for op 'prefill' on target 'cuda'"):
        VariantSpec(op="prefill", target="cuda", q_dtype="e4m3", kv_dtype="e5m2", o_dtype="bf16", head_dim_qk=128,
                    head_dim_vo=128, group_size=1, pos_encoding="none", use_sliding_window=False,
                    use_logits_soft_cap=False, mask_mode="causal", kv_layout="nhd", kv_storage="ragged")
    with pytest.raises(ValueError, match="fp8 queries are only"):
        VariantSpec(op="prefill", target="cpu", q_dtype="e4m3", kv_dtype="e4m3", o_dtype="bf16")
    with pytest.raises(ValueError, match="fp8 queries are only"):
        VariantSpec(op="decode", target="cuda", q_dtype="e4m3", kv_dtype="e4m3", o_dtype="bf16", head_dim_qk=128,
                    head_dim_vo=128, group_size=4, pos_encoding="none", use_sliding_window=False,
                    use_logits_soft_cap=False, kv_layout="nhd", kv_storage="paged")


@pytest.mark.parametrize("case_id", list(SUPPORTED))
def test_fp8_specs_take_sm90_or_say_why_not(case_id, tier_env):
    spec = SUPPORTED[case_id]
    assert prefill_sm90.sm90_unsupported(spec) is None
    assert prefill.tier(spec, ("9.0a",)) == "sm90"
    assert prefill.tier(spec, None) == "sm90"  # no arch list known: the only tier that runs it
    assert prefill.resident_blocks(spec) == 1
    for archs in (("8.0",), ("9.0",), ("8.0", "9.0a")):
        with pytest.raises(ValueError, match="runs on the sm90 prefill tier only.*not 9.0a only"):
            prefill.tier(spec, archs)
    tier_env.setenv("JITATTN_PREFILL_TIER", "sm80")
    with pytest.raises(ValueError, match="JITATTN_PREFILL_TIER is sm80"):
        prefill.tier(spec, ("9.0a",))


@pytest.mark.parametrize("case_id", list(UNSUPPORTED))
def test_fp8_specs_the_kernel_does_not_run(case_id, tier_env):
    spec, why = UNSUPPORTED[case_id]
    assert why in prefill_sm90.sm90_unsupported(spec)
    with pytest.raises(ValueError, match=f"runs on the sm90 prefill tier only.*{why}"):
        prefill.tier(spec, ("9.0a",))
    with pytest.raises(ValueError, match="sm90 prefill tier cannot run"):
        prefill_sm90.sm90_layout(spec)


@pytest.mark.parametrize("case_id", list(SUPPORTED))
def test_fp8_layout(case_id):
    spec = SUPPORTED[case_id]
    lay = prefill_sm90.sm90_layout(spec)
    assert lay["kFp8"] == 1 and lay["kBoxCols"] == 128 and lay["kChunks"] == lay["kChunksV"] == 1
    assert lay["kBN"] == prefill_sm90.SM90_FP8_KV_BLOCK == 128 and lay["kKSteps"] == 4 and lay["kPvSteps"] == 4
    assert lay["kQBytes"] == lay["kBM"] * 128 and lay["kKBytes"] == lay["kVBytes"] == 128 * 128
    # V^T's stages after the raw V's, then the barriers: 6 per stage (k, v^T full / empty, the raw V's full / empty)
    assert lay["kVtBytes"] == 128 * 128
    assert lay["kOffVt"] - lay["kOffV"] == lay["kStages"] * lay["kVBytes"]
    assert lay["kOffBar"] - lay["kOffVt"] == lay["kStages"] * lay["kVtBytes"]
    for name in ("kOffK", "kOffV", "kOffVt", "kOffBar"):
        assert lay[name] % 1024 == 0, name
    assert lay["kOffItems"] - lay["kOffBar"] >= 8 * (3 * lay["kQBufs"] + 6 * lay["kStages"] + 2 * lay["kItemRing"])
    assert lay["kPagedTma"] == (1 if spec.kv_storage is KVStorage.PAGED else 0)  # fp8 pages: TMA, never gathers
    assert lay["kSmemBytes"] <= 227 << 10 and lay["kRowSumMma"] == 0
    # the producer transposes V in 56 registers; the consumers take the rest of the launch's 168 x 384
    assert lay["kProducerRegs"] == 56 and lay["kConsumerRegs"] == 224
    assert 128 * lay["kProducerRegs"] + 256 * lay["kConsumerRegs"] <= 168 * 384


def test_16_bit_layouts_keep_their_constants():
    lay = prefill_sm90.sm90_layout(attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=bf16, kv_dtype=bf16, o_dtype=bf16, head_dim_qk=128, head_dim_vo=128,
        num_qo_heads=32, num_kv_heads=8, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
        use_logits_soft_cap=False, mask_mode=MaskMode.CAUSAL, kv_layout=KVLayout.NHD, kv_storage=KVStorage.RAGGED))
    # (P V steps: 128-key blocks of 16 keys a step)
    assert (lay["kFp8"], lay["kBoxCols"], lay["kKSteps"], lay["kPvSteps"], lay["kVtBytes"]) == (0, 64, 8, 8, 0)
    assert (lay["kProducerRegs"], lay["kConsumerRegs"], lay["kOffVt"]) == (24, 240, lay["kOffBar"])


@pytest.mark.parametrize("knob,fp8,bf16", [(0, 0, 0), (1, 0, 1), (2, 1, 1)])
def test_pv_overlap_leaves_the_fp8_kernel_out_unless_asked(monkeypatch, knob, fp8, bf16):
    """pv_overlap 1 (the default): the 16-bit kernels' softmax in its own basic block, not the fp8 kernel's (slower
    with it on the H200); 2: both."""
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "pv_overlap", knob)
    sixteen = attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
        head_dim_qk=128, head_dim_vo=128, num_qo_heads=32, num_kv_heads=8, pos_encoding=PosEncoding.NONE,
        use_sliding_window=False, use_logits_soft_cap=False, mask_mode=MaskMode.CAUSAL, kv_layout=KVLayout.NHD,
        kv_storage=KVStorage.RAGGED)
    assert prefill_sm90.sm90_layout(SUPPORTED["e4m3_causal_g4"])["kPvOverlap"] == fp8
    assert prefill_sm90.sm90_layout(sixteen)["kPvOverlap"] == bf16


def test_fp8_lazy_rescale_keeps_p_inside_e4m3(monkeypatch):
    """P reaches 2^lazy_rescale; e4m3's largest value is 448, so an e4m3 kernel takes at most 8 (e5m2: any)."""
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "lazy_rescale", 12)
    assert prefill_sm90.sm90_layout(SUPPORTED["e4m3_causal_g4"])["kLazyRescale"] == 8
    assert prefill_sm90.sm90_layout(SUPPORTED["e5m2_full_g1_f16"])["kLazyRescale"] == 12


def test_fp8_kv_block_knob(monkeypatch):
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "kv_block", 176)
    with pytest.raises(ValueError, match="an fp8 query takes KV blocks of 128"):
        prefill_sm90.sm90_layout(SUPPORTED["e4m3_causal_g4"])


def test_fp8_render(tier_env):
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    source = render(SUPPORTED["e4m3_causal_g4"])["kernel.cu"]
    assert "using q_t = __nv_fp8_e4m3;" in source and "constexpr int kFp8 = 1;" in source
    e5m2_source = render(SUPPORTED["e5m2_full_g1_f16"])["kernel.cu"]
    assert "using q_t = __nv_fp8_e5m2;" in e5m2_source and "using o_t = __half;" in e5m2_source


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_fp8_kernel_compiles_for_sm90a_without_a_gpu(tier_env, fresh_cache):
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    module = jitattn.load(SUPPORTED["e4m3_causal_g4"])
    assert set(module.entry_names) == {"attention"}

"""The cuda prefill tiers on the host: which specs the sm90 (Hopper) tier takes, how the arch list
and JITATTN_PREFILL_TIER choose between it and the sm80 tier, its shared-memory layout, and that
its source renders (and, with nvcc, compiles) for sm_90a without a GPU."""

from __future__ import annotations

import ctypes
import shutil
import time

import pytest
import torch

import jitattn
import jitattn.hardware
from jitattn import env
from jitattn.runtime.specs import attention_spec
from jitattn.kernels import prefill, prefill_sm90
from jitattn.jit import render
from jitattn.spec import DType, KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec
from jitattn.variant import AttentionVariant

bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32


def _spec(d=128, dtype=bf16, kv_dtype=None, o_dtype=None, dvo=None, causal=True, storage=KVStorage.RAGGED,
          pos=PosEncoding.NONE, window=False, soft_cap=False, mask=None, hq=32, hkv=8, variant=None,
          layout=KVLayout.NHD):
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=dtype, kv_dtype=kv_dtype or dtype, o_dtype=o_dtype or dtype, head_dim_qk=d,
        head_dim_vo=dvo or d, num_qo_heads=hq, num_kv_heads=hkv, pos_encoding=pos, use_sliding_window=window,
        use_logits_soft_cap=soft_cap, mask_mode=mask or (MaskMode.CAUSAL if causal else MaskMode.NONE),
        kv_layout=layout, kv_storage=storage, variant=variant,
    )


SUPPORTED = {
    "d128_bf16_causal": _spec(),
    "d128_bf16_full": _spec(causal=False),
    "d64_f16_mha": _spec(d=64, dtype=f16, hq=4, hkv=4),
    "d256_bf16_g8": _spec(d=256, hq=16, hkv=2),
    "paged_d128_bf16_causal": _spec(storage=KVStorage.PAGED),
    "paged_d64_f16_hnd": _spec(d=64, dtype=f16, causal=False, storage=KVStorage.PAGED, layout=KVLayout.HND),
    "paged_d256_bf16_g8": _spec(d=256, hq=16, hkv=2, storage=KVStorage.PAGED),
    "d128_bf16_causal_soft_cap": _spec(soft_cap=True),
    "paged_d64_f16_soft_cap": _spec(d=64, dtype=f16, hq=4, hkv=4, causal=False, soft_cap=True, storage=KVStorage.PAGED),
    "d256_bf16_soft_cap": _spec(d=256, hq=16, hkv=2, soft_cap=True),
    "d128_bf16_causal_window": _spec(window=True),
    "paged_d128_bf16_full_window_soft_cap": _spec(causal=False, window=True, soft_cap=True, storage=KVStorage.PAGED),
    "d64_f16_window": _spec(d=64, dtype=f16, hq=8, hkv=2, window=True),
    "d128_bf16_causal_sinks": _spec().replace(use_sinks=True),
    "paged_d64_f16_window_sinks": _spec(d=64, dtype=f16, hq=8, hkv=2, window=True, storage=KVStorage.PAGED).replace(
        use_sinks=True),
    "d128_bf16_causal_alibi": _spec(pos=PosEncoding.ALIBI),
    "paged_d64_f16_alibi_window": _spec(d=64, dtype=f16, hq=8, hkv=2, pos=PosEncoding.ALIBI, window=True,
                                        storage=KVStorage.PAGED),
    "d256_bf16_alibi_sinks": _spec(d=256, hq=16, hkv=2, causal=False, pos=PosEncoding.ALIBI).replace(use_sinks=True),
    "custom_mask": _spec(mask=MaskMode.CUSTOM),
    "paged_custom_mask_window": _spec(mask=MaskMode.CUSTOM, window=True, storage=KVStorage.PAGED),
    "f32_out": _spec(o_dtype=f32),
    "variant_logits": _spec(variant=AttentionVariant("plain", logits_transform="logits")),
    "paged_variant_mask_output": _spec(storage=KVStorage.PAGED, mask=MaskMode.CUSTOM, variant=AttentionVariant(
        "gate", logits_mask="kv_idx % 3 != 1", output_transform="out * 0.5f")),
    "paged_f16_in_bf16_out": _spec(dtype=f16, o_dtype=torch.bfloat16, storage=KVStorage.PAGED),
    "dqk192_dvo128_mha": _spec(d=192, dvo=128, hq=16, hkv=16),  # DeepSeek's MLA prefill (ragged)
    "dqk192_dvo128_window_cap": _spec(d=192, dvo=128, hq=8, hkv=8, causal=False, window=True, soft_cap=True),
}
UNSUPPORTED = {
    "paged_rope": _spec(storage=KVStorage.PAGED, pos=PosEncoding.ROPE_LLAMA),
    "paged_fp8_kv": _spec(storage=KVStorage.PAGED, kv_dtype=torch.float8_e4m3fn),
    "rope": _spec(pos=PosEncoding.ROPE_LLAMA),
    "alibi_soft_cap": _spec(pos=PosEncoding.ALIBI, soft_cap=True),
    "rope_soft_cap": _spec(pos=PosEncoding.ROPE_LLAMA, soft_cap=True),
    "fp8_kv": _spec(kv_dtype=torch.float8_e4m3fn),
    "d96": _spec(d=96),
    "dqk_ne_dvo_paged": _spec(d=192, dvo=128, storage=KVStorage.PAGED),  # pages are gathered: 24-piece rows do not
    "dqk576_dvo512": _spec(d=576, dvo=512, hq=16, hkv=1),
    "variant_no_softmax": _spec(variant=AttentionVariant("w", logits_transform="logits", use_softmax=False)),
    "variant_query_transform": _spec(variant=AttentionVariant("q2", query_transform="q * 2.0f")),
    "variant_soft_cap": _spec(soft_cap=True, variant=AttentionVariant("plain", logits_transform="logits")),
}


@pytest.fixture
def tier_env(monkeypatch):
    monkeypatch.delenv("JITATTN_PREFILL_TIER", raising=False)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    return monkeypatch


@pytest.mark.parametrize("case_id", list(SUPPORTED))
def test_supported_specs_take_sm90_on_hopper_only(case_id, tier_env):
    spec = SUPPORTED[case_id]
    assert prefill_sm90.sm90_unsupported(spec) is None
    assert prefill.tier(spec, ("9.0a",)) == "sm90"
    assert prefill.tier(spec, ("9.0a+PTX",)) == "sm90"
    for archs in (("8.0",), ("9.0",), ("8.0", "9.0a"), ("10.0a",), (), None):
        assert prefill.tier(spec, archs) == "sm80", archs


@pytest.mark.parametrize("case_id", list(UNSUPPORTED))
def test_unsupported_specs_keep_sm80(case_id, tier_env):
    spec = UNSUPPORTED[case_id]
    assert isinstance(prefill_sm90.sm90_unsupported(spec), str)
    assert prefill.tier(spec, ("9.0a",)) == "sm80"
    tier_env.setenv("JITATTN_PREFILL_TIER", "sm90")
    assert prefill.tier(spec, ("9.0a",)) == "sm80"  # forcing sm90 keeps the specs it cannot run on sm80
    with pytest.raises(ValueError, match="sm90 prefill tier cannot run"):
        prefill_sm90.sm90_layout(spec)


def test_resident_blocks_follow_the_tier(tier_env):
    """What a cascade's shared-level split fills: one block per SM on the sm90 tier, the sm80 layout's
    kMinBlocks otherwise (and without an arch list or GPU, the sm80 figure)."""
    from jitattn.jit import resident_blocks

    spec = SUPPORTED["paged_d128_bf16_causal"]
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    assert resident_blocks(spec) == 1
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "8.0")
    assert resident_blocks(spec) == prefill.cuda_layout(spec)["kMinBlocks"] >= 1
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    tier_env.setenv("JITATTN_PREFILL_TIER", "sm80")
    assert resident_blocks(spec) == prefill.cuda_layout(spec)["kMinBlocks"]
    tier_env.delenv("JITATTN_PREFILL_TIER")

    def no_gpu():
        raise jitattn.hardware.ArchListError("no visible CUDA GPU")

    tier_env.setattr("jitattn.hardware.cuda_arch_list", no_gpu)
    assert resident_blocks(spec) == prefill.cuda_layout(spec)["kMinBlocks"]


def test_the_knob_forces_a_tier(tier_env):
    spec = SUPPORTED["d128_bf16_causal"]
    tier_env.setenv("JITATTN_PREFILL_TIER", "sm80")
    assert prefill.tier(spec, ("9.0a",)) == "sm80"
    tier_env.setenv("JITATTN_PREFILL_TIER", "SM90")
    assert prefill.tier(spec, None) == "sm90"  # an unknown arch list (no GPU here) is taken at its word
    assert prefill.tier(spec, ("9.0a",)) == "sm90"
    with pytest.raises(ValueError, match="9.0a-only CUDA arch list"):
        prefill.tier(spec, ("8.0",))
    tier_env.setenv("JITATTN_PREFILL_TIER", "hopper")
    assert "JITATTN_PREFILL_TIER" in env.problems()
    with pytest.raises(ValueError, match="not a prefill tier"):
        prefill.tier(spec, ("9.0a",))
    tier_env.setenv("JITATTN_PREFILL_TIER", "auto")
    assert "JITATTN_PREFILL_TIER" not in env.problems()
    assert any(row[0] == "JITATTN_PREFILL_TIER" for row in env.describe())


@pytest.mark.parametrize("case_id", list(SUPPORTED))
def test_sm90_layout_fits_and_aligns(case_id):
    spec = SUPPORTED[case_id]
    layout = prefill_sm90.sm90_layout(spec)
    assert layout["kSmemBytes"] <= 227 << 10
    for name in ("kOffK", "kOffV", "kOffBar"):
        assert layout[name] % 1024 == 0, name  # 128-byte swizzle atoms start on 1 KiB
    assert layout["kD"] == spec.head_dim_qk and layout["kChunks"] * 64 == layout["kD"]
    assert layout["kDV"] == spec.head_dim_vo and layout["kChunksV"] * 64 == layout["kDV"]
    blocks = prefill_sm90.SM90_PAGED_KV_BLOCK if spec.kv_storage is KVStorage.PAGED else prefill_sm90.SM90_KV_BLOCK
    consumers = prefill_sm90.SM90_TUNING["consumers_d64"] if spec.head_dim_qk == 64 else 2
    assert layout["kBM"] == 64 * consumers and layout["kThreads"] == 128 * (1 + consumers)
    block = prefill_sm90.SM90_KV_BLOCK_3WG if consumers == 3 else blocks[spec.head_dim_qk]
    assert layout["kBN"] == block and layout["kGroup"] == spec.group_size
    assert layout["kStages"] == (prefill_sm90.SM90_TUNING["kv_stages"] or (4 if consumers == 3 else 2))
    assert layout["kOffV"] - layout["kOffK"] == layout["kStages"] * layout["kKBytes"]
    assert layout["kOffBar"] - layout["kOffV"] == layout["kStages"] * layout["kVBytes"]
    # Barriers (per query buffer q full TMA / gathered, q empty; k, v full / empty per stage), then the paged row
    # tables, then (custom masks) a word per stage saying whether the producer loaded it, then (a 16-bit output
    # staged) each consumer warp's 16 rows x 64 columns.
    assert layout["kQBufs"] == prefill_sm90.SM90_TUNING["q_buffers"]
    assert layout["kOffK"] == layout["kQBufs"] * layout["kQBytes"]
    assert layout["kOffTab"] - layout["kOffBar"] >= 8 * (3 * layout["kQBufs"] + 4 * layout["kStages"])
    assert layout["kOffTab"] % 16 == 0
    tables = 2 * layout["kBN"] * 16 if spec.kv_storage is KVStorage.PAGED else 0
    assert layout["kOffLive"] == layout["kOffTab"] + tables
    live = 16 * -(-4 * layout["kStages"] // 16) if spec.mask_mode is MaskMode.CUSTOM else 0
    assert layout["kOffStageO"] >= layout["kOffLive"] + live and layout["kOffStageO"] % 128 == 0
    staged = 4 * consumers * 16 * 64 * 2 if layout["kStageO"] else 0
    assert layout["kStageO"] in (0, 1) and (spec.o_dtype in (DType.F16, DType.BF16) or not layout["kStageO"])
    assert layout["kSmemBytes"] == layout["kOffStageO"] + staged + 1024
    # Registers: producer and consumer warpgroups within the SM's 64 Ki, setmaxnreg's multiples of 8.
    assert 128 * layout["kProducerRegs"] + 128 * consumers * layout["kConsumerRegs"] <= 65536
    # setmaxnreg moves registers within the CTA's launch allocation (kThreads x the launch count, at most
    # 64 Ki / kThreads rounded down to 8): what the consumers add must be what the producer gives back, or their
    # increase never returns.
    launch = 65536 // layout["kThreads"] // 8 * 8
    assert layout["kProducerRegs"] + consumers * layout["kConsumerRegs"] <= (1 + consumers) * launch
    assert layout["kProducerRegs"] % 8 == 0 and layout["kConsumerRegs"] % 8 == 0


def test_sm90_producer_registers(monkeypatch):
    """The producer keeps 56 registers where its paged loads spilled at 24 (paged KV up to head_dim 128 beside two
    consumer warpgroups; H100: paged rows 4-8% faster), 24 elsewhere (d256's consumers need theirs, three consumer
    warpgroups take 160 each); SM90_TUNING producer_regs sets it beside two consumers, the rest theirs."""
    def regs(case):
        layout = prefill_sm90.sm90_layout(SUPPORTED[case])
        return layout["kProducerRegs"], layout["kConsumerRegs"]
    assert regs("paged_d128_bf16_causal") == (56, 224)
    assert regs("d128_bf16_causal") == regs("paged_d256_bf16_g8") == (24, 240)
    assert regs("paged_d64_f16_hnd") == (24, 160)
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "producer_regs", 40)
    assert regs("d128_bf16_causal") == regs("paged_d128_bf16_causal") == (40, 232)
    assert regs("paged_d64_f16_hnd") == (24, 160)  # three consumer warpgroups: no registers to give
    for bad in (16, 44, 128):
        monkeypatch.setitem(prefill_sm90.SM90_TUNING, "producer_regs", bad)
        with pytest.raises(ValueError, match="producer_regs 0 or 24 to 120 by 8"):
            prefill_sm90.sm90_layout(SUPPORTED["d128_bf16_causal"])


def test_gqa_packing_choice():
    assert prefill_sm90.sm90_pack(_spec(d=128, hq=32, hkv=8)) == 4     # the group of a KV head fills the rows
    assert prefill_sm90.sm90_pack(_spec(d=256, hq=16, hkv=2)) == 8
    assert prefill_sm90.sm90_pack(_spec(d=128, hq=6, hkv=2)) == 1      # 3 does not divide the 128-row tile
    assert prefill_sm90.sm90_pack(_spec(d=64, hq=32, hkv=8)) == 1      # measured slower packed at head_dim 64
    assert prefill_sm90.sm90_layout(_spec(d=128, hq=32, hkv=8))["kPackG"] == 4


def test_render_follows_the_arch_list(tier_env):
    spec = SUPPORTED["d128_bf16_causal"]
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    hopper = render(spec)["kernel.cu"]
    assert "sm90 tier" in hopper and "wgmma::mma_ss" in hopper
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "8.0")
    generic = render(spec)["kernel.cu"]
    assert "sm90 tier" not in generic and "sm80+ generic tier" in generic
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    tier_env.setenv("JITATTN_PREFILL_TIER", "sm80")
    assert render(spec)["kernel.cu"] == generic
    tier_env.setenv("JITATTN_PREFILL_TIER", "sm90")
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "8.0;9.0a")
    with pytest.raises(ValueError, match="9.0a-only"):
        render(spec)
    # Other families and the cpu target are untouched by the knob.
    cpu = VariantSpec(op="prefill", target="cpu", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16")
    assert "sm90 tier" not in render(cpu)["kernel.cpp"]


@pytest.mark.parametrize("case_id", list(SUPPORTED))
def test_sm90_render_compiles_in_exactly_the_spec_axes(case_id, tier_env):
    """The soft cap and the window are template constants (a plain spec's kernel compiles them away);
    the host-side checks refuse run-time scalars the kernel was not compiled for."""
    spec = SUPPORTED[case_id]
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    source = render(spec)["kernel.cu"]
    assert "sm90 tier" in source
    assert f"constexpr bool kSoftCap = {'true' if spec.use_logits_soft_cap else 'false'};" in source
    assert f"constexpr bool kSwa = {'true' if spec.use_sliding_window else 'false'};" in source
    assert f"constexpr int kSoftCapTanh = {1 if spec.use_logits_soft_cap else 0};" in source  # tanh.approx
    assert "this kernel is compiled without a sliding window" in source


def test_sm90_soft_cap_tanh_knob(monkeypatch):
    spec = SUPPORTED["d128_bf16_causal_soft_cap"]
    assert prefill_sm90.sm90_layout(spec)["kSoftCapTanh"] == 1  # the default: tanh.approx
    # a spec without a soft cap renders the same source (the same cache entry) whatever the knob says
    assert prefill_sm90.sm90_layout(spec.replace(use_logits_soft_cap=False))["kSoftCapTanh"] == 0
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "soft_cap_tanh", 0)
    assert prefill_sm90.sm90_layout(spec)["kSoftCapTanh"] == 0
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "soft_cap_tanh", 2)
    with pytest.raises(ValueError, match="soft_cap_tanh"):
        prefill_sm90.sm90_layout(spec)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
@pytest.mark.parametrize("case_id", ["d64_f16_mha", "paged_d128_bf16_causal", "paged_d128_bf16_full_window_soft_cap",
                                     "dqk192_dvo128_mha"])
def test_sm90_tier_compiles_for_sm90a_without_a_gpu(case_id, tier_env, fresh_cache):
    spec = SUPPORTED[case_id]
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    started = time.perf_counter()
    module = jitattn.load(spec)
    seconds = time.perf_counter() - started
    print(f"\ncold nvcc build + load of {spec.uri} (sm90 tier, sm_90a): {seconds:.2f} s")
    assert set(module.entry_names) == {"attention"}
    assert "sm90 tier" in (module.path.parent / "sources" / "kernel.cu").read_text()


def test_sm90_gather_knobs(monkeypatch):
    """SM90_TUNING (the experiments of tools/bench_paged_sm90.py): the defaults are the tested kernel,
    paged_kv_block applies to paged specs only, and bad values are refused."""
    paged, ragged = SUPPORTED["paged_d128_bf16_causal"], SUPPORTED["d128_bf16_causal"]
    layout = prefill_sm90.sm90_layout(paged)
    assert (layout["kGatherSync"], layout["kGatherL2"]) == (0, 0)
    assert layout["kBN"] == prefill_sm90.SM90_PAGED_KV_BLOCK[128]
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "paged_kv_block", 176)
    assert prefill_sm90.sm90_layout(paged)["kBN"] == 176
    assert prefill_sm90.sm90_layout(ragged)["kBN"] == prefill_sm90.SM90_KV_BLOCK[128]
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "gather_sync", 2)
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "gather_l2", 256)
    assert (prefill_sm90.sm90_layout(paged)["kGatherSync"], prefill_sm90.sm90_layout(paged)["kGatherL2"]) == (2, 256)
    assert layout["kPagedTma"] == 1, "paged TMA: paged specs only"
    assert prefill_sm90.sm90_layout(ragged)["kPagedTma"] == 0, "paged TMA: paged specs only"
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "paged_tma", 0)
    assert prefill_sm90.sm90_layout(paged)["kPagedTma"] == 0
    for key, bad in (("gather_sync", 4), ("gather_l2", 32), ("paged_kv_block", 100), ("soft_cap_tanh", -1),
                     ("paged_tma", 3)):
        monkeypatch.setitem(prefill_sm90.SM90_TUNING, key, bad)
        with pytest.raises(ValueError, match="SM90_TUNING"):
            prefill_sm90.sm90_layout(paged)
        monkeypatch.setitem(prefill_sm90.SM90_TUNING, key, 0)


def test_sm90_trace_renders_only_when_set(monkeypatch, tier_env, fresh_cache):
    """SM90_TUNING trace (tools/trace_prefill.py): off, the source has no stamps (the tested kernel); on, every
    phase is stamped and the module (built where nvcc is) exports the copy and clear entry points; other values
    are refused."""
    spec = SUPPORTED["paged_d128_bf16_causal"]
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    plain = render(spec)["kernel.cu"]
    assert "trace_stamp" not in plain and "globaltimer" not in plain
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "trace", 1)
    traced = render(spec)["kernel.cu"]
    assert all(f"trace_stamp({field})" in traced for field in (0, 1, 2, 3, 4, 5, 6, 7, 10))
    assert "jitattn_prefill_trace(void* dst)" in traced and "jitattn_prefill_trace_clear()" in traced
    if shutil.which("nvcc") is not None:
        library = ctypes.CDLL(str(jitattn.load(spec).path))
        assert hasattr(library, "jitattn_prefill_trace") and hasattr(library, "jitattn_prefill_trace_clear")
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "trace", 2)
    with pytest.raises(ValueError, match="SM90_TUNING"):
        prefill_sm90.sm90_layout(spec)


def test_hardware_facts_come_from_one_module(tier_env):
    """The arch list (and its errors) is read in one place: jit's toolchain reports it as a ToolchainError."""
    from jitattn import hardware

    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "8.0;9.0a")
    assert hardware.cuda_arch_list() == ("8.0", "9.0a") == jitattn.jit.toolchain.cuda_arch_list()
    assert not hardware.hopper_only(hardware.known_arch_list())
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a+PTX")
    assert hardware.hopper_only(hardware.known_arch_list()) and not hardware.hopper_only(None)
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "sm_90")
    with pytest.raises(hardware.ArchListError, match="not an arch"):
        hardware.cuda_arch_list()
    with pytest.raises(jitattn.jit.ToolchainError, match="not an arch"):
        jitattn.jit.toolchain.cuda_arch_list()
    assert hardware.known_arch_list() is None


def test_custom_mask_modules_of_the_sm90_tier_export_mask_states(tier_env):
    """The block states a custom-mask plan writes once (``mask_states``) exist on the sm90 tier only, with the
    attention entry's fields; other specs and tiers export ``attention`` alone."""
    custom, plain = SUPPORTED["custom_mask"], SUPPORTED["d128_bf16_causal"]
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    names = [e.name for e in prefill.entries(custom)]
    assert names == ["attention", "mask_states"]
    assert prefill.entries(custom)[1].fields == prefill.entries(custom)[0].fields
    assert [e.name for e in prefill.entries(plain)] == ["attention"]
    source = render(custom)["kernel.cu"]
    assert "jitattn_mask_states(const MaskStatesParams*" in source and "_mask_states<<<" in source
    assert "jitattn_mask_states(" not in render(plain)["kernel.cu"]
    tier_env.setenv("JITATTN_CUDA_ARCH_LIST", "8.0")
    assert [e.name for e in prefill.entries(custom)] == ["attention"]
    assert "jitattn_mask_states(" not in render(custom)["kernel.cu"]


@pytest.mark.parametrize("case_id", ["custom_mask", "paged_custom_mask_window"])
def test_mask_states_bytes_cover_every_virtual_tile(case_id):
    """A row per virtual tile of the kernel's items (``tile_base(batch)``: a request's tiles and one spare), each a
    word (the tile's last block seen) and the most KV blocks of a request rounded up to 4, after the header, and 8
    spare bytes; none without a custom mask."""
    spec = SUPPORTED[case_id]
    layout = prefill_sm90.sm90_layout(spec)
    bm, bn, pack = layout["kBM"], layout["kBN"], layout["kPackG"]
    qo_lens, kv_lens = [1, 37, 300, 0, 129], [1, 200, 4100, 5, 129]
    starts = [sum(qo_lens[:r]) for r in range(len(qo_lens) + 1)]
    tiles = len(qo_lens) + starts[-1] * pack // bm  # the kernel's tile_base(batch)
    assert all(r + starts[r] * pack // bm + -(-q * pack // bm) <= tiles for r, q in enumerate(qo_lens))
    stride = -(-max(-(-k // bn) for k in kv_lens) // 4) * 4
    header = prefill_sm90.MASK_STATES_HEADER
    assert prefill_sm90.mask_states_bytes(spec, qo_lens, kv_lens) == header + tiles * (4 + stride) + 8
    assert prefill_sm90.mask_states_bytes(SUPPORTED["d128_bf16_causal"], qo_lens, kv_lens) == 0
    assert prefill_sm90.mask_states_bytes(spec, [], []) == 0

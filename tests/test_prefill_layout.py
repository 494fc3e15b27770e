"""The cuda prefill layout (jitattn.kernels.prefill.cuda_layout) on the host: every documented
combination gets a tile whose shared memory fits the H200's opt-in limit per block, and the
resident-block count the kernel is compiled for (``kMinBlocks``) fits the SM."""

from __future__ import annotations

import itertools

import pytest

from jitattn.kernels.prefill import TUNING, cuda_layout
from jitattn.spec import ASYMMETRIC_HEAD_DIMS, SUPPORTED_HEAD_DIMS, VariantSpec
from jitattn.variant import AttentionVariant

OPT_IN_LIMIT = 227 << 10  # cudaDevAttrMaxSharedMemoryPerBlockOptin on H100/H200
RUNTIME_RESERVED = 1024   # per resident block

HEAD_DIMS = [(d, d) for d in SUPPORTED_HEAD_DIMS] + [hd for hd in ASYMMETRIC_HEAD_DIMS if hd[0] <= 256]
# Query/key transforms make bf16 keep hi + lo pairs in shared memory, as RoPE does.
QK_TRANSFORM = AttentionVariant("qscale", query_transform="q * 0.5f", key_transform="k * 2.0f")


def _specs():
    for (dqk, dvo), q, kv_kind, o, pos, swa, cap, mask, layout, storage in itertools.product(
            HEAD_DIMS, ("f16", "bf16"), ("same", "e4m3", "e5m2"), ("f16", "bf16", "f32"), ("none", "rope", "alibi"),
            (False, True), (False, True), ("none", "causal", "custom"), ("nhd", "hnd"), ("paged", "ragged")):
        yield dict(op="prefill", target="cuda", q_dtype=q, kv_dtype=q if kv_kind == "same" else kv_kind, o_dtype=o,
                   head_dim_qk=dqk, head_dim_vo=dvo, group_size=4, pos_encoding=pos, use_sliding_window=swa,
                   use_logits_soft_cap=cap, mask_mode=mask, kv_layout=layout, kv_storage=storage)


def _check(spec: VariantSpec) -> dict[str, int]:
    layout = cuda_layout(spec)
    blocks = layout["kMinBlocks"]
    assert blocks in (1, TUNING["blocks_per_sm"]), spec.uri
    assert layout["kSmemBytes"] <= OPT_IN_LIMIT, spec.uri
    assert blocks * (layout["kSmemBytes"] + RUNTIME_RESERVED) <= TUNING["smem_per_sm"], spec.uri
    assert layout["kCtaKV"] in (16, 32, 64), spec.uri
    assert layout["kOffFreq"] + (layout["kDQK"] // 2 * 8 if spec.pos_encoding.value == "rope" else 0) \
        <= layout["kSmemBytes"], spec.uri
    return layout


def test_every_documented_prefill_combination_has_a_layout() -> None:
    count = 0
    for fields in _specs():
        _check(VariantSpec(**fields))
        count += 1
    assert count == len(HEAD_DIMS) * 2 * 3 * 3 * 3 * 2 * 2 * 3 * 2 * 2


@pytest.mark.parametrize("dim", [128, 192, 224, 256])
@pytest.mark.parametrize("q", ["f16", "bf16"])
def test_variants_with_qk_transforms_have_a_layout(dim: int, q: str) -> None:
    for kv, pos in itertools.product((q, "e4m3"), ("none", "rope")):
        _check(VariantSpec(op="prefill", target="cuda", q_dtype=q, kv_dtype=kv, o_dtype="f32", head_dim_qk=dim,
                           head_dim_vo=dim, group_size=1, pos_encoding=pos, use_sliding_window=True,
                           use_logits_soft_cap=True, mask_mode="causal", kv_layout="hnd", kv_storage="paged",
                           variant=QK_TRANSFORM))


@pytest.mark.parametrize("uri", [
    "prefill_ragged_cuda_bf16_of32_hd256_g4_rope_swa_causal_nhd",         # was: 149504 B, over 115200
    "prefill_paged_cuda_bf16_kve4m3_of32_hd224_g4_rope_softcap_causal_hnd",  # was: 134528 B
])
def test_previously_refused_tiles_keep_two_blocks_per_sm(uri: str) -> None:
    from jitattn.spec_text import parse_spec_text

    layout = _check(parse_spec_text(uri))
    assert layout["kMinBlocks"] == 2 and layout["kCtaKV"] == 16


def test_tiles_that_fit_keep_their_width() -> None:
    """Configurations that fitted before keep their KV block (their renders are unchanged)."""
    assert cuda_layout(VariantSpec(op="prefill", target="cuda", q_dtype="f16", kv_dtype="f16", o_dtype="f16",
                                   head_dim_qk=128, head_dim_vo=128, group_size=4, pos_encoding="rope",
                                   use_sliding_window=False, use_logits_soft_cap=False, mask_mode="causal",
                                   kv_layout="nhd", kv_storage="paged"))["kCtaKV"] == 64
    assert cuda_layout(VariantSpec(op="prefill", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16",
                                   head_dim_qk=256, head_dim_vo=256, group_size=4, pos_encoding="none",
                                   use_sliding_window=False, use_logits_soft_cap=False, mask_mode="causal",
                                   kv_layout="nhd", kv_storage="ragged"))["kCtaKV"] == 32


def test_one_block_per_sm_when_two_do_not_fit() -> None:
    """A tuning with deeper pipelines falls back to one resident block under the opt-in limit."""
    spec = VariantSpec(op="prefill", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="f32", head_dim_qk=256,
                       head_dim_vo=256, group_size=4, pos_encoding="rope", use_sliding_window=True,
                       use_logits_soft_cap=False, mask_mode="causal", kv_layout="nhd", kv_storage="ragged")
    layout = cuda_layout(spec, {"stages": 4})
    assert layout["kMinBlocks"] == 1
    assert layout["kSmemBytes"] <= OPT_IN_LIMIT
    with pytest.raises(ValueError, match="shared memory"):
        cuda_layout(spec, {"stages": 12})

"""VariantSpec: validation errors, accepted spellings, the uri grammar, value semantics.

Pure Python: nothing here renders or builds.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
import torch

from jitattn.spec import (
    DType, KVLayout, MaskMode, Op, PosEncoding, SUPPORTED_HEAD_DIMS, Target, VariantSpec,
)

# One valid spec per kernel family: every compile-time axis of (op, target) set.
MERGE_CPU = dict(op="merge", target="cpu", o_dtype="f32")
DECODE_CUDA = dict(
    op="decode", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16",
    head_dim_qk=128, head_dim_vo=128, group_size=4, pos_encoding="none",
    use_sliding_window=False, use_logits_soft_cap=False, kv_layout="nhd", kv_storage="paged",
)
PREFILL_CUDA = {**DECODE_CUDA, "op": "prefill", "mask_mode": "causal", "kv_storage": "ragged"}
DECODE_CPU = dict(op="decode", target="cpu", q_dtype="f16", kv_dtype="f16", o_dtype="f16")


def _spec(base: dict, **changes) -> VariantSpec:
    fields = {**base, **changes}
    return VariantSpec(**{k: v for k, v in fields.items() if v is not _DROP})


_DROP = object()  # a sentinel value meaning "leave this field out"


def test_base_specs_are_valid():
    for base in (MERGE_CPU, DECODE_CUDA, PREFILL_CUDA, DECODE_CPU):
        assert VariantSpec(**base).uri.startswith(base["op"])


# (case id, base spec, changed fields, the field the error must name first, a hint the message must carry)
BAD_FIELDS = [
    ("op-unknown", MERGE_CPU, dict(op="attend"), "op", "'decode'"),
    ("target-unknown", MERGE_CPU, dict(target="tpu"), "target", "'cuda'"),
    ("q_dtype-unknown", DECODE_CUDA, dict(q_dtype="int8"), "q_dtype", "'bf16'"),
    ("kv_dtype-unknown", DECODE_CUDA, dict(kv_dtype="fp4"), "kv_dtype", "'e4m3'"),
    ("o_dtype-unknown", MERGE_CPU, dict(o_dtype="double"), "o_dtype", "'f32'"),
    ("pos_encoding-unknown", DECODE_CUDA, dict(pos_encoding="xpos"), "pos_encoding", "'rope'"),
    ("mask_mode-unknown", PREFILL_CUDA, dict(mask_mode="sliding"), "mask_mode", "'causal'"),
    ("kv_layout-unknown", DECODE_CUDA, dict(kv_layout="nchw"), "kv_layout", "'hnd'"),
    ("kv_storage-unknown", DECODE_CUDA, dict(kv_storage="sparse"), "kv_storage", "'paged'"),
    ("idtype-unknown", MERGE_CPU, dict(idtype="i64"), "idtype", "'i32'"),
    ("q_dtype-fp8", DECODE_CUDA, dict(q_dtype="e4m3", kv_dtype="e4m3"), "q_dtype", "fp8"),
    ("o_dtype-fp8", DECODE_CUDA, dict(o_dtype="e5m2"), "o_dtype", "fp8"),
    ("q_dtype-f32-on-cuda", DECODE_CUDA, dict(q_dtype="f32", kv_dtype="f32", o_dtype="f32"), "q_dtype", "cpu target"),
    ("kv_dtype-f32-on-cuda", {**DECODE_CUDA, "op": "append"}, dict(
        q_dtype=_DROP, o_dtype=_DROP, head_dim_qk=_DROP, head_dim_vo=_DROP, group_size=_DROP, pos_encoding=_DROP,
        use_sliding_window=_DROP, use_logits_soft_cap=_DROP, kv_layout=_DROP, kv_storage=_DROP, kv_dtype="f32",
    ), "kv_dtype", "cuda"),
    ("head_dim-36", DECODE_CUDA, dict(head_dim_qk=36, head_dim_vo=36), "head_dim_qk", "multiple of 8"),
    ("head_dim-264", DECODE_CUDA, dict(head_dim_qk=264, head_dim_vo=264), "head_dim_qk", "256"),
    ("head_dim-20", DECODE_CUDA, dict(head_dim_qk=20, head_dim_vo=20), "head_dim_qk", "from 8"),
    ("head_dim-128x64", DECODE_CUDA, dict(head_dim_qk=128, head_dim_vo=64), "head_dim_qk", "(192, 128)"),
    ("head_dim-512-symmetric", DECODE_CUDA, dict(head_dim_qk=512, head_dim_vo=512), "head_dim_qk", "(576, 512)"),
    ("head_dim-str", DECODE_CUDA, dict(head_dim_qk="128"), "head_dim_qk", "int"),
    ("head_dim-bool", DECODE_CUDA, dict(head_dim_vo=True), "head_dim_vo", "int"),
    ("group_size-0", DECODE_CUDA, dict(group_size=0), "group_size", ">= 1"),
    ("group_size-negative", DECODE_CUDA, dict(group_size=-4), "group_size", ">= 1"),
    ("use_sliding_window-str", DECODE_CUDA, dict(use_sliding_window="yes"), "use_sliding_window", "True, False"),
    ("use_logits_soft_cap-int", DECODE_CUDA, dict(use_logits_soft_cap=1), "use_logits_soft_cap", "True, False"),
    ("axis-not-specialised-merge-head_dim", MERGE_CPU, dict(head_dim_qk=128, head_dim_vo=128), "head_dim_qk",
     "leave it None"),
    ("axis-not-specialised-merge-q_dtype", MERGE_CPU, dict(q_dtype="f32"), "q_dtype", "leave it None"),
    ("axis-not-specialised-cpu-decode-group_size", DECODE_CPU, dict(group_size=4), "group_size", "leave it None"),
    ("axis-not-specialised-cuda-decode-mask_mode", DECODE_CUDA, dict(mask_mode="causal"), "mask_mode",
     "leave it None"),
    ("required-axis-missing-o_dtype", MERGE_CPU, dict(o_dtype=_DROP), "o_dtype", "set o_dtype"),
    ("required-axis-missing-group_size", DECODE_CUDA, dict(group_size=_DROP), "group_size", "set group_size"),
    ("required-axis-missing-mask_mode", PREFILL_CUDA, dict(mask_mode=_DROP), "mask_mode", "set mask_mode"),
    ("kv_dtype-differs-without-fp8", DECODE_CUDA, dict(q_dtype="f16", o_dtype="f16", kv_dtype="bf16"), "kv_dtype",
     "only fp8"),
]


@pytest.mark.parametrize("base, changes, field, hint", [c[1:] for c in BAD_FIELDS], ids=[c[0] for c in BAD_FIELDS])
def test_each_bad_field_raises_its_own_value_error_naming_the_field(base, changes, field, hint):
    with pytest.raises(ValueError) as info:
        _spec(base, **changes)
    message = str(info.value)
    # The message leads with the offending field (not some other field it tripped over) ...
    assert re.match(rf"{field}\b", message), f"error does not lead with {field!r}: {message}"
    # ... and says what is supported or what to do.
    assert hint in message, f"error for {field} lacks {hint!r}: {message}"


@pytest.mark.parametrize("head_dim", SUPPORTED_HEAD_DIMS)
def test_every_multiple_of_8_from_8_to_256_is_a_supported_head_dim(head_dim):
    spec = _spec(DECODE_CUDA, head_dim_qk=head_dim, head_dim_vo=head_dim)
    assert f"_hd{head_dim}_" in spec.uri


def test_supported_head_dims_are_exactly_the_multiples_of_8_from_8_to_256():
    assert SUPPORTED_HEAD_DIMS == tuple(range(8, 257, 8))


@pytest.mark.parametrize("qk, vo, token", [(192, 128, "hd192x128"), (576, 512, "hd576x512")])
@pytest.mark.parametrize("base", [DECODE_CUDA, PREFILL_CUDA], ids=["decode", "prefill"])
def test_asymmetric_head_dims_of_deepseek_and_mla_are_accepted(base, qk, vo, token):
    spec = _spec(base, head_dim_qk=qk, head_dim_vo=vo)
    assert (spec.head_dim_qk, spec.head_dim_vo) == (qk, vo)
    assert f"_{token}_" in spec.uri


def test_fp8_kv_may_differ_from_q():
    spec = _spec(DECODE_CUDA, kv_dtype="e4m3")
    assert spec.kv_dtype is DType.E4M3 and spec.q_dtype is DType.BF16


def test_f32_is_accepted_on_cpu():
    spec = _spec(DECODE_CPU, q_dtype="f32", kv_dtype="f32", o_dtype="f32")
    assert spec.q_dtype is DType.F32


def test_replace_revalidates():
    spec = VariantSpec(**DECODE_CUDA)
    with pytest.raises(ValueError, match="head_dim_qk"):
        spec.replace(head_dim_qk=36, head_dim_vo=36)


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="head_size"):
        VariantSpec.from_dict({**MERGE_CPU, "head_size": 128})


# -- accepted spellings --------------------------------------------------------

@pytest.mark.parametrize("field, spelling, expected", [
    ("pos_encoding", "NONE", PosEncoding.NONE),
    ("pos_encoding", "ROPE_LLAMA", PosEncoding.ROPE_LLAMA),
    ("pos_encoding", "ALIBI", PosEncoding.ALIBI),
    ("pos_encoding", PosEncoding.ALIBI, PosEncoding.ALIBI),
    ("kv_layout", "NHD", KVLayout.NHD),
    ("kv_layout", "HND", KVLayout.HND),
    ("q_dtype", torch.float16, DType.F16),
    ("q_dtype", torch.bfloat16, DType.BF16),
    ("q_dtype", "bfloat16", DType.BF16),
    ("q_dtype", "float16", DType.F16),
    ("q_dtype", "half", DType.F16),
    ("q_dtype", "fp16", DType.F16),
    ("kv_dtype", torch.float8_e4m3fn, DType.E4M3),
    ("kv_dtype", torch.float8_e5m2, DType.E5M2),
    ("kv_dtype", "fp8_e4m3", DType.E4M3),
    ("kv_dtype", "float8_e5m2", DType.E5M2),
])
def test_flashinfer_and_torch_spellings_parse(field, spelling, expected):
    changes = {field: spelling}
    if field == "q_dtype":
        changes.update(kv_dtype=spelling, o_dtype=spelling)
    spec = _spec(DECODE_CUDA, **changes)
    assert getattr(spec, field) is expected


@pytest.mark.parametrize("spelling", ["f32", "float32", "fp32", "float", torch.float32, DType.F32, " F32 "])
def test_spellings_of_one_dtype_give_equal_specs(spelling):
    assert VariantSpec("merge", "cpu", o_dtype=spelling) == VariantSpec(Op.MERGE, Target.CPU, o_dtype=DType.F32)


def test_mask_mode_accepts_upper_case():
    assert _spec(PREFILL_CUDA, mask_mode="CAUSAL").mask_mode is MaskMode.CAUSAL


# -- the uri grammar -----------------------------------------------------------

URI_EXAMPLES = [
    (MERGE_CPU, {}, "merge_cpu_f32", "jitattn_merge_f32"),
    (MERGE_CPU, dict(target="cuda", o_dtype="bf16"), "merge_cuda_bf16", "jitattn_merge_bf16"),
    (DECODE_CUDA, {}, "decode_paged_cuda_bf16_hd128_g4_nhd", "jitattn_decode_paged_bf16_hd128_g4_nhd"),
    (DECODE_CUDA, dict(q_dtype="f16", kv_dtype="e4m3", o_dtype="f16", group_size=8, pos_encoding="ROPE_LLAMA",
                       use_sliding_window=True, use_logits_soft_cap=True, kv_layout="HND"),
     "decode_paged_cuda_f16_kve4m3_hd128_g8_rope_swa_softcap_hnd",
     "jitattn_decode_paged_f16_kve4m3_hd128_g8_rope_swa_softcap_hnd"),
    (DECODE_CUDA, dict(pos_encoding="ALIBI", group_size=1), "decode_paged_cuda_bf16_hd128_g1_alibi_nhd", None),
    (DECODE_CUDA, dict(o_dtype="f32"), "decode_paged_cuda_bf16_of32_hd128_g4_nhd", None),
    (PREFILL_CUDA, dict(head_dim_qk=192, head_dim_vo=128), "prefill_ragged_cuda_bf16_hd192x128_g4_causal_nhd",
     "jitattn_prefill_ragged_bf16_hd192x128_g4_causal_nhd"),
    (PREFILL_CUDA, dict(head_dim_qk=576, head_dim_vo=512, mask_mode="custom", kv_storage="paged"),
     "prefill_paged_cuda_bf16_hd576x512_g4_custom_nhd", None),
    (PREFILL_CUDA, dict(mask_mode="none"), "prefill_ragged_cuda_bf16_hd128_g4_nhd", None),
    (DECODE_CPU, dict(o_dtype="f32"), "decode_cpu_f16_of32", "jitattn_decode_f16_of32"),
    (dict(op="append", target="cuda", kv_dtype="e4m3"), {}, "append_cuda_e4m3", "jitattn_append_e4m3"),
]


@pytest.mark.parametrize("base, changes, uri, kernel_name", URI_EXAMPLES, ids=[e[2] for e in URI_EXAMPLES])
def test_uri_grammar_examples(base, changes, uri, kernel_name):
    spec = _spec(base, **changes)
    assert spec.uri == uri
    expected_kernel = kernel_name or "jitattn_" + uri.replace(f"_{spec.target.value}", "", 1)
    assert spec.kernel_name == expected_kernel


def _valid_decode_grid():
    for dtype, kv, hd, g, pos, swa, cap, layout, storage in itertools.product(
        ("f16", "bf16"), ("same", "e4m3", "e5m2"), ((64, 64), (128, 128), (192, 128)), (1, 4, 8),
        ("none", "rope", "alibi"), (False, True), (False, True), ("nhd", "hnd"), ("paged", "ragged"),
    ):
        yield _spec(DECODE_CUDA, q_dtype=dtype, kv_dtype=dtype if kv == "same" else kv, o_dtype=dtype,
                    head_dim_qk=hd[0], head_dim_vo=hd[1], group_size=g, pos_encoding=pos,
                    use_sliding_window=swa, use_logits_soft_cap=cap, kv_layout=layout, kv_storage=storage)


def test_uri_is_unique_per_spec_and_path_safe():
    specs = list(_valid_decode_grid())
    specs += [_spec(MERGE_CPU, o_dtype=d) for d in ("f32", "f16", "bf16")]
    specs += [_spec(MERGE_CPU, target="cuda", o_dtype=d) for d in ("f32", "f16", "bf16")]
    uris = {}
    for spec in specs:
        assert re.fullmatch(r"[a-z0-9_]+", spec.uri), spec.uri
        assert uris.setdefault(spec.uri, spec) == spec, f"two specs share uri {spec.uri}"
    assert len(uris) == len(set(specs))


# -- value semantics -----------------------------------------------------------

@pytest.mark.parametrize("base, changes", [
    (MERGE_CPU, {}),
    (DECODE_CUDA, dict(kv_dtype="e5m2", pos_encoding="alibi", use_sliding_window=True)),
    (PREFILL_CUDA, dict(head_dim_qk=576, head_dim_vo=512)),
    (DECODE_CPU, dict(o_dtype="f32")),
], ids=["merge", "decode", "prefill-mla", "decode-cpu"])
def test_to_dict_from_dict_round_trip(base, changes):
    spec = _spec(base, **changes)
    data = spec.to_dict()
    assert VariantSpec.from_dict(data) == spec
    # The dict is plain JSON (enums as their values), and survives a JSON trip too.
    assert VariantSpec.from_dict(json.loads(json.dumps(data))) == spec
    # ``variant`` and ``use_sinks`` appear only when set, so specs without them keep their cache keys.
    assert set(data) == {f.name for f in dataclasses.fields(VariantSpec)} - {"variant", "use_sinks"}
    assert spec.canonical_json() == VariantSpec.from_dict(data).canonical_json()


def test_specs_are_hashable_and_equal_by_value():
    a = VariantSpec("merge", "cpu", o_dtype="bfloat16")
    b = VariantSpec(Op.MERGE, Target.CPU, o_dtype=torch.bfloat16)
    c = VariantSpec("merge", "cpu", o_dtype="f16")
    assert a == b and hash(a) == hash(b)
    assert a != c
    assert {a: 1, b: 2, c: 3} == {a: 2, c: 3}
    assert a.canonical_json() == b.canonical_json()
    # idtype None is the default i32 its uri prints: one spec, one cache entry (it was a second key)
    none = VariantSpec("merge", "cpu", o_dtype="bfloat16", idtype=None)
    assert none == a and none.canonical_json() == a.canonical_json()


def test_specs_are_frozen():
    spec = VariantSpec(**MERGE_CPU)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.o_dtype = DType.F16  # type: ignore[misc]


@pytest.mark.parametrize("flag", ["sliding_window", "full_attention_too", "logits_soft_cap", "attention_sinks"])
@pytest.mark.parametrize("value", ["no", None, 2])
def test_model_specs_flags_must_be_bools(flag: str, value) -> None:
    """A string such as "no" was truthy: sliding_window="no" added the windowed builds."""
    import jitattn

    with pytest.raises(TypeError, match=f"^{flag}=.* must be True or False"):
        jitattn.model_specs(Target.CPU, num_qo_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16,
                            kv_dtype=torch.bfloat16, **{flag: value})


@pytest.mark.parametrize("change,named", [
    (dict(kv_lora_rank=256), "kv_lora_rank=256 with qk_rope_head_dim=64"),
    (dict(qk_rope_head_dim=0), "kv_lora_rank=512 with qk_rope_head_dim=0"),
    (dict(v_head_dim=100), r"qk_nope_head_dim=128 \+ qk_rope_head_dim=64 with v_head_dim=100"),
])
def test_mla_model_specs_name_the_models_dimensions(change: dict, named: str) -> None:
    """The refused shape is the spec's derived head dims: the message leads with the model's own arguments."""
    import jitattn

    dims = dict(num_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
    with pytest.raises(ValueError, match=f"^an MLA model of {named}: head_dim_qk=.* is not supported"):
        jitattn.mla_model_specs(Target.CPU, **{**dims, **change}, dtype=torch.bfloat16, kv_dtype=torch.bfloat16)

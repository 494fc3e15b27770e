"""Custom attention variants (jitattn.variant): every hook against a torch reference, the
cache contract (content-keyed, built once), argument checks and compile-error reports."""

from __future__ import annotations

import json

import pytest
import torch

import jitattn
from jitattn import AttentionVariant, VariantParam, reference
from jitattn.runtime.specs import attention_spec
from jitattn.jit import BuildError, compile_count
from jitattn.jit.key import build_inputs
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec
from jitattn.spec_text import parse_spec_text

from attention_cases import devices, random_paged_batch
from helpers.procs import load_at_once
from helpers.render_hashes import RECORD, current_hashes

HQ, HKV, DIM, PAGE = 8, 2, 64, 16
QO_LENS = [5, 1, 0, 19]
KV_LENS = [9, 1, 3, 40]
DECODE_KV_LENS = [9, 1, 0, 70]

# Each variant with torch callables that mean the same as its snippets, and run() arguments.
SIGMOID = AttentionVariant(
    "sigmoid", logits_transform="1.0f / (1.0f + expf(-(logits + bias)))", use_softmax=False,
    params=(VariantParam("bias", "f32"),),
)
DOC_MASK = AttentionVariant(
    "docmask",
    logits_mask="doc_ids[doc_start[request] + kv_len - qo_len + q_idx] == doc_ids[doc_start[request] + kv_idx]",
    params=(VariantParam("doc_ids", "i32", rank=1), VariantParam("doc_start", "i64", rank=1)),
)
QUERY_SCALE = AttentionVariant(
    "qscale", query_transform="q * head_scale[qo_head] + (dim % 2 == 0 ? shift : 0.0f)",
    params=(VariantParam("head_scale", "f32", rank=1), VariantParam("shift", "f32")),
)
KEY_RAMP = AttentionVariant("kramp", key_transform="k * (1.0f + 0.01f * float(kv_idx % 7)) - 0.05f * float(kv_head)")
POS_BIAS = AttentionVariant(
    "posbias", logits_transform="logits + slope * float(kv_idx - (kv_len - qo_len + q_idx))",
    params=(VariantParam("slope", "f32"),),
)
OUT_GATE = AttentionVariant(
    "outgate", output_transform="out * gate[request * gate_size1 + qo_head] + (out_bias ? 0.25f : 0.0f)",
    params=(VariantParam("gate", "f32", rank=2), VariantParam("out_bias", "i32", optional=True)),
)
VARIANTS = {v.name: v for v in (SIGMOID, DOC_MASK, QUERY_SCALE, KEY_RAMP, POS_BIAS, OUT_GATE)}


def _doc_ids(kv_lens, gen):
    """Per-request document ids of every kv position (runs of 1..6 tokens), concatenated."""
    ids, starts = [], [0]
    for n in kv_lens:
        doc, row = 0, []
        while len(row) < n:
            run = int(torch.randint(1, 7, (1,), generator=gen))
            row += [doc] * run
            doc += 1
        ids += row[:n]
        starts.append(starts[-1] + n)
    return torch.tensor(ids or [0], dtype=torch.int32), torch.tensor(starts[:-1], dtype=torch.int64)


def _hooks_and_args(name: str, kv_lens, device: str, gen):
    """(reference hooks, run() kwargs) for variant ``name``."""
    if name == "sigmoid":
        bias = -0.5
        return {"logits_transform": lambda logits, **_: torch.sigmoid(logits + bias), "use_softmax": False}, {
            "bias": bias}
    if name == "docmask":
        ids, starts = _doc_ids(kv_lens, gen)

        def mask(logits, request, q_idx, kv_idx, qo_len, kv_len, **_):
            base = int(starts[request])
            return ids[base + kv_len - qo_len + q_idx] == ids[base + kv_idx]
        return {"logits_mask": mask}, {"doc_ids": ids.to(device), "doc_start": starts.to(device)}
    if name == "qscale":
        head_scale = torch.rand(HQ, generator=gen) + 0.5
        shift = 0.3
        return {"query_transform": lambda q, dim, qo_head, **_: q * head_scale.double()[qo_head]
                + torch.where(dim % 2 == 0, shift, 0.0)}, {"head_scale": head_scale.to(device), "shift": shift}
    if name == "kramp":
        return {"key_transform": lambda k, kv_idx, kv_head, **_: k * (1 + 0.01 * (kv_idx % 7)) - 0.05 * kv_head}, {}
    if name == "posbias":
        slope = 0.05
        return {"logits_transform": lambda logits, q_idx, kv_idx, qo_len, kv_len, **_:
                logits + slope * (kv_idx - (kv_len - qo_len + q_idx))}, {"slope": slope}
    if name == "outgate":
        gate = torch.rand(len(kv_lens), HQ, generator=gen) + 0.5
        return {"output_transform": lambda out, request, qo_head, **_: out * gate.double()[request][qo_head] + 0.25}, {
            "gate": gate.to(device), "out_bias": 1}
    raise KeyError(name)


def _dtype(device: str) -> torch.dtype:
    return torch.float32 if device == "cpu" else torch.bfloat16


def _check(out, lse, ref_out, ref_lse, dtype, use_softmax=True):
    tol = 2e-4 if dtype == torch.float32 else 3e-2
    out = out.float().cpu()
    assert not torch.isnan(out).any(), "output has NaN (unwritten?)"
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    if use_softmax:
        lse, ref_lse = lse.cpu(), ref_lse.cpu()
        assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
        finite = ~torch.isinf(ref_lse)
        torch.testing.assert_close(lse[finite], ref_lse[finite], atol=max(tol, 2e-3), rtol=1e-4)
    else:
        assert torch.isnan(lse).all(), "without softmax the LSE is documented as NaN"


def _indptr(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _ragged_kv(batch):
    k, v, _ = reference.paged_kv_to_ragged(batch.cache, batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len)
    return k, v


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_paged_variant_matches_reference(name, device):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    dtype = _dtype(device)
    batch = random_paged_batch(KV_LENS, HKV, DIM, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(sum(QO_LENS), HQ, DIM, generator=gen).to(dtype).to(device)
    hooks, args = _hooks_and_args(name, KV_LENS, device, gen)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(_indptr(QO_LENS), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, DIM, PAGE,
                 causal=True, q_data_type=dtype, variant=VARIANTS[name])
    out, lse = wrapper.run(q, batch.cache, return_lse=True, **args)
    k, v = _ragged_kv(batch)
    ref_out, ref_lse = reference.variant_attention(q.cpu(), k.cpu(), v.cpu(), _indptr(QO_LENS), _indptr(KV_LENS),
                                                   causal=True, **hooks)
    _check(out, lse, ref_out, ref_lse, dtype, hooks.get("use_softmax", True))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("name", list(VARIANTS))
def test_prefill_ragged_variant_matches_reference(name, device):
    gen = torch.Generator().manual_seed(7 + sum(map(ord, name)))
    dtype = _dtype(device)
    q = torch.randn(sum(QO_LENS), HQ, DIM, generator=gen).to(dtype).to(device)
    k = torch.randn(sum(KV_LENS), HKV, DIM, generator=gen).to(dtype).to(device)
    v = torch.randn(sum(KV_LENS), HKV, DIM, generator=gen).to(dtype).to(device)
    hooks, args = _hooks_and_args(name, KV_LENS, device, gen)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(_indptr(QO_LENS), _indptr(KV_LENS), HQ, HKV, DIM, causal=False, q_data_type=dtype,
                 variant=VARIANTS[name])
    out, lse = wrapper.run(q, k, v, return_lse=True, **args)
    ref_out, ref_lse = reference.variant_attention(q.cpu(), k.cpu(), v.cpu(), _indptr(QO_LENS), _indptr(KV_LENS),
                                                   **hooks)
    _check(out, lse, ref_out, ref_lse, dtype, hooks.get("use_softmax", True))


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("split", [False, True], ids=["nosplit", "split"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_decode_variant_matches_reference(name, split, device):
    gen = torch.Generator().manual_seed(11 + sum(map(ord, name)))
    dtype = _dtype(device)
    batch = random_paged_batch(DECODE_KV_LENS, HKV, DIM, PAGE, dtype, device=device, generator=gen)
    q = torch.randn(len(DECODE_KV_LENS), HQ, DIM, generator=gen).to(dtype).to(device)
    hooks, args = _hooks_and_args(name, DECODE_KV_LENS, device, gen)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, DIM, PAGE, q_data_type=dtype,
                 variant=VARIANTS[name], fixed_split_size=1 if split else None, disable_split_kv=not split)
    if split:  # splits exactly when the variant's partial states merge by LSE
        assert (wrapper._plan.split.kv_chunk_size > 0) == VARIANTS[name].splittable
    out, lse = wrapper.run(q, batch.cache, return_lse=True, **args)
    k, v = _ragged_kv(batch)
    ref_out, ref_lse = reference.variant_attention(q.cpu(), k.cpu(), v.cpu(), _indptr([1] * len(DECODE_KV_LENS)),
                                                   _indptr(DECODE_KV_LENS), **hooks)
    _check(out, lse, ref_out, ref_lse, dtype, hooks.get("use_softmax", True))


@pytest.mark.parametrize("device", devices())
def test_cascade_runs_a_variant_at_every_level_and_refuses_one_without_softmax_or_reading_positions(device):
    """A level's positions (request, q_idx, kv_idx, qo_len, kv_len) are its node's, not the request's: a variant
    reading them gave wrong results (POS_BIAS with a nonzero slope, DOC_MASK's request) and is refused."""
    gen = torch.Generator().manual_seed(3)
    dtype = _dtype(device)
    shared, unique = 20, [7, 12]
    batch = random_paged_batch([shared] + unique, HKV, DIM, 4, dtype, device=device, generator=gen)
    pages = batch.kv_indices.tolist()
    p0 = pages[: batch.kv_indptr[1]]
    rest = [pages[batch.kv_indptr[i]: batch.kv_indptr[i + 1]] for i in (1, 2)]
    qo = [3, 4]
    q = torch.randn(sum(qo), HQ, DIM, generator=gen).to(dtype).to(device)
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8, device=device))
    i32 = torch.int32
    plan_args = (
        [torch.tensor([0, sum(qo)], dtype=i32), _indptr(qo)],
        [torch.tensor([0, len(p0)], dtype=i32), _indptr([len(r) for r in rest])],
        [torch.tensor(p0, dtype=i32), torch.tensor(rest[0] + rest[1], dtype=i32)],
        [torch.tensor([4], dtype=i32), batch.kv_last_page_len[1:]],
        HQ, HKV, DIM, 4,
    )
    wrapper.plan(*plan_args, causal=True, q_data_type=dtype, variant=QUERY_SCALE)
    head_scale, shift = (torch.rand(HQ, generator=gen) + 0.5).to(device), 0.3
    out = wrapper.run(q, batch.cache, head_scale=head_scale, shift=shift)
    k, v = _ragged_kv(batch)
    ks = [torch.cat([k[:shared], k[shared + sum(unique[:i]): shared + sum(unique[:i + 1])]]) for i in range(2)]
    vs = [torch.cat([v[:shared], v[shared + sum(unique[:i]): shared + sum(unique[:i + 1])]]) for i in range(2)]
    q_ref = q.float().cpu() * head_scale.cpu()[None, :, None] + shift * (torch.arange(DIM) % 2 == 0)
    ref, _ = reference.variant_attention(q_ref, torch.cat(ks).cpu(), torch.cat(vs).cpu(), _indptr(qo),
                                         _indptr([shared + u for u in unique]), causal=True)
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2 if dtype != torch.float32 else 2e-4, rtol=1e-2)
    with pytest.raises(ValueError, match="cannot run in cascade: its levels' LSE merge needs softmax"):
        wrapper.plan(*plan_args, q_data_type=dtype, variant=SIGMOID)
    with pytest.raises(ValueError, match="cannot run in cascade: it reads q_idx, kv_idx, qo_len, kv_len, which"):
        wrapper.plan(*plan_args, causal=True, q_data_type=dtype, variant=POS_BIAS)
    with pytest.raises(ValueError, match="it reads request, q_idx, kv_idx, qo_len, kv_len"):
        wrapper.plan(*plan_args, q_data_type=dtype, variant=DOC_MASK)


# -- spec, uri and cache key --------------------------------------------------

def _cpu_spec(variant, op=Op.PREFILL):
    return VariantSpec(op=op, target="cpu", q_dtype="f32", kv_dtype="f32", o_dtype="f32", variant=variant)


def test_variant_is_in_the_uri_and_the_canonical_spec():
    spec = _cpu_spec(SIGMOID)
    assert spec.uri == f"prefill_cpu_f32_vsigmoid-{SIGMOID.digest[:8]}"
    assert spec.kernel_name.endswith(f"_vsigmoid_{SIGMOID.digest[:8]}") and "-" not in spec.kernel_name
    assert VariantSpec.from_dict(json.loads(spec.canonical_json())) == spec
    assert "variant" not in _cpu_spec(None).to_dict()  # specs without a variant keep their keys


def test_editing_a_snippet_changes_the_key_and_rebuilds(fresh_cache):
    edited = AttentionVariant("posbias", logits_transform="logits + slope * float(kv_idx - q_idx)",
                              params=POS_BIAS.params)
    a, b = _cpu_spec(POS_BIAS), _cpu_spec(edited)
    assert a.uri != b.uri and build_inputs(a).key != build_inputs(b).key
    same = AttentionVariant.from_dict(json.loads(json.dumps(POS_BIAS.to_dict())))
    assert build_inputs(_cpu_spec(same)).key == build_inputs(a).key
    before = compile_count()
    jitattn.load(a)
    jitattn.load(b)
    jitattn.load(_cpu_spec(same))
    assert compile_count() == before + 2


def test_the_same_variant_in_two_processes_builds_once(fresh_cache, tmp_path):
    spec = _cpu_spec(DOC_MASK, Op.DECODE)
    reports = load_at_once(spec, 2, tmp_path)
    assert sum(r["compile_count"] for r in reports) == 1
    assert len({r["path"] for r in reports}) == 1


def test_no_variant_renders_unchanged():
    """Every existing spec renders byte-identical sources (the cuda kernels were validated in that form)."""
    recorded = json.loads(RECORD.read_text())
    now = current_hashes()
    changed = sorted(k for k in recorded if now.get(k) != recorded[k])
    assert not changed, f"{len(changed)} specs without a variant render differently, e.g. {changed[:3]}"
    assert set(now) == set(recorded)


def test_warm_spec_file_builds_a_variant(tmp_path, capsys, fresh_cache):
    from jitattn_cache.cli import main

    path = tmp_path / "sigmoid.json"
    path.write_text(json.dumps(_cpu_spec(SIGMOID, Op.DECODE).to_dict()))
    assert parse_spec_text("@" + str(path)) == _cpu_spec(SIGMOID, Op.DECODE)
    assert main(["warm", "--spec", f"@{path}", "--target", "cpu"]) == 0
    jitattn.load(_cpu_spec(SIGMOID, Op.DECODE))
    with pytest.raises(ValueError, match="@path"):
        parse_spec_text(_cpu_spec(SIGMOID).uri)
    assert main(["warm", "--spec", f"@{tmp_path / 'missing.json'}"]) == 2


# -- validation -----------------------------------------------------------------

@pytest.mark.parametrize("kwargs, message", [
    (dict(name="has space", logits_transform="logits"), "variant name"),
    (dict(name="v", logits_transform="  "), "non-empty C\\+\\+ expression"),
    (dict(name="v", logits_transform="logits; return 0"), "one C\\+\\+ expression"),
    (dict(name="v"), "changes nothing"),
    (dict(name="v", logits_transform="logits", params=[dict(name="q_idx", dtype="f32")]), "reserved"),
    (dict(name="v", logits_transform="logits", params=[dict(name="k_scale", dtype="f32")]), "reserved"),
    # names of run() / forward() keywords: a parameter so named could never be passed
    *[(dict(name="v", logits_transform="logits", params=[dict(name=n, dtype="f32")]), "reserved")
      for n in ("q_scale", "window_left", "sinks", "enable_pdl", "sm_scale", "logits_soft_cap", "causal")],
    (dict(name="v", logits_transform="logits", params=[dict(name="x", dtype="f16", rank=1)]), "dtype='f16'"),
    (dict(name="v", logits_transform="logits", params=[dict(name="x", dtype="u8")]), "for a scalar"),
    (dict(name="v", logits_transform="logits", params=[dict(name="x", dtype="f32", rank=7)]), "rank=7"),
    (dict(name="v", logits_transform="logits", params=[dict(name="1x", dtype="f32")]), "C identifier"),
    (dict(name="v", logits_transform="logits", params=[dict(name="x", dtype="f32")] * 2), "declared twice"),
])
def test_invalid_variants_are_refused_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AttentionVariant(**kwargs)


def test_variant_only_on_attention_ops():
    with pytest.raises(ValueError, match="attention kernels"):
        VariantSpec(op="merge", target="cpu", o_dtype="f32", variant=SIGMOID)


QK_BOTH = AttentionVariant(
    "qkboth", query_transform=QUERY_SCALE.query_transform, key_transform=KEY_RAMP.key_transform,
    params=QUERY_SCALE.params,
)
E4M3 = torch.float8_e4m3fn


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("q_dtype, kv_dtype, rope", [
    (torch.bfloat16, torch.bfloat16, True), (torch.bfloat16, E4M3, False), (torch.bfloat16, E4M3, True),
    (torch.float16, torch.float16, True),
], ids=["bf16-rope", "bf16-e4m3", "bf16-e4m3-rope", "f16-rope"])
def test_prefill_query_and_key_transforms_run_after_rope_and_fp8_dequant(q_dtype, kv_dtype, rope, device):
    """Both transforms see RoPE-rotated, unscaled (fp8 k_scale applies to the logit) q/k rows, over
    several Q tiles and KV blocks (the cuda kernel transforms tiles in shared memory)."""
    gen = torch.Generator().manual_seed(21)
    if device == "cpu":
        q_dtype = torch.float32
        kv_dtype = torch.float32 if kv_dtype != E4M3 else E4M3
    qo_lens, kv_lens, dim, k_scale, v_scale = [70, 3, 0], [300, 3, 17], 128, 0.7, 1.3
    batch = random_paged_batch(kv_lens, HKV, dim, PAGE, kv_dtype, device=device, generator=gen)
    q = torch.randn(sum(qo_lens), HQ, dim, generator=gen).to(q_dtype).to(device)
    hooks_q, args = _hooks_and_args("qscale", kv_lens, device, gen)
    hooks_k, _ = _hooks_and_args("kramp", kv_lens, device, gen)
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(_indptr(qo_lens), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, dim, PAGE,
                 causal=True, pos_encoding_mode="ROPE_LLAMA" if rope else "NONE", q_data_type=q_dtype,
                 kv_data_type=kv_dtype, variant=QK_BOTH)
    out, lse = wrapper.run(q, batch.cache, return_lse=True, k_scale=k_scale, v_scale=v_scale, **args)

    k, v = _ragged_kv(batch)
    q_ref, k_ref = q.cpu().double(), k.cpu().double()
    if rope:
        q_pos = torch.cat([torch.arange(kv - qo, kv) for qo, kv in zip(qo_lens, kv_lens)])
        k_pos = torch.cat([torch.arange(kv) for kv in kv_lens])
        q_ref, k_ref = reference.apply_rope_llama(q_ref, q_pos), reference.apply_rope_llama(k_ref, k_pos)
    ref_out, ref_lse = reference.variant_attention(q_ref, k_ref, v.cpu().double(), _indptr(qo_lens),
                                                   _indptr(kv_lens), causal=True, sm_scale=k_scale / dim ** 0.5,
                                                   **hooks_q, **hooks_k)
    _check(out, lse, ref_out * v_scale, ref_lse, q_dtype)


def test_bf16_query_and_key_transforms_keep_hi_lo_pairs_on_cuda_prefill():
    from jitattn.kernels.prefill import cuda_layout

    def split(variant, q_dtype=torch.bfloat16):
        spec = attention_spec(Op.PREFILL, Target.CUDA, q_dtype=q_dtype, kv_dtype=q_dtype, o_dtype=q_dtype,
                              head_dim_qk=DIM, head_dim_vo=DIM, num_qo_heads=HQ, num_kv_heads=HKV,
                              pos_encoding=PosEncoding.NONE, use_sliding_window=False, use_logits_soft_cap=False,
                              mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED,
                              variant=variant)
        return cuda_layout(spec)["kSplitQK"]
    assert split(QUERY_SCALE) and split(KEY_RAMP) and split(QK_BOTH)
    assert not split(SIGMOID) and not split(None) and not split(QK_BOTH, torch.float16)


def _planned_ragged(variant):
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8))
    wrapper.plan(_indptr([2]), _indptr([3]), HQ, HKV, DIM, q_data_type=torch.float32, variant=variant)
    qkv = (torch.randn(2, HQ, DIM), torch.randn(3, HKV, DIM), torch.randn(3, HKV, DIM))
    return wrapper, qkv


@pytest.mark.parametrize("args, error, message", [
    ({}, TypeError, "missing required argument 'gate'"),
    ({"gate": torch.ones(1, HQ), "nope": 1}, TypeError, "unexpected keyword argument\\(s\\) \\['nope'\\]"),
    ({"gate": torch.ones(1, HQ, dtype=torch.float64)}, TypeError, "dtype torch.float64"),
    ({"gate": torch.ones(HQ)}, ValueError, "declares rank 2"),
    ({"gate": torch.ones(1, HQ, device="meta")}, ValueError, "is on meta"),
    ({"gate": torch.ones(2, HQ).t()}, ValueError, "contiguous"),
    ({"gate": torch.ones(1, HQ), "out_bias": 1.5}, TypeError, "declared i32"),
    ({"gate": torch.ones(1, HQ), "out_bias": torch.tensor(1)}, TypeError, "Python number"),
    ({"gate": torch.ones(1, HQ), "out_bias": 2**40}, ValueError, "does not fit"),
])
def test_run_checks_variant_arguments_before_launch(args, error, message):
    wrapper, (q, k, v) = _planned_ragged(OUT_GATE)
    with pytest.raises(error, match=message):
        wrapper.run(q, k, v, **args)


@pytest.mark.parametrize("slope", [1e40, -1e39, float("nan")])
def test_a_float_parameter_beyond_float32_is_refused(slope):
    """It would become inf (or stay NaN) in the kernel and turn the output to NaN without a word."""
    wrapper, (q, k, v) = _planned_ragged(POS_BIAS)
    with pytest.raises(ValueError, match="slope=.* does not fit in f32"):
        wrapper.run(q, k, v, slope=slope)
    wrapper.run(q, k, v, slope=3e38)  # within float32's range: taken
    wrapper.run(q, k, v, slope=float("-inf"))  # an infinity passes as given


def test_forward_takes_the_variants_parameters():
    """forward() (and forward_return_lse()) pass a variant's parameters to run(), as run() takes them."""
    gen = torch.Generator().manual_seed(4)
    wrapper, _ = _planned_ragged(POS_BIAS)
    q, k, v = torch.randn(2, HQ, DIM, generator=gen), torch.randn(3, HKV, DIM, generator=gen), \
        torch.randn(3, HKV, DIM, generator=gen)
    want = wrapper.run(q, k, v, slope=0.3)
    torch.testing.assert_close(wrapper.forward(q, k, v, slope=0.3), want)
    torch.testing.assert_close(wrapper.forward_return_lse(q, k, v, slope=0.3)[0], want)
    assert not torch.equal(wrapper.forward(q, k, v, slope=-0.3), want)


def test_variant_given_as_a_dict_names_the_fix():
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8))
    with pytest.raises(TypeError, match="AttentionVariant.from_dict"):
        wrapper.plan(_indptr([2]), _indptr([3]), HQ, HKV, DIM, q_data_type=torch.float32,
                     variant=POS_BIAS.to_dict())


def test_extra_arguments_without_a_variant_are_refused():
    wrapper, (q, k, v) = _planned_ragged(None)
    with pytest.raises(TypeError, match="this plan has none"):
        wrapper.run(q, k, v, bias=1.0)


def test_optional_parameter_may_be_omitted():
    wrapper, (q, k, v) = _planned_ragged(OUT_GATE)
    plain = wrapper.run(q, k, v, gate=torch.ones(1, HQ))
    biased = wrapper.run(q, k, v, gate=torch.ones(1, HQ), out_bias=1)
    torch.testing.assert_close(biased, plain + 0.25)


@pytest.mark.parametrize("name", ["constexpr", "static_cast", "NULL", "M_PI", "std", "VariantParams",
                                  "variant_logits_transform", "decltype", "isnan", "int64_t", "uint8_t",
                                  "JITATTN_VARIANT_FN", "JitattnChecked"])
def test_parameter_names_that_the_snippets_headers_or_cpp_own_are_reserved(name):
    """Such names passed the declaration and failed at build with compiler errors that named no parameter
    (2026-12-06 sweep). A math function's name (cos, max) is a fine parameter: it shadows the function."""
    with pytest.raises(ValueError, match=f"variant parameter name '{name}' is reserved"):
        VariantParam(name, "f32")
    assert VariantParam("cos", "f32", rank=1) and VariantParam("max", "f32")


def test_names_ending_in_a_newline_are_refused() -> None:
    """A regex's $ matches before a final newline: "name\\n" passed, then broke the build file (ninja) or run()."""
    with pytest.raises(ValueError, match="must be a C identifier"):
        VariantParam("s\n", "f32")
    with pytest.raises(ValueError):
        AttentionVariant("nlname\n", output_transform="out * 2.0f")


def test_a_double_slash_on_a_one_line_snippet_is_refused_it_would_comment_out_the_rest():
    with pytest.raises(ValueError, match=r"'//', which starts a C\+\+ comment .* floorf\(a / b\)"):
        AttentionVariant("halve", logits_transform="logits // 2.0f")
    assert AttentionVariant("halve", logits_transform="logits /* halved */ / 2.0f").logits_transform
    assert AttentionVariant("near", logits_mask="kv_idx <= q_idx + 1  // near keys\n|| kv_idx == 0").logits_mask
    with pytest.raises(ValueError, match="ending in a backslash"):  # a comment whose backslash splices the next line
        AttentionVariant("spliced", logits_transform="logits\n // note \\\n * 2.0f")


@pytest.mark.parametrize("snippet", ["logits * 2.0f \\", "logits \\ \n * 2.0f", "logits %:define X"])
def test_line_splices_and_digraph_directives_are_refused(snippet):
    """A snippet's last backslash joined the generated #line after it (the compiler's report then pointed
    elsewhere); %: is the digraph of #, a preprocessor line the '#' check missed."""
    with pytest.raises(ValueError, match="backslash|no preprocessor"):
        AttentionVariant("spliced", logits_transform=snippet)


@pytest.mark.parametrize("params", [("a",), VariantParam("a", "f32"), "a", [3], 3, {VariantParam("a", "f32")}],
                         ids=["str", "bare", "text", "int", "number", "set"])
def test_params_of_another_form_name_the_form(params):
    with pytest.raises(TypeError, match="params must be a tuple of VariantParam"):
        AttentionVariant("t", logits_transform="logits + a", params=params)
    generated = AttentionVariant("t", logits_transform="logits + a", params=(p for p in [VariantParam("a", "f32")]))
    assert generated.params == (VariantParam("a", "f32"),)


def test_an_empty_required_tensor_parameter_is_refused_before_the_launch():
    """Its null pointer crashed the process (a segfault) on the first read (2026-12-06 sweep)."""
    wrapper, (q, k, v) = _planned_ragged(OUT_GATE)
    with pytest.raises(ValueError, match=r"gate is empty \(shape \(0, 8\)\); a required tensor"):
        wrapper.run(q, k, v, gate=torch.ones(0, HQ))
    # a launch without query rows reads nothing: an empty tensor sized to the batch is fine there
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1024, dtype=torch.uint8))
    wrapper.plan(_indptr([0]), _indptr([3]), HQ, HKV, DIM, q_data_type=torch.float32, variant=OUT_GATE)
    assert wrapper.run(q[:0], k, v, gate=torch.ones(0, HQ)).shape == (0, HQ, DIM)


# -- compile errors in user code --------------------------------------------------

def test_a_snippet_compile_error_names_the_snippet_line_and_the_compiler_message(fresh_cache):
    broken = AttentionVariant("broken", logits_transform="logits *\n  no_such_function(2.0f)")
    with pytest.raises(BuildError) as info:
        jitattn.load(_cpu_spec(broken))
    message = str(info.value)
    head = message.split("(snippets are")[0]
    assert "variant 'broken' does not compile" in head
    assert "logits_transform, line 2" in head
    assert "no_such_function(2.0f)" in head
    assert "no_such_function" in head.split("line 2:")[1].splitlines()[0]  # the compiler's own words
    assert len(message.splitlines()) < 20, "the report should not be a wall of template noise"


def test_a_parameter_named_as_a_header_macro_is_named_in_the_build_error(fresh_cache):
    """M_1_PI, EOF, INT32_MAX...: the compiler's 'expected unqualified-id' at variant.h's declaration, which named
    no parameter and closed with a hint about crashes."""
    clash = AttentionVariant("clash", logits_transform="logits * M_1_PI", params=(VariantParam("M_1_PI", "f32"),))
    with pytest.raises(BuildError, match=r"parameter 'M_1_PI': the C/C\+\+ headers the kernel includes define this "
                                         r"name \(a macro\), so it cannot name a parameter; rename it"):
        jitattn.load(_cpu_spec(clash))


@pytest.mark.parametrize("snippet", ['([]{ _Pragma("pack(1)") }(), logits)', "logits\x00 * 2.0f",
                                     "logits\x1c * 2.0f", "logits\u2028 * 2.0f"])
def test_pragma_operators_and_characters_that_are_not_source_are_refused(snippet):
    """_Pragma got past the preprocessor check and packed the kernel's own structs; the compiler met a line break
    where Python's splitlines saw one it did not (or dropped a NUL)."""
    with pytest.raises(ValueError, match=r"no preprocessor lines or _Pragma|a NUL or a line break other than"):
        AttentionVariant("odd", logits_transform=snippet)


def test_a_float_index_is_refused_by_the_checked_build_too(fresh_cache, monkeypatch):
    """JITATTN_DEBUG=1's bounds-checked accessor took a float index (truncated) that the plain build refuses."""
    float_index = AttentionVariant("fidx", logits_transform="logits + hb[logits > 0.0f ? 1.5f : 0.5f]",
                                   params=(VariantParam("hb", "f32", 1),))
    with pytest.raises(BuildError):
        jitattn.load(_cpu_spec(float_index))
    monkeypatch.setenv("JITATTN_DEBUG", "1")
    with pytest.raises(BuildError, match="index must be an integer"):
        jitattn.load(_cpu_spec(float_index))


# -- the cuda tiers (run on the GPU machine; compile-checked locally with nvcc) ----------

def _cuda_specs():
    specs = []
    for variant in VARIANTS.values():
        common = dict(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16, head_dim_qk=DIM,
                      head_dim_vo=DIM, num_qo_heads=HQ, num_kv_heads=HKV, pos_encoding=PosEncoding.NONE,
                      use_sliding_window=False, use_logits_soft_cap=False, variant=variant)
        specs.append(attention_spec(Op.DECODE, Target.CUDA, mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD,
                                    kv_storage=KVStorage.PAGED, **common))
        specs.append(attention_spec(Op.PREFILL, Target.CUDA, mask_mode=MaskMode.CAUSAL, kv_layout=KVLayout.NHD,
                                    kv_storage=KVStorage.PAGED, **common))
        specs.append(attention_spec(Op.PREFILL, Target.CUDA, mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD,
                                    kv_storage=KVStorage.RAGGED, **common))
        if variant.splittable:  # the cascade test's levels: causal (last) and none, paged
            specs.append(attention_spec(Op.PREFILL, Target.CUDA, mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD,
                                        kv_storage=KVStorage.PAGED, **common))
    for q_dtype, kv_dtype, pos in [(torch.bfloat16, torch.bfloat16, PosEncoding.ROPE_LLAMA),
                                   (torch.bfloat16, E4M3, PosEncoding.NONE), (torch.bfloat16, E4M3, PosEncoding.ROPE_LLAMA),
                                   (torch.float16, torch.float16, PosEncoding.ROPE_LLAMA)]:
        specs.append(attention_spec(Op.PREFILL, Target.CUDA, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=q_dtype,
                                    head_dim_qk=128, head_dim_vo=128, num_qo_heads=HQ, num_kv_heads=HKV,
                                    pos_encoding=pos, use_sliding_window=False, use_logits_soft_cap=False,
                                    mask_mode=MaskMode.CAUSAL, kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED,
                                    variant=QK_BOTH))
    return list(dict.fromkeys(specs))


GPU_SPECS = _cuda_specs()

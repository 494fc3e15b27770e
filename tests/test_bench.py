"""The benchmark suite (``python -m jitattn.bench``): its byte/FLOP formulas against hand-computed
values for every config, and a ``--quick`` run on the cpu target that writes valid JSON."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import types
from unittest import mock

import pytest
import torch

from jitattn.bench import configs, inputs, report, suite, units
from jitattn.bench import rows as bench_rows
from jitattn.bench import __main__ as bench_main
from jitattn.bench.__main__ import main, parse_args

# decode bytes = 2 * tokens read * H_kv * D * bytes/elem (K and V) + q bytes + o bytes (B * H_q * D * 2 each, bf16)
DECODE_BYTES = {
    "decode/llama8b_b64_s2048": 2 * 64 * 2048 * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2,  # 537_919_488
    "decode/llama8b_b256_s4096": 2 * 256 * 4096 * 8 * 128 * 2 + 2 * 256 * 32 * 128 * 2,
    "decode/llama8b_b1_s32768": 2 * 1 * 32768 * 8 * 128 * 2 + 2 * 1 * 32 * 128 * 2,
    "decode/mha_b64_s2048_d128": 2 * 64 * 2048 * 32 * 128 * 2 + 2 * 64 * 32 * 128 * 2,
    "decode/gemma2_softcap_b64_s4096_d256": 2 * 64 * 4096 * 8 * 256 * 2 + 2 * 64 * 16 * 256 * 2,
    # window_left 4095: each query reads the 4096 keys inside its window, not 16384
    "decode/mistral_window4096_b32_s16384": 2 * 32 * 4096 * 8 * 128 * 2 + 2 * 32 * 32 * 128 * 2,  # 537_395_200
    "decode/phi3_d96_b64_s4096": 2 * 64 * 4096 * 32 * 96 * 2 + 2 * 64 * 32 * 96 * 2,
    "decode/skewed_b64": 2 * (32768 + 63 * 512) * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2,  # 267_386_880
    # fp8 KV: 1 byte per element; q and o stay bf16
    "decode/fp8kv_b256_s4096": 2 * 256 * 4096 * 8 * 128 * 1 + 2 * 256 * 32 * 128 * 2,  # 2_151_677_952
    "decode/llama8b_b64_s2048_page1": 537_919_488,
    "decode/llama8b_b64_s2048_rope": 537_919_488,
}

# prefill FLOPs = 4 * unmasked (q, k) pairs * H_q * D; bottom-right causal with qo_len = kv_len = S: S (S + 1) / 2
PREFILL_FLOPS = {
    "prefill/llama8b_causal_b8_s4096": 4 * 8 * (4096 * 4097 // 2) * 32 * 128,  # 1_099_780_063_232
    "prefill/d64_causal_b16_s2048": 4 * 16 * (2048 * 2049 // 2) * 32 * 64,  # 275_012_124_672
    "prefill/d256_causal_b4_s4096": 4 * 4 * (4096 * 4097 // 2) * 16 * 256,  # 549_890_031_616
    "prefill/llama8b_noncausal_b8_s4096": 4 * 8 * 4096 * 4096 * 32 * 128,  # 2**41
    "prefill/llama8b_causal_paged_b8_s4096": 1_099_780_063_232,
    "variants/plain_prefill_causal_b4_s4096": 549_890_031_616,
    "variants/prefill_softcap_causal_b4_s4096": 549_890_031_616,
    "variants/prefill_custom_causal_b4_s4096": 549_890_031_616,  # the custom mask has the causal pattern
    # causal + window_left 1023: query p sees min(p + 1, 1024) keys
    "variants/prefill_window1024_causal_b4_s4096": 4 * 4 * (1024 * 1025 // 2 + (4096 - 1024) * 1024) * 32 * 128,
}

# cascade bytes = shared prefix once + each request's own KV (+ q and o)
CASCADE_BYTES = {
    "cascade/b128_shared8192_u256": 2 * (8192 + 128 * 256) * 8 * 128 * 2 + 2 * 128 * 32 * 128 * 2,  # 169_869_312
    "cascade/b32_shared32768_u128": 2 * (32768 + 32 * 128) * 8 * 128 * 2 + 2 * 32 * 32 * 128 * 2,  # 151_519_232
    # a tree: the root once, each of 4 branches once, every tail
    "cascade/agent_fork_b128_root8192_4x2048_u128": 2 * (8192 + 4 * 2048 + 128 * 128) * 8 * 128 * 2
    + 2 * 128 * 32 * 128 * 2,
    "cascade/agent_fork_b128_root32768_4x2048_u128": 2 * (32768 + 4 * 2048 + 128 * 128) * 8 * 128 * 2
    + 2 * 128 * 32 * 128 * 2,
    # a wide tree: 32 branches of 512
    "cascade/agent_fork_b128_root32768_32x512_u128": 2 * (32768 + 32 * 512 + 128 * 128) * 8 * 128 * 2
    + 2 * 128 * 32 * 128 * 2,
}

# MLA FLOPs = 2 * B * H * L * (576 + 512); bytes = B * L * 576 * bytes/elem
MLA_FLOPS_BYTES = {
    "mla/b64_s4096_p64": (2 * 64 * 128 * 4096 * (576 + 512), 64 * 4096 * 576 * 2),
    "mla/b128_s8192_p64": (2 * 128 * 128 * 8192 * (576 + 512), 128 * 8192 * 576 * 2),
    "mla/h16_b128_s4096_p64": (2 * 128 * 16 * 4096 * (576 + 512), 128 * 4096 * 576 * 2),
    "mla/h16_b128_s4096_p64_fp8": (2 * 128 * 16 * 4096 * (576 + 512), 128 * 4096 * 576 * 1),  # e4m3 latent cache
    # causal multi-token rows: token i of q_len sees kv_len - q_len + 1 + i keys; the cache is read once
    "mla/spec2_b64_s4096_p64": (2 * 64 * 128 * (2 * 4096 - 1) * (576 + 512), 64 * 4096 * 576 * 2),
    "mla/spec4_b64_s4096_p64": (2 * 64 * 128 * (4 * 4096 - 6) * (576 + 512), 64 * 4096 * 576 * 2),
    "mla/chunk64_b16_s4096_p64": (2 * 16 * 128 * (64 * 4096 - 2016) * (576 + 512), 16 * 4096 * 576 * 2),
}

# RoPE bytes = q and k read + written (2 * nnz * (H_q + H_k) * D * 2, bf16) + positions (int32; cos/sin cache: int64)
ROPE_BYTES = {
    "ops/rope_llama8b_nnz16384": 2 * 16384 * (32 + 8) * 128 * 2 + 16384 * 4,  # 335_609_856
    "ops/rope_interleave_llama8b_nnz16384": 335_609_856,
    "ops/rope_outofplace_llama8b_nnz16384": 335_609_856,
    "ops/rope_cos_sin_cache_nnz16384": 2 * 16384 * (32 + 8) * 128 * 2 + 16384 * 8,  # 335_675_392
}

# block-sparse FLOPs = 4 * nonzero blocks * 64 * 64 * H_q * D; 128 x 128 blocks of 64, round(density * 128) per row
BSR_FLOPS = {
    "ops/bsr_r64_d0.1_s8192": 4 * (128 * 13) * 64 * 64 * 32 * 128,  # 111_669_149_696
    "ops/bsr_r64_d0.3_s8192": 4 * (128 * 38) * 64 * 64 * 32 * 128,
    "ops/bsr_r64_d0.5_s8192": 4 * (128 * 64) * 64 * 64 * 32 * 128,  # 2**39: half the dense twin's
}

# fp8 prefill FLOPs = 4 * 8192^2 * 32 * 128 (non-causal); bytes = q, K, V in e4m3 + the bf16 output
FP8_FLOPS_BYTES = {
    "ops/fp8_prefill_noncausal_s8192": (4 * 8192 * 8192 * 32 * 128, 8192 * (32 + 2 * 8) * 128 + 8192 * 32 * 128 * 2),
}

# mixed batches (a 2048-token causal chunk + 64 decodes over 4096, 32/8 heads, d128, bf16):
# FLOPs = 4 * (2048 * 2049 / 2) * 32 * 128 + 4 * 64 * 4096 * 32 * 128;
# bytes = the chunk's K/V + q + o (2 * 2048 * 8 * 128 * 2 + 2 * 2048 * 32 * 128 * 2) + the decodes' KV + q + o
MIXED_FLOPS_BYTES = {
    name: (4 * (2048 * 2049 // 2) * 32 * 128 + 4 * 64 * 4096 * 32 * 128,  # 38_671_482_880
           2 * 2048 * 8 * 128 * 2 + 2 * 2048 * 32 * 128 * 2 + 2 * 64 * 4096 * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2)
    for name in ("ops/pod_chunk2048_decode64x4096", "ops/batch_attention_mixed")
}


def test_every_issue_config_is_defined() -> None:
    names = set(configs.BY_NAME)
    for expected in (*DECODE_BYTES, *PREFILL_FLOPS, *CASCADE_BYTES, *MLA_FLOPS_BYTES, *ROPE_BYTES, *BSR_FLOPS,
                     *FP8_FLOPS_BYTES, *MIXED_FLOPS_BYTES,
                     "ops/dense_prefill_noncausal_s8192", "prefill/llama8b_causal_varlen",
                     "jit/import_jitattn", "jit/build", "jit/run_overhead_decode", "jit/plan_decode_b256"):
        assert expected in names
    assert set(configs.QUICK) <= names
    # names are suite/name and unique
    assert all(n.split("/", 1)[0] in configs.SUITES for n in names)
    assert len(configs.ALL_CASES) == len(names)


@pytest.mark.parametrize("name", list(DECODE_BYTES))
def test_decode_bytes(name: str) -> None:
    case = configs.BY_NAME[name]
    assert case.kind == "bandwidth"
    assert case.bytes == DECODE_BYTES[name]


def test_decode_hand_values() -> None:
    assert DECODE_BYTES["decode/llama8b_b64_s2048"] == 537_919_488
    assert DECODE_BYTES["decode/mistral_window4096_b32_s16384"] == 537_395_200
    assert DECODE_BYTES["decode/fp8kv_b256_s4096"] == 2_151_677_952
    assert configs.BY_NAME["decode/llama8b_b64_s2048_page1"].page_size == 1
    assert configs.BY_NAME["decode/skewed_b64"].kv_lens == (32768,) + (512,) * 63


@pytest.mark.parametrize("name", list(PREFILL_FLOPS))
def test_prefill_flops(name: str) -> None:
    case = configs.BY_NAME[name]
    assert case.kind == "compute"
    assert case.flops == PREFILL_FLOPS[name]


def test_prefill_hand_values() -> None:
    assert PREFILL_FLOPS["prefill/llama8b_causal_b8_s4096"] == 1_099_780_063_232
    assert PREFILL_FLOPS["prefill/llama8b_noncausal_b8_s4096"] == 2**41
    assert PREFILL_FLOPS["variants/prefill_window1024_causal_b4_s4096"] == 240_551_723_008


def test_varlen_prefill() -> None:
    case = configs.BY_NAME["prefill/llama8b_causal_varlen"]
    lengths = (7045, 3283, 6337, 7420, 3573, 459, 2249, 8037, 4316, 4108, 3445, 7650, 6548, 6926, 2612, 8056)
    assert case.kv_lens == case.qo_lens == lengths == configs.varlen_lengths()  # fixed seed
    assert all(128 <= n <= 8192 for n in lengths)
    assert case.flops == 4 * sum(n * (n + 1) // 2 for n in lengths) * 32 * 128 == 4_151_673_094_144


def test_visible_keys_match_the_reference_mask() -> None:
    """Pairs counted by formula equal the unmasked entries of the reference's mask rules."""
    for qo, kv, causal, window in [(1, 9, False, -1), (1, 9, False, 3), (5, 5, True, -1), (3, 10, True, -1),
                                   (7, 20, True, 4), (6, 6, False, 2), (4, 11, True, 0), (8, 8, True, 20)]:
        p = torch.arange(qo).unsqueeze(1) + (kv - qo)
        j = torch.arange(kv).unsqueeze(0)
        allowed = torch.ones(qo, kv, dtype=torch.bool)
        if causal:
            allowed &= j <= p
        if window >= 0:
            allowed &= j >= p - window
        expected = int(allowed.sum())
        assert units.visible_keys(qo, kv, causal, window) == expected
        assert units.visible_keys_fast(qo, kv, causal, window) == expected


def test_tree_mask_rows_are_a_draft_trees_ancestors() -> None:
    """The verification mask: every key before the draft visible, then a chain of ancestors ending at the query
    itself (inside the causal pattern); fixed by the seed; a row slice is the same rows."""
    qo, kv = 24, 70
    mask = inputs.tree_mask_rows(qo, kv, seed=5)
    prefix = kv - qo
    assert mask.shape == (qo, kv) and bool(mask[:, :prefix].all())
    tree = mask[:, prefix:]
    assert bool(tree.diagonal().all()) and not bool(tree.triu(1).any())  # itself; no later query
    for i in range(1, qo):
        ancestors = tree[i, :i].nonzero().flatten().tolist()
        parent = ancestors[-1]  # the nearest ancestor is the parent, whose own row holds the rest
        assert tree[i, :i].tolist() == tree[parent, :i].tolist()[:parent] + [True] + [False] * (i - parent - 1)
    assert int(tree.sum()) < qo * (qo + 1) // 2  # a tree, not the causal pattern (at this seed)
    assert torch.equal(inputs.tree_mask_rows(qo, kv, seed=5), mask)
    assert torch.equal(inputs.tree_mask_rows(qo, kv, seed=5, first_row=10), mask[10:])
    case = configs.BY_NAME["variants/verify_custom_tree_b32_q64_s4160"]
    plain = configs.BY_NAME[case.plain]
    assert case.custom_mask_kind == "tree" and case.flops == plain.flops and case.queries == plain.queries


def test_variants_equal_work() -> None:
    plain = configs.BY_NAME["variants/plain_decode_b64_s4096"]
    for case in configs.VARIANTS:
        if case.plain == plain.name:
            assert case.bytes == plain.bytes, case.name  # the window variant reads the same 4096 tokens
        assert case.plain is None or case.plain in configs.BY_NAME


@pytest.mark.parametrize("name", list(CASCADE_BYTES))
def test_cascade_bytes(name: str) -> None:
    case = configs.BY_NAME[name]
    assert case.bytes == CASCADE_BYTES[name]
    flat = case.flat()
    # flat decode reads the prefix (root and branch) once per request
    kv_len = case.shared_len + case.branch_len + case.unique_len
    assert flat.bytes == 2 * case.batch * kv_len * 8 * 128 * 2 + 2 * case.batch * 32 * 128 * 2
    assert flat.bytes > case.bytes


@pytest.mark.parametrize("name", list(MLA_FLOPS_BYTES))
def test_mla_formulas(name: str) -> None:
    case = configs.BY_NAME[name]
    assert (case.flops, case.bytes) == MLA_FLOPS_BYTES[name]


def test_small_cases_keep_their_shape() -> None:
    small = configs.BY_NAME["decode/mistral_window4096_b32_s16384"].small()
    assert small.name == "decode/mistral_window4096_b32_s16384"
    assert small.kv_lens == (1024, 1024) and small.window_left == 255
    skewed = configs.BY_NAME["decode/skewed_b64"].small()
    assert skewed.kv_lens == (2048, 32, 32, 32)
    window = next(c for c in configs.VARIANTS if "decode_window" in c.name).small()
    plain = configs.BY_NAME["variants/plain_decode_b64_s4096"].small()
    assert window.bytes == plain.bytes
    cascade = configs.BY_NAME["cascade/b128_shared8192_u256"].small()
    assert cascade.shared_len % cascade.page_size == 0


def test_select() -> None:
    assert [c.name for c in configs.select("cascade")] == list(CASCADE_BYTES)
    picked = [c.name for c in configs.select("all", ["variants/decode_rope_*", "decode/llama8b_b1_s32768"])]
    # a variant brings its plain case
    assert picked == ["decode/llama8b_b1_s32768", "variants/plain_decode_b64_s4096", "variants/decode_rope_b64_s4096"]
    assert [c.name for c in configs.select("all", ["jit/cold_build_decode"])] == ["jit/build"]
    assert {c.name for c in configs.select("all", quick=True)} == set(configs.QUICK)
    with pytest.raises(ValueError, match="no case matches"):
        configs.select("all", ["decode/nope"])
    assert main(["--only", "decode/nope"]) == 2


def test_tree_cascade_case_times_the_tree_the_two_level_cascade_and_flat_decode(tmp_path) -> None:
    """The agent-fork case (cpu, small): its three rows are exact against the reference; the two-level row names
    the tree's as its baseline. Its small twin keeps a whole number of requests per branch."""
    case = configs.BY_NAME["cascade/agent_fork_b128_root8192_4x2048_u128"]
    small = case.small()
    assert small.batch % small.branches == 0 and small.batch // small.branches >= 2
    assert configs.row_names(case) == (case.name, case.name + ":flat", case.name + ":two_level")
    path = tmp_path / "bench.json"
    assert main(["--only", case.name, "--target", "cpu", "--json", str(path), "--measure-s", "0.02"]) == 0
    rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    for name in configs.row_names(case):
        assert rows[name]["status"] == "ok" and rows[name]["max_rel_err"] < 0.05, name
    assert rows[case.name]["params"]["levels"] == 3
    assert rows[case.name + ":two_level"]["baseline"]["name"] == case.name
    two = rows[case.name + ":two_level"]
    assert two["baseline"]["speedup"] == pytest.approx(rows[case.name]["time_us"] / two["time_us"])
    # the report's note says which is faster, against the tree cascade (not flat decode)
    assert " than the tree cascade (" in report._notes(two)


def test_report_reads_two_level_rows_of_earlier_runs() -> None:
    """Runs before the two-level row named its baseline kept the inverted ratio (two-level / tree time) and no
    'than': the note still says which is faster, against the tree."""
    old = {"baseline": {"name": "cascade/t", "time_us": 100.0, "speedup": 2.0,
                        "what": "two-level time / tree cascade time"}}
    assert "2.00x slower than the tree cascade (100.0 us)" in report._notes(old)
    flat = {"baseline": {"name": "cascade/t:flat", "time_us": 400.0, "speedup": 4.0,
                         "what": "flat decode time / cascade time"}}
    assert "4.00x faster than flat decode (400.0 us)" in report._notes(flat)


def test_no_sdpa_times_jitattn_alone_with_given_ceilings(tmp_path) -> None:
    """--no-sdpa (tools/bench_settings.py --fast): each row says SDPA was not timed, a cascade row too, and
    --ceilings-json's ceilings are the document's (none measured)."""
    path = tmp_path / "bench.json"
    ceilings = {"copy": {"gbps": 1.0}, "read_stream": {"gbps": 2.0}, "gemm": {"tflops": 3.0, "n": 64, "dtype": "f32"}}
    assert main(["--only", "decode/llama8b_b64_s2048,cascade/b32_shared32768_u128", "--target", "cpu", "--json",
                 str(path), "--measure-s", "0.02", "--no-sdpa", "--ceilings-json", json.dumps(ceilings)]) == 0
    doc = json.loads(path.read_text())
    rows = {r["name"]: r for r in doc["rows"]}
    assert doc["ceilings"] == ceilings
    for name in ("decode/llama8b_b64_s2048", "cascade/b32_shared32768_u128"):
        assert rows[name]["status"] == "ok" and rows[name]["time_us"] > 0, name
        assert not rows[name].get("sdpa") and rows[name]["sdpa_na"] == "not timed (--no-sdpa)", name


def test_rate_and_fraction() -> None:
    ceilings = {"read_stream": {"gbps": 4000.0}, "gemm": {"tflops": 800.0}}
    rate, unit, ceiling, fraction = bench_rows.rate_of("bandwidth", 2_000_000_000, None, 1000.0, ceilings)
    assert (rate, unit, ceiling) == (2000.0, "GB/s", "read_stream") and fraction == pytest.approx(0.5)
    rate, unit, ceiling, fraction = bench_rows.rate_of("compute", None, 400 * 10**9, 1000.0, ceilings)
    assert (unit, ceiling) == ("TFLOP/s", "gemm") and rate == pytest.approx(400.0) and fraction == pytest.approx(0.5)
    assert bench_rows.rel_err([torch.tensor([1.0, float("nan")])], [torch.tensor([1.0, 1.0])]) == math.inf
    assert bench_rows.rel_err([torch.tensor([1.1, 2.0])], [torch.tensor([1.0, 2.0])]) == pytest.approx(0.05)


ROW_KEYS = {"name", "suite", "kind", "status", "params", "time_us", "timing", "bytes", "flops", "rate", "rate_unit",
            "ceiling", "fraction", "sdpa", "sdpa_na", "baseline", "max_rel_err", "note", "error", "seconds"}


def test_quick_cpu_run_writes_valid_json(tmp_path, capsys) -> None:
    path = tmp_path / "bench.json"
    assert main(["--quick", "--target", "cpu", "--json", str(path), "--measure-s", "0.05"]) == 0
    doc = json.loads(path.read_text())  # strict JSON: NaN/inf are written as null
    assert doc["schema"] == bench_rows.SCHEMA and doc["target"] == "cpu"
    assert "cpu target at small sizes" in doc["note"]
    for key in ("created", "args", "environment", "method", "prebuild", "ceilings", "rows", "elapsed_s"):
        assert key in doc
    assert doc["prebuild"]["failed"] == {}
    for name, unit in (("copy", "gbps"), ("read_stream", "gbps"), ("gemm", "tflops")):
        assert math.isfinite(doc["ceilings"][name][unit]) and doc["ceilings"][name][unit] > 0
    rows = {r["name"]: r for r in doc["rows"]}
    for row in doc["rows"]:
        assert ROW_KEYS <= set(row), row["name"]
    ok = [r for r in doc["rows"] if r["status"] == "ok" and r["kind"] in ("bandwidth", "compute")]
    assert len(ok) >= 5
    for row in ok:
        for key in ("time_us", "rate", "fraction", "max_rel_err"):
            assert row[key] is not None and math.isfinite(row[key]), (row["name"], key)
        assert row["max_rel_err"] < 0.05, row["name"]
    decode = rows["decode/llama8b_b64_s2048"]
    assert decode["rate_unit"] == "GB/s" and decode["ceiling"] == "read_stream"
    assert decode["sdpa"]["default"]["speedup"] > 0
    prefill = rows["prefill/llama8b_causal_b8_s4096"]
    assert prefill["rate_unit"] == "TFLOP/s" and prefill["ceiling"] == "gemm"
    assert prefill["sdpa"]["flash"]["time_us"] > 0 and "n/a" in prefill["sdpa"]["cudnn"]
    assert rows["decode/fp8kv_b256_s4096"]["sdpa_na"]
    assert rows["cascade/b128_shared8192_u256"]["baseline"]["speedup"] > 0
    assert rows["cascade/b128_shared8192_u256:flat"]["status"] == "ok"
    assert rows["variants/decode_softcap_b64_s4096"]["baseline"]["ratio"] > 0
    assert rows["mla/b64_s4096_p64"]["status"] == "ok" and rows["mla/b64_s4096_p64"]["max_rel_err"] < 0.05
    for name in ("jit/import_jitattn", "jit/cold_build_decode", "jit/cold_build_prefill", "jit/warm_load_decode",
                 "jit/warm_load_prefill", "jit/run_overhead_decode", "jit/plan_decode_b256"):
        assert rows[name]["status"] == "ok" and rows[name]["time_us"] > 0, name
    assert "compiles there: 2" in rows["jit/cold_build_decode"]["note"]
    assert "compiles there: 0" in rows["jit/warm_load_decode"]["note"]
    out = capsys.readouterr().out
    assert "ceilings:" in out and "decode/llama8b_b64_s2048" in out and "speedup" in out


def test_a_failing_case_is_a_row_error_and_the_suite_goes_on(tmp_path, monkeypatch) -> None:
    real = inputs.make_attn_data

    def broken(case, device):
        if case.name == "decode/llama8b_b64_s2048":
            raise RuntimeError("boom")
        return real(case, device)

    monkeypatch.setattr(suite, "make_attn_data", broken)
    path = tmp_path / "bench.json"
    assert main(["--target", "cpu", "--only", "decode/llama8b_b64_s2048,decode/llama8b_b1_s32768,mla/*",
                 "--json", str(path), "--measure-s", "0.02", "--ceilings-json", "{}"]) == 1  # a row failed
    rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    assert rows["decode/llama8b_b64_s2048"]["status"] == "error"
    assert "boom" in rows["decode/llama8b_b64_s2048"]["error"]
    assert rows["decode/llama8b_b1_s32768"]["status"] == "ok"
    assert rows["decode/llama8b_b1_s32768"]["fraction"] is None  # no ceilings given
    assert len([r for r in rows if r.startswith("mla/")]) == len(configs.MLA_CASES)
    for name in ("mla/h16_b128_s4096_p64", "mla/h16_b128_s4096_p64_fp8", "mla/b64_s4096_p64", "mla/spec2_b64_s4096_p64",
                 "mla/spec4_b64_s4096_p64", "mla/chunk64_b16_s4096_p64"):
        row = rows[name]
        assert row["status"] == "ok" and row["max_rel_err"] < 0.05, name
        seconds = row["time_us"] * 1e-6
        assert row["tflops"] == pytest.approx(row["flops"] / seconds / 1e12)  # both columns on every MLA row
        assert row["tb_per_s"] == pytest.approx(row["bytes"] / seconds / 1e12)
    assert rows["mla/b64_s4096_p64"]["rate_unit"] == "TFLOP/s" and rows["mla/h16_b128_s4096_p64"]["rate_unit"] == "GB/s"
    fp8 = rows["mla/h16_b128_s4096_p64_fp8"]
    assert fp8["params"]["kv_dtype"] == "e4m3" and fp8["bytes"] * 2 == rows["mla/h16_b128_s4096_p64"]["bytes"]
    assert fp8["baseline"]["name"] == "mla/h16_b128_s4096_p64" and fp8["baseline"]["speed_ratio"] > 0
    for name in ("mla/spec2_b64_s4096_p64", "mla/spec4_b64_s4096_p64", "mla/chunk64_b16_s4096_p64"):
        row, twin = rows[name], rows["mla/b64_s4096_p64"]
        assert row["params"]["q_len"] > 1 and row["baseline"]["name"] == "mla/b64_s4096_p64"
        assert row["baseline"]["speed_ratio"] == pytest.approx((row["flops"] / row["time_us"]) /
                                                               (twin["flops"] / twin["time_us"]))


def test_case_budget_and_deadline(tmp_path, capsys) -> None:
    """A run that timed nothing exits 1 (a script checking the exit code must not take it for results)."""
    path = tmp_path / "bench.json"
    assert main(["--target", "cpu", "--only", "decode/llama8b_b1_s32768", "--json", str(path),
                 "--case-budget", "0.0001", "--ceilings-json", "{}"]) == 1
    assert "no case was timed" in capsys.readouterr().err
    row = json.loads(path.read_text())["rows"][0]
    assert row["time_us"] is None and "time budget" in row["note"]
    assert parse_args(["--case-budget", "0"]).case_budget == 45.0  # 0 is the default, as for --deadline
    assert main(["--target", "cpu", "--only", "decode/llama8b_b1_s32768,mla/*", "--json", str(path),
                 "--deadline", "0.001", "--ceilings-json", "{}", "--no-prebuild"]) == 1
    rows = json.loads(path.read_text())["rows"]
    assert rows and all(r["status"] == "skipped" and "time budget" in r["error"] for r in rows)


def _fake_doc() -> dict:
    row = {"name": "decode/x", "suite": "decode", "kind": "bandwidth", "status": "ok", "time_us": 10.0,
           "rate": 100.0, "rate_unit": "GB/s", "fraction": 0.5, "max_rel_err": 1e-3, "seconds": 0.1,
           "sdpa": {"default": {"time_us": 20.0, "fraction": 0.25, "speedup": 2.0}}, "sdpa_na": None,
           "baseline": None, "note": "", "error": None}
    return {"target": "cpu", "note": "n", "rows": [row, dict(row, name="decode/y", fraction=None)],
            "ceilings": {"read_stream": {"gbps": 200.0}}, "environment": {"device": "cpu"}}


def test_plot_with_a_stub_matplotlib(tmp_path, monkeypatch) -> None:
    pyplot = mock.MagicMock()
    fig, ax = mock.MagicMock(), mock.MagicMock()
    pyplot.subplots.return_value = (fig, ax)
    mpl = types.ModuleType("matplotlib")
    mpl.use = mock.MagicMock()
    mpl.pyplot = pyplot
    monkeypatch.setitem(sys.modules, "matplotlib", mpl)
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", pyplot)
    messages = []
    assert report.plot(_fake_doc(), str(tmp_path / "p.png"), messages.append)
    assert ax.barh.call_count == 2  # jitattn and SDPA default
    fig.savefig.assert_called_once()
    assert messages == [f"plot written to {tmp_path / 'p.png'}"]


def test_plot_without_matplotlib(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    messages = []
    assert not report.plot(_fake_doc(), str(tmp_path / "p.png"), messages.append)
    assert "matplotlib is not installed" in messages[0]
    assert not (tmp_path / "p.png").exists()


def test_plot_without_matplotlib_or_a_writable_path_is_refused_before_the_run(tmp_path, monkeypatch, capsys) -> None:
    """--plot was looked at after the whole run (then 'no plot written', exit 0)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["--target", "cpu", "--only", "decode/llama8b_b64_s2048", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot" in (err := capsys.readouterr().err) and "matplotlib is not installed" in err
    monkeypatch.setattr(bench_main, "_has_matplotlib", lambda: True)
    assert main(["--target", "cpu", "--only", "decode/llama8b_b64_s2048", "--plot", str(tmp_path)]) == 2
    assert "is a directory; name a file" in capsys.readouterr().err


def test_table_formats_every_row_status() -> None:
    doc = _fake_doc()
    doc["rows"].append(dict(doc["rows"][0], name="mla/z", status="skipped", error="not implemented yet",
                            time_us=None, rate=None, fraction=None, sdpa=None))
    text = report.table(doc)
    assert "decode/x" in text and "2.00x" in text and "SKIPPED: not implemented yet" in text


def test_remaining_cases_resume_in_a_child_process(capfd) -> None:
    """What the suite does when a case leaves the CUDA context unusable, exercised on the cpu target."""
    from jitattn.bench.__main__ import parse_args

    opts = parse_args(["--target", "cpu", "--measure-s", "0.02"])
    doc = {"ceilings": {"read_stream": {"gbps": 10.0}}, "rows": [{"name": "decode/llama8b_b64_s2048"}]}
    cases = [configs.BY_NAME["decode/llama8b_b1_s32768"].small(), configs.BY_NAME["mla/b64_s4096_p64"]]
    rows = suite._resume_in_child(cases, opts, doc, 100.0, print, target="cpu")
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"decode/llama8b_b1_s32768", "mla/b64_s4096_p64"}
    decode = by_name["decode/llama8b_b1_s32768"]
    assert decode["status"] == "ok" and decode["fraction"] is not None  # the parent's ceilings were reused
    assert decode["params"]["kv_len"] == 2048  # the child ran the cpu-size case


def test_timer_event_path_with_fake_cuda_events(monkeypatch) -> None:
    """The CUDA branch of Timer (scrub passes sized to the host work, events around each call) on the CPU."""
    import time as _time

    from jitattn.bench.timing import Timer

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.t = None

        def record(self) -> None:
            self.t = _time.perf_counter()

        def elapsed_time(self, end: "FakeEvent") -> float:
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    timer = Timer(torch.device("cpu"))
    timer.cuda = True
    timer._scrub = torch.ones(1 << 16)
    calls = []
    timing = timer.measure(lambda: (calls.append(1), _time.sleep(0.001)), budget_s=0.05, max_iters=20)
    assert 900 < timing.median_us < 20_000 and 3 <= timing.iters <= 20
    assert timer.scrub_passes(lambda: _time.sleep(0.001)) >= 1 and timer._scrub_us is not None
    assert len(calls) >= timing.iters + 3


def test_plain_launch_time_is_wall_time_per_back_to_back_call() -> None:
    from jitattn.bench.timing import Timer

    timer = Timer(torch.device("cpu"))
    assert 900 <= timer.plain_launch_us(lambda: time.sleep(0.001), calls=5, rounds=3) < 20000


def test_mla_rows_take_the_flashinfer_peer(tmp_path, monkeypatch) -> None:
    """--peer flashinfer reaches the MLA rows (n/a with the reason where it cannot run: here, no CUDA)."""
    path = tmp_path / "bench.json"
    assert main(["--target", "cpu", "--only", "mla/h16_b128_s4096_p64", "--json", str(path), "--measure-s", "0.02",
                 "--ceilings-json", "{}", "--peer", "flashinfer"]) == 0
    row = json.loads(path.read_text())["rows"][0]
    assert row["status"] == "ok" and row["peers"]["flashinfer"] == {"n/a": "FlashInfer needs CUDA"}
    from jitattn.bench import peers

    class _Cuda:
        cuda = True

    monkeypatch.setattr(peers, "available", lambda name: True)
    assert peers.flashinfer_mla_unsupported(configs.BY_NAME["mla/h16_b128_s4096_p64"], _Cuda()) is None
    assert "no fp8 dequantization scales" in peers.flashinfer_mla_unsupported(
        configs.BY_NAME["mla/h16_b128_s4096_p64_fp8"], _Cuda())


def test_the_results_page_is_what_the_dated_runs_give() -> None:
    """docs/benchmarks/RESULTS.md is generated: adding a run without regenerating it fails here."""
    from jitattn.bench import results

    assert results.main(["--check"]) == 0, "run python -m jitattn.bench.results"


def test_the_results_page_takes_each_cases_newest_successful_row(tmp_path) -> None:
    from jitattn.bench import results

    def run(created: str, rows: list[dict], target: str = "cuda") -> dict:
        return {"schema": "jitattn-bench/1", "created": created, "target": target, "rows": rows,
                "environment": {"device": "NVIDIA H200", "torch": "2.11"}}

    def row(time_us: float, status: str = "ok", **extra) -> dict:
        return {"name": "decode/x", "status": status, "time_us": time_us, "rate": 1000.0, "rate_unit": "GB/s",
                "fraction": 0.5, **extra}

    (tmp_path / "a.json").write_text(json.dumps(run("2026-12-01T00:00:00", [row(300.0)])))
    (tmp_path / "b.json").write_text(json.dumps(run("2026-12-02T00:00:00", [
        row(200.0, peers={"flashinfer": {"time_us": 250.0, "speedup": 1.25}},
            sdpa={"flash": {"time_us": 260.0, "speedup": 1.3}, "cudnn": {"time_us": 240.0, "speedup": 1.2}})])))
    (tmp_path / "c.json").write_text(json.dumps(run("2026-12-03T00:00:00", [row(100.0, status="error")])))
    (tmp_path / "notes.json").write_text("{}")  # not a run: skipped
    (tmp_path / "d.json").write_text(json.dumps(run("2026-12-04T00:00:00", [row(50.0)], target="cpu")))  # not a GPU's
    picked = results.newest_rows(tmp_path)
    assert picked["decode/x"][2] == "b.json" and picked["decode/x"][0]["time_us"] == 200.0
    text = results.page(tmp_path)
    assert "| `x` | 200.0 us | 1000 GB/s | 0.50 | 240.0 us (1.20x) cudnn | 250.0 us (1.25x) | [2026-12-02](b.json) |" in text


@pytest.mark.parametrize("content, match", [
    ("{not json", "not a readable JSON file"),
    ('{"schema": "jitattn-bench/1", "target": "cuda", "rows": [{"status": "ok", "time_us": 1.0}]}',
     r"rows\[0\] is not a bench row"),
    ('{"schema": "jitattn-bench/1", "target": "cuda", "rows": [{"name": "decode/x", "status": "ok", "time_us": "1"}]}',
     "time_us='1' is not a positive number"),
    ('{"schema": "jitattn-bench/1", "target": "cuda", "rows": [{"name": "decode/x", "status": "ok", "time_us": -5}]}',
     "time_us=-5 is not a positive number"),
    ('{"schema": "jitattn-bench/1", "target": "cuda", "rows": null}', "needs a list of rows"),
    ('{"schema": "jitattn-bench/1", "target": "cuda", "created": 2099, "rows": []}', "a created date string"),
    ('{"schema": "jitattn-bench/1", "target": "cuda", "rows": [{"name": "decode/x", "status": "ok", "time_us": 1, '
     '"peers": [1]}]}', "peers=\\[1\\] is not a mapping"),
    ('{"schema": "jitattn-bench/1", "target": "cuda", "rows": [{"name": "decode/x", "status": "ok", "time_us": 1, '
     '"rate": "fast"}]}', "rate='fast' is not a number"),
])
def test_a_run_the_results_page_cannot_read_is_named_not_dropped(tmp_path, capsys, content, match) -> None:
    from jitattn.bench import results

    (tmp_path / "bad.json").write_text(content)
    (tmp_path / "list.json").write_text("[1, 2]")  # valid JSON but no run: skipped, as other notes are
    assert results.main(["--runs", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "bad.json" in err and re.search(match, err) and not (tmp_path / "RESULTS.md").exists()


def test_the_results_page_of_no_cuda_run_is_refused(tmp_path, capsys) -> None:
    """A folder without a cuda run's rows wrote a page of no tables, and said so as a success."""
    from jitattn.bench import results

    (tmp_path / "cpu.json").write_text('{"schema": "jitattn-bench/1", "target": "cpu", "rows": [{"name": '
                                       '"decode/x", "status": "ok", "time_us": 1}]}')
    assert results.main(["--runs", str(tmp_path)]) == 2
    assert "holds no successful row of a cuda run" in capsys.readouterr().err
    assert not (tmp_path / "RESULTS.md").exists()


@pytest.mark.parametrize("name", list(ROPE_BYTES))
def test_rope_bytes(name: str) -> None:
    case = configs.BY_NAME[name]
    assert (case.kind, case.ceiling, case.suite) == ("bandwidth", "copy", "ops")
    assert case.bytes == ROPE_BYTES[name]
    small = case.small()
    assert small.name == name and small.nnz == 16384 // configs.CPU_SCALE
    assert small.bytes == 2 * small.nnz * 40 * 128 * 2 + small.nnz * small.position_bytes


@pytest.mark.parametrize("name", list(BSR_FLOPS))
def test_block_sparse_flops(name: str) -> None:
    case = configs.BY_NAME[name]
    dense = configs.BY_NAME[case.dense]
    assert case.kind == dense.kind == "compute"
    assert case.flops == BSR_FLOPS[name]
    assert dense.flops == 4 * 8192 * 8192 * 32 * 128 == 2**40  # non-causal: every pair
    assert case.flops / dense.flops == pytest.approx(case.density, abs=0.01)
    small = case.small()
    assert small.seq == 512 and small.seq % small.block == 0 and small.dense == case.dense


def test_block_sparse_pairs_are_the_reference_masks_entries() -> None:
    """The unmasked pairs counted by formula equal the True entries of the reference's dense mask of the pattern."""
    from jitattn import reference
    from jitattn.bench import ops

    case = configs.BY_NAME["ops/bsr_r64_d0.3_s8192"].small()
    data = ops.make_bsr_data(case, torch.device("cpu"))
    mask = reference.bsr_dense_mask(data.indptr, data.indices, case.seq, case.seq, case.block, case.block)
    assert int(mask.sum()) == case.pairs == case.nonzero_blocks * 64 * 64
    assert data.indices.numel() == case.nonzero_blocks


def test_rope_rows_are_against_the_copy_ceiling() -> None:
    ceilings = {"copy": {"gbps": 3000.0}, "read_stream": {"gbps": 4000.0}}
    rate, unit, ceiling, fraction = bench_rows.rate_of("bandwidth", 2_000_000_000, None, 1000.0, ceilings, "copy")
    assert (rate, unit, ceiling) == (2000.0, "GB/s", "copy") and fraction == pytest.approx(2 / 3)
    row = bench_rows.new_row(configs.BY_NAME["ops/rope_llama8b_nnz16384"])
    assert row["ceiling"] == "copy"
    assert bench_rows.new_row(configs.BY_NAME["decode/llama8b_b64_s2048"])["ceiling"] is None


def test_a_block_sparse_row_brings_its_dense_twin() -> None:
    picked = [c.name for c in configs.select("all", ["ops/bsr_r64_d0.3_*"])]
    assert picked == ["ops/dense_prefill_noncausal_s8192", "ops/bsr_r64_d0.3_s8192"]
    assert [c.name for c in configs.select("ops")] == [*ROPE_BYTES, "ops/dense_prefill_noncausal_s8192", *BSR_FLOPS,
                                                       *FP8_FLOPS_BYTES, *MIXED_FLOPS_BYTES]
    picked = [c.name for c in configs.select("all", ["ops/fp8_*"])]
    assert picked == ["ops/dense_prefill_noncausal_s8192", "ops/fp8_prefill_noncausal_s8192"]


@pytest.mark.parametrize("name", list(FP8_FLOPS_BYTES))
def test_fp8_prefill_work(name: str) -> None:
    case = configs.BY_NAME[name]
    assert (case.kind, case.suite, case.flops, case.bytes) == ("compute", "ops", *FP8_FLOPS_BYTES[name])
    assert case.flops == configs.BY_NAME[case.dense].flops  # the dense twin's work, every pair
    small = case.small()
    assert small.seq == 512 and small.flops == 4 * 512 * 512 * 32 * 128
    assert [s.q_dtype.value for s in inputs.specs_of(case, "cpu")] == ["bf16"]  # the conversion's 16-bit kernel


@pytest.mark.parametrize("name", list(MIXED_FLOPS_BYTES))
def test_mixed_batch_work_is_its_parts(name: str) -> None:
    """A mixed batch counts its chunk's causal prefill and its decodes; its rows are the call and the two parts."""
    case = configs.BY_NAME[name]
    assert (case.kind, case.suite, case.flops, case.bytes) == ("compute", "ops", *MIXED_FLOPS_BYTES[name])
    chunk, decodes = case.parts()
    assert chunk.flops == 4 * (2048 * 2049 // 2) * 32 * 128 and chunk.causal and chunk.kind == "compute"
    assert decodes.bytes == 2 * 64 * 4096 * 8 * 128 * 2 + 2 * 64 * 32 * 128 * 2 and decodes.kind == "bandwidth"
    assert configs.row_names(case) == (name, name + ":prefill", name + ":decode")
    assert [c.name for c in configs.select("ops", [name + ":decode"])] == [name]
    small = case.small()
    assert (small.name, small.chunk, small.batch, small.kv_len) == (name, 128, 4, 256)
    assert small.flops == 4 * (128 * 129 // 2) * 32 * 128 + 4 * 4 * 256 * 32 * 128
    assert len(inputs.specs_of(case, "cpu")) == 2


def test_a_mixed_batchs_baseline_is_its_separate_launches_summed() -> None:
    from jitattn.bench.ops_mixed import separate_baseline

    case = configs.BY_NAME["ops/pod_chunk2048_decode64x4096"]
    parts = [{"name": "p", "time_us": 300.0}, {"name": "d", "time_us": 150.0}]
    base = separate_baseline(case, {"time_us": 400.0}, parts)
    assert base["time_us"] == 450.0 and base["ratio"] == pytest.approx(450 / 400) and base["name"] == "p + d"
    assert base["target"] == pytest.approx(1 / 0.9)
    assert "error" in separate_baseline(case, {"time_us": 400.0}, [parts[0], {"name": "d", "time_us": None}])
    assert "1.12x the separate launches' rate" in report._notes({"baseline": base})


def test_ops_suite_on_the_cpu(tmp_path) -> None:
    """Every ops row runs on the cpu target, exact against the reference, with its work and rate by the formulas;
    --peer flashinfer reaches each row (n/a here: no CUDA)."""
    path = tmp_path / "bench.json"
    ceilings = {"copy": {"gbps": 10.0}, "read_stream": {"gbps": 20.0},
                "gemm": {"tflops": 1.0, "n": 8, "dtype": "float32"}}
    assert main(["--suite", "ops", "--target", "cpu", "--json", str(path), "--measure-s", "0.02",
                 "--ceilings-json", json.dumps(ceilings), "--peer", "flashinfer"]) == 0
    rows = {r["name"]: r for r in json.loads(path.read_text())["rows"]}
    assert set(rows) == {n for c in configs.select("ops") for n in configs.row_names(c)}
    parts = {p.name: p for c in MIXED_FLOPS_BYTES for p in configs.BY_NAME[c].small().parts()}
    for name, row in rows.items():
        case = parts[name] if name in parts else configs.BY_NAME[name].small()
        assert row["status"] == "ok" and row["max_rel_err"] < 0.02, name
        if name not in parts:  # a separate launch is no peer's row
            assert row["peers"]["flashinfer"] == {"n/a": "FlashInfer needs CUDA"}, name
        seconds = row["time_us"] * 1e-6
        if case.kind == "bandwidth":
            assert row["bytes"] == case.bytes and row["rate_unit"] == "GB/s"
            assert row["rate"] == pytest.approx(case.bytes / seconds / 1e9)
        if name in ROPE_BYTES:
            assert row["bytes"] == case.bytes and row["ceiling"] == "copy" and row["rate_unit"] == "GB/s"
            assert row["rate"] == pytest.approx(case.bytes / seconds / 1e9)
            assert row["fraction"] == pytest.approx(row["rate"] / 10.0)
        elif case.kind == "compute":
            assert row["flops"] == case.flops and row["ceiling"] == "gemm" and row["rate_unit"] == "TFLOP/s"
            assert row["fraction"] == pytest.approx(case.flops / seconds / 1e12)
    dense = rows["ops/dense_prefill_noncausal_s8192"]
    for name in (*BSR_FLOPS, *FP8_FLOPS_BYTES):
        base = rows[name]["baseline"]
        assert base["name"] == dense["name"] and base["rate"] == dense["rate"]
        assert base["ratio"] == pytest.approx(rows[name]["rate"] / dense["rate"])
    assert rows["ops/rope_cos_sin_cache_nnz16384"]["params"]["function"] == "apply_rope_with_cos_sin_cache_inplace"
    assert rows["ops/fp8_prefill_noncausal_s8192"]["params"]["path"] == "converted to 16 bits"  # no fp8 kernel on cpu
    for name in MIXED_FLOPS_BYTES:
        base, separate = rows[name]["baseline"], [rows[name + ":prefill"], rows[name + ":decode"]]
        assert base["time_us"] == pytest.approx(sum(r["time_us"] for r in separate))
        assert base["ratio"] == pytest.approx(base["time_us"] / rows[name]["time_us"])


def test_bad_arguments_are_refused_before_any_case_runs(tmp_path, capsys) -> None:
    """A --json that is a directory used to fail after the first case (a raw IsADirectoryError, a stray temp
    file); --list with an unknown pattern printed a traceback; negative or NaN budgets ran or skipped silently."""
    folder = tmp_path / "out"
    folder.mkdir()
    assert main(["--target", "cpu", "--json", str(folder), "--only", "decode/llama8b_b64_s2048"]) == 2
    assert "is a directory; name a file" in capsys.readouterr().err and not list(tmp_path.glob(".bench-*"))
    (tmp_path / "file").write_text("x")
    assert main(["--target", "cpu", "--json", str(tmp_path / "file" / "b.json")]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    os.mkfifo(tmp_path / "fifo")  # the results replace the path: a FIFO (or /dev/null, as root) would be replaced
    assert main(["--target", "cpu", "--json", str(tmp_path / "fifo"), "--only", "decode/llama8b_b64_s2048"]) == 2
    assert "is not a regular file" in capsys.readouterr().err and (tmp_path / "fifo").is_fifo()
    assert main(["--target", "cpu", "--json", "", "--only", "decode/llama8b_b64_s2048"]) == 2  # it wrote nothing
    assert "--json: the path is empty" in capsys.readouterr().err
    long_name = tmp_path / "new" / ("a" * 300 + ".json")  # it failed at the first write, the results lost
    assert main(["--target", "cpu", "--json", str(long_name), "--only", "decode/llama8b_b64_s2048"]) == 2
    assert "the file name is longer than" in capsys.readouterr().err and not (tmp_path / "new").exists()
    if os.path.isdir("/proc/self"):  # a directory nobody can make (root passes os.access there)
        assert main(["--target", "cpu", "--json", "/proc/jitattn/b.json", "--only", "decode/llama8b_b64_s2048"]) == 2
        assert "cannot make /proc/jitattn" in capsys.readouterr().err
    assert main(["--list", "--only", "nosuch*"]) == 2
    assert "no case matches nosuch*" in capsys.readouterr().err
    assert main(["--list", "--only", ","]) == 2  # it ran the whole suite
    assert "--only names no case" in capsys.readouterr().err
    assert main(["--list", "--suite", "decode", "--only", "prefill/*"]) == 2  # it measured the ceilings, then nothing
    assert "no case is in --suite decode and --only prefill/*" in capsys.readouterr().err
    for flag, value in (("--measure-s", "nan"), ("--deadline", "-1"), ("--case-budget", "-5"), ("--jobs", "-3")):
        with pytest.raises(SystemExit):
            main([flag, value])
        assert "must be a finite number >= 0" in capsys.readouterr().err


def test_results_json_is_readable_and_leaves_no_temp_file(tmp_path) -> None:
    path = tmp_path / "r.json"
    report.write_json({"rows": [], "x": float("nan")}, str(path))
    assert json.loads(path.read_text())["x"] is None and (path.stat().st_mode & 0o777) == 0o644
    with pytest.raises(TypeError):
        report.write_json({"bad": object()}, str(path))
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"], "the temp file of a failed write is removed"


def test_reader_gone_is_quiet() -> None:
    """``python -m jitattn.bench --list | head -1``: the closed pipe ends the run without a traceback."""
    import subprocess

    proc = subprocess.Popen([sys.executable, "-m", "jitattn.bench", "--list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()  # before the first line is written: every write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1 and "Traceback" not in err and "BrokenPipe" not in err, err


def test_skipped_row_reason_once(tmp_path, capsys) -> None:
    """A skipped row's note names its reason once ("SKIPPED: the run's time budget ..."), not twice."""
    main(["--target", "cpu", "--only", "decode/llama8b_b1_s32768", "--deadline", "0.001", "--ceilings-json", "{}",
          "--no-prebuild"])
    out = capsys.readouterr().out
    assert "SKIPPED: the run's time budget" in out and "skipped: skipped" not in out.lower(), out

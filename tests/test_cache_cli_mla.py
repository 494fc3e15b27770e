"""jitattn-cache for MLA models: the ``deepseek-v3`` / ``deepseek-v2-lite`` presets and ``--config`` with
``kv_lora_rank``; the specs they list are exactly the ones the MLA wrapper, the non-absorbed ragged prefill,
the merge and ``append_paged_mla_kv_cache`` request, so a warmed cache serves them with zero compiles."""

from __future__ import annotations

import json
import math

import pytest
import torch

import jitattn
import jitattn.jit
from jitattn.runtime import builder
from jitattn.runtime.specs import append_spec, merge_spec, mla_kernel_spec
from jitattn.spec import Target
from jitattn_cache.cli import main
from jitattn_cache.presets import PRESETS, MLAShape, from_hf_config

CKV, KPE, NOPE, V_HEAD = 512, 64, 128, 128
e4m3 = torch.float8_e4m3fn

DEEPSEEK_V3_CONFIG = {  # the attention fields of deepseek-ai/DeepSeek-V3's config.json
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "rope_theta": 10000,
}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("JITATTN_CACHE_PATH", "JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST", "JITATTN_ASSERT_NO_COMPILE"):
        monkeypatch.delenv(name, raising=False)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def _dry_run_uris(capsys, *argv: str) -> list[str]:
    rc, out, err = run_cli(capsys, "warm", *argv, "--dry-run")
    assert rc == 0, err
    return [line.split()[0] for line in out.splitlines()[:-1]]


class _Requested(Exception):
    pass


def _cuda_specs_the_wrappers_request(monkeypatch, num_heads: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> list:
    """The cuda specs the MLA wrapper (decode and causal) and the non-absorbed ragged prefill (causal and not)
    ask for, found without a GPU: the wrappers are built on the cpu and told their target is cuda, and the
    load is intercepted."""
    requested = []

    def record(spec):
        requested.append(spec)
        raise _Requested

    monkeypatch.setattr(builder, "load", record)
    one = torch.tensor([0, 1], dtype=torch.int32)
    for causal in (False, True):
        mla = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(0, dtype=torch.uint8))
        mla._inner._target = Target.CUDA
        with pytest.raises(_Requested):
            mla.plan(one, one, torch.zeros(1, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), num_heads,
                     CKV, KPE, 64, causal, 1 / math.sqrt(192), dtype, kv_dtype)
        ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(0, dtype=torch.uint8))
        ragged._target = Target.CUDA
        with pytest.raises(_Requested):
            ragged.plan(one, one, num_heads, num_heads, NOPE + KPE, head_dim_vo=V_HEAD, causal=causal,
                        q_data_type=dtype)
    return requested


@pytest.mark.parametrize("preset", ["deepseek-v3", "deepseek-v2-lite"])
@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_mla_presets_list_exactly_what_the_wrappers_request(preset, kv_dtype, monkeypatch, fresh_cache,
                                                            capsys) -> None:
    uris = _dry_run_uris(capsys, "--preset", preset, "--arch", "9.0a", "--kv-dtype", kv_dtype)
    kv = getattr(torch, kv_dtype)
    attention = _cuda_specs_the_wrappers_request(monkeypatch, PRESETS[preset].num_heads, torch.bfloat16, kv)
    expected = [s.uri for s in attention] + [merge_spec(Target.CUDA, torch.bfloat16).uri,
                                             append_spec(Target.CUDA, kv).uri]
    # on a 9.0a arch list the wrapper plans the latent cache (bf16 or fp8) on the sm90 MLA kernel
    expected.append(mla_kernel_spec(torch.bfloat16, kv).uri)
    assert ("mla_cuda_bf16_kve4m3_hd576x512" if kv is e4m3 else "mla_cuda_bf16_hd576x512") in uris
    assert sorted(uris) == sorted(set(expected))
    heads = PRESETS[preset].num_heads
    kve = "_kve4m3" if kv is e4m3 else ""
    assert f"prefill_paged_cuda_bf16{kve}_hd576x512_g{heads}_causal_nhd" in uris
    assert "prefill_ragged_cuda_bf16_hd192x128_g1_causal_nhd" in uris


def test_mla_hf_config_matches_the_preset(tmp_path, fresh_cache, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    assert from_hf_config(path) == PRESETS["deepseek-v3"] == MLAShape(128, 512, 64, 128, 128)
    assert (_dry_run_uris(capsys, "--config", path, "--arch", "9.0a")
            == _dry_run_uris(capsys, "--preset", "deepseek-v3", "--arch", "9.0a"))
    lite = dict(DEEPSEEK_V3_CONFIG, num_attention_heads=16, q_lora_rank=None)
    path.write_text(json.dumps(lite))
    assert from_hf_config(path) == PRESETS["deepseek-v2-lite"]
    # tensor parallel splits the query heads; the latent head is replicated
    assert any("_hd576x512_g16_" in uri for uri in _dry_run_uris(capsys, "--preset", "deepseek-v3", "--arch", "9.0a",
                                                                  "--tp", "8"))


@pytest.mark.parametrize("config, message", [
    ({"num_attention_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "v_head_dim": 128},
     "needs qk_rope_head_dim"),
    ({"num_attention_heads": 16, "kv_lora_rank": 0, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
      "v_head_dim": 128}, "kv_lora_rank=0 must be a positive integer"),
    ({"num_attention_heads": 16, "kv_lora_rank": 256, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
      "v_head_dim": 128}, "head_dim_qk=320, head_dim_vo=256 is not supported"),
])
def test_mla_config_errors_exit_2(config, message, tmp_path, fresh_cache, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    rc, _, err = run_cli(capsys, "warm", "--config", path, "--arch", "9.0a", "--dry-run")
    assert rc == 2 and message in err


def _run_every_mla_path(device: str, num_heads: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    """Plan and run what a DeepSeek layer does: MLA decode and speculative decode over the latent cache, the
    non-absorbed ragged prefill (causal, and over an earlier chunk), the merge of the two, the latent append."""
    gen = torch.Generator().manual_seed(1)

    def rand(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt).to(device)

    latent = rand(4, 64, CKV + KPE, dt=kv_dtype)
    ckv, kpe = latent[..., :CKV], latent[..., CKV:]
    indptr, indices = torch.tensor([0, 2, 3], dtype=torch.int32), torch.tensor([3, 0, 1], dtype=torch.int32)
    lens = torch.tensor([100, 40], dtype=torch.int32)
    for qo_lens, causal in (([1, 1], False), ([4, 2], True)):
        qo_indptr = torch.tensor([0, qo_lens[0], sum(qo_lens)], dtype=torch.int32)
        mla = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
        mla.plan(qo_indptr, indptr, indices, lens, num_heads, CKV, KPE, 64, causal, 1 / math.sqrt(192), dtype,
                 kv_dtype)
        out = mla.run(rand(sum(qo_lens), num_heads, CKV), rand(sum(qo_lens), num_heads, KPE), ckv, kpe)
        assert out.isfinite().all()
    states = []
    for causal in (True, False):
        ragged = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
        ragged.plan(torch.tensor([0, 8], dtype=torch.int32), torch.tensor([0, 8], dtype=torch.int32), num_heads,
                    num_heads, NOPE + KPE, head_dim_vo=V_HEAD, causal=causal, q_data_type=dtype)
        states.append(ragged.run(rand(8, num_heads, NOPE + KPE), rand(8, num_heads, NOPE + KPE),
                                 rand(8, num_heads, V_HEAD), return_lse=True))
    merged, _ = jitattn.merge_state(*states[0], *states[1])
    assert merged.isfinite().all()
    batch, positions = jitattn.get_batch_indices_positions(torch.tensor([0, 1, 2], dtype=torch.int32), lens + 1, 2)
    last = torch.tensor([(100 % 64) + 1, 41], dtype=torch.int32)
    jitattn.append_paged_mla_kv_cache(rand(2, CKV), rand(2, KPE), batch.to(device), positions.to(device), ckv, kpe,
                                      indices.to(device), indptr.to(device), last.to(device))


def _compiles_after_warming(monkeypatch, capsys, target: str, device: str, kv_dtype: str) -> int:
    """Warm the deepseek-v2-lite preset, then run every MLA path: the compiles that took (0 when warm)."""
    rc, out, err = run_cli(capsys, "warm", "--preset", "deepseek-v2-lite", "--target", target, "--kv-dtype", kv_dtype)
    assert rc == 0, err
    jitattn.jit._registry.clear()  # what this process loaded while warming is forgotten: loads go to the disk
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    before = jitattn.jit.compile_count()
    _run_every_mla_path(device, PRESETS["deepseek-v2-lite"].num_heads, torch.bfloat16, getattr(torch, kv_dtype))
    return jitattn.jit.compile_count() - before


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_warmed_mla_cache_serves_every_mla_path_with_zero_compiles(kv_dtype, monkeypatch, fresh_cache,
                                                                     capsys) -> None:
    assert _compiles_after_warming(monkeypatch, capsys, "cpu", "cpu", kv_dtype) == 0


@pytest.mark.gpu
def test_a_warmed_mla_cache_serves_every_mla_path_with_zero_compiles_on_cuda(monkeypatch, fresh_cache,
                                                                             capsys) -> None:
    """One dtype on the GPU (it builds the preset's six cuda specs in a fresh cache); that the lists match the
    wrappers' requests for both dtypes is checked without a GPU above."""
    assert _compiles_after_warming(monkeypatch, capsys, "cuda", "cuda", "bfloat16") == 0

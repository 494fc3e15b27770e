"""The jitattn-cache CLI: warm, ls/info/verify, prune, export/import bundles, doctor, show-config.

Commands run in-process through ``jitattn_cache.cli.main([...])`` with a
private ``JITATTN_CACHE_DIR``; the console entry (``python -m jitattn_cache``)
and loads "on another machine" run in child processes. One warmed cache
(llama-3-8b, cpu target) is built once per module and copied where a test
changes it.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import pytest
import torch

import jitattn.jit
from jitattn.runtime.specs import model_specs
from jitattn.jit.key import SCHEMA, build_inputs
from jitattn.jit.cache import entry_dirs, entry_lock, read_manifest, remove_entry
from jitattn.spec import Target, VariantSpec
from jitattn.spec_text import parse_spec_text
from jitattn_cache.cli import main
from jitattn_cache.presets import PRESETS, ModelShape, from_hf_config

REPO = Path(__file__).resolve().parents[1]
LLAMA_CPU = ["decode_cpu_bf16", "prefill_cpu_bf16", "merge_cpu_bf16", "append_cpu_bf16", "rope_cpu_bf16",
             "norm_cpu_bf16", "act_cpu_bf16"]
_KNOBS = ("JITATTN_CACHE_PATH", "JITATTN_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST", "JITATTN_ASSERT_NO_COMPILE",
          "JITATTN_MAX_JOBS", "MAX_JOBS", "JITATTN_NVCC")


def _has_nvcc() -> bool:
    from jitattn.jit.toolchain import ToolchainError, probe

    try:
        probe(Target.CUDA)
        return True
    except ToolchainError:
        return False


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in _KNOBS:
        monkeypatch.delenv(name, raising=False)
    saved = dict(jitattn.jit._registry)
    jitattn.jit._registry.clear()
    yield
    jitattn.jit._registry.clear()
    jitattn.jit._registry.update(saved)


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def warmed(tmp_path_factory):
    """A cache root warmed with `warm --preset llama-3-8b --target cpu` (and that command's output)."""
    root = tmp_path_factory.mktemp("warmed") / "cache"
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JITATTN_CACHE_DIR", str(root))
        for name in _KNOBS:
            mp.delenv(name, raising=False)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["warm", "--preset", "llama-3-8b", "--target", "cpu"])
    return root, rc, out.getvalue(), err.getvalue()


@pytest.fixture
def cache_copy(warmed, tmp_path, monkeypatch) -> Path:
    """A private copy of the warmed cache as JITATTN_CACHE_DIR."""
    root = tmp_path / "cache"
    shutil.copytree(warmed[0], root, symlinks=True)
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    return root


def _names(root: Path) -> list[str]:
    return [p.name.rsplit("-", 1)[0] for p in entry_dirs(root / SCHEMA)]


# -- warm ------------------------------------------------------------------------------


def test_warm_preset_builds_the_cpu_specs_then_reports_all_cached(warmed, monkeypatch, capsys) -> None:
    root, rc, out, err = warmed
    assert rc == 0, err
    assert "7 built, 0 already cached, 0 failed" in out
    expected = model_specs(Target.CPU, num_qo_heads=32, num_kv_heads=8, head_dim=128, dtype=torch.bfloat16,
                           kv_dtype=torch.bfloat16)
    assert sorted(s.uri for s in expected) == sorted(LLAMA_CPU) == sorted(_names(root))
    assert "jitattn warm" in err  # the progress bar

    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    before = jitattn.jit.compile_count()
    rc, out, _ = run_cli(capsys, "warm", "--preset", "llama-3-8b", "--target", "cpu")
    assert rc == 0
    assert "0 built, 7 already cached, 0 failed" in out
    assert jitattn.jit.compile_count() == before


def test_dry_run_lists_specs_and_cache_status_without_building(warmed, monkeypatch, capsys) -> None:
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(warmed[0]))
    before = jitattn.jit.compile_count()
    rc, out, _ = run_cli(capsys, "warm", "--preset", "llama-3-8b", "--target", "cpu", "--spec", "merge_cpu_f16",
                         "--dry-run")
    assert rc == 0
    status = {line.split()[0]: line.split()[1] for line in out.splitlines()[:-1]}
    assert status == {**{uri: "cached" for uri in LLAMA_CPU}, "merge_cpu_f16": "cold"}
    assert "8 specs (target cpu): 7 cached, 1 cold" in out
    assert jitattn.jit.compile_count() == before
    assert "merge_cpu_f16" not in _names(warmed[0])


@pytest.mark.parametrize("argv,message", [
    (["warm", "--preset", "llama-9b"], "unknown preset 'llama-9b'"),
    (["warm", "--spec", "decode_cpu_bf16_bogus"], "unknown token 'bogus'"),
    (["warm", "--spec", "decode_paged_cpu_f32_hd64_g4_g8_nhd"], "'g8' sets group_size again (after 'g4')"),
    (["warm", "--spec", "decode_paged_cpu_f32_hd64_g4_rope_alibi_nhd"], "'alibi' sets pos_encoding again"),
    (["warm", "--spec", "decode_paged_cpu_f32_hd0064_g4_nhd"], "'hd0064' is not a head dim token"),
    (["warm", "--spec", "decode_paged_cpu_f32_hd_g4_nhd"], "'hd' is not a head dim token"),
    (["warm", "--spec", "decode_paged_cpu_f32_hd64_g\u0664_nhd"], "unknown token 'g\u0664'"),
    (["warm", "--spec", "op=merge,target=cpu"], "o_dtype is required"),
    (["warm", "--spec", "op=merge,target=cpu,o_dtype=int4"], "o_dtype='int4' is not supported"),
    (["warm", "--spec", "op=merge,target=cpu,o_dtype=f32,use_sinks=ture"], "use_sinks='ture' is neither on nor off"),
    (["warm", "--spec", "op=merge,target=cpu,o_dtype=f32,o_dtype=f16"], "o_dtype is given twice"),
    (["warm", "--spec", "op=merge,target=cpu,o_dtype=f32,,"], "has an empty key=value pair"),
    (["warm", "--spec", '{"op": "merge"}'], "a spec needs target (e.g. op=decode, target=cuda)"),
    (["warm", "--spec", "op=decode,target=cpu,q_dtype=f32,head_dim_qk=abc"], "head_dim_qk='abc' is not an integer"),
    (["warm", "--config", "/nonexistent/config.json"], "does not exist"),
    (["warm", "--preset", "llama-3-8b", "--arch", "9.x"], "'9.x' is not an arch"),
    (["warm", "--preset", "llama-3-8b", "--arch", ";"], "';' names no arch"),
    pytest.param(["warm", "--preset", "llama-3-8b", "--target", "cuda"], "pass --arch",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the visible GPU gives the arch")),
    (["warm", "--preset", "llama-3-8b", "--tp", "3"], "--tp 3 must divide num_attention_heads=32"),
    (["warm", "--preset", "llama-3-8b", "--dtype", "int8"], "--dtype='int8' is not supported"),
    (["warm", "--preset", "llama-3-8b", "--arch", "9.0a", "--dtype", "float32"], "cpu target only"),
    (["warm", "--preset", "llama-3-8b", "-j", "0"], "-j 0 must be at least 1"),
    (["warm"], "nothing selected"),
    (["warm", "--bogus-flag"], "unrecognized arguments"),
    (["frobnicate"], "invalid choice"),
    (["prune"], "prune needs --max-size"),
    (["prune", "--max-size", "2X"], "size '2X' is not understood"),
    (["prune", "--older-than", "30 days"], "duration '30 days' is not understood"),
    (["import", "/nonexistent/bundle.tar.gz"], "no such file"),
    (["export", "/nonexistent/dir/b.tar.gz"], "is not a directory"),
    (["export", "/tmp/b.zip"], "bundles are tar archives"),
    (["import", "/tmp"], "/tmp is a directory; import takes a bundle file"),
], ids=lambda v: "-".join(v) if isinstance(v, list) else None)
def test_usage_errors_exit_2(argv, message, fresh_cache, capsys) -> None:
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2, (out, err)
    assert message in err
    assert "JITATTN_CUDA_ARCH_LIST" not in os.environ  # --arch never leaks into the process
    assert not (fresh_cache / SCHEMA).exists() or not entry_dirs(fresh_cache / SCHEMA)


def test_failed_build_exits_1_with_the_reason(fresh_cache, monkeypatch, capsys) -> None:
    monkeypatch.setenv("JITATTN_CXX", "/nonexistent/c++")
    rc, out, err = run_cli(capsys, "warm", "--spec", "merge_cpu_f16", "-q")
    assert rc == 1
    assert "0 built, 0 already cached, 1 failed" in out
    assert "merge_cpu_f16" in err and "host C++ compiler '/nonexistent/c++' not found" in err


def test_a_compiler_command_line_in_cxx_is_named_as_such(fresh_cache, monkeypatch, capsys) -> None:
    monkeypatch.delenv("JITATTN_CXX", raising=False)
    monkeypatch.setenv("CXX", "ccache g++")
    rc, out, err = run_cli(capsys, "warm", "--spec", "merge_cpu_f16", "-q")
    assert rc == 1 and "CXX='ccache g++' is a command line" in err and "/usr/lib/ccache/g++" in err


def test_a_spec_without_a_kernel_template_is_listed_then_fails_with_the_reason(fresh_cache, monkeypatch,
                                                                                capsys) -> None:
    real = build_inputs

    def no_template(spec):
        if spec.op.value == "decode":
            raise NotImplementedError(f"{spec.uri}: op 'decode' has no kernel template for target 'cpu'")
        return real(spec)

    monkeypatch.setattr("jitattn.jit.key.build_inputs", no_template)
    monkeypatch.setattr("jitattn.jit.build_inputs", no_template)
    monkeypatch.setattr("jitattn.jit.admin.build_inputs", no_template)  # the CLI's view of the cache
    rc, out, _ = run_cli(capsys, "warm", "--spec", "decode_cpu_f16", "--spec", "merge_cpu_f32", "--dry-run")
    assert rc == 1  # as the warm itself
    assert out.splitlines()[0].split()[:2] == ["decode_cpu_f16", "unavailable"] and "no kernel template" in out
    rc, out, err = run_cli(capsys, "warm", "--spec", "decode_cpu_f16", "--spec", "merge_cpu_f32", "-q")
    assert rc == 1
    assert "1 built, 0 already cached, 1 failed" in out and "no kernel template" in err


GEMMA2_CONFIG = {
    "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "hidden_size": 3584, "head_dim": 256,
    "num_attention_heads": 16, "num_key_value_heads": 8, "sliding_window": 4096, "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0, "rope_theta": 10000.0, "query_pre_attn_scalar": 256,
}


def test_hf_config_gemma2_expands_to_softcap_and_window_specs_on_cuda(tmp_path, fresh_cache, capsys) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(GEMMA2_CONFIG))
    rc, out, err = run_cli(capsys, "warm", "--config", path, "--arch", "9.0a", "--dry-run")
    assert rc == 0, err
    uris = [line.split()[0] for line in out.splitlines()[:-1]]
    assert set(uris) == {
        "decode_paged_cuda_bf16_hd256_g2_softcap_nhd", "decode_paged_cuda_bf16_hd256_g2_swa_softcap_nhd",
        *(f"prefill_{storage}_cuda_bf16_hd256_g2{swa}_softcap{mask}_nhd" for storage in ("paged", "ragged")
          for swa in ("", "_swa") for mask in ("", "_causal")),
        "merge_cuda_bf16", "append_cuda_bf16", "rope_cuda_bf16", "norm_cuda_bf16", "act_cuda_bf16",
    }
    assert "target cuda" in out.splitlines()[-1]
    assert "JITATTN_CUDA_ARCH_LIST" not in os.environ
    # the preset and the config agree
    rc, preset_out, _ = run_cli(capsys, "warm", "--preset", "gemma-2-9b", "--arch", "9.0a", "--dry-run")
    assert [line.split()[0] for line in preset_out.splitlines()[:-1]] == uris


def test_hf_config_variants(tmp_path) -> None:
    def shape(config: dict) -> ModelShape:
        path = tmp_path / "c.json"
        path.write_text(json.dumps(config))
        return from_hf_config(path)

    mistral = shape({"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "sliding_window": 4096})
    assert mistral == ModelShape(32, 8, 128, sliding_window=True, full_attention_too=False)
    qwen = shape({"num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
                  "sliding_window": 131072, "use_sliding_window": False})
    assert qwen == PRESETS["qwen2.5-7b"]
    assert shape({"text_config": {"num_attention_heads": 8, "head_dim": 64}}) == ModelShape(8, 8, 64)
    assert shape({"num_attention_heads": 8, "head_dim": 64, "sliding_window": 512,
                  "layer_types": ["sliding_attention", "full_attention"]}).full_attention_too
    gpt_oss = shape(GPT_OSS_CONFIG)
    assert gpt_oss == ModelShape(64, 8, 64, sliding_window=True, full_attention_too=True, attention_sinks=True)
    for bad, message in [({"hidden_size": 4096}, "no num_attention_heads"),
                         ({"num_attention_heads": 32}, "neither head_dim nor hidden_size"),
                         ({"num_attention_heads": 32, "num_key_value_heads": 5, "head_dim": 64}, "not a multiple"),
                         ({"num_attention_heads": 32, "num_key_value_heads": 0, "head_dim": 64},
                          "num_key_value_heads=0 must be a positive integer"),
                         ({"num_attention_heads": 32, "head_dim": 0}, "head_dim=0 must be a positive integer"),
                         ({"num_attention_heads": 32, "head_dim": 64, "sliding_window": "abc"},
                          "sliding_window='abc' must be a positive integer"),
                         ({"num_attention_heads": 8, "head_dim": 64, "attn_logit_softcapping": "x"},
                          "attn_logit_softcapping='x' is not a soft cap"),
                         ({"num_attention_heads": 8, "head_dim": 64, "attn_logit_softcapping": -1.0},
                          "attn_logit_softcapping=-1.0 is not a soft cap")]:
        with pytest.raises(ValueError, match=message):
            shape(bad)


GPT_OSS_CONFIG = {"model_type": "gpt_oss", "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
                  "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"]}


def test_gpt_oss_config_warms_the_sink_builds_beside_the_plain_ones(fresh_cache, capsys, tmp_path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(GPT_OSS_CONFIG))
    rc, out, err = run_cli(capsys, "warm", "--config", str(config), "--arch", "9.0a", "--dry-run")
    assert rc == 0, err
    uris = {line.split()[0] for line in out.splitlines()[:-1]}
    sinks = {u for u in uris if u.endswith("_sink")}
    assert sinks and {u.removesuffix("_sink") for u in sinks} <= uris
    assert "decode_paged_cuda_bf16_hd64_g8_swa_nhd_sink" in sinks and "merge_cuda_bf16_sink" in sinks


def test_tp_splits_heads(fresh_cache, capsys) -> None:
    def groups(*argv: str) -> set[str]:
        rc, out, err = run_cli(capsys, "warm", "--preset", "llama-3-70b", "--arch", "9.0a", "--dry-run", *argv)
        assert rc == 0, err
        return {tok for line in out.splitlines()[:-1] for tok in line.split()[0].split("_") if tok[:1] == "g"}

    assert groups() == {"g8"}  # 64 q heads / 8 kv heads
    assert groups("--tp", "8") == {"g8"}  # 8 q heads / 1 kv head per rank
    assert groups("--tp", "16") == {"g4"}  # 4 q heads / 1 replicated kv head per rank
    assert PRESETS["llama-3-8b"].with_tensor_parallel(4) == ModelShape(8, 2, 128)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        ModelShape(24, 6, 128).with_tensor_parallel(4)


@pytest.mark.skipif(not _has_nvcc(), reason="needs nvcc")
def test_warm_cuda_spec_with_arch_builds_without_a_gpu(fresh_cache, tmp_path, monkeypatch, capsys) -> None:
    rc, out, err = run_cli(capsys, "warm", "--spec", "merge_cuda_bf16", "--arch", "9.0a", "-q")
    assert rc == 0, err
    assert "1 built, 0 already cached, 0 failed" in out and "target cuda" in out
    assert "JITATTN_CUDA_ARCH_LIST" not in os.environ
    rc, out, _ = run_cli(capsys, "ls")
    row = next(line for line in out.splitlines() if line.startswith("merge_cuda_bf16"))
    assert row.split()[1:3] == ["cuda", "9.0a"]
    # Imported on a machine that loads entries for another arch: refused, and said why.
    bundle = tmp_path / "cuda.tar.gz"
    assert run_cli(capsys, "export", bundle, "--spec", "merge_cuda_bf16", "--arch", "9.0a")[0] == 0
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "8.0")
    rc, out, err = run_cli(capsys, "import", bundle, "--to", tmp_path / "other")
    assert rc == 1
    assert "built for CUDA arch 9.0a, but this machine uses 8.0 (from JITATTN_CUDA_ARCH_LIST)" in err
    assert not entry_dirs(tmp_path / "other" / SCHEMA)
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    rc, out, err = run_cli(capsys, "import", bundle, "--to", tmp_path / "other")
    assert rc == 0, err
    assert "imported 1 entries" in out


def test_ctrl_c_leaves_the_cache_consistent(fresh_cache, monkeypatch, capsys) -> None:
    specs = ["decode_cpu_f16", "prefill_cpu_f16", "merge_cpu_f16", "append_cpu_f16"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "jitattn_cache", "warm", "-j", "1", "-q"] + [a for s in specs for a in ("--spec", s)]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    tmp = fresh_cache / SCHEMA / "tmp"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if tmp.is_dir() and any("." in p.name for p in tmp.iterdir()):
            break  # a build is running in its private temp dir "<uri>-<key16>.<random>"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "interrupted" in err and "consistent" in err
    rc, out, _ = run_cli(capsys, "verify")
    assert rc == 0 and " 0 bad" in out
    assert not [p for p in tmp.iterdir()]  # the interrupted build's temp dir is gone
    assert not (fresh_cache / SCHEMA / "failed").exists() or not any((fresh_cache / SCHEMA / "failed").iterdir())
    assert len(_names(fresh_cache)) < len(specs)
    rc, out, _ = run_cli(capsys, "warm", "-q", *[a for s in specs for a in ("--spec", s)])
    assert rc == 0 and "0 failed" in out


# -- ls / info / verify / prune / clear ----------------------------------------------------------------


def test_ls_info_verify_and_fix(cache_copy, capsys) -> None:
    rc, out, _ = run_cli(capsys, "ls")
    assert rc == 0
    lines = out.splitlines()
    assert lines[0].split() == ["URI", "TARGET", "ARCH", "SIZE", "BUILT", "(UTC)", "LAYER"]
    assert sorted(line.split()[0] for line in lines[1:-1]) == sorted(LLAMA_CPU)
    assert all(line.split()[1] == "cpu" and "KiB" in line and " rw" in line for line in lines[1:-1])
    assert lines[-1].startswith("7 entries")

    rc, out, _ = run_cli(capsys, "info", "merge_cpu_bf16")
    assert rc == 0 and "status: ok" in out
    manifest = json.loads(out[out.index("{"):])
    assert manifest["uri"] == "merge_cpu_bf16" and len(manifest["sha256"]) == 64 and manifest["machine"]
    assert run_cli(capsys, "info", "decode_cuda_nothing")[0] == 1

    assert run_cli(capsys, "verify")[0] == 0
    victim = next(p for p in entry_dirs(cache_copy / SCHEMA) if p.name.startswith("decode_cpu_bf16"))
    with open(victim / "lib.so", "r+b") as f:
        f.seek(100)
        f.write(b"\xde\xad\xbe\xef")
    rc, out, _ = run_cli(capsys, "verify")
    assert rc == 1 and f"BAD {victim}: library checksum does not match" in out and "6 ok, 1 bad" in out
    rc, out, _ = run_cli(capsys, "info", "decode_cpu_bf16")
    assert rc == 1 and "status: BAD" in out, "a bad entry's info exits 1"
    rc, out, _ = run_cli(capsys, "verify", "--fix")
    assert rc == 0 and "removed" in out
    assert not victim.exists()
    assert run_cli(capsys, "verify")[1].endswith("6 entries, 6 ok, 0 bad\n")


def test_export_to_a_directory_says_to_name_the_file(cache_copy, tmp_path, capsys) -> None:
    folder = tmp_path / "bundles"
    folder.mkdir()
    rc, _, err = run_cli(capsys, "export", str(folder))
    assert rc != 0 and f"cannot write {folder}: it is a directory; name the bundle file" in err
    assert not list(folder.iterdir()) and not list(tmp_path.glob(".bundles.partial*")), "nothing written"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs a directory nobody can write in (Linux /proc)")
def test_export_into_an_unwritable_directory_names_the_bundle_not_its_temporary_file(cache_copy, capsys) -> None:
    rc, _, err = run_cli(capsys, "export", "/proc/jitattn.tar.gz")
    assert rc == 1 and err.startswith("jitattn-cache: cannot write /proc/jitattn.tar.gz (") and "partial" not in err


def test_verify_fix_never_touches_a_read_only_layer(cache_copy, tmp_path, monkeypatch, capsys) -> None:
    layer = tmp_path / "layer"
    shutil.copytree(cache_copy, layer)
    victim = next(p for p in entry_dirs(layer / SCHEMA) if p.name.startswith("merge_cpu_bf16"))
    (victim / "lib.so").write_bytes(b"not a library")
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    rc, out, _ = run_cli(capsys, "verify", "--fix")
    assert rc == 1 and "read-only layer" in out
    assert victim.exists()


def test_verify_fix_keeps_another_jitattn_versions_entries(cache_copy, monkeypatch, capsys) -> None:
    """A cache two jitattn versions share: the other's entries (another ABI version, so another key: never loaded
    here) are reported and kept, not removed as bad."""
    import jitattn.jit.loader as loader

    monkeypatch.setattr(loader, "ABI_VERSION", loader.ABI_VERSION + 1)  # as a newer jitattn sees these entries
    rc, out, _ = run_cli(capsys, "verify", "--fix")
    assert rc == 0 and "7 entries, 0 ok, 0 bad, 7 of another jitattn version" in out, out
    assert out.count("OTHER ") == 7 and "0 removed" in out
    assert len(list(entry_dirs(cache_copy / SCHEMA))) == 7


def _set_built_at(root: Path, ages_days: dict[str, float]) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    for path in entry_dirs(root / SCHEMA):
        manifest = read_manifest(path)
        manifest["built_at"] = (now - datetime.timedelta(days=ages_days[manifest["uri"]])).isoformat()
        (path / "manifest.json").write_text(json.dumps(manifest))


def test_prune_by_age_then_by_size_oldest_first(cache_copy, capsys) -> None:
    _set_built_at(cache_copy, {"decode_cpu_bf16": 40, "prefill_cpu_bf16": 20, "rope_cpu_bf16": 15,
                               "norm_cpu_bf16": 13, "act_cpu_bf16": 12, "merge_cpu_bf16": 10, "append_cpu_bf16": 0})
    rc, out, _ = run_cli(capsys, "prune", "--older-than", "30d", "--dry-run")
    assert rc == 0 and "would remove decode_cpu_bf16" in out and len(_names(cache_copy)) == 7
    rc, out, _ = run_cli(capsys, "prune", "--older-than", "30d")
    assert rc == 0 and "pruned 1 entries" in out
    assert sorted(_names(cache_copy)) == sorted(["prefill_cpu_bf16", "rope_cpu_bf16", "norm_cpu_bf16", "act_cpu_bf16",
                                                 "merge_cpu_bf16", "append_cpu_bf16"])

    from jitattn_cache.store import tree_size

    sizes = {p.name.rsplit("-", 1)[0]: tree_size(p) for p in entry_dirs(cache_copy / SCHEMA)}
    limit = sizes["merge_cpu_bf16"] + sizes["append_cpu_bf16"] + 10  # room for the two newest
    rc, out, _ = run_cli(capsys, "prune", "--max-size", str(limit))
    assert rc == 0 and out.index("removed prefill_cpu_bf16") < out.index("removed rope_cpu_bf16")
    assert sorted(_names(cache_copy)) == ["append_cpu_bf16", "merge_cpu_bf16"]
    rc, out, _ = run_cli(capsys, "prune", "--max-size", "1K")
    assert out.index("removed merge_cpu_bf16") < out.index("removed append_cpu_bf16")  # oldest first
    assert _names(cache_copy) == []
    assert run_cli(capsys, "verify")[0] == 0


def test_remove_entry_waits_for_the_per_key_lock(cache_copy) -> None:
    base = cache_copy / SCHEMA
    entry = entry_dirs(base)[0]
    lock = entry_lock(base, entry.name)
    with lock:  # a builder of this key is running
        assert remove_entry(base, entry, timeout=0.2) is False
    assert entry.exists()
    assert remove_entry(base, entry, timeout=0.2) is True
    assert not entry.exists()


# -- export / import -------------------------------------------------------------------------------


CHILD = textwrap.dedent("""
    import torch, jitattn, jitattn.jit as jit
    from jitattn.runtime.merge import merge_state
    bf16, i32 = torch.bfloat16, torch.int32
    hq, hkv, d, page = 32, 8, 128, 16  # llama-3-8b
    ws = torch.empty(64 << 20, dtype=torch.uint8)
    indptr, indices = torch.tensor([0, 1, 4], dtype=i32), torch.tensor([3, 0, 2, 1], dtype=i32)
    last = torch.tensor([5, 1], dtype=i32)
    cache = torch.randn(4, 2, page, hkv, d).to(bf16)
    dec = jitattn.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    dec.plan(indptr, indices, last, hq, hkv, d, page, q_data_type=bf16)
    outs = [dec.run(torch.randn(2, hq, d).to(bf16), cache)]
    qo = torch.tensor([0, 3, 5], dtype=i32)
    pre = jitattn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    pre.plan(qo, indptr, indices, last, hq, hkv, d, page, causal=True, q_data_type=bf16)
    outs.append(pre.run(torch.randn(5, hq, d).to(bf16), cache))
    rag = jitattn.BatchPrefillWithRaggedKVCacheWrapper(ws)
    rag.plan(qo, torch.tensor([0, 5, 38], dtype=i32), hq, hkv, d, causal=True, q_data_type=bf16)
    outs.append(rag.run(torch.randn(5, hq, d).to(bf16), torch.randn(38, hkv, d).to(bf16),
                        torch.randn(38, hkv, d).to(bf16)))
    cas = jitattn.MultiLevelCascadeAttentionWrapper(2, ws)
    cas.plan([torch.tensor([0, 2], dtype=i32), torch.tensor([0, 1, 2], dtype=i32)],
             [torch.tensor([0, 1], dtype=i32), torch.tensor([0, 1, 2], dtype=i32)],
             [torch.tensor([3], dtype=i32), torch.tensor([0, 2], dtype=i32)],
             [torch.tensor([16], dtype=i32), torch.tensor([4, 9], dtype=i32)], hq, hkv, d, page, q_data_type=bf16)
    outs.append(cas.run(torch.randn(2, hq, d).to(bf16), cache))
    outs.append(merge_state(torch.randn(3, hq, d).to(bf16), torch.randn(3, hq), torch.randn(3, hq, d).to(bf16),
                            torch.randn(3, hq))[0])
    new = torch.randn(2, hkv, d).to(bf16)
    jitattn.append_paged_kv_cache(new, new, torch.tensor([0, 1], dtype=i32), torch.tensor([5, 32], dtype=i32),
                                  cache, indices, indptr, torch.tensor([6, 1], dtype=i32))
    assert torch.equal(cache[3, 0, 5], new[0])
    assert all(torch.isfinite(o.float()).all() for o in outs)
    print("compiles", jit.compile_count())
""")


def _child_env(tmp_path: Path, layer: Path) -> dict[str, str]:
    """A server without compilers: no c++, no nvcc, an empty writable cache, the bundle as a read-only layer."""
    empty_bin = tmp_path / "bin"
    empty_bin.mkdir(exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("JITATTN_") and k not in ("CUDA_HOME", "CXX")}
    env.update({
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]), "PATH": str(empty_bin),
        "JITATTN_CACHE_PATH": str(layer), "JITATTN_CACHE_DIR": str(tmp_path / "server-cache"),
        "JITATTN_ASSERT_NO_COMPILE": "1", "JITATTN_CXX": "/nonexistent/c++", "JITATTN_NVCC": "/nonexistent/nvcc",
    })
    return env


def test_export_import_bundle_loads_read_only_in_a_new_process_with_zero_compiles(warmed, tmp_path, monkeypatch,
                                                                                capsys) -> None:
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(warmed[0]))
    bundle = tmp_path / "llama.tar.gz"
    rc, out, err = run_cli(capsys, "export", bundle)
    assert rc == 0, err
    assert "exported 7 entries" in out
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
    assert all(n == SCHEMA or n.startswith(f"{SCHEMA}/") for n in names)
    assert {n.split("/", 2)[2] for n in names if n.count("/") == 2} == {"manifest.json", "build.ninja", "lib.so",
                                                                          "sources"}
    layer = tmp_path / "layer"
    rc, out, err = run_cli(capsys, "import", bundle, "--to", layer)
    assert rc == 0, err
    assert "imported 7 entries" in out and f"JITATTN_CACHE_PATH={layer}" in out
    rc, out, _ = run_cli(capsys, "import", bundle, "--to", layer)
    assert rc == 0 and "imported 0 entries" in out and "7 already present" in out

    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = _child_env(tmp_path, layer)
    proc = subprocess.run([sys.executable, str(script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith("compiles 0")
    assert not (tmp_path / "server-cache").exists()  # the load path wrote nothing

    # the console entry, in the same compiler-less environment
    proc = subprocess.run([sys.executable, "-m", "jitattn_cache", "ls"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(f"ro {layer}") == 7
    proc = subprocess.run([sys.executable, "-m", "jitattn_cache", "warm", "--preset", "no-such-model"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "unknown preset" in proc.stderr


def test_extracted_bundle_is_a_read_only_layer(warmed, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(warmed[0]))
    bundle = tmp_path / "b.tar.gz"
    assert run_cli(capsys, "export", bundle, "--preset", "llama-3-8b", "--target", "cpu")[0] == 0
    layer = tmp_path / "extracted"
    layer.mkdir(mode=0o755)
    with tarfile.open(bundle) as tar:
        tar.extractall(layer, filter="data")
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(tmp_path / "empty"))
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    before = jitattn.jit.compile_count()
    for uri in LLAMA_CPU:
        module = jitattn.jit.load(parse_spec_text(uri))
        assert str(module.path).startswith(str(layer))
    assert jitattn.jit.compile_count() == before


def test_export_clear_import_then_load_with_zero_compiles(cache_copy, tmp_path, monkeypatch, capsys) -> None:
    bundle = tmp_path / "b.tgz"
    rc, out, err = run_cli(capsys, "export", bundle, "--preset", "llama-3-8b", "--target", "cpu")
    assert rc == 0, err
    rc, out, _ = run_cli(capsys, "clear")
    assert rc == 0 and "removed 7 entries" in out
    assert _names(cache_copy) == []
    rc, out, err = run_cli(capsys, "import", bundle)
    assert rc == 0, err
    assert "imported 7 entries" in out
    monkeypatch.setenv("JITATTN_ASSERT_NO_COMPILE", "1")
    before = jitattn.jit.compile_count()
    for uri in LLAMA_CPU:
        jitattn.jit.load(parse_spec_text(uri))
    assert jitattn.jit.compile_count() == before
    # a selection naming something that is not cached: refused, nothing written
    rc, _, err = run_cli(capsys, "export", tmp_path / "more.tgz", "--spec", "merge_cpu_f16", "--spec", "merge_cpu_bf16")
    assert rc == 1 and "merge_cpu_f16: not in the cache" in err
    assert not (tmp_path / "more.tgz").exists()
    rc, out, _ = run_cli(capsys, "export", tmp_path / "more.tgz", "--spec", "merge_cpu_f16", "--spec",
                         "merge_cpu_bf16", "--allow-missing")
    assert rc == 1 and "exported 1 entries" in out


def _entry_files(spec: VariantSpec, *, archs=(), machine: str | None = None, lib: bytes = b"\x7fELF fake") -> dict:
    """The files of a hand-made, internally consistent entry (manifest matches its library)."""
    key = hashlib.sha256(spec.canonical_json().encode()).hexdigest()
    manifest = {"schema": SCHEMA, "uri": spec.uri, "key": key, "spec": spec.to_dict(), "target": spec.target.value,
                "archs": list(archs), "library": "lib.so", "sha256": hashlib.sha256(lib).hexdigest(),
                "built_at": "2026-01-01T00:00:00+00:00"}
    if machine:
        manifest["machine"] = machine
    name = f"{SCHEMA}/{spec.uri}-{key[:16]}"
    return {f"{name}/manifest.json": json.dumps(manifest).encode(), f"{name}/lib.so": lib}


def _write_tar(path: Path, files: dict[str, bytes], extra=()) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        for info in extra:
            tar.addfile(info, io.BytesIO(b"evil") if info.isreg() else None)
    return path


def _member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.size = 4 if kind == tarfile.REGTYPE else 0
    return info


GOOD = _entry_files(VariantSpec(op="merge", target="cpu", o_dtype="f16"))
ENTRY = next(iter(GOOD)).rsplit("/", 1)[0]


UNSAFE = {
    "dotdot": ([_member("../evil")], "'..'"),
    "dotdot-inside": ([_member(f"{ENTRY}/sources/../../../evil")], "'..'"),
    "absolute": ([_member("/tmp/jitattn-evil")], "absolute path"),
    "symlink": ([_member(f"{ENTRY}/sources/x.h", tarfile.SYMTYPE, "/etc/passwd")], "symlink"),
    "hardlink": ([_member(f"{ENTRY}/sources/x.h", tarfile.LNKTYPE, "/etc/passwd")], "hard link"),
    "device": ([_member(f"{ENTRY}/sources/null", tarfile.CHRTYPE)], "device file"),
    "fifo": ([_member(f"{ENTRY}/sources/fifo", tarfile.FIFOTYPE)], "fifo"),
    "outside-schema": ([_member("evil.sh")], "outside v1/"),
    "cache-state": ([_member(f"{SCHEMA}/locks/x.lock")], "the cache's working state, not an entry"),
    "not-an-entry": ([_member(f"{SCHEMA}/my-notes")], "not a cache entry name"),
    "other-layout": ([_member("v2/x")], "is of cache layout v2 (this jitattn reads v1)"),
    "stray-file": ([_member(f"{ENTRY}/run_me.sh")], "not part of a cache entry"),
    "duplicate": ([_member(f"{ENTRY}/lib.so")], "appears twice"),
}


@pytest.mark.parametrize("case", list(UNSAFE))
def test_import_refuses_unsafe_archives(case, tmp_path, fresh_cache, capsys) -> None:
    extra, message = UNSAFE[case]
    bundle = _write_tar(tmp_path / "bad.tar.gz", GOOD, extra)
    dest = tmp_path / "dest"
    rc, out, err = run_cli(capsys, "import", bundle, "--to", dest)
    assert rc == 1, (out, err)
    assert "unsafe archive; nothing was imported" in err and message in err
    assert not dest.exists()  # refused before anything was written
    assert not (tmp_path / "evil").exists() and not Path("/tmp/jitattn-evil").exists()


def test_import_refuses_a_damaged_or_empty_archive(tmp_path, fresh_cache, capsys) -> None:
    good = _write_tar(tmp_path / "good.tgz", GOOD).read_bytes()
    (tmp_path / "cut.tgz").write_bytes(good[: len(good) // 2])
    (tmp_path / "noise.tgz").write_bytes(b"not a tar at all" * 100)
    for name in ("cut.tgz", "noise.tgz"):
        rc, _, err = run_cli(capsys, "import", tmp_path / name, "--to", tmp_path / "dest")
        assert rc == 1 and ("nothing was imported" in err or "not a readable tar" in err), err
        assert not entry_dirs(tmp_path / "dest" / SCHEMA)
    rc, _, err = run_cli(capsys, "import", _write_tar(tmp_path / "empty.tar", {}), "--to", tmp_path / "dest")
    assert rc == 1 and "holds no cache entries" in err


def test_import_refuses_a_plain_tar_cut_at_a_member_boundary(tmp_path, fresh_cache, capsys) -> None:
    """tarfile reads an uncompressed tar cut after a whole member as if it ended there: import took the entries
    before the cut and said nothing; the missing end-of-archive marker gives it away."""
    plain = tmp_path / "plain.tar"
    with tarfile.open(plain, "w") as tar:
        for name, data in GOOD.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with tarfile.open(plain) as tar:
        first = tar.getmembers()[0]
        cut = first.offset_data + -(-first.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE  # after the first member
    (tmp_path / "cut.tar").write_bytes(plain.read_bytes()[:cut])
    rc, _, err = run_cli(capsys, "import", tmp_path / "cut.tar", "--to", tmp_path / "dest")
    assert rc == 1 and "end-of-archive marker" in err and "nothing was imported" in err, err
    assert not entry_dirs(tmp_path / "dest" / SCHEMA)
    rc, out, err = run_cli(capsys, "import", plain, "--to", tmp_path / "dest")  # the whole one imports
    assert rc == 0 and "imported 1 entries" in out, (out, err)


def test_import_refuses_tampered_entries(warmed, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(warmed[0]))
    bundle = tmp_path / "b.tar.gz"
    assert run_cli(capsys, "export", bundle)[0] == 0
    tampered = tmp_path / "tampered.tar.gz"
    with tarfile.open(bundle) as src, tarfile.open(tampered, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isreg() else None
            if member.name.startswith(f"{SCHEMA}/merge_cpu_bf16") and member.name.endswith("/lib.so"):
                data = data[:200] + b"\x90\x90\x90\x90" + data[204:]  # same size, different bytes
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    rc, out, err = run_cli(capsys, "import", tampered, "--to", tmp_path / "dest")
    assert rc == 1
    assert "fail their own manifest" in err and "merge_cpu_bf16" in err and "checksum does not match" in err
    assert not entry_dirs(tmp_path / "dest" / SCHEMA)  # nothing imported, not even the good entries
    assert not list((tmp_path / "dest" / SCHEMA / "tmp").iterdir())  # staging cleaned up
    # a manifest that lies about its entry's name is refused too
    files = dict(GOOD)
    manifest_name = next(n for n in files if n.endswith("manifest.json"))
    manifest = json.loads(files[manifest_name])
    manifest["uri"] = "merge_cpu_bf16"
    files[manifest_name] = json.dumps(manifest).encode()
    rc, _, err = run_cli(capsys, "import", _write_tar(tmp_path / "liar.tgz", files), "--to", tmp_path / "dest")
    assert rc == 1 and "do not match the entry's name" in err


def test_import_takes_an_entrys_build_logs(tmp_path, fresh_cache, capsys) -> None:
    """A tar of a cache's entries made by hand carries the build.log and .ninja_log each build writes."""
    logs = {f"{ENTRY}/build.log": b"[1/2] c++ ...", f"{ENTRY}/.ninja_log": b"# ninja log v5"}
    rc, out, err = run_cli(capsys, "import", _write_tar(tmp_path / "b.tgz", {**GOOD, **logs}), "--to", tmp_path / "d")
    assert rc == 0 and "imported 1 entries" in out, (out, err)
    rc, out, err = run_cli(capsys, "import", tmp_path / "b.tgz", "--to", tmp_path / "a layer")  # pasteable
    assert rc == 0 and f"JITATTN_CACHE_PATH='{tmp_path / 'a layer'}'" in out, (out, err)


def test_import_refuses_entries_for_another_machine(tmp_path, fresh_cache, monkeypatch, capsys) -> None:
    merge_cuda = VariantSpec(op="merge", target="cuda", o_dtype="bf16")
    foreign = _entry_files(VariantSpec(op="merge", target="cpu", o_dtype="f32"), machine="riscv64")
    bundle = _write_tar(tmp_path / "b.tgz", {**GOOD, **foreign, **_entry_files(merge_cuda, archs=["8.0"])})
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    rc, out, err = run_cli(capsys, "import", bundle, "--to", tmp_path / "dest")
    assert rc == 1
    assert "built on a riscv64 machine" in err
    assert "built for CUDA arch 8.0, but this machine uses 9.0a" in err
    assert "imported 1 entries" in out and "2 refused" in out  # the compatible one (no machine recorded)
    assert _names(tmp_path / "dest") == ["merge_cpu_f16"]
    monkeypatch.delenv("JITATTN_CUDA_ARCH_LIST")  # no GPU and no arch list: a cuda entry cannot be judged
    monkeypatch.setattr("jitattn_cache.selection.gpu_visible", lambda: False)
    rc, out, err = run_cli(capsys, "import", bundle, "--to", tmp_path / "dest2")
    assert rc == 1 and "1 refused" in out and "riscv64" in err


# -- doctor / show-config ---------------------------------------------------------------------------


def test_doctor_healthy_then_nvcc_missing(fresh_cache, monkeypatch, capsys) -> None:
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    rc, out, err = run_cli(capsys, "doctor")
    assert rc == 0, out
    assert "host compiler" in out and "cache dir" in out and "free" in out and "0 problem(s)" in out
    assert "GPU:" in out
    monkeypatch.setenv("JITATTN_NVCC", "/nonexistent/nvcc")
    rc, out, _ = run_cli(capsys, "doctor")
    assert rc == 1
    line = next(line for line in out.splitlines() if "nvcc:" in line)
    assert "FAIL" in line and "missing" in line and "/nonexistent/nvcc" in line
    assert "fix: point JITATTN_NVCC at nvcc" in out


def test_doctor_reports_an_unsafe_read_only_layer(warmed, tmp_path, fresh_cache, monkeypatch, capsys) -> None:
    layer = tmp_path / "layer"
    shutil.copytree(warmed[0], layer)
    os.chmod(layer / SCHEMA, 0o777)
    monkeypatch.setenv("JITATTN_CACHE_PATH", str(layer))
    rc, out, _ = run_cli(capsys, "doctor")
    assert rc == 1 and "writable by other users" in out and "chmod -R go-w" in out


def test_show_config_lists_every_knob_and_its_source(fresh_cache, monkeypatch, capsys) -> None:
    monkeypatch.setenv("MAX_JOBS", "3")
    monkeypatch.setenv("JITATTN_CACHE_DIRR", "typo")
    rc, out, _ = run_cli(capsys, "show-config")
    assert rc == 0
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert str(fresh_cache) in rows["JITATTN_CACHE_DIR"] and rows["JITATTN_CACHE_DIR"].endswith("[env]")
    assert "3" in rows["JITATTN_MAX_JOBS"] and rows["JITATTN_MAX_JOBS"].endswith("[env MAX_JOBS]")
    assert rows["JITATTN_ASSERT_NO_COMPILE"].endswith("[default]")
    assert "typo" in rows["JITATTN_CACHE_DIRR"]
    from jitattn import env

    assert {k.name for k in env.KNOBS} <= set(rows)
    # a knob left unset shows the value jitattn uses, never an empty one
    assert rows["JITATTN_PREFILL_TIER"].split()[1:] == ["auto", "[default]"]
    assert rows["JITATTN_BATCH_INVARIANT"].split()[1:] == ["0", "[default]"]
    assert all(len(line.split()) >= 3 for line in rows.values()), out


def test_show_config_names_a_development_knob_as_such(fresh_cache, monkeypatch, capsys) -> None:
    monkeypatch.setenv("JITATTN_DEV_SM90_TUNING", "{}")
    rc, out, _ = run_cli(capsys, "show-config")
    line = next(line for line in out.splitlines() if line.startswith("JITATTN_DEV_SM90_TUNING"))
    assert rc == 0 and line.endswith("[env (development only)]") and "typo" not in line
    monkeypatch.setenv("JITATTN_DEV_SM90_TUNNING", "{}")  # a misspelt one is still a likely typo
    rc, out, _ = run_cli(capsys, "show-config")
    typo = next(line for line in out.splitlines() if line.startswith("JITATTN_DEV_SM90_TUNNING"))
    assert typo.endswith("[env (unknown to jitattn: a typo?)]")


@pytest.mark.parametrize("name, ok", [
    ("decode_cuda_bf16-0123456789abcdef", True), ("prefill_cpu_f32_vSig_2-7e0074a5-0123456789abcdef", True),
    ("decode_cuda_bf16-0123456789abcdef\n", False), ("../x-0123456789abcdef", False),
    ("prefill_cpu_f32_vSig-7e0074a-0123456789abcdef", False), ("Decode-0123456789abcdef", False),
    ("prefill_cpu_f32_v1x-7e0074a5-0123456789abcdef", False)])
def test_entry_names(name: str, ok: bool) -> None:
    from jitattn.jit.cache import ENTRY_NAME_RE

    assert bool(ENTRY_NAME_RE.match(name)) is ok


def test_a_custom_variant_entry_is_listed_verified_exported_cleared_and_imported(cache_copy, tmp_path, capsys) -> None:
    # a variant's uri ends in "_v<name>-<hash8>" (the name may hold capitals): every command must see its entry
    spec = VariantSpec.from_dict({"op": "prefill", "target": "cpu", "q_dtype": "f32", "kv_dtype": "f32",
                                  "o_dtype": "f32", "variant": {"name": "Sig_2", "use_softmax": False, "params": [],
                                                                "logits_transform": "1.0f/(1.0f+expf(-logits))"}})
    jitattn.jit.load(spec)
    assert "_vSig_2-" in spec.uri
    rc, out, _ = run_cli(capsys, "ls")
    assert rc == 0 and spec.uri in out and out.splitlines()[-1].startswith("8 entries")
    rc, out, _ = run_cli(capsys, "info", spec.uri)
    assert rc == 0 and "status: ok" in out
    assert run_cli(capsys, "verify")[1].endswith("8 entries, 8 ok, 0 bad\n")
    bundle = tmp_path / "v.tgz"
    rc, out, err = run_cli(capsys, "export", bundle, "--spec", json.dumps(spec.to_dict()))
    assert rc == 0 and "exported 1 entries" in out, err
    rc, out, _ = run_cli(capsys, "clear")
    assert rc == 0 and "removed 8 entries" in out and _names(cache_copy) == []
    rc, out, err = run_cli(capsys, "import", bundle)
    assert rc == 0 and "imported 1 entries" in out, err
    assert _names(cache_copy) == [spec.uri]

"""Tensor-parallel serving on the cpu target (gloo): same tokens as TP 1, one build per spec, a warmed cache.

Ranks are spawned with ``torch.multiprocessing`` and meet through a file (no ports).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from helpers import tp_worker
from jitattn.runtime.specs import merge_spec
from jitattn.serving import Engine, LlamaModel, head_shard, preset
from jitattn.spec import Target

CONFIG = preset("tiny")  # 4 q heads over 2 kv heads
NEW_TOKENS = 5


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(0, CONFIG.vocab_size, (24,), generator=gen).tolist()
    return [system + torch.randint(0, CONFIG.vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 2, 19)]


def _spawn(fn, world: int, tmp_path: Path, env: dict[str, str], *args) -> list[dict]:
    out = tmp_path / f"out-{fn.__name__}-{world}"
    out.mkdir()
    mp.spawn(fn, args=(world, str(tmp_path / f"init-{fn.__name__}-{world}"), env, *args, str(out)), nprocs=world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def _env(**extra: str) -> dict[str, str]:
    env = {"JITATTN_CACHE_DIR": os.environ["JITATTN_CACHE_DIR"], "OMP_NUM_THREADS": "1"}
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def tp1_tokens() -> list[list[int]]:
    engine = Engine(LlamaModel.random(CONFIG, seed=0), num_pages=64, page_size=8)
    requests = [engine.add_request(p, NEW_TOKENS) for p in _prompts()]
    engine.run()
    return [r.output for r in requests]


@pytest.mark.parametrize("tp", [2, 4], ids=["tp2", "tp4-replicated-kv"])
def test_tensor_parallel_greedy_tokens_equal_tp1(tp, tp1_tokens, tmp_path) -> None:
    ranks = _spawn(tp_worker.serve, tp, tmp_path, _env(), asdict(CONFIG), _prompts(), NEW_TOKENS)
    for result in ranks:
        assert result["tokens"] == tp1_tokens
        assert result["cascade_steps"] > 0
    assert [r["heads"] for r in ranks] == [[CONFIG.num_attention_heads // tp, max(1, CONFIG.num_key_value_heads // tp)]] * tp


def test_head_shards_cover_every_head_and_replicate_kv() -> None:
    assert [head_shard(8, 2, r, 4) for r in range(4)] == [
        head_shard(8, 2, 0, 4).__class__(2 * r, 2, r // 2, 1) for r in range(4)]
    assert [(s.q_start, s.kv_start, s.num_kv) for s in (head_shard(32, 8, r, 2) for r in range(2))] == [(0, 0, 4), (16, 4, 4)]
    with pytest.raises(ValueError, match="must divide num_key_value_heads"):
        head_shard(12, 4, 0, 3)


def test_ranks_racing_for_one_cold_spec_build_it_once(fresh_cache, tmp_path) -> None:
    spec = merge_spec(Target.CPU, torch.float32)  # a spec every cascade step loads; a cheap build
    results = _spawn(tp_worker.race_load, 3, tmp_path, _env(), spec.to_dict())
    assert sum(r["compiles"] for r in results) == 1
    assert len(list(fresh_cache.rglob("lib.so"))) == 1


def test_warm_tp2_prebuilds_exactly_what_the_ranks_load(tmp_path, capsys) -> None:
    from jitattn_cache.cli import main as jitattn_cache

    config_dir = tmp_path / "model"
    CONFIG.save(config_dir)
    warm = ["warm", "--config", str(config_dir / "config.json"), "--tp", "2", "--target", "cpu", "--dtype", "float32"]
    assert jitattn_cache(warm + ["-q"]) == 0
    capsys.readouterr()
    assert jitattn_cache(warm + ["--dry-run"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.split()[1:2] in (["cached"], ["cold"])]
    assert rows and all(status == "cached" for _, status, *_ in rows), rows
    # every rank loads from the warmed cache only: compiling would raise
    ranks = _spawn(tp_worker.serve, 2, tmp_path, _env(JITATTN_ASSERT_NO_COMPILE="1"), asdict(CONFIG), _prompts(),
                   NEW_TOKENS)
    for result in ranks:
        assert result["compiles"] == 0
        assert result["loaded"] == sorted(uri for uri, *_ in rows)  # on cpu the engine loads every warmed spec

"""Import hygiene and the opt-in logging contract."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

import jitattn

from attention_cases import random_paged_batch

REPO = Path(__file__).resolve().parent.parent


def test_import_creates_no_directory_initialises_no_cuda_and_adds_no_handler(tmp_path) -> None:
    cache = tmp_path / "not-created"
    code = (
        "import logging, os, sys, torch, jitattn, jitattn.ops.decode, jitattn.ops.prefill, jitattn.ops.cascade, jitattn.ops.page\n"
        f"assert not os.path.exists({str(cache)!r}), 'import created the cache dir'\n"
        "assert not torch.cuda.is_initialized(), 'import initialised CUDA'\n"
        "assert logging.getLogger('jitattn').handlers == [], 'import added a log handler'\n"
        "assert jitattn.jit.compile_count() == 0\n"
        "print('ok')\n"
    )
    env = dict(os.environ, JITATTN_CACHE_DIR=str(cache), PYTHONPATH=str(REPO))
    env.pop("JITATTN_LOG_LEVEL", None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_log_level_info_logs_each_cold_build_and_each_plan(fresh_cache, monkeypatch, caplog) -> None:
    monkeypatch.setenv("JITATTN_LOG_LEVEL", "info")
    batch = random_paged_batch([20, 3], 2, 64, 16, torch.float16)
    with caplog.at_level(logging.INFO, logger="jitattn"):
        wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16,
                     q_data_type=torch.float16)
        wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, 8, 2, 64, 16,
                     q_data_type=torch.float16)
    builds = [r.getMessage() for r in caplog.records if r.getMessage().startswith("built ")]
    plans = [r.getMessage() for r in caplog.records if ".plan: kernel" in r.getMessage()]
    assert len(builds) == 1 and "decode_cpu_f16" in builds[0] and str(fresh_cache) in builds[0]
    assert len(plans) == 2 and "jitattn_decode_f16" in plans[0] and "workspace" in plans[0]


def test_an_unknown_log_level_warns_once_and_logs_nothing(monkeypatch, recwarn) -> None:
    from jitattn import env
    from jitattn.log import get_logger

    monkeypatch.setenv("JITATTN_LOG_LEVEL", "verbose-for-this-test")
    assert env.log_level() is None
    get_logger()
    warned = [str(w.message) for w in recwarn if "JITATTN_LOG_LEVEL" in str(w.message)]
    assert warned == ["JITATTN_LOG_LEVEL='verbose-for-this-test' is not a level jitattn knows; set it to info or "
                      "debug, or unset it; jitattn logs nothing"]

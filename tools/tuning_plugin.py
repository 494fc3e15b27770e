"""A pytest plugin that runs a test session under development knobs: ``JITATTN_DEV_TUNING`` (JSON) updates the
``TUNING`` dicts of kernel families before any test runs, so the GPU tests check the kernels those knobs render.

    JITATTN_DEV_TUNING='{"mla": {"lazy_rescale": 0}}' PYTHONPATH=tools python3 -m pytest -m gpu -p tuning_plugin \\
        tests/test_mla_kernel.py

Keys: ``decode``, ``mla``, ``prefill`` (``jitattn.kernels.<name>.TUNING``) and ``prefill_sm90`` (its
``SM90_TUNING``); every knob must already exist in its dict. Tests that set a knob themselves (monkeypatch) still
restore it to this session's value.
"""

from __future__ import annotations

import importlib
import json
import os

import pytest

_DICTS = {"decode": "TUNING", "mla": "TUNING", "prefill": "TUNING", "prefill_sm90": "SM90_TUNING"}


def pytest_configure(config: pytest.Config) -> None:
    text = os.environ.get("JITATTN_DEV_TUNING", "").strip()
    if not text:
        return
    for family, knobs in json.loads(text).items():
        if family not in _DICTS:
            raise pytest.UsageError(f"JITATTN_DEV_TUNING: unknown family {family!r} (use one of {sorted(_DICTS)})")
        tuning = getattr(importlib.import_module(f"jitattn.kernels.{family}"), _DICTS[family])
        unknown = sorted(set(knobs) - set(tuning))
        if unknown:
            raise pytest.UsageError(f"JITATTN_DEV_TUNING: {family} has no knobs {unknown} (it has {sorted(tuning)})")
        tuning.update(knobs)
        config.issue_config_time_warning(pytest.PytestWarning(f"{family} TUNING overridden: {knobs}"), stacklevel=2)

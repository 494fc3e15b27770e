"""Shared test setup.

- The whole session uses one private cache dir (unless JITATTN_CACHE_DIR is
  set), so tests share builds and never touch the user's cache.
- ``@pytest.mark.gpu`` tests are skipped without CUDA.
- The terminal summary reports how many cold builds this process ran.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("JITATTN_CACHE_DIR"):
        os.environ["JITATTN_CACHE_DIR"] = tempfile.mkdtemp(prefix="jitattn-test-cache-")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    import jitattn.jit

    terminalreporter.write_line(
        f"jitattn: {jitattn.jit.compile_count()} cold builds in this test process "
        f"(cache: {os.environ.get('JITATTN_CACHE_DIR')})"
    )


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    """An empty private cache root for tests that count builds or break things."""
    root = tmp_path / "cache"
    monkeypatch.setenv("JITATTN_CACHE_DIR", str(root))
    monkeypatch.delenv("JITATTN_CACHE_PATH", raising=False)
    import jitattn.jit

    saved = dict(jitattn.jit._registry)
    jitattn.jit._registry.clear()
    yield root
    jitattn.jit._registry.clear()
    jitattn.jit._registry.update(saved)

"""Shared test setup.

- The whole session shares one cache dir: ``JITATTN_TEST_CACHE_DIR`` when set
  (reuse a cache warmed beforehand: ``.ci/run`` sets it after
  ``jitattn-cache warm``), else ``JITATTN_CACHE_DIR`` when set, else a private
  temp dir that is removed when the session ends. Tests that count builds or
  break things take the ``fresh_cache`` fixture: an empty cache of their own.
- ``@pytest.mark.gpu`` tests are skipped without CUDA.
- The terminal summary reports how many cold builds this process ran.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch


TEST_CACHE_VAR = "JITATTN_TEST_CACHE_DIR"
_created_cache: str | None = None  # the temp cache this session made (removed at the end)


def pytest_configure(config: pytest.Config) -> None:
    global _created_cache
    reuse = os.environ.get(TEST_CACHE_VAR)
    if reuse:
        os.environ["JITATTN_CACHE_DIR"] = reuse
    elif not os.environ.get("JITATTN_CACHE_DIR"):
        _created_cache = tempfile.mkdtemp(prefix="jitattn-test-cache-")
        os.environ["JITATTN_CACHE_DIR"] = _created_cache


def pytest_unconfigure(config: pytest.Config) -> None:
    global _created_cache
    if _created_cache is not None:
        shutil.rmtree(_created_cache, ignore_errors=True)
        if os.environ.get("JITATTN_CACHE_DIR") == _created_cache:
            del os.environ["JITATTN_CACHE_DIR"]
        _created_cache = None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session: pytest.Session) -> None:
    """On a GPU machine, pre-build every spec the selected GPU tests load, in parallel.

    A test module lists them in ``GPU_SPECS``; the machine starts with an
    empty cache, and building them one by one inside the tests would be slow.
    """
    if not torch.cuda.is_available():
        return
    specs, seen = [], set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None or module in seen or "gpu" not in item.keywords:
            continue
        seen.add(module)
        specs += list(getattr(module, "GPU_SPECS", []))
    if not specs:
        return
    import time

    import jitattn.jit

    started = time.perf_counter()
    results = jitattn.jit.build_many(specs, jobs=os.cpu_count())
    failed = [r for r in results if r.status == "failed"]
    built = sum(r.status == "built" for r in results)
    print(f"\njitattn: pre-built {built} of {len(results)} GPU specs in {time.perf_counter() - started:.1f} s"
          f" ({len(failed)} failed)")
    for r in failed:
        print(f"  FAILED {r.spec.uri}: {r.error.splitlines()[0] if r.error else ''}")


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    import jitattn.jit

    cache = os.environ.get("JITATTN_CACHE_DIR")
    how = ("reused from " + TEST_CACHE_VAR if os.environ.get(TEST_CACHE_VAR)
           else "a temp dir, removed at exit" if cache == _created_cache else "JITATTN_CACHE_DIR")
    terminalreporter.write_line(
        f"jitattn: {jitattn.jit.compile_count()} cold builds in this test process (cache: {cache}; {how})"
    )


@pytest.fixture
def fresh_registry():
    """Modules loaded after a tier or tuning change (the registry keeps one module per spec)."""
    import jitattn.jit

    saved = dict(jitattn.jit._registry)
    jitattn.jit._registry.clear()
    yield
    jitattn.jit._registry.clear()
    jitattn.jit._registry.update(saved)


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

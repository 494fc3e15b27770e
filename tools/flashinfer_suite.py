"""Run FlashInfer's own test files against ``jitattn.flashinfer`` (FlashInfer's conventions: base-2 LSE).

FlashInfer's tests import ``flashinfer`` and its helpers (``flashinfer.utils``, ``flashinfer.jit``), so the
real package must be importable (its wheel; no kernel of it is built): every name ``jitattn.flashinfer``
provides replaces FlashInfer's, in the top-level package and in its submodule, before any test module is
imported; FlashInfer's JIT warm-up (``flashinfer.jit.build_jit_specs``) becomes a no-op. Tests of names
jitattn does not provide, or that build their reference with FlashInfer's JIT internals, still run
FlashInfer's own code and are not jitattn's results: read the failures by test name.

    python tools/flashinfer_suite.py PATH/TO/flashinfer/tests/attention/test_deepseek_mla.py [--sample N] \\
        [pytest arguments...]

``--sample N`` keeps every N-th collected case of each file (FlashInfer's grids are large); the summary line
and ``-rf`` list are pytest's.
"""

from __future__ import annotations

import argparse
import importlib
import sys


def overlay_flashinfer() -> list[str]:
    """Replace FlashInfer's names with ``jitattn.flashinfer``'s; returns the replaced ``module.name`` list."""
    import flashinfer

    import jitattn.flashinfer as ours

    replaced = []
    modules = [(flashinfer, ours)] + [(importlib.import_module(f"flashinfer.{sub}"), module)
                                      for sub, module in ours.SUBMODULES.items()]
    for theirs, mine in modules:
        for name in mine.__all__:
            if name in ("install", "__version__"):
                continue
            setattr(theirs, name, getattr(mine, name))
            replaced.append(f"{theirs.__name__}.{name}")
    import flashinfer.jit

    flashinfer.jit.build_jit_specs = lambda *args, **kwargs: None  # nothing of FlashInfer's is built
    return replaced


class _EveryNth:
    """A pytest plugin keeping every n-th collected item of each file."""

    def __init__(self, n: int) -> None:
        self.n = n

    def pytest_collection_modifyitems(self, config, items) -> None:
        seen: dict[str, int] = {}
        kept, dropped = [], []
        for item in items:
            index = seen.get(item.fspath.strpath, 0)
            seen[item.fspath.strpath] = index + 1
            (kept if index % self.n == 0 else dropped).append(item)
        items[:] = kept
        config.hook.pytest_deselected(items=dropped)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=1, help="keep every N-th case of each file")
    args, pytest_args = parser.parse_known_args(argv)
    if args.sample < 1:
        parser.error("--sample must be >= 1")
    import pytest

    replaced = overlay_flashinfer()
    print(f"flashinfer_suite: {len(replaced)} FlashInfer names are jitattn.flashinfer's", flush=True)
    plugins = [_EveryNth(args.sample)] if args.sample > 1 else []
    return pytest.main(["-p", "no:cacheprovider", *pytest_args], plugins=plugins)


if __name__ == "__main__":
    sys.exit(main())

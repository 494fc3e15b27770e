"""The cache as the cache tool (``jitattn-cache``) sees it: the one interface it uses of ``jitattn.jit``.

What the CLI looks up, checks, moves or removes in the cache, and the toolchain facts its ``doctor``
reports, are named here; the CLI imports nothing else of the pipeline's modules (``.importlinter``'s
``cli`` contract), so a change inside ``jit`` that keeps these names keeps the tool working. ``load()``
and the wrappers go through ``jitattn.jit``'s face (``load``, ``build_many``) over the same modules.

- entries: ``find_entry`` (the published entry of a ``build_inputs(spec)``, trust checked),
  ``read_manifest``, ``entry_dirs``, ``ENTRY_NAME_RE``, ``LIBRARY_NAME``, ``SCHEMA`` (the layout version);
- the roots: ``writable_root`` and ``layers`` (the read-only layers first);
- trust: ``chain_violations`` (every directory from a root to a path owned by you, not group / world
  writable), ``foreign_entry_problem`` (an entry built for another machine or arch list), ``library_problem``
  (a library that does not load here as its module);
- changes, each under the entry's lock: ``publish_entry`` (one atomic rename), ``remove_entry``,
  ``remove_stale_builds`` (what killed builds left in ``tmp/``);
- builds: ``cancel_builds`` / ``reset_cancel`` (Ctrl-C), ``default_jobs``;
- the toolchain: ``probe``, ``cuda_arch_list``, ``ninja_path``, ``CPU_FLAGS``; errors ``JitError``,
  ``BuildError``, ``ToolchainError``.
"""

from __future__ import annotations

from .build import LIBRARY_NAME, cancel_builds, ninja_path, reset_cancel
from .loader import OTHER_VERSION, library_problem
from .cache import (ENTRY_NAME_RE, entry_dirs, find_entry, foreign_entry_problem, layers, publish_entry, read_manifest,
                    remove_entry, remove_stale_builds, writable_root)
from .errors import BuildError, JitError
from .key import SCHEMA, build_inputs
from .toolchain import CPU_FLAGS, ToolchainError, cuda_arch_list, default_jobs, probe
from .trust import chain_violations

__all__ = [
    "BuildError", "CPU_FLAGS", "ENTRY_NAME_RE", "JitError", "LIBRARY_NAME", "OTHER_VERSION", "SCHEMA", "ToolchainError",
    "build_inputs", "cancel_builds", "chain_violations", "cuda_arch_list", "default_jobs", "entry_dirs", "find_entry",
    "foreign_entry_problem", "layers", "library_problem", "ninja_path", "probe", "publish_entry", "read_manifest",
    "remove_entry", "remove_stale_builds", "reset_cancel", "writable_root",
]

"""The cache key: every input that determines one binary, hashed.

Key = sha256 over the cache schema, the ABI version, the canonical spec, the rendered sources,
the hand-written headers they include, the compile and link flags and the CUDA arch list --
never paths, mtimes or the compiler's location (a reinstall, or another PATH to the same
toolkit, rebuilds nothing).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from ..abi import ABI_VERSION, Entry
from ..kernels import family
from ..spec import Target, VariantSpec
from . import toolchain as tc
from .render import included_headers, render

SCHEMA = "v1"


@dataclass(frozen=True)
class BuildInputs:
    """Everything that determines one binary, and the key derived from it."""

    spec: VariantSpec
    sources: dict[str, str]
    headers: dict[str, str]
    cflags: tuple[str, ...]
    ldflags: tuple[str, ...]
    archs: tuple[str, ...]
    key: str

    @property
    def name(self) -> str:
        return f"{self.spec.uri}-{self.key[:16]}"

    @property
    def entries(self) -> tuple[Entry, ...]:
        return family(self.spec.op).entries(self.spec)


def compute_key(
    spec: VariantSpec, sources: dict[str, str], headers: dict[str, str],
    cflags: tuple[str, ...], ldflags: tuple[str, ...], archs: tuple[str, ...],
) -> str:
    """sha256 over every keyed input; paths, mtimes and compiler locations are not among them."""
    material = {
        "schema": SCHEMA,
        "abi": ABI_VERSION,
        "spec": spec.to_dict(),
        "sources": sources,
        "headers": headers,
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "archs": list(archs),
    }
    return hashlib.sha256(json.dumps(material, sort_keys=True).encode()).hexdigest()


def build_inputs(spec: VariantSpec) -> BuildInputs:
    """Render ``spec`` and compute its key (pure apart from reading templates and the arch)."""
    sources = render(spec)
    headers = included_headers(sources, spec.target)
    archs = tc.cuda_arch_list() if spec.target is Target.CUDA else ()
    cflags = tc.compile_flags(spec.target) + tc.gencode_flags(archs)
    ldflags = tc.link_flags(spec.target) + tc.gencode_flags(archs)
    key = compute_key(spec, sources, headers, cflags, ldflags, archs)
    return BuildInputs(spec, sources, headers, cflags, ldflags, archs, key)

"""spec -> {filename: source text}. Pure: no I/O besides reading templates."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jinja2

from ..abi import ABI_VERSION, c_header
from ..families import family
from ..spec import Target, VariantSpec
from .templates import include_dir, template_root

_SOURCE_SUFFIX = {Target.CUDA: ".cu", Target.CPU: ".cpp"}
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


@functools.cache
def _environment(root: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,  # a missing context value is an error, not ""
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def render(spec: VariantSpec) -> dict[str, str]:
    """Render every source file of ``spec``'s module: ``{"params.h": ..., "kernel.cu": ...}``."""
    fam = family(spec.op)
    entries = fam.entries(spec)
    context = {
        "uri": spec.uri,
        "kernel_name": spec.kernel_name,
        "abi_version": ABI_VERSION,
        "entries": {e.name: e for e in entries},
        **fam.context(spec),
    }
    template = _environment(template_root()).get_template(fam.TEMPLATES[spec.target.value])
    return {
        "params.h": c_header(entries),
        "kernel" + _SOURCE_SUFFIX[spec.target]: template.render(context),
    }


def included_headers(sources: dict[str, str], target: Target) -> dict[str, str]:
    """Every hand-written header the sources include (transitively): {relative path: text}."""
    inc = include_dir(target.value)
    found: dict[str, str] = {}
    pending = list(sources.values())
    while pending:
        text = pending.pop()
        for name in _INCLUDE_RE.findall(text):
            if name in sources or name in found:
                continue
            path = inc / name
            if path.is_file():
                found[name] = path.read_text()
                pending.append(found[name])
    return dict(sorted(found.items()))

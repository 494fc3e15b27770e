"""spec -> {filename: source text}. Pure: no I/O besides reading templates, JITATTN_DEBUG and, for a family
with kernel tiers (prefill), the cuda arch list and JITATTN_PREFILL_TIER."""

from __future__ import annotations

import functools
import posixpath
import re
from pathlib import Path

import jinja2

from .. import env
from ..abi import ABI_VERSION, c_header
from ..kernels import family
from ..kernels import variant as variant_source
from ..spec import Target, VariantSpec
from .templates import include_dir, template_root
from .toolchain import ToolchainError, cuda_arch_list

_SOURCE_SUFFIX = {Target.CUDA: ".cu", Target.CPU: ".cpp"}
_INCLUDE_RE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]', re.MULTILINE)


@functools.cache
def _environment(root: Path) -> jinja2.Environment:
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(root)),
        undefined=jinja2.StrictUndefined,  # a missing context value is an error, not ""
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )


def _archs(spec: VariantSpec) -> tuple[str, ...] | None:
    """The arch list a cuda build of ``spec`` targets; None when it cannot be known here (no GPU, no list)."""
    if spec.target is not Target.CUDA:
        return ()
    try:
        return cuda_arch_list()
    except ToolchainError:
        return None


def render(spec: VariantSpec) -> dict[str, str]:
    """Render every source file of ``spec``'s module: ``{"params.h": ..., "kernel.cu": ...}``."""
    fam = family(spec.op)
    entries = fam.entries(spec)
    select = getattr(fam, "select", None)  # families with tiers pick their template from the spec and the archs
    if select is not None:
        template_name, fam_context = select(spec, _archs(spec))
    else:
        template_name, fam_context = fam.TEMPLATES[spec.target.value], fam.context(spec)
    context = {
        "uri": spec.uri,
        "kernel_name": spec.kernel_name,
        "abi_version": ABI_VERSION,
        "entries": {e.name: e for e in entries},
        **fam_context,
    }
    try:
        template = _environment(template_root()).get_template(template_name)
    except jinja2.TemplateNotFound:
        raise NotImplementedError(
            f"{spec.uri}: op {spec.op.value!r} has no kernel template for target {spec.target.value!r} "
            "in this version of jitattn"
        ) from None
    sources = {
        "params.h": c_header(entries),
        "kernel" + _SOURCE_SUFFIX[spec.target]: template.render(context),
    }
    if spec.variant is not None:
        # JITATTN_DEBUG changes only this header's text, so a debug build has its own cache key.
        sources[variant_source.HEADER_NAME] = variant_source.header(spec, debug=env.debug())
    return sources


def included_headers(sources: dict[str, str], target: Target) -> dict[str, str]:
    """Every hand-written header the sources include (transitively): {relative path: text}.

    Resolved the way the compiler does: a quoted include is looked up next to the
    including file first, then in the -I dirs (the rendered sources, then ``include_dir``).
    """
    inc = include_dir(target.value)
    found: dict[str, str] = {}
    # (directory of the including file relative to ``inc``, or None for a rendered source; its text)
    pending: list[tuple[str | None, str]] = [(None, text) for text in sources.values()]
    while pending:
        here, text = pending.pop()
        for quote, name in _INCLUDE_RE.findall(text):
            search = ([here] if quote == '"' else []) + [None, ""]
            for base in search:
                if base is None:  # the rendered sources' dir: those files are keyed already
                    if name in sources:
                        break
                    continue
                rel = posixpath.normpath(posixpath.join(base, name))
                if rel in found:
                    break
                if rel.startswith("../") or posixpath.isabs(rel) or not (inc / rel).is_file():
                    continue
                found[rel] = (inc / rel).read_text()
                pending.append((posixpath.dirname(rel), found[rel]))
                break
    return dict(sorted(found.items()))

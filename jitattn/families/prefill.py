"""Prefill kernels: many query tokens per request over a ragged or paged KV.

The cpu target shares the generic attention kernel with decode (every axis
but the dtypes at run time); the cuda target compiles its own template.
"""

from __future__ import annotations

from .attention import context, entries  # noqa: F401  (the family interface)

TEMPLATES = {"cpu": "cpu/attention.cpp.jinja", "cuda": "cuda/prefill.cu.jinja"}

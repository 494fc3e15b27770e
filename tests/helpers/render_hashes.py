"""sha256 of ``render(spec)`` for every spec the tests, the presets and the cpu target use.

``tests/data/render_hashes.json`` was recorded with this function before custom
variants were added; ``test_variants.py::test_no_variant_renders_unchanged``
asserts that a spec without a variant still renders byte-identical sources
(the cuda kernels were validated on an H200 in that exact form). Re-record
only after re-validating on a GPU: ``python3 -m tests.helpers.render_hashes``.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
from pathlib import Path

import torch

RECORD = Path(__file__).resolve().parent.parent / "data" / "render_hashes.json"
_GPU_TEST_MODULES = ("test_api_decode", "test_api_prefill", "test_append", "test_compile", "test_decode_cuda",
                     "test_prefill_cuda", "test_serving_gpu")


def existing_specs() -> list:
    from jitattn.runtime.specs import model_specs
    from jitattn.spec import Target, VariantSpec
    from jitattn_cache.presets import PRESETS, ModelShape

    tests_dir = str(Path(__file__).resolve().parent.parent)
    if tests_dir not in sys.path:
        sys.path.insert(0, tests_dir)
    specs = []
    for name in _GPU_TEST_MODULES:
        specs += list(importlib.import_module(name).GPU_SPECS)
    for target in (Target.CPU, Target.CUDA):
        for shape in PRESETS.values():
            if not isinstance(shape, ModelShape):  # the MLA presets' specs are not in the record (as test_mla's)
                continue
            specs += model_specs(target, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads,
                                 head_dim=shape.head_dim, dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                                 sliding_window=shape.sliding_window, logits_soft_cap=shape.logits_soft_cap)
    pairs = [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("f16", "e4m3"), ("bf16", "e5m2"), ("bf16", "e4m3"),
             ("f16", "e5m2")]
    for op in ("decode", "prefill"):
        for q, kv in pairs:
            specs.append(VariantSpec(op=op, target="cpu", q_dtype=q, kv_dtype=kv, o_dtype=q))
            specs.append(VariantSpec(op=op, target="cpu", q_dtype=q, kv_dtype=kv, o_dtype="f32"))
    for dtype in ("f32", "f16", "bf16"):
        specs.append(VariantSpec(op="merge", target="cpu", o_dtype=dtype))
        specs.append(VariantSpec(op="append", target="cpu", kv_dtype=dtype))
    return [s for s in dict.fromkeys(specs) if s.variant is None]


def render_hash(spec) -> str:
    from jitattn.jit.render import render

    sources = render(spec)
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    return digest.hexdigest()


def current_hashes() -> dict[str, str]:
    """The hashes of the generic kernels: the cuda prefill tier is pinned to sm80 (the sm90 tier is
    chosen by the arch list, so it is not part of this record)."""
    saved = os.environ.get("JITATTN_PREFILL_TIER")
    os.environ["JITATTN_PREFILL_TIER"] = "sm80"
    try:
        return {spec.canonical_json(): render_hash(spec) for spec in existing_specs()}
    finally:
        if saved is None:
            del os.environ["JITATTN_PREFILL_TIER"]
        else:
            os.environ["JITATTN_PREFILL_TIER"] = saved


if __name__ == "__main__":
    RECORD.write_text(json.dumps(current_hashes(), indent=0, sort_keys=True) + "\n")
    print(f"wrote {RECORD}")

"""append_paged_kv_cache: scatter new key/value tokens into a paged KV cache.

One module per cache dtype (``kv_dtype``, the only compile-time axis). The
source (append_key/value) dtype is a run-time switch, ``src_dtype``:

- ``same`` (``abi.APPEND_SOURCE_CODES``): the source has the cache's dtype; elements are copied bit for bit.
- ``f32``, ``f16``, ``bf16``: each element goes through
  float and is rounded to the cache dtype with round-to-nearest-even, as
  torch's ``.to()`` does in range; fp8 beyond its range (inf too) saturates to
  the largest finite value (e4m3 +-448, e5m2 +-57344), on both targets; NaN
  stays NaN.

Token t (``append_key[t]``: ``[num_heads, head_dim]``) belongs to request
``r = batch_indices[t]`` at position ``pos = positions[t]`` and is written to
page ``kv_indices[kv_indptr[r] + pos / page_size]``, slot ``pos % page_size``.
A cache element (page p, slot s, head h, dim d) lives at
``p*stride_page + s*stride_n + h*stride_h + d`` (NHD and HND differ only in
these strides; a 3-D ``[tokens, heads, dim]`` cache is page_size 1 with
stride_n 0). All strides are in elements; index arrays are int32 on the
cache's device. ``batch_size`` and ``num_pages`` bound the indices: the cpu
kernel reports an out-of-range token before writing anything, the cuda
kernel skips it (it cannot report without a sync; the Python front-end
validates host-side index arrays before launching).
"""

from __future__ import annotations

from typing import Any

from ..abi import APPEND_SOURCE_CODES, Entry, fields
from ..spec import VariantSpec
from . import c_type

TEMPLATES = {"cpu": "cpu/append.cpp.jinja", "cuda": "cuda/append.cu.jinja"}


APPEND = Entry("append", fields(
    "append_key:ptr append_value:ptr batch_indices:ptr positions:ptr "
    "k_cache:ptr v_cache:ptr kv_indices:ptr kv_indptr:ptr "
    "nnz:i64 batch_size:i64 num_pages:i64 num_heads:i64 head_dim:i64 page_size:i64 "
    "key_stride_n:i64 key_stride_h:i64 value_stride_n:i64 value_stride_h:i64 "
    "k_stride_page:i64 k_stride_n:i64 k_stride_h:i64 v_stride_page:i64 v_stride_n:i64 v_stride_h:i64 "
    "src_dtype:i32 num_threads:i32"
))


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    return (APPEND,)


def context(spec: VariantSpec) -> dict[str, Any]:
    return {
        "kv_ctype": c_type(spec.kv_dtype, spec.target),
        "src_codes": APPEND_SOURCE_CODES,
    }

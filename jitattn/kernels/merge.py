"""merge_state / merge_states: combine partial attention states by their LSE.

States are (v [rows, H, D], s [rows, H]) with s the natural-log LSE (fp32).
The head dimension and all strides are run-time arguments; only the value
dtype is compiled in. A ``use_sinks`` merge module (the final merge of a cascade
whose model has attention sinks) adds a ``sinks`` pointer (float32
``[num_heads]``) to ``merge_states``: its merged output is scaled by
``1 / (1 + exp(sinks[h] - lse))``, its LSE stays that of the states.
"""

from __future__ import annotations

from typing import Any

from ..abi import Entry, Field, fields
from ..spec import VariantSpec
from . import c_type

TEMPLATES = {"cpu": "cpu/merge.cpp.jinja", "cuda": "cuda/merge.cu.jinja"}

# Strides are in elements. A row is one (seq, head) pair.
MERGE_STATE = Entry("merge_state", fields(
    "v_a:ptr s_a:ptr v_b:ptr s_b:ptr v_out:ptr s_out:ptr mask:ptr "
    "seq_len:i64 num_heads:i64 head_dim:i64 "
    "v_a_stride_n:i64 v_a_stride_h:i64 s_a_stride_n:i64 s_a_stride_h:i64 "
    "v_b_stride_n:i64 v_b_stride_h:i64 s_b_stride_n:i64 s_b_stride_h:i64 "
    "v_out_stride_n:i64 v_out_stride_h:i64 s_out_stride_n:i64 s_out_stride_h:i64 "
    "num_threads:i32"
))
MERGE_STATES = Entry("merge_states", fields(
    "v:ptr s:ptr v_out:ptr s_out:ptr "
    "seq_len:i64 num_states:i64 num_heads:i64 head_dim:i64 "
    "v_stride_n:i64 v_stride_k:i64 v_stride_h:i64 s_stride_n:i64 s_stride_k:i64 s_stride_h:i64 "
    "v_out_stride_n:i64 v_out_stride_h:i64 s_out_stride_n:i64 s_out_stride_h:i64 "
    "num_threads:i32"
))


MERGE_STATES_WITH_SINKS = Entry("merge_states", MERGE_STATES.fields + (Field("sinks", "ptr"),))


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    return (MERGE_STATE, MERGE_STATES_WITH_SINKS if spec.use_sinks else MERGE_STATES)


def context(spec: VariantSpec) -> dict[str, Any]:
    return {"v_ctype": c_type(spec.o_dtype, spec.target), "use_sinks": spec.use_sinks}

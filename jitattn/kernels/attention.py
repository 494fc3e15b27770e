"""The binary interface shared by the decode and prefill kernel families.

One launch computes attention for a batch of requests. Request r has queries
``q[qo_indptr[r]:qo_indptr[r+1]]`` and a KV sequence that is either ragged
(tokens ``kv_indptr[r]:kv_indptr[r+1]`` of k/v) or paged (pages
``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``, the last one holding
``kv_last_page_len[r]`` tokens). All strides are in elements:

- q/o: ``[tokens, heads, dim]`` with ``*_stride_n`` (token) and ``*_stride_h`` (head).
- k/v ragged: token t, head h at ``t*stride_n + h*stride_h``.
- k/v paged: page p, slot s, head h at ``p*stride_page + s*stride_n + h*stride_h``
  (NHD and HND differ only in these strides).
- lse: ``[tokens, heads]`` float32, natural log; ``lse`` may be null.

Query i of a request with qo_len q and kv_len k sits at position k - q + i.
``q_row_period`` > 0 (prefill): the query of output row t is q row
``t % q_row_period`` (a cascade level cut into chunks reads its queries once
per chunk without copies); 0: row t.
``q_rows`` / ``kv_rows``: the rows q has and the rows of k/v (tokens; pages of a paged cache), the
extent of the sm90 tier's tensor maps (0: unknown, the allocation's range is taken); kernels that
address rows through the index arrays alone ignore them.
``num_threads``: a launch's workers: OpenMP threads on the cpu target; on cuda, when > 0, the most blocks
of a persistent grid (the sm90 prefill tier, one block per SM; 0: every SM), so that kernels another stream
runs beside it get the other SMs; other cuda kernels ignore it.
``pos_encoding``: 0 none, 1 rope (llama rotate-half), 2 alibi.
``causal``: bottom-right. ``window_left`` < 0 disables the window.
``logits_soft_cap`` <= 0 disables the cap. ``custom_mask``: per-request
bit-packed (little-endian) row-major qo_len x kv_len masks, request r's block
starting at byte ``mask_indptr[r]`` (FlashInfer's layout); null when unused.
Index arrays are int32. ``k_scale``/``v_scale`` dequantize fp8 KV (1 otherwise).

Custom variants (``spec.variant``, see ``jitattn.variant``): the struct gains a
last field ``variant_params``, a pointer to the variant's ``VariantParams``
(generated in ``variant.h`` by ``jitattn.kernels.variant``); specs without a
variant keep the struct without it, byte for byte.

Attention sinks (``spec.use_sinks``): the struct gains a last field ``sinks``, a
float32 ``[num_qo_heads]`` pointer (natural-log sink logit per query head, on the
scale of the logits after sm_scale and the soft cap). Partial states (split-KV
chunks) and the returned LSE are those of the keys alone; only the final output
is scaled by ``1 / (1 + exp(sinks[h] - lse))`` (0 when no key is visible).

Split-KV (the decode kernels, both targets): when ``kv_chunk_size`` > 0, request
r's KV is cut into chunks of that many tokens (under a window, ``window_left`` >= 0,
counted from its first token ``max(0, kv_len - 1 - window_left)``; the last chunk
runs to the end of the KV either way);
``split_indptr[r]`` (int32, batch+1 entries) is the index of r's first chunk
among all chunks (every request has at least one, an empty request too: its
chunk writes o = 0 and lse = -inf), and ``workspace`` (``workspace_bytes`` long, from the
plan) holds each chunk's partial output and LSE before they are merged;
``split_counters`` (int32, ``batch_size * num_kv_heads``, zero before the
first launch) counts the finished chunks of each (request, KV head), and the
kernel leaves it zero again.

Prior states (the cuda decode kernel only; every other kernel refuses
``prior_states`` != 0): a cascade's earlier levels, merged by LSE into the
kernel's result before its one write, so no merge kernel runs after it.
``prior_v`` (the output dtype, ``[prior_states][prior_rows][num_qo_heads][head_dim_vo]``,
contiguous) and ``prior_lse`` (float32, ``[prior_states][prior_rows][num_qo_heads]``)
hold state s of query row i at row ``s * prior_rows + i``; the merged LSE is
written to ``lse`` (when set). Not with sinks or a custom variant.

``prior_pdl`` (with prior states, sm_90 and later): the launch is a programmatic dependent of the
stream's previous kernel, which then writes nothing the launch reads but the prior states: its blocks
start while that kernel's last blocks run, and each waits for it (``griddepcontrol.wait``) only before it
reads the prior states or writes anything. The cascade sets it for a decode level launched right after
the levels whose states it merges; the sm90 prefill kernel lets its dependents launch as it starts.

``head_scales`` (the sm90 prefill tier's fp8 kernel; the tier's 16-bit kernels refuse a non-null one, other
kernels ignore it): null, or float32 device scales multiplying the scalar ones -- ``num_qo_heads`` of q's, then
``num_kv_heads`` of k's, then ``num_kv_heads`` of v's -- read by the kernel (a caller's scale tensors need no host
read; FlashInfer's fp8 prefill takes per-head ones).

The sm90 prefill tier's custom-mask modules read ``workspace`` (``workspace_bytes`` long; null: unused) as the
blocks' states their ``mask_states`` entry (the same fields) wrote for the plan (``kernels.prefill_sm90``).

``short_items`` (the cuda decode kernel; others ignore it): 1 launches the module's short-items layout (more
resident blocks with fewer or shorter stages: ``kernels.decode.short_items_layout``), which a plan of many short
requests takes; a module without one refuses it.
"""

from __future__ import annotations

from typing import Any

from ..abi import POS_ENCODING_CODES, Entry, Field, fields
from ..spec import VariantSpec
from . import c_type
from .variant import HEADER_NAME
from .variant import context as variant_context
from .variant import explain_build_error as _explain_variant_error

ATTENTION = Entry("attention", fields(
    "q:ptr k:ptr v:ptr o:ptr lse:ptr "
    "qo_indptr:ptr kv_indptr:ptr kv_indices:ptr kv_last_page_len:ptr custom_mask:ptr mask_indptr:ptr "
    "batch_size:i64 num_qo_heads:i64 num_kv_heads:i64 head_dim_qk:i64 head_dim_vo:i64 page_size:i64 "
    "q_stride_n:i64 q_stride_h:i64 "
    "k_stride_page:i64 k_stride_n:i64 k_stride_h:i64 v_stride_page:i64 v_stride_n:i64 v_stride_h:i64 "
    "o_stride_n:i64 o_stride_h:i64 lse_stride_n:i64 lse_stride_h:i64 "
    "kv_paged:i32 causal:i32 pos_encoding:i32 window_left:i32 "
    "sm_scale:f32 logits_soft_cap:f32 rope_rcp_scale:f32 rope_rcp_theta:f32 k_scale:f32 v_scale:f32 "
    "workspace:ptr workspace_bytes:i64 split_indptr:ptr kv_chunk_size:i64 split_counters:ptr q_row_period:i64 "
    "num_threads:i32 q_rows:i64 kv_rows:i64 "
    "prior_v:ptr prior_lse:ptr prior_states:i64 prior_rows:i64 prior_pdl:i32 short_items:i32 head_scales:ptr"
))

ATTENTION_WITH_VARIANT = Entry("attention", ATTENTION.fields + (Field("variant_params", "ptr"),))
ATTENTION_WITH_SINKS = Entry("attention", ATTENTION.fields + (Field("sinks", "ptr"),))


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    if spec.use_sinks:  # a spec never has both (spec validation)
        return (ATTENTION_WITH_SINKS,)
    return (ATTENTION_WITH_VARIANT if spec.variant is not None else ATTENTION,)


def context(spec: VariantSpec) -> dict[str, Any]:
    return {
        **variant_context(spec),
        "q_ctype": c_type(spec.q_dtype, spec.target),
        "kv_ctype": c_type(spec.kv_dtype, spec.target),
        "o_ctype": c_type(spec.o_dtype, spec.target),
        "pos_codes": POS_ENCODING_CODES,
        "use_sinks": spec.use_sinks,
    }


def explain_build_error(spec: VariantSpec, message: str, sources: dict[str, str]) -> str:
    """A failed build of ``spec`` explained in its custom variant's terms (the family hook ``jit`` applies)."""
    return _explain_variant_error(spec, message, sources.get(HEADER_NAME))

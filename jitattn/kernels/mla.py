"""The dedicated MLA kernel: DeepSeek-style latent attention over a paged latent cache, Hopper (sm_90a).

With weight absorption every query head attends over one latent head per token: keys are
``ckv`` (512) joined with ``kpe`` (64), values are ``ckv``. The kernel
(``templates/cuda/mla_sm90.cu.jinja``) packs 64 rows -- (query token, head) pairs of one request,
head fastest -- into the M dimension of one wgmma tile, so each latent KV block is read once for
all of them; see the template's header for the schedule. This module owns its binary interface and
every derived constant (``layout``); ``jitattn.kernels.mla_plan`` builds the work items it walks.

Params (``MLA``; strides in elements, index arrays int32 on the device):

- ``q_nope`` ``[tokens, heads, 512]``, ``q_pe`` ``[tokens, heads, 64]`` (token and head strides each);
  ``o`` ``[tokens, heads, 512]``; ``lse`` ``[tokens, heads]`` float32, natural log, may be null.
- ``ckv`` / ``kpe``: page p, slot s at ``p * stride_page + s * stride_n`` (one latent head); request r's
  pages are ``kv_indices[kv_indptr[r]:kv_indptr[r+1]]``, its length ``kv_len[r]``; query i of a request
  with qo_len q sits at position kv_len - q + i (``causal``: bottom-right).
- ``items``: ``num_items`` work items of 8 int32 (request, first row, first KV block, end KV block,
  first partial row or -1, three unused), heaviest first; the kernel's grid is ``grid`` blocks. ``narrow``
  (0 / 1): launch the narrow kernel, which computes an item as 16-row sub-tiles (the plan sets it for plans whose
  tiles hold at most ``TUNING["narrow_rows"]`` rows).
- Split items (a request's KV cut into block ranges) write a normalised fp32 partial output
  ``[workspace_rows, 512]`` at byte 0 of ``workspace`` and its natural-log LSE ``[workspace_rows]``
  after it; ``merges``: ``num_merges`` entries of 4 int32 (request, first row, chunks, first partial
  row; chunk c of tile row x is partial row first + 64 c + x) merged by a second kernel of the same call.
- ``k_scale`` multiplies the logits, ``v_scale`` the output (1 for a 16-bit cache): an fp8 (e4m3 / e5m2)
  cache is staged raw and converted exactly to the queries' dtype in shared memory, per block.
"""

from __future__ import annotations

from typing import Any

from ..abi import Entry, fields
from ..spec import DType, Target, VariantSpec
from . import c_type

TEMPLATES = {"cuda": "cuda/mla_sm90.cu.jinja"}

MLA = Entry("mla", fields(
    "q_nope:ptr q_pe:ptr ckv:ptr kpe:ptr o:ptr lse:ptr "
    "qo_indptr:ptr kv_indptr:ptr kv_indices:ptr kv_len:ptr items:ptr merges:ptr workspace:ptr "
    "num_items:i64 num_merges:i64 workspace_rows:i64 num_heads:i64 page_size:i64 "
    "q_nope_stride_n:i64 q_nope_stride_h:i64 q_pe_stride_n:i64 q_pe_stride_h:i64 "
    "ckv_stride_page:i64 ckv_stride_n:i64 kpe_stride_page:i64 kpe_stride_n:i64 "
    "o_stride_n:i64 o_stride_h:i64 lse_stride_n:i64 lse_stride_h:i64 "
    "causal:i32 grid:i32 narrow:i32 sm_scale:f32 k_scale:f32 v_scale:f32"
))

CKV_DIM, KPE_DIM = 512, 64  # the widths the kernel is written for (DeepSeek-V2/V3: kv_lora_rank, qk_rope_head_dim)
ROWS = 64                   # rows (query token x head) per tile: the wgmma M of one warpgroup
KV_BLOCK = 64               # latent tokens per pipeline stage
ITEM_INTS, MERGE_INTS = 8, 4
_LOG2E = 1.4426950408889634
_SMEM_LIMIT = 227 << 10     # the opt-in shared memory per block on sm_90

# Tuning knobs. The benchmark (tools/mla_tuning.py) may override entries (distinct sources, hence distinct
# cache entries); nothing else should.
TUNING: dict[str, int] = {
    "load_threads": 128,  # threads issuing the KV cp.async gathers: 128 = warpgroup 1 (idle during S), 256 = both
    # a row keeps its running max while a block's is at most this much above it (log2 units), and a warp whose rows
    # all kept theirs skips O's rescale (128 multiplies per thread per block); 0 rescales at every new max
    "lazy_rescale": 8,
    # 1 (development): clock64 stamps of each block's phases, both warpgroups, for a window of KV blocks of each
    # CTA's first item (``jitattn_mla_trace`` copies them out; tools/trace_mla.py). 0 renders no trace code.
    "trace": 0,
    # a plan whose tiles hold at most this many rows (heads x query tokens) launches the narrow kernel (S^T = K Q^T,
    # O^T = V^T P^T as m64n16 products); 0: never, 64: always (a 64-row item as four 16-row sub-tiles). Plan-time
    # only: the module holds both kernels.
    "narrow_rows": 16,
}
# The trace's shape (TUNING trace=1): CTAs, the first traced KV block of each CTA's first item, the blocks traced, the
# stamps per block (the template's field numbers: tools/trace_mla.py).
TRACE = {"kTraceCtas": 1024, "kTraceFrom": 8, "kTraceCount": 8, "kTraceFields": 12}


def unsupported(spec: VariantSpec) -> str | None:
    """Why the MLA kernel cannot run ``spec`` (None when it can)."""
    if spec.target is not Target.CUDA:
        return "it is a cuda (sm_90a) kernel"
    if spec.q_dtype not in (DType.F16, DType.BF16) or spec.o_dtype is not spec.q_dtype:
        return "it takes one 16-bit dtype (f16 or bf16) for the queries and the output"
    if spec.kv_dtype is not spec.q_dtype and not spec.kv_dtype.is_fp8:
        return "it takes a latent cache of the queries' dtype or fp8 (e4m3 / e5m2)"
    if (spec.head_dim_qk, spec.head_dim_vo) != (CKV_DIM + KPE_DIM, CKV_DIM):
        return f"it takes head_dim_ckv={CKV_DIM}, head_dim_kpe={KPE_DIM}"
    return None


def layout(spec: VariantSpec) -> dict[str, int]:
    """Every derived constant of the MLA kernel for ``spec`` (plain ints)."""
    reason = unsupported(spec)
    if reason is not None:
        raise ValueError(f"{spec.uri}: the MLA kernel cannot run this spec: {reason}")
    if TUNING["trace"] not in (0, 1):
        raise ValueError(f"mla TUNING trace={TUNING['trace']!r} must be 0 or 1")
    chunks = (CKV_DIM + KPE_DIM) // 64       # 128-byte swizzle boxes per row
    chunk_bytes = KV_BLOCK * 128             # one box of 64 rows (tokens or query rows)
    tile_bytes = chunks * chunk_bytes        # Q tile or one KV stage (ROWS == KV_BLOCK)
    fp8 = spec.kv_dtype.is_fp8
    raw_row = (CKV_DIM + KPE_DIM) if fp8 else 0  # fp8: row-major staging of the raw block, two stages
    raw_bytes = KV_BLOCK * raw_row
    off_kv = tile_bytes
    off_raw = off_kv + tile_bytes if fp8 else 0
    off_p = off_kv + tile_bytes + 2 * raw_bytes if fp8 else off_kv + 2 * tile_bytes
    p_bytes = (KV_BLOCK // 16) * 4 * 128 * 4  # P words of warpgroup 0: [k16 steps][4][128 threads]
    off_alpha = off_p + p_bytes
    smem = off_alpha + 128 * 8 + 1024        # + slack to align the base to 1 KiB (swizzle atoms)
    if smem > _SMEM_LIMIT:
        raise ValueError(f"{spec.uri}: the MLA tile needs {smem} B of shared memory, over {_SMEM_LIMIT}")
    return {
        "kThreads": 256, "kRows": ROWS, "kBN": KV_BLOCK, "kDC": CKV_DIM, "kDR": KPE_DIM,
        "kChunks": chunks, "kChunkBytes": chunk_bytes, "kTileBytes": tile_bytes,
        "kOffQ": 0, "kOffKV": off_kv, "kOffP": off_p, "kOffAlpha": off_alpha, "kOffStat": 0, "kSmemBytes": smem,
        "kLoadThreads": TUNING["load_threads"], "kLazyRescale": TUNING["lazy_rescale"],
        "kRawRowBytes": raw_row, "kRawBytes": raw_bytes, "kOffRaw": off_raw,
    }


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    return (MLA,)


def context(spec: VariantSpec) -> dict[str, Any]:
    constants = [("int", name, str(value)) for name, value in layout(spec).items()]
    constants.append(("float", "kLog2e", repr(_LOG2E) + "f"))
    constants.append(("bool", "kKVFp8", "true" if spec.kv_dtype.is_fp8 else "false"))
    constants.append(("__nv_fp8_interpretation_t", "kFp8Kind", "__NV_E5M2" if spec.kv_dtype is DType.E5M2 else "__NV_E4M3"))
    if TUNING["trace"]:
        constants += [("int", name, str(value)) for name, value in TRACE.items()]
    return {
        "q_ctype": c_type(spec.q_dtype, spec.target),
        "kv_ctype": c_type(spec.kv_dtype, spec.target),
        "o_ctype": c_type(spec.o_dtype, spec.target),
        "constants": constants,
        "trace": bool(TUNING["trace"]),
    }

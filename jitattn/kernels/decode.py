"""Decode kernels: one query token per request over a paged (or ragged) KV.

The cpu target shares the generic attention kernel with prefill (every axis
but the dtypes at run time); the cuda target compiles its own template
(``templates/cuda/decode.cu.jinja``), whose every derived constant -- vector
widths, thread layout, tile and pipeline sizes, shared memory -- is computed
here by ``cuda_layout`` and handed to the template as a flat constant list.

cuda kernel shape (one thread block per (request, KV chunk, KV head); the
KV heads of one request are consecutive blocks):

- The K/V rows of a tile of ``tile_tokens`` tokens are copied into shared
  memory with ``cp.async`` (16-byte copies where a row allows it),
  ``stages`` tiles in flight; the page table of the tile after next is read
  while the current tile is computed.
- Tensor-core path (``mma_eligible``: head dims multiples of 16 (32 with
  fp8 KV or RoPE), no RoPE with fp8 KV, qk <= 192, vo <= 128, group <= 16;
  with TUNING ``mma_d256`` also 256 / 256 with 16-bit KV, group <= 8 and no RoPE;
  RoPE rotates each K fragment in registers between ``ldmatrix`` and the mma,
  the dims i and i + D/2 of a pair being the same register of two fragments, and feeds the turned K
  as tf32 to ``mma.sync.m16n8k8`` (fp32 Q^T, exact)): four warps each take
  16 tokens per step, the tokens as the M dimension of ``mma.sync.m16n8k16``
  and the group's heads as N (one n8 tile up to 8 heads, two up to 16, so
  GQA wastes at most half a tile): S^T = K Q^T (K by ``ldmatrix``, Q^T held
  in registers), fp32 online softmax per head, P^T by ``movmatrix`` as the B
  operand of O^T += V^T P^T (V^T by ``ldmatrix.trans``). Rows of whole
  128-byte lines sit unpadded on 128-byte boundaries, the 16-byte pieces of
  each line permuted by the row so ``ldmatrix`` is bank-conflict free and
  each line's copies reach L2 as one request (TUNING ``swizzle``); other rows
  are padded to an odd number of 16-byte units. fp8 K/V stay fp8 in shared memory (half the bytes per
  stage): ``ldmatrix`` moves byte pairs as b16 and each lane converts its
  fragment to f16 in registers (the mma runs in f16 whatever the query
  dtype: one instruction per fp8 pair; bf16 queries are scaled by a power of
  two into f16 range, the scores scaled back), K with the head dimension
  permuted within 16 dims (Q^T is loaded in the same order), V with one
  byte shuffle that sends even and odd dims to the two row halves of a tile.
- CUDA-core path (every other variant: RoPE with fp8 KV, head dims with a remainder of 8
  (16 with fp8), large groups, head_dim 256): a thread owns ``vec``
  consecutive elements of the head dimension (``cpt_q``/``cpt_v`` such chunks, ``tx`` threads per row) for
  ``heads_per_thread`` of the group's query heads, so every KV element read
  from shared memory is converted once and used for all those heads; scores
  are summed over the ``tx`` lanes with butterfly shuffles.
  ``tz`` groups of threads take interleaved tokens of a tile.
- Each warp (tensor cores) or thread group (CUDA cores) keeps its own fp32
  online-softmax state; they are merged through shared memory at the end.
- Split-KV (``kv_chunk_size > 0`` at run time): a block per (chunk, KV head)
  writes a partial output and natural-log LSE to the workspace (or the final
  output when its request has one chunk); the block that finishes a request's
  last chunk (an atomic count per (request, KV head) in ``split_counters``,
  reset by that block) merges the chunks, so there is no second kernel.

Workspace layout (split-KV), in the ABI's terms: with
``row_bytes = 4 * num_qo_heads * (head_dim_vo + 1)`` the workspace holds
``cap = workspace_bytes // row_bytes`` chunk rows: float32 partial outputs
``[cap, num_qo_heads, head_dim_vo]`` at byte 0, then float32 LSEs
``[cap, num_qo_heads]``. A plan needs ``cap >= split_indptr[batch]``; see
``split_workspace_bytes``.
"""

from __future__ import annotations

import functools
from typing import Any

from ..kv_split import MAX_RESIDENT_BLOCKS, split_workspace_bytes  # noqa: F401  (the planner's bound, the workspace layout)
from ..spec import DType, PosEncoding, Target, VariantSpec
from . import c_type
from .attention import context as _attention_context
from .attention import entries, explain_build_error  # noqa: F401  (the family interface)

TEMPLATES = {"cpu": "cpu/attention.cpp.jinja", "cuda": "cuda/decode.cu.jinja"}

# Tuning knobs of the cuda layout. The benchmark may override entries (it
# renders distinct sources, hence distinct cache entries); nothing else should.
TUNING: dict[str, int] = {
    "threads": 128,            # target threads per block (more when a group needs them)
    "tokens_per_step": 4,      # tokens a thread scores between softmax updates (8 when one head per thread)
    "max_heads_per_thread": 4,  # query heads a thread owns before the group is spread over more threads
    "stage_bytes": 16 << 10,   # target bytes of K+V per pipeline stage
    "smem_bytes": 48 << 10,    # target shared memory for the pipeline
    "max_stages": 4,
    "head_minor": 1,           # consecutive blocks take the KV heads of one request (DRAM locality in NHD)
    "mma": 1,                  # tensor-core path where the variant allows it (see mma_eligible)
    "mma_blocks_per_sm": 2,    # resident blocks the tensor-core path is sized for (shared memory, registers)
    "mma_blocks_per_sm_fp8": 3,  # ... with fp8 KV (half the bytes per stage: more blocks keep as many in flight)
    # Resident blocks of the module's second tensor-core layout, for many short requests (see short_items_layout);
    # 0: modules have none (at 16-bit head dim 64 the next knob decides instead).
    "mma_blocks_per_sm_short": 3,
    # ... and its resident blocks and 16-token steps per warp and stage where a token's K + V rows are at most 256
    # bytes (16-bit head dim 64; see mma_steps_small_rows): the layout's tiles may be shorter than the default's.
    # Four blocks of three 64-token stages (128 registers, 8 bytes of spill at d64 g8 window). H200, 2026-12-05 (h):
    # gpt-oss window 128 (64 requests x 8 KV heads, one wave of four: kv_split's SHORT_ITEMS_ONE_WAVE_MIN_BLOCKS)
    # 16.6 us in the default layout, 15.7 in three blocks of 128-token stages, 13.0 in four of 64 (SDPA 13.8).
    # H100, 2026-12-05 (i), four of 64 against three of 128: window 128 14.8 vs 18.0 us (SDPA 15.2), 64 x 1024
    # tokens 55 vs 58 (one wave against the default layout), 128 x 1024 103.4 vs 101.7 (both short layouts; the
    # default layout 105.8).
    "mma_blocks_per_sm_short_small_rows": 4,
    "mma_steps_short_small_rows": 1,
    "mma_steps": 1,            # 16-token steps per warp per pipeline stage on the tensor-core path
    # ... when a token's K + V rows are at most 256 bytes (16-bit head dim 64): two steps make 32 KiB stages
    # as at head dim 128, halving the per-stage costs (barrier, softmax update, page lookups) per byte. H200,
    # gpt-oss d64 b64 x 8192 (64 / 8 heads): 305.7 us with one step, 257.3 with two (SDPA 244); two steps at
    # head dim 128 are slower (32 requests over 32k shared pages: 522 vs 850 us).
    "mma_steps_small_rows": 2,
    "mma_warps": 4,            # warps per block on the tensor-core path (each takes 16 tokens of a step)
    # head_dim 256 (16-bit KV, group <= 8, no RoPE) on the tensor-core path (mma_eligible); 0: the CUDA-core path
    "mma_d256": 1,
    # Tensor-core path, rows of whole 128-byte lines: unpadded K / V rows on 128-byte aligned stages, their
    # 16-byte pieces permuted within each line by the row (see swz in the template); 0: rows at an odd
    # multiple of 16 bytes, whose lines straddle two 128-byte shared-memory segments: each line's cp.async
    # pieces then go to L2 as two or three requests (H200, tools/l2_stream.cu's copy pattern alone, b256 x 4096:
    # 88.1 M requests / 201 M sectors and 1005 us padded, 33.6 M / 134 M and 937 us swizzled; 32 requests
    # over 32k shared pages 750 vs 460 us).
    "swizzle": 1,
    # ... and rows that end half-way into a line (192 bytes: head_dim 96 in 16 bits), which NHD pages start at
    # either half of a line (every other KV head): with row_shift a row takes a slot of 256 bytes, starting at its
    # second half when its head's rows start mid-line, so each of its lines' pieces again lands in one 128-byte
    # segment; 0: the padded pitch (208 bytes). Phi-3 (d96, 32 KV heads) b64 x 4096 on the H200: 823 us padded,
    # 761 us shifted (3914 -> 4230 GB/s), SDPA 752-753 us in the same runs.
    "row_shift": 1,
    "smem_per_sm": 227 << 10,  # usable shared memory per SM (H100/H200: 227 KiB; A100: 163 KiB)
    # Page ids of a work item kept in shared memory (loaded once at its start, beside the query) when
    # the item spans at most this many pages; longer items read them from the page table a stage ahead.
    "page_ids": 1024,
    # ... on the tensor-core path with 16-bit KV at head dims 64 and 96 (unless cuda_layout's ``tuning`` argument sets
    # page_ids; tools/decode_tunings.py updates TUNING itself, so its A/B of those specs sets this key), which read
    # them a stage ahead always (0). H100, events, L2 evicted, two alternated rounds in each of two runs
    # (docs/benchmarks/h100-2026-12-05-page-ids.txt), 1024 -> 0 (us): phi-3 d96 b64 x 4096 1112.7 -> 1093.0,
    # gpt-oss d64 b64 x 8192 372.1 -> 365.0. Elsewhere one run: gemma-2 d256 720.0 -> 712.7, d128 within 0.5%
    # but b1 x 32k 55.3 -> 57.4 in plain launches (the 2026-12-01 reason for the table), fp8 KV 752.0 -> 769.7.
    # H200 (2026-12-05 (h), one run): phi-3 766.8 -> 763.9, but gpt-oss d64 256.9 -> 260.5 and gemma-2 497.8 ->
    # 499.6: d64 stays at 0 until a second H200 run confirms it, with its short-items layout (measured with 0).
    "page_ids_d64_d96": 0,
    # Development only: 1 stamps each block's first work item with %globaltimer at its phases
    # (``jitattn_decode_trace`` copies them out; tools/trace_decode.py). 0 renders no trace code. The
    # stamps cost registers (bf16 d128: 164 -> 171), which can spill under a tight blocks-per-SM cap.
    "trace": 0,
}

def _next_pow2(n: int) -> int:
    p = 1
    while p < n:
        p *= 2
    return p


def mma_eligible(spec: VariantSpec, tuning: dict[str, int] | None = None) -> bool:
    """Whether ``spec`` can take the tensor-core (mma.sync m16n8k16) path (``tuning``: overrides of ``TUNING``)."""
    dim_unit = 32 if spec.kv_dtype.is_fp8 else 16  # fp8: one ldmatrix covers 32 dims
    d256 = (tuning or {}).get("mma_d256", TUNING["mma_d256"])
    # With TUNING mma_d256: head dim 256, 16-bit KV, one head tile, no RoPE: 253-255 registers at one block per
    # SM, no spills (fp8 KV spills at its three blocks' cap). H200, gemma-2 b64 x 4096 (16 / 8 heads, soft cap 50):
    # 490.6-497.2 us against 641.6-643.7 on the CUDA-core path (FlashInfer 483-494); before the stages were
    # swizzled it measured 645 vs 603.
    if (d256 and spec.head_dim_qk == spec.head_dim_vo == 256 and spec.group_size <= 8
            and spec.variant is None and spec.pos_encoding is not PosEncoding.ROPE_LLAMA and not spec.kv_dtype.is_fp8):
        return True
    return (
        spec.variant is None  # custom snippets run on the CUDA-core path
        # RoPE rotates K fragments in registers: each rotation pair must sit in two whole fragments
        and (spec.pos_encoding is not PosEncoding.ROPE_LLAMA or (not spec.kv_dtype.is_fp8 and spec.head_dim_qk % 32 == 0))
        and spec.head_dim_qk % dim_unit == 0 and spec.head_dim_vo % dim_unit == 0 and spec.group_size <= 16
        # Q^T and O^T fragments stay in registers (head dim 256: above)
        and spec.head_dim_qk <= 192 and spec.head_dim_vo <= 128
    )




@functools.lru_cache(maxsize=256)
def resident_blocks(spec: VariantSpec) -> int:
    """Blocks per SM the cuda kernel of ``spec`` is sized for: what the split-KV planner balances over."""
    layout = cuda_layout(spec)
    return layout["kMinBlocks"] if layout["kMma"] else 2


# The constants in which a module's two tensor-core layouts differ (the rest are the module's).
LAYOUT_CONSTANTS = ("kMinBlocks", "kStages", "kQOffset", "kPipeBytes", "kSmemBytes", "kMergeStageFloats", "kSteps",
                    "kTileTokens", "kLoadsK", "kLoadsV", "kTabPerThread", "kKStageBytes", "kVStageBytes")


@functools.lru_cache(maxsize=256)
def short_items_layout(spec: VariantSpec) -> dict[str, int] | None:
    """The module's second tensor-core layout, for a plan of many short requests (None: the module has one layout).

    ``mma_blocks_per_sm_short`` resident blocks of two stages each instead of two blocks of three (at 16-bit head
    dim 64 ``mma_blocks_per_sm_short_small_rows``, and ``mma_steps_short_small_rows`` steps per stage: the layouts
    may differ in tile length too): a request of a few tiles spends most of its block's time in the prologue's chain
    of memory latencies (page ids, row addresses, the first stages), and a third block per SM streams meanwhile.
    H200, 2026-12-04 (x) (events, L2 evicted): 128 requests x 96 / 256 / 2048 tokens 31.6 -> 28.8, 48.1 -> 44.3, 255
    -> 247 us; 128 requests over 8k shared pages 554 -> 465 us; but 32 requests (split) up to 35% slower, b64 x 2048
    (512 blocks, 1.3 waves of three) 129 -> 141, b1 x 32k 46 -> 55. The plan takes it for unsplit batches of many
    blocks of short requests or shared pages (``kv_split.short_items_split``). Only for 16-bit KV at head dims 64
    and 128 without RoPE or a variant, one head tile: their kernels fit the three blocks' register cap (156-168
    registers in this layout, no spills; four blocks of 64-token stages at d64 g8 with a window: 128 registers, 8
    bytes of spill)."""
    small_rows = _small_rows(spec)
    blocks = TUNING["mma_blocks_per_sm_short_small_rows" if small_rows else "mma_blocks_per_sm_short"]
    base = cuda_layout(spec)
    if (not blocks or not base["kMma"] or blocks <= base["kMinBlocks"] or spec.kv_dtype.is_fp8
            or spec.variant is not None or spec.pos_encoding is PosEncoding.ROPE_LLAMA or spec.group_size > 8
            or spec.head_dim_qk not in (64, 128) or spec.head_dim_vo != spec.head_dim_qk):
        return None
    tuning = {"mma_blocks_per_sm": blocks}
    if small_rows:
        tuning["mma_steps_small_rows"] = TUNING["mma_steps_short_small_rows"]
    short = cuda_layout(spec, tuning)
    return short if short["kMinBlocks"] == blocks else None


def _small_rows(spec: VariantSpec) -> bool:
    """Whether a token's K + V rows are at most 256 bytes (16-bit KV at head dim 64 or less): the tensor-core path
    then takes ``mma_steps_small_rows`` steps per stage."""
    return not spec.kv_dtype.is_fp8 and (spec.head_dim_qk + spec.head_dim_vo) * spec.kv_dtype.itemsize <= 256


def _whole_lines(*row_bytes: int) -> bool:
    """Whether rows of these byte widths are whole 128-byte lines: such rows are kept on 128-byte boundaries (see
    TUNING swizzle), others are padded."""
    return all(n % 128 == 0 for n in row_bytes)


def _half_lines(*row_bytes: int) -> bool:
    """Whether rows of these byte widths end half-way into a 128-byte line (192 bytes: head_dim 96 in 16 bits): such
    rows are kept in slots of one more half line, shifted by where they start in their line (see TUNING swizzle)."""
    return all(n % 128 == 64 and n >= 192 for n in row_bytes)


def _pitch(row_bytes: int) -> int:
    """Shared-memory row pitch: an odd number of 16-byte units, so ldmatrix rows hit distinct banks."""
    units = row_bytes // 16
    return 16 * (units if units % 2 else units + 1)


def cuda_layout(spec: VariantSpec, tuning: dict[str, int] | None = None) -> dict[str, int]:
    """Every derived constant of the cuda decode kernel for ``spec`` (plain ints)."""
    t = dict(TUNING)
    if tuning:
        t.update(tuning)
    if not (t["mma"] and mma_eligible(spec, t)):
        return _simt_layout(spec, t)
    if "page_ids" not in (tuning or {}) and not spec.kv_dtype.is_fp8 and spec.head_dim_qk in (64, 96):
        t["page_ids"] = t["page_ids_d64_d96"]
    return {**_simt_layout(spec, t), **_mma_layout(spec, t)}


def _mma_layout(spec: VariantSpec, t: dict[str, int]) -> dict[str, int]:
    """Tensor-core path: ``mma_warps`` (4) warps, each scores 16 tokens per step for all (<= 16) heads with
    mma.sync (tokens as M, heads as N), then O^T += V^T P^T; see the module docstring.

    Sized for ``mma_blocks_per_sm`` (``_fp8``) resident blocks (two with 16-head groups, whose
    fragments need more registers), fewer when not even two stages fit; registers are capped to
    match. H200, b256 x 4096: bf16 1001 us with 2 or 3 blocks (b64 x 2048: 139 us with 2, 165 with
    3); fp8 674 / 605 / 596 us with 2 / 3 / 4 blocks."""
    dqk, dvo, group = spec.head_dim_qk, spec.head_dim_vo, spec.group_size
    elem = spec.kv_dtype.itemsize
    nw = t["mma_warps"]
    if not 1 <= nw <= 32:
        raise ValueError(f"TUNING mma_warps={nw} must be in 1..32")
    head_tiles = -(-group // 8)
    row_shift = bool(t["swizzle"]) and bool(t["row_shift"]) and _half_lines(dqk * elem, dvo * elem)
    swizzle = bool(t["swizzle"]) and _whole_lines(dqk * elem, dvo * elem) or row_shift
    if row_shift:  # a slot of whole lines: the row, shifted by half a line when it starts mid-line
        k_pitch, v_pitch = dqk * elem + 64, dvo * elem + 64
    elif swizzle:
        k_pitch, v_pitch = dqk * elem, dvo * elem
    else:
        k_pitch, v_pitch = _pitch(dqk * elem), _pitch(dvo * elem)
    q_pitch = _pitch(dqk * 2)
    steps = t["mma_steps_small_rows"] if _small_rows(spec) else t["mma_steps"]
    tile_tokens = nw * 16 * steps  # a barrier per stage: per `steps` 16-token steps of each warp
    k_stage, v_stage = tile_tokens * k_pitch, tile_tokens * v_pitch
    stage_bytes = k_stage + v_stage + tile_tokens * 16  # + the stage's row-offset table
    blocks = t["mma_blocks_per_sm_fp8" if spec.kv_dtype.is_fp8 else "mma_blocks_per_sm"] if head_tiles == 1 else 2
    blocks = min(blocks, MAX_RESIDENT_BLOCKS)
    ids = _page_id_bytes(t)
    align = 128 if swizzle else 0  # slack to round the dynamic region's start up to a 128-byte boundary
    while blocks > 1 and (t["smem_per_sm"] // blocks - 1024 - ids - align) // stage_bytes < 2:
        blocks -= 1
    stages = max(2, min(t["max_stages"], (t["smem_per_sm"] // blocks - 1024 - ids - align) // stage_bytes))
    pipe = stages * (k_stage + v_stage)
    table = stages * tile_tokens * 16 + ids
    # The query rows alias the last stage's K tile until Q^T is in registers: the prologue fills the
    # other stages meanwhile (that stage is first issued after the main loop's first barrier).
    q_bytes = 16 * q_pitch
    if q_bytes > k_stage:  # only with fewer warps than the default (a smaller tile)
        raise ValueError(f"TUNING mma_warps={nw}: the 16 query rows ({q_bytes} B) do not fit a stage's K tile "
                         f"({k_stage} B); use more warps")
    merge = nw * group * (dvo * 4 + 8)
    nt = nw * 32
    return {
        "kMma": 1, "kNW": nw, "kTZ": nw, "kGS": group, "kNT": nt, "kHT": head_tiles, "kMinBlocks": blocks,
        "kKPitch": k_pitch, "kVPitch": v_pitch, "kQPitch": q_pitch, "kQOffset": (stages - 1) * k_stage,
        "kSteps": steps, "kTileTokens": tile_tokens, "kStages": stages, "kQTiles": dqk // 16, "kOTiles": dvo // 16,
        "kLoadBytes": 16, "kCPRK": dqk * elem // 16, "kCPRV": dvo * elem // 16,
        "kLoadsK": -(-(tile_tokens * dqk * elem // 16) // nt), "kLoadsV": -(-(tile_tokens * dvo * elem // 16) // nt),
        "kTabPerThread": -(-tile_tokens // nt), "kSwizzle": int(swizzle), "kRowShift": int(row_shift),
        "kSmemAlign": align, "kKStageBytes": k_stage, "kVStageBytes": v_stage, "kPipeBytes": pipe,
        "kSmemBytes": max(pipe + table, merge), **_page_id_fields(t, nt),
        "kMergeStageFloats": _merge_stage_floats(max(pipe + table, merge), group, nt),
    }


def _simt_layout(spec: VariantSpec, t: dict[str, int]) -> dict[str, int]:
    """CUDA-core path (every variant): see the module docstring."""
    dqk, dvo, group = spec.head_dim_qk, spec.head_dim_vo, spec.group_size
    elem = spec.kv_dtype.itemsize
    rope = spec.pos_encoding is PosEncoding.ROPE_LLAMA

    # Compute vector: 8 elements (16 B of f16/bf16, 8 B of fp8). RoPE pairs
    # element i with i + D/2, so a chunk must not straddle D/2.
    vec = 8
    if rope and (dqk // 2) % vec:
        vec = 4
    ncq, ncv = dqk // vec, dvo // vec
    tx = min(32, _next_pow2(min(ncq, ncv)))
    cpt_q, cpt_v = -(-ncq // tx), -(-ncv // tx)

    # Query heads per thread, bounded by registers (q, o and scores per head).
    tps = t["tokens_per_step"]
    per_head = vec * (cpt_q + cpt_v) + tps
    hpt_max = max(1, min(t["max_heads_per_thread"], 96 // per_head))
    gy = -(-group // hpt_max)
    gy = max(1, min(gy, max(1, 512 // tx)))
    hpt = -(-group // gy)
    if hpt == 1 and tps < 8:
        tps = 8
    tz = max(1, t["threads"] // (tx * gy))
    nt = tx * gy * tz

    # Tile: tz * tps tokens per step, steps per tile to reach the stage target.
    bytes_per_token = (dqk + dvo) * elem
    while tps > 1 and tz * tps * bytes_per_token > t["stage_bytes"]:
        tps //= 2
    step_tokens = tz * tps
    steps = 1
    while step_tokens * steps * 2 * bytes_per_token <= t["stage_bytes"] and steps < 8:
        steps *= 2
    tile_tokens = step_tokens * steps
    while tile_tokens % 4:  # keeps every stage 16-byte aligned for any dtype
        steps *= 2
        tile_tokens = step_tokens * steps
    stage_bytes = tile_tokens * bytes_per_token
    stages = max(2, min(t["max_stages"], t["smem_bytes"] // stage_bytes))

    load_bytes = 16 if (dqk * elem) % 16 == 0 and (dvo * elem) % 16 == 0 else 8
    cpr_k, cpr_v = dqk * elem // load_bytes, dvo * elem // load_bytes
    gs = gy * hpt  # head slots (>= group; extra slots repeat the last head)

    k_stage_bytes = tile_tokens * dqk * elem
    v_stage_bytes = tile_tokens * dvo * elem
    pipe_bytes = stages * (k_stage_bytes + v_stage_bytes)
    table_bytes = stages * tile_tokens * 16 + _page_id_bytes(t)  # K and V row addresses per stage; page ids
    merge_bytes = tz * gs * (dvo * 4 + 8)
    smem = max(pipe_bytes + table_bytes, merge_bytes)
    assert k_stage_bytes % 16 == 0 and v_stage_bytes % 16 == 0 and pipe_bytes % 16 == 0

    return {
        "kDQK": dqk, "kDVO": dvo, "kGroup": group, "kElemBytes": elem,
        "kVec": vec, "kNCQ": ncq, "kNCV": ncv, "kTX": tx, "kCPTQ": cpt_q, "kCPTV": cpt_v,
        "kHPT": hpt, "kGY": gy, "kGS": gs, "kTZ": tz, "kNT": nt,
        "kTPS": tps, "kSteps": steps, "kTileTokens": tile_tokens, "kStages": stages,
        "kLoadBytes": load_bytes, "kCPRK": cpr_k, "kCPRV": cpr_v,
        "kLoadsK": -(-(tile_tokens * cpr_k) // nt), "kLoadsV": -(-(tile_tokens * cpr_v) // nt),
        "kTabPerThread": -(-tile_tokens // nt),
        "kKStageBytes": k_stage_bytes, "kVStageBytes": v_stage_bytes,
        # the tensor-core path's 16-dim fragment counts of Q^T and O^T (array extents; 1 here: unused)
        "kMma": 0, "kQTiles": 1, "kOTiles": 1, "kHT": 1, "kMinBlocks": 1, "kNW": 1, "kKPitch": dqk * elem, "kVPitch": dvo * elem, "kQPitch": 0,
        # rows of whole 128-byte lines start on 128-byte boundaries (see TUNING swizzle)
        "kQOffset": 0, "kSwizzle": 0, "kRowShift": 0, "kSmemAlign": 128 if _whole_lines(dqk * elem, dvo * elem) else 0,
        "kPipeBytes": pipe_bytes, "kSmemBytes": smem, "kMergeStageFloats": _merge_stage_floats(smem, group, nt),
        **_page_id_fields(t, nt),
        "kHeadMinor": int(bool(t["head_minor"])),
    }


def _page_id_bytes(t: dict[str, int]) -> int:
    """Shared memory for an item's page ids (``TUNING["page_ids"]`` int32)."""
    return t["page_ids"] * 4


def _page_id_fields(t: dict[str, int], threads: int) -> dict[str, int]:
    """The page-id constants of either layout (at least one id register per thread: no empty array)."""
    return {"kPageIds": t["page_ids"], "kIdsPerThread": max(1, -(-t["page_ids"] // threads))}


def _merge_stage_floats(smem_bytes: int, group: int, threads: int) -> int:
    """Split-KV merge weights (one float per chunk and query head) that fit in the block's dynamic
    shared memory beside each head's (max, sum); a request cut into more chunks merges unstaged.
    0 (never staged) when the block is not whole warps: the staged merge gives each head to a warp."""
    if threads % 32:
        return 0
    return smem_bytes // 4 - 2 * group


def _cuda_context(spec: VariantSpec) -> dict[str, Any]:
    layout = cuda_layout(spec)
    pos = spec.pos_encoding
    flags = {
        "kRope": pos is PosEncoding.ROPE_LLAMA,
        "kAlibi": pos is PosEncoding.ALIBI,
        "kWindow": bool(spec.use_sliding_window),
        "kSoftCap": bool(spec.use_logits_soft_cap),
        "kKVFp8": spec.kv_dtype in (DType.E4M3, DType.E5M2),
    }
    constants = [("int", name, str(value)) for name, value in layout.items() if name not in LAYOUT_CONSTANTS]
    constants += [("bool", name, "true" if value else "false") for name, value in flags.items()]
    constants.append(("int", "kPosCode", str({PosEncoding.NONE: 0, PosEncoding.ROPE_LLAMA: 1, PosEncoding.ALIBI: 2}[pos])))
    return {
        "constants": constants,
        # The kernel's layouts: struct name -> the constants in which they differ (the first is the default).
        "layouts": [(name, [(k, lay[k]) for k in LAYOUT_CONSTANTS])
                    for name, lay in (("DefaultLayout", layout), ("ShortItemsLayout", short_items_layout(spec)))
                    if lay is not None],
        "trace": bool(TUNING["trace"]),
        "kv_elem_ctype": c_type(spec.kv_dtype, Target.CUDA),
    }


def context(spec: VariantSpec) -> dict[str, Any]:
    ctx = _attention_context(spec)
    if spec.target is Target.CUDA:
        ctx.update(_cuda_context(spec))
    return ctx

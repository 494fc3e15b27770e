"""The sm90 (Hopper) tier of the cuda prefill family: which specs it runs, its knobs, its layout.

``templates/cuda/prefill_sm90.cu.jinja`` (sm_90a: TMA, mbarriers, wgmma, warp specialisation), every derived
constant from ``sm90_layout``. The family (``jitattn.kernels.prefill``: ``tier`` and ``select``) takes it when the
arch list is 9.0a only and ``sm90_unsupported(spec)`` is None (ragged or paged KV, one 16-bit dtype for q
and kv, a 16-bit or float32 output, head_dim_qk == head_dim_vo in 64/128/256, causal or not,
sliding window, logits soft cap, attention sinks, ALiBi without a soft cap, custom masks, and
custom variants with a softmax and no query / key transform; no in-kernel RoPE, no fp8 KV);
every other spec keeps the sm80 tier. An fp8 query (q, k and v of one fp8 dtype: ragged or paged KV, head_dim
128, no custom mask or variant) runs on this tier only (``tier`` raises elsewhere): fp8 wgmmas, V transposed by the
producer. ``JITATTN_PREFILL_TIER``
forces a tier: ``sm80`` always the generic one; ``sm90`` the Hopper one for every spec it
supports even with an unknown arch list (an error with a non-Hopper one). The tier is in the
rendered source, hence in the cache key.

- A block: warpgroup 0 produces (one thread issues the TMA loads; its registers given back
  with setmaxnreg), warpgroups 1 and 2 consume 64 query rows each (warpgroups 1 to 3 at head_dim 64: a 192-row
  tile, ``SM90_TUNING["consumers_d64"]``). A tile is 128 rows: the GQA
  group of one KV head packed into the rows (row = (token, head in group), ``128 // group``
  tokens; one Q TMA box of 64 columns x group heads x tokens) when the group divides 128 and
  head_dim >= 128, else 128 tokens of one query head (``sm90_pack`` has the measurements).
- KV blocks of ``kBN`` tokens (ragged: 128 at head_dim 64 and 128, 80 at 256;
  paged: 128 at 64 and 128, 64 at 256) go through a
  2-stage pipeline (4 stages at head_dim 64); each 64-column slice of a row is one 128-byte-swizzled TMA box
  (ragged KV).
  Paged KV: the whole producer warpgroup gathers each block with ``cp.async`` -- a table of the
  block's row offsets from the page table (``kOffTab``, two by block parity), then every 16-byte
  piece into the same swizzled layout, rows past the request zero-filled -- completing on the
  stage's full barrier (one arrival per producer thread). With ``kPagedTma`` and a page size that is
  a multiple of 8 dividing the KV block, the launch takes TMA instead: the producer threads read the
  block's page ids into the table, and one thread loads each page as a box of 64 columns x page_size
  rows of a 4-d tensor map over the cache (dim, head, slot, page; head and slot swapped for HND),
  which lands in the same swizzled rows; rows past the keys are masked (K) and zeroed (V) as for
  ragged KV. ``q_row_period`` > 0 (the cascade's
  chunked shared levels) gathers the tile's query rows the same way instead of one Q TMA box. The
  consumers overlap block j's S GEMM with block j-1's P.V and take turns issuing GEMMs
  (ping-pong), so one warpgroup's softmax runs under the other's GEMMs.
- Soft cap and sliding window, both template constants (``kSoftCap``, ``kSwa``: a spec without
  them compiles to the same machine code as before they existed). The soft cap turns a block's
  scores into ``tanh(s * sm_scale / cap)`` before any mask (``tanh.approx``, one MUFU op;
  ``SM90_TUNING["soft_cap_tanh"]`` = 0 for ``1 - 2 / (1 + e^2x)`` on two), and the softmax scale becomes
  ``cap * log2(e)``, so the max, the exponent and the LSE are those of the plain kernel. Window
  (``window_left`` = w, the sm80 tier's and the reference's convention): key j is visible to
  query i of a request when ``j >= kv_len - qo_len + i - w`` (and ``j <= kv_len - qo_len + i``
  when causal); a tile walks KV blocks from the one holding its first query's window start
  (``Tile::blk0``: producer and consumers decode the same range, blocks before it are neither
  loaded nor computed) and masks the blocks starting before its last query's window start.
- Custom masks (``kCustom``): each consumer warpgroup loads its rows' bits per block while the block's S GEMM
  runs and drops a block none of its rows sees (a ``bar.red.or`` vote: its S is discarded, its softmax and P V
  skipped); a block whose bits let every key of a thread's rows through skips the per-element masking; the
  producer records each block's state in a word per stage at ``kOffLive``: hidden (no query of the tile sees it:
  no TMA, no consumer computes it), open (every query sees every key: the consumers read no bits) or masked.
  A plan writes every (virtual tile, block) pair's state once, for all heads, with the module's second entry,
  ``mask_states`` (a small kernel), into a buffer of ``mask_states_bytes`` (below; under CUDA graphs the
  wrapper's, fixed) that its launches get as ``workspace``; the producer reads them four blocks to a word, a
  word ahead, and a tile's walk ends at the last block some query of it sees (the states' word per tile: the
  hidden tail past it is not walked; the count reaches the consumers with the Q TMA's arrive, ``tile_blocks``).
  Without them the whole producer warpgroup reads the tile's mask rows per block and votes. Gathered paged KV
  loads every block and its consumers read every block's bits.
- Work mapping: the sm80 tier's virtual tiles (``base(r) = r + qo_indptr[r] * pack // 128``),
  items (virtual tile, kv head; query head when unpacked), a persistent grid of one block per
  SM taking items from the same per-stream counter slots as the sm80 tier
  (``jitattn/work_queue.cuh``): the producer's thread 0 takes an item as soon as the previous
  one is known and hands it to the block's other threads through a ring of ``kItemRing``
  shared-memory slots (full / empty mbarriers), so producer and consumers walk the same sequence
  and a block that finishes early takes the next item (the static snake order, still the
  fallback without a slot, gave a cascade level cut into one item per SM two items on some
  blocks and none on others).
- The tensor maps' token extent is the allocation holding q / k / v (``cuMemGetAddressRange``):
  a tile reaching past the last request reads memory that exists; its rows are masked, and V
  rows past a request's keys are zeroed in shared memory (P is 0 there; 0 * NaN is not).
"""

from __future__ import annotations

from typing import Any

import json
import math
import os

from ..spec import DType, KVStorage, MaskMode, PosEncoding, Target, VariantSpec
from .attention import context as _attention_context

TEMPLATE_SM90 = "cuda/prefill_sm90.cu.jinja"
_LOG2E = math.log2(math.e)


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


# head_dim_qk -> KV tokens per stage (docs/kernels/sm90_prefill.md: measured; d256: 80 is the most two stages fit
# in 227 KiB beside the 128-row query tile, 5% faster than 64 on the H200; 192 (with head_dim_vo 128: DeepSeek's MLA
# prefill): 128, the wgmma N that two stages of K and V fit; d128: 128, 1-4% faster than 176 on the suite's rows
# (H200 and H100, 2026-12-06), and with a custom mask since its tiles end at their last seen block (causal 3% faster,
# the tree's verify alike, H200 2026-12-07)
SM90_KV_BLOCK = {64: 192, 128: 128, 256: 80, 192: 128}
# (head_dim_qk, head_dim_vo) pairs of the tier: equal, or 192 / 128 (ragged KV only: its 24 pieces of a row do not
# split over the producer's 128 threads, which the paged gathers and repeated query rows need)
SM90_HEAD_DIMS = ((64, 64), (128, 128), (256, 256), (192, 128))
# Paged KV: a block that pages of 16, 32, 64 and 128 tile whole, so each page is one TMA box (H200,
# 2026-12-01, causal b8 x 4096 d128: page 64 300 -> 520 TFLOP/s, page 16 382 -> 389; 176 kept only 8/16/88).
SM90_PAGED_KV_BLOCK = {64: 192, 128: 128, 256: 64}
SM90_KV_BLOCK_3WG = 128  # head_dim 64 with three consumer warpgroups (SM90_TUNING consumers_d64)
# An fp8 query: the P V GEMM's B operand (V^T, keys along K, fp8 wgmma takes K-major operands only) is a row of 128
# keys per swizzle atom, so blocks of 128 (256, two atoms, would overflow the consumers' registers); not yet measured.
SM90_FP8_KV_BLOCK = 128

# Knobs of the sm90 tier's cp.async gathers (paged KV, repeated query rows), for experiments
# (tools/bench_paged_sm90.py renders other values: distinct sources, distinct cache entries).
# gather_sync: how gathered stages reach the consumers (0 consumer-side proxy fence, the tested
# default; 1 writer-side fence after cp.async.wait_group; 2 no fence; 3 the consumers' acquire-only
# proxy fence, which ptxas turns into no instruction on sm_90a: see the template);
# gather_l2: cp.async L2 prefetch hint in bytes (0 none, 64, 128, 256);
# paged_kv_block: KV tokens per stage for paged KV (0: SM90_PAGED_KV_BLOCK's);
# soft_cap_tanh: the soft cap's tanh (1, the default: tanh.approx.f32, one MUFU op, as in FlashInfer and
# FlashAttention-3; measured on an H100 within 1e-5 relative, 8e-6 absolute, of tanh over |x| < 12, though PTX
# documents 2^-11; 0: 1 - 2 / (1 + e^2x) on ex2 + rcp, two MUFU ops, absolute error ~2.3e-7, 1.11-1.19x the time;
# docs/kernels/sm90_prefill.md);
# paged_tma: 1 loads paged KV blocks with one TMA box per page (64 columns x page_size rows, a 4-d tensor
# map over the cache) when page_size is a multiple of 8 dividing the KV block, 0 always gathers, 2 (tests)
# as 1 but a launch of such a page size that cannot make the tensor maps is an error instead of gathering.
# consumers_d64: consumer warpgroups (64 query rows each) at head_dim 64: 3 (a 192-row tile, KV blocks of
# SM90_KV_BLOCK_3WG tokens, registers 160 per consumer thread) or 2 (128 rows, as at the other head dims).
# kv_block / kv_stages: KV tokens per stage of ragged KV and pipeline stages (0: the tables', and 2 stages, 4
# with three consumer warpgroups: H200, d64 causal b16 x 2048, 360.5 / 362.3 / 366.1 TFLOP/s with 2 / 3 / 4).
# q_buffers: query tiles in shared memory (1; 2: the producer loads the next tile's queries while this tile's
# blocks run; H200, paged d128 tiles of 1 / 2 / 8 KV blocks: 7.5 / 9.3 / 19.3 us against 7.2 / 9.0 / 19.4 with one).
# tile_search: how the consumer warps find an item's request (0: one thread's binary search over qo_indptr, one
# dependent load per halving; 1: each warp probes 32 entries at once, one load round trip per 32-fold cut; H200,
# paged d128 one-block tiles 7.55 -> 7.20 us).
# stage_o: 1 writes a 16-bit output through shared memory (each warp's 16 rows, 64 columns at a time, then
# 16-byte stores of whole row segments) where its 2 KiB per consumer warp fit, 0 stores the accumulator's pairs.
# lazy_rescale: the softmax keeps a row's running max while a block's is at most this much above it (log2 units;
# the exponentials then stay below 2^lazy_rescale), and a warp whose rows all kept theirs skips O's rescale;
# 0 rescales at every new max. trace: 1 (development) stamps each block's phases (tools/trace_prefill.py).
# row_sum_mma: 1 lets the P V GEMM sum P's rows (8 more columns reading a 2 KiB block of ones) where head_dim_vo is
# in ROW_SUM_MMA_DIMS, instead of one add per probability in softmax (64 of a d64 block loop's 444 instructions per
# thread); the sums are then of the 16-bit P that O's numerator takes (LSE within 2^-9 relative of the fp32 sum's).
# max_chains: independent chains of maxima per row and thread in softmax (1: one chain through all kBN / 4 of a
# thread's scores of a row, whose length the exponentials wait on; 2, 4, 8: shorter chains, more registers live).
# pv_overlap: 1 puts the 16-bit block loop's softmax in a basic block of its own, so that ptxas keeps the wait for the
# previous block's P V after it (0: ptxas hoists that wait above the softmax, which then starts only once P V is
# done; 2: the fp8 kernel's too). H200, 2026-12-05 (c), events: d128 causal b8 x 4096 -1 to -3%, non-causal -0.6%,
# paged within noise; the fp8 kernel 2-4% slower with it (1389-1403 -> 1423-1441 us), so 1 leaves it out.
# wg_skip: 1 (causal or a sliding window, no custom mask, query heads not packed into the tile: its warpgroups hold 64
# consecutive tokens each) lets each consumer warpgroup skip the KV blocks outside its own rows' keys, which only the tile's other
# rows need (d64 causal b16 x 2048: 10% of the warpgroups' blocks); 0 computes them masked (the same bits).
# producer_regs: the producer warpgroup's registers beside two consumer warpgroups, which share the rest of 168 x 384
# (0: sm90_layout's rule; 24 to 120 in steps of 8; three consumer warpgroups keep it at 24).
SM90_TUNING: dict[str, int] = {"gather_sync": 0, "gather_l2": 0, "paged_kv_block": 0, "soft_cap_tanh": 1,
                               "paged_tma": 1, "consumers_d64": 3, "kv_block": 0, "kv_stages": 0,
                               "q_buffers": 1, "tile_search": 1, "stage_o": 1, "lazy_rescale": 8, "trace": 0,
                               "row_sum_mma": 0, "max_chains": 1, "pv_overlap": 1, "wg_skip": 1, "producer_regs": 0}
ROW_SUM_MMA_DIMS = (64,)  # the wgmma_sm90.cuh row-sum wrappers' N (tools/gen_wgmma.py ROW_SUM_NS)
_ONES_BYTES = 16 * 128  # row_sum_mma's block of ones: one k-step (16 rows) of a 64-column block


def _sm90_tuning_override() -> None:
    """``JITATTN_DEV_SM90_TUNING`` (development only, e.g. '{"gather_sync": 1}'): overrides of
    ``SM90_TUNING`` that every process of a run (the test suite's parallel pre-build too) renders
    with; each tuning is its own source, so its own cache entry."""
    raw = os.environ.get("JITATTN_DEV_SM90_TUNING", "").strip()
    if not raw:
        return
    try:
        override = json.loads(raw)
    except json.JSONDecodeError as e:
        raise ValueError(f"JITATTN_DEV_SM90_TUNING={raw!r} is not JSON ({e}); e.g. '{{\"gather_sync\": 1}}'") from e
    if not isinstance(override, dict) or not set(override) <= set(SM90_TUNING) or \
            not all(isinstance(v, int) for v in override.values()):
        raise ValueError(f"JITATTN_DEV_SM90_TUNING={raw!r}: an object of int values with keys in {sorted(SM90_TUNING)}")
    SM90_TUNING.update(override)


_sm90_tuning_override()


def sm90_unsupported(spec: VariantSpec) -> str | None:
    """Why the sm90 tier cannot run ``spec`` (None when it can)."""
    if spec.target is not Target.CUDA:
        return "it is a cuda kernel"
    if spec.q_dtype is not None and spec.q_dtype.is_fp8:
        return _fp8_unsupported(spec)
    if spec.q_dtype not in (DType.F16, DType.BF16) or spec.kv_dtype != spec.q_dtype:
        return "it takes one 16-bit dtype (f16 or bf16) for q and kv, or one fp8 dtype for q, k and v"
    if spec.o_dtype not in (DType.F16, DType.BF16, DType.F32):
        return "it writes a 16-bit or float32 output"
    if (spec.head_dim_qk, spec.head_dim_vo) not in SM90_HEAD_DIMS:
        return f"it takes (head_dim_qk, head_dim_vo) in {list(SM90_HEAD_DIMS)}"
    if spec.head_dim_qk != spec.head_dim_vo and spec.kv_storage is KVStorage.PAGED:
        return "it takes head_dim_qk != head_dim_vo over ragged KV only"
    if spec.pos_encoding not in (PosEncoding.NONE, PosEncoding.ALIBI):
        return "it has no in-kernel RoPE yet"
    if spec.pos_encoding is PosEncoding.ALIBI and spec.use_logits_soft_cap:
        return "it applies ALiBi only without a soft cap (the cap would act on the biased logits)"
    v = spec.variant
    if v is not None and (not v.use_softmax or v.query_transform or v.key_transform):
        return "it runs custom variants with a softmax and without query / key transforms only"
    if v is not None and (spec.use_logits_soft_cap or spec.pos_encoding is PosEncoding.ALIBI):
        return "it runs custom variants without a soft cap or ALiBi only"
    return None


def _fp8_unsupported(spec: VariantSpec) -> str | None:
    """Why the sm90 tier cannot run ``spec``, whose query is fp8 (None when it can): the fp8 kernel takes k and v
    of the query's dtype, ragged or paged (pages TMA loads: a launch of other page sizes is refused), at head_dim 128 (a row is one 128-byte swizzle atom; at 256 the accumulators of O
    and of a 128-key block of S overflow the consumers' registers: ptxas serializes the wgmmas), with no custom
    mask, in-kernel RoPE or custom variant."""
    if spec.kv_dtype != spec.q_dtype:
        return "an fp8 query takes k and v of its own fp8 dtype"
    if spec.o_dtype not in (DType.F16, DType.BF16, DType.F32):
        return "it writes a 16-bit or float32 output"
    if (spec.head_dim_qk, spec.head_dim_vo) != (128, 128):
        return "it takes an fp8 query at head_dim 128"
    if spec.mask_mode is MaskMode.CUSTOM or spec.variant is not None:
        return "it takes an fp8 query without a custom mask or variant"
    if spec.pos_encoding not in (PosEncoding.NONE, PosEncoding.ALIBI):
        return "it has no in-kernel RoPE"
    if spec.pos_encoding is PosEncoding.ALIBI and spec.use_logits_soft_cap:
        return "it applies ALiBi only without a soft cap (the cap would act on the biased logits)"
    return None


def sm90_pack(spec: VariantSpec, tile_rows: int = 128) -> int:
    """Query heads packed into a tile's rows: the whole GQA group when it divides the 128-row tile
    and head_dim >= 128, else 1. Measured on the H200 (docs/kernels/sm90_prefill.md, run 5; TFLOP/s packed vs not):
    d128 causal b8x4096 586 vs 540, ragged 587 vs 532, 16 queries x 4096 keys 170 vs 78; d256 573
    vs 570; but d64 causal b16x2048 289 vs 330, so head_dim 64 stays unpacked."""
    return spec.group_size if tile_rows % spec.group_size == 0 and spec.head_dim_qk >= 128 else 1


_SM90_SMEM = 227 << 10  # shared memory one block may take on sm_90a
_STAGE_O_WARP_BYTES = 16 * 64 * 2  # stage_o: a consumer warp's 16 rows x 64 columns of a 16-bit output


def _check_tuning(tuning: dict[str, int]) -> None:
    """Raise on an SM90_TUNING value the tier has no code for."""
    if tuning["gather_sync"] not in (0, 1, 2, 3) or tuning["gather_l2"] not in (0, 64, 128, 256) or \
            tuning["soft_cap_tanh"] not in (0, 1) or tuning["paged_tma"] not in (0, 1, 2) or \
            tuning["consumers_d64"] not in (2, 3) or tuning["q_buffers"] not in (1, 2) or \
            tuning["tile_search"] not in (0, 1) or tuning["stage_o"] not in (0, 1) or \
            tuning["lazy_rescale"] not in range(0, 16) or tuning["trace"] not in (0, 1) or \
            tuning["row_sum_mma"] not in (0, 1) or tuning["max_chains"] not in (1, 2, 4, 8) or \
            tuning["wg_skip"] not in (0, 1) or tuning["pv_overlap"] not in (0, 1, 2) or \
            tuning["producer_regs"] not in (0, *range(24, 121, 8)):
        raise ValueError(f"SM90_TUNING={tuning}: gather_sync takes 0 to 3, gather_l2 0, 64, 128 or 256, "
                         "soft_cap_tanh 0 or 1, paged_tma 0 to 2, consumers_d64 2 or 3, q_buffers 1 or 2, "
                         "tile_search / stage_o / trace / row_sum_mma / wg_skip 0 or 1, pv_overlap 0 to 2, "
                         "max_chains 1, 2, 4 or 8, lazy_rescale 0 to 15 and producer_regs 0 or 24 to 120 by 8")


def _producer_regs(spec: VariantSpec, consumers: int, paged: bool, fp8: bool) -> int:
    """Registers per producer thread: 24 (56 when it transposes fp8 V: at 40 its per-thread addresses and the item's
    state spill around the transpose; 56 for paged KV up to head_dim 128 beside two consumer warpgroups: at 24 its
    page ids and box operands spill, at 56 nothing, and d256's consumers would spill at the 224 left to them; ragged
    KV at 40 removes its producer's spills but was no faster, docs/kernels/sm90_prefill.md), or
    SM90_TUNING's producer_regs. The consumers share the rest of the launch's 168 x 384 (multiples of 8); three
    consumer warpgroups take 160 each, leaving the producer 24."""
    if consumers == 3:
        return 24
    if SM90_TUNING["producer_regs"]:
        return SM90_TUNING["producer_regs"]
    return 56 if fp8 or (paged and spec.head_dim_vo <= 128) else 24


def _kv_block(dim: int, consumers: int, paged: bool, fp8: bool) -> int:
    """KV tokens per stage: the tables', or SM90_TUNING's kv_block / paged_kv_block."""
    # three consumers: S, the last block's P and O in 160 registers, so KV blocks of 128
    paged_block, ragged_block = (SM90_KV_BLOCK_3WG, SM90_KV_BLOCK_3WG) if consumers == 3 else \
        (SM90_PAGED_KV_BLOCK.get(dim), SM90_KV_BLOCK[dim])  # (no paged KV at head_dim_qk 192)
    if fp8:  # V^T's rows: one 128-byte swizzle atom of keys (the P V GEMM's K-major B)
        ragged_block = SM90_FP8_KV_BLOCK
    bn = (SM90_TUNING["paged_kv_block"] or paged_block) if paged else (SM90_TUNING["kv_block"] or ragged_block)
    if bn not in (64, 80, 96, 128, 176, 192, 256):  # the wgmma N of wgmma_sm90.cuh
        raise ValueError(f"SM90_TUNING kv_block / paged_kv_block={bn}: take one of 64, 80, 96, 128, 176, 192, 256")
    if fp8 and bn != 128:  # (V^T's atoms take 256 too, but S's 256 columns and O overflow the registers)
        raise ValueError(f"SM90_TUNING kv_block={bn}: an fp8 query takes KV blocks of 128")
    return bn


def sm90_layout(spec: VariantSpec) -> dict[str, int]:
    """Every derived constant of the sm90 prefill kernel for ``spec`` (plain ints)."""
    reason = sm90_unsupported(spec)
    if reason is not None:
        raise ValueError(f"{spec.uri}: the sm90 prefill tier cannot run this spec: {reason}")
    dim = spec.head_dim_qk
    paged = spec.kv_storage is KVStorage.PAGED
    tuning = SM90_TUNING
    _check_tuning(tuning)
    consumers = tuning["consumers_d64"] if dim == 64 else 2
    bm, stages = 64 * consumers, tuning["kv_stages"] or (4 if consumers == 3 else 2)
    fp8 = spec.q_dtype.is_fp8
    elem = spec.q_dtype.itemsize
    bn = _kv_block(dim, consumers, paged, fp8)
    if not 2 <= stages <= 8:
        raise ValueError(f"SM90_TUNING kv_stages={stages}: take 2 to 8")
    box = 128 // elem  # columns of one 128-byte TMA box (64 16-bit, 128 fp8 values)
    chunks, chunks_v = dim // box, spec.head_dim_vo // box  # boxes per q / k row, per v row
    q_chunk, kv_chunk = bm * 128, bn * 128   # bytes of one box
    q_bytes, k_bytes, v_bytes = chunks * q_chunk, chunks * kv_chunk, chunks_v * kv_chunk
    vt_bytes = spec.head_dim_vo * bn if fp8 else 0  # fp8: V^T of a stage, written by the producer warps
    ring = 4                                 # item slots: how far the item taker may run ahead of its readers
    row_sum = bool(tuning["row_sum_mma"]) and spec.head_dim_vo in ROW_SUM_MMA_DIMS and not fp8

    def smem_of(q_bufs: int, stage_o: bool) -> dict[str, int]:
        off_k = q_bufs * q_bytes
        off_v = off_k + stages * k_bytes
        off_vt = off_v + stages * v_bytes
        off_bar = off_vt + stages * vt_bytes
        # per query buffer q full (TMA), full (gathered), empty; k, v full/empty per stage (fp8: v full / empty
        # are V^T's, and the TMA's V has a full / empty pair more); item full/empty per slot
        barriers = 3 * q_bufs + (6 if fp8 else 4) * stages + 2 * ring
        off_items = off_bar + _ceil(8 * barriers, 16)
        off_tab = off_items + _ceil(8 * ring, 16)
        tab_bytes = 2 * bn * 16 if paged else 0  # paged: two tables (block parity) of (k, v) int64 row offsets
        off_live = off_tab + tab_bytes
        # custom mask: each stage's block state, then the blocks each query buffer's tile walks (tile_blocks)
        live_bytes = _ceil(4 * stages + 4 * q_bufs, 16) if spec.mask_mode is MaskMode.CUSTOM else 0
        off_stage_o = _ceil(off_live + live_bytes, 128)
        stage_o_bytes = 4 * consumers * _STAGE_O_WARP_BYTES if stage_o else 0
        # row_sum_mma's ones after every V stage (the P V descriptors' lbo reaches them forward), 1 KiB aligned
        off_ones = _ceil(off_stage_o + stage_o_bytes, 1024) if row_sum else 0
        end = off_ones + _ONES_BYTES if row_sum else off_stage_o + stage_o_bytes
        return {"kQBufs": q_bufs, "kOffK": off_k, "kOffV": off_v, "kOffVt": off_vt, "kOffBar": off_bar,
                "kOffItems": off_items,
                "kOffTab": off_tab, "kOffLive": off_live, "kStageO": int(stage_o), "kOffStageO": off_stage_o,
                "kOffOnes": off_ones, "kOnesBytes": _ONES_BYTES if row_sum else 0,
                "kSmemBytes": end + 1024}  # + slack to align the base to 1 KiB (swizzle atoms)

    sixteen_bit_o = spec.o_dtype in (DType.F16, DType.BF16)
    offsets = smem_of(tuning["q_buffers"], bool(tuning["stage_o"]) and sixteen_bit_o)
    if offsets["kStageO"] and offsets["kSmemBytes"] > _SM90_SMEM:
        offsets = smem_of(tuning["q_buffers"], False)  # no room to stage the output: its pairs stored from registers
    if offsets["kSmemBytes"] > _SM90_SMEM:
        raise ValueError(f"{spec.uri}: the sm90 tile needs {offsets['kSmemBytes']} B of shared memory, over 227 KiB "
                         f"(KV block {bn}, {offsets['kQBufs']} query buffers)")
    # lazy rescale lets P reach 2^lazy_rescale: an e4m3 P saturates at 448, so at most 2^8 there
    lazy = min(tuning["lazy_rescale"], 8) if spec.q_dtype is DType.E4M3 else tuning["lazy_rescale"]
    producer_regs = _producer_regs(spec, consumers, paged, fp8)
    return {
        "kThreads": 128 * (1 + consumers), "kProducerRegs": producer_regs,
        "kConsumerRegs": (168 * 384 - 128 * producer_regs) // 256 // 8 * 8 if consumers == 2 else 160,
        "kBM": bm, "kBN": bn, "kD": dim, "kDV": spec.head_dim_vo, "kStages": stages, "kChunks": chunks,
        "kChunksV": chunks_v, "kGroup": spec.group_size, "kPackG": sm90_pack(spec, bm),
        "kFp8": int(fp8), "kBoxCols": box, "kKSteps": dim * elem // 32, "kPvSteps": bn // (32 if fp8 else 16),
        "kVtBytes": vt_bytes,
        "kQChunkBytes": q_chunk, "kKVChunkBytes": kv_chunk, "kQBytes": q_bytes, "kKBytes": k_bytes, "kVBytes": v_bytes,
        "kOffQ": 0, "kItemRing": ring, **offsets, "kTileSearch": tuning["tile_search"],
        "kLazyRescale": lazy, "kRowSumMma": int(row_sum),
        "kMaxChains": tuning["max_chains"],
        "kPvOverlap": int(tuning["pv_overlap"] > (1 if fp8 else 0)),
        "kWgSkip": int(bool(tuning["wg_skip"]) and spec.mask_mode is not MaskMode.CUSTOM and sm90_pack(spec, bm) == 1
                       and (spec.mask_mode is MaskMode.CAUSAL or spec.use_sliding_window)),
        "kGatherSync": tuning["gather_sync"], "kGatherL2": tuning["gather_l2"],
        "kSoftCapTanh": tuning["soft_cap_tanh"] if spec.use_logits_soft_cap else 0,  # other specs' sources unchanged
        "kPagedTma": (max(1, tuning["paged_tma"]) if fp8 else tuning["paged_tma"]) if paged else 0,  # fp8: no gathers
    }


def sm90_context(spec: VariantSpec) -> dict[str, Any]:
    layout = sm90_layout(spec)
    constants = [("int", name, str(value)) for name, value in layout.items()]
    constants.append(("bool", "kCausal", "true" if spec.mask_mode is MaskMode.CAUSAL else "false"))
    constants.append(("bool", "kPaged", "true" if spec.kv_storage is KVStorage.PAGED else "false"))
    constants.append(("bool", "kSwa", "true" if spec.use_sliding_window else "false"))
    constants.append(("bool", "kSoftCap", "true" if spec.use_logits_soft_cap else "false"))
    constants.append(("bool", "kAlibi", "true" if spec.pos_encoding is PosEncoding.ALIBI else "false"))
    constants.append(("bool", "kCustom", "true" if spec.mask_mode is MaskMode.CUSTOM else "false"))
    constants.append(("bool", "kVariant", "true" if spec.variant is not None else "false"))
    constants.append(("float", "kLog2e", repr(_LOG2E) + "f"))
    return {**_attention_context(spec), "constants": constants, "smem_bytes": layout["kSmemBytes"],
            "trace": bool(SM90_TUNING["trace"]), "custom_mask": spec.mask_mode is MaskMode.CUSTOM}


# The layout the custom-mask kernels' mask_states writes into the workspace (the template's kStatesHeader): a 16-byte
# header (int32 [0]: the states per row), then a row per virtual tile of the launch's items (tile_base): an int32, one
# past the last KV block some query of the tile sees (0: none), then a byte per KV block as many as the most KV
# blocks of a request rounded up to 4; then 8 spare bytes.
MASK_STATES_HEADER = 16


def mask_states_bytes(spec: VariantSpec, qo_lens: list[int], kv_lens: list[int]) -> int:
    """Workspace bytes a custom-mask launch of this tier needs for its blocks' states (0 without a custom mask): with
    fewer the kernel classifies each block from the mask rows itself (exact, slower)."""
    if spec.mask_mode is not MaskMode.CUSTOM or not qo_lens:
        return 0
    layout = sm90_layout(spec)
    virtual_tiles = len(qo_lens) + sum(qo_lens) * layout["kPackG"] // layout["kBM"]
    most_blocks = max((-(-k // layout["kBN"]) for k in kv_lens), default=0)
    stride = -(-most_blocks // 4) * 4  # rows of whole 4-byte words, and 8 spare bytes past the last row
    return MASK_STATES_HEADER + virtual_tiles * (4 + stride) + 8

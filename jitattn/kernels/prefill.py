"""Prefill kernels: many query tokens per request over a ragged or paged KV.

The cpu target shares the generic attention kernel with decode (every axis
but the dtypes at run time); the cuda target compiles its own template
(``templates/cuda/prefill.cu.jinja``), whose every derived constant -- tile
sizes, warps, pipeline stages, shared-memory layout, swizzle -- is computed
here by ``cuda_layout`` and handed to the template as a flat constant list.

cuda kernel shape (sm80+ generic tier: ``mma.sync.m16n8k16``, fp32 accumulate):

- A thread block of ``warps`` warps owns a tile of ``cta_q`` query *rows* of
  one request and one KV head; row = (query token, head in the GQA group), so
  row ``rho`` of a request is token ``rho // group``, query head
  ``kv_head * group + rho % group``. Each warp owns ``16 * mma_q`` rows.
- KV is walked in blocks of ``cta_kv`` tokens (64, else 32, else 16: the widest whose
  shared memory fits two resident blocks per SM; failing that, one block per SM
  under the opt-in limit) through a ``stages``-deep
  ``cp.async`` pipeline into XOR-swizzled (or odd-padded) shared memory; the
  row offsets of each block (page-table lookups for paged KV) are fetched one
  iteration ahead into a small table. ``ldmatrix`` feeds the tensor cores;
  online softmax runs in fp32 in the log2 domain. Causal / window blocks no
  query row can see are skipped; only blocks on a boundary are masked.
- head_dim is padded to a multiple of 16 inside shared memory only (the
  padded columns are zero-filled by ``cp.async``, never read from memory).
- fp8 KV lands raw and is converted to the query dtype in shared memory; RoPE
  rotates Q (once per tile) and each K block in shared memory in fp32, and a
  custom variant's query / key transforms run after it, in place, in fp32.
  With bf16 and RoPE or such a transform the values are kept as hi + lo bf16
  pairs and q.k is three MMAs (hi.hi + hi.lo + lo.hi): a single bf16 rounding
  after the rotation costs ~4e-3 in the logits, which the LSE cannot afford.
- Work mapping, with no host-side work list and no total query count on the
  host: a persistent grid (SMs x resident blocks) walks *virtual tiles*.
  Request r's tiles start at ``base(r) = r + (qo_indptr[r] * group) // cta_q``
  (strictly increasing, and ``base(r+1) - base(r)`` is at least r's tile
  count), so a virtual tile finds its request by a binary search over
  ``qo_indptr``; the few virtual tiles past a request's last tile are empty.
  Items are (virtual tile, kv head), kv head fastest; within a request the
  tiles run last (the most causal work) first. Blocks take items from an
  atomic counter (dynamic, balanced: a static order left 22% of the causal
  benchmark idle); the counter is a slot of a module-global array that the
  launch's last block resets, one slot per stream (launches on a stream are
  ordered) and one per launch captured into a CUDA graph. With no slot free,
  or on the per-thread default stream, blocks take a static snake order.
  The grid size does not depend on the batch, so a captured launch replays
  correctly after a re-plan.

The Hopper tier (sm_90a: TMA, wgmma, warp specialisation) is ``jitattn.kernels.prefill_sm90``; ``tier`` and
``select`` below choose between the two.
"""

from __future__ import annotations

from typing import Any, Callable

import functools

from .. import env, hardware
from ..abi import Entry
from ..spec import DType, KVStorage, MaskMode, PosEncoding, Target, VariantSpec
from .attention import context as _attention_context
from .attention import entries as _attention_entries
from .attention import explain_build_error  # noqa: F401  (the family interface)
from .prefill_sm90 import TEMPLATE_SM90, sm90_context, sm90_unsupported

TEMPLATES = {"cpu": "cpu/attention.cpp.jinja", "cuda": "cuda/prefill.cu.jinja"}

# Tuning knobs of the cuda layout. The benchmark may override entries (it
# renders distinct sources, hence distinct cache entries); nothing else should.
TUNING: dict[str, int] = {
    "warps": 4,
    "stages": 2,
    "blocks_per_sm": 2,          # resident blocks the layout is sized for (registers and shared memory)
    "smem_per_sm": 227 << 10,    # usable shared memory per SM (H100/H200: 227 KiB; A100: 163 KiB)
    "mma_q_max_dim": 128,        # head dims up to this get 32 rows per warp (two m16 tiles)
}

_LOG2E = 1.4426950408889634


def _ceil(n: int, m: int) -> int:
    return -(-n // m) * m


def _row_chunks(dim_pad: int) -> tuple[int, bool]:
    """(16-byte chunks per shared-memory row, swizzled?) for a row of ``dim_pad`` 16-bit elements."""
    chunks = dim_pad // 8
    if chunks % 8 == 0:
        return chunks, True
    return (chunks + 1 if chunks % 2 == 0 else chunks), False


_CTA_KV_CHOICES = (64, 32, 16)  # KV tokens per block, widest first (16: the smallest, one k16 step of P.V)


def _smem_budget(smem_per_sm: int, blocks_per_sm: int) -> int:
    return smem_per_sm // blocks_per_sm - 1024  # the runtime reserves 1 KiB per block


def _fit(smem_for: Callable[[int], dict[str, int]], smem_per_sm: int,
         blocks_per_sm: int) -> tuple[int, int, dict[str, int] | None]:
    """(resident blocks, cta_kv, smem offsets) of the first fitting choice; offsets None if none fits."""
    for blocks in sorted({blocks_per_sm, 1}, reverse=True):
        for cta_kv in _CTA_KV_CHOICES:
            smem = smem_for(cta_kv)
            if smem["Total"] <= _smem_budget(smem_per_sm, blocks):
                return blocks, cta_kv, smem
    return 1, _CTA_KV_CHOICES[-1], None


def query_tile_rows(head_dim_qk: int, head_dim_vo: int, tuning: dict[str, int] | None = None) -> int:
    """Query rows (token, head-in-group pairs) one cuda thread block owns: ``cta_q``."""
    t = {**TUNING, **(tuning or {})}
    mma_q = 2 if max(_ceil(head_dim_qk, 16), _ceil(head_dim_vo, 16)) <= t["mma_q_max_dim"] else 1
    return t["warps"] * 16 * mma_q


def cuda_layout(spec: VariantSpec, tuning: dict[str, int] | None = None) -> dict[str, int]:
    """Every derived constant of the cuda prefill kernel for ``spec`` (plain ints)."""
    t = dict(TUNING)
    if tuning:
        t.update(tuning)
    dqk, dvo, group = spec.head_dim_qk, spec.head_dim_vo, spec.group_size
    kv_fp8 = spec.kv_dtype.is_fp8
    rope = spec.pos_encoding is PosEncoding.ROPE_LLAMA
    qk_transform = spec.variant is not None and bool(spec.variant.query_transform or spec.variant.key_transform)
    split = (rope or qk_transform) and spec.q_dtype is DType.BF16
    warps = t["warps"]
    threads = 32 * warps
    dqk_pad, dvo_pad = _ceil(dqk, 16), _ceil(dvo, 16)
    qk_rc, qk_sw = _row_chunks(dqk_pad)
    vo_rc, vo_sw = _row_chunks(dvo_pad)
    cta_q = query_tile_rows(dqk, dvo, t)
    mma_q = cta_q // (warps * 16)
    stages = t["stages"]

    def smem_for(cta_kv: int) -> dict[str, int]:
        sizes = {
            "Q": cta_q * qk_rc * 16,
            "QLo": cta_q * qk_rc * 16 if split else 0,
            "K": stages * cta_kv * (dqk if kv_fp8 else qk_rc * 16),
            "V": stages * cta_kv * (dvo if kv_fp8 else vo_rc * 16),
            "Kc": cta_kv * qk_rc * 16 if kv_fp8 else 0,
            "KcLo": cta_kv * qk_rc * 16 if split else 0,
            "Vc": cta_kv * vo_rc * 16 if kv_fp8 else 0,
            "Tab": 2 * cta_kv * 16,
            "Freq": _ceil(dqk // 2 * 8, 16) if rope else 0,
        }
        offsets, at = {}, 0
        for name, size in sizes.items():  # Kc, KcLo, Vc are contiguous: zeroed once as one range
            offsets[name] = at
            at += _ceil(size, 16)
        offsets["Zero"], offsets["ZeroEnd"] = offsets["Kc"], offsets["Tab"]
        offsets["QLoEnd"] = offsets["QLo"] + sizes["QLo"]
        offsets["Total"] = at
        return offsets

    # The widest KV block that fits the resident-block target; the largest tiles (head_dim 256,
    # bf16 hi + lo pairs, fp8 staging) take narrower blocks first, keeping two blocks per SM to
    # hide each other's softmax, then one block per SM (the launch raises the opt-in limit).
    blocks_per_sm, cta_kv, smem = _fit(smem_for, t["smem_per_sm"], t["blocks_per_sm"])
    if smem is None:
        need = smem_for(_CTA_KV_CHOICES[-1])["Total"]
        raise ValueError(f"{spec.uri}: the prefill tile needs {need} B of shared memory, over "
                         f"{_smem_budget(t['smem_per_sm'], 1)}")

    kv_bytes = spec.kv_dtype.itemsize
    load_bytes = 8 if kv_fp8 else 16       # one cp.async: 8 elements
    k_load_chunks = dqk // 8 if kv_fp8 else dqk_pad // 8   # 16-bit rows also zero-fill the padded chunks
    v_load_chunks = dvo // 8 if kv_fp8 else dvo_pad // 8
    q_load_chunks = dqk_pad // 8
    layout = {
        "kThreads": threads, "kWarps": warps, "kMinBlocks": blocks_per_sm,
        "kMmaQ": mma_q, "kCtaQ": cta_q, "kCtaKV": cta_kv, "kStages": stages, "kGroup": group,
        "kDQK": dqk, "kDVO": dvo, "kDQKPad": dqk_pad, "kDVOPad": dvo_pad,
        "kQKRowChunks": qk_rc, "kVORowChunks": vo_rc,
        "kKVBytes": kv_bytes, "kLoadBytes": load_bytes,
        "kQLoadChunks": q_load_chunks, "kKLoadChunks": k_load_chunks, "kVLoadChunks": v_load_chunks,
        "kKStageBytes": cta_kv * (dqk if kv_fp8 else qk_rc * 16),
        "kVStageBytes": cta_kv * (dvo if kv_fp8 else vo_rc * 16),
        "kSmemBytes": smem["Total"],
    }
    for name in ("Q", "QLo", "K", "V", "Kc", "KcLo", "Vc", "Tab", "Freq", "Zero", "ZeroEnd", "QLoEnd"):
        layout["kOff" + name] = smem[name]
    flags = {"kQKSwizzle": qk_sw, "kVOSwizzle": vo_sw, "kSplitQK": split}
    return {**layout, **{k: int(v) for k, v in flags.items()}}


def _cuda_context(spec: VariantSpec, tuning: dict[str, int] | None = None) -> dict[str, Any]:
    layout = cuda_layout(spec, tuning)
    bool_names = {"kQKSwizzle", "kVOSwizzle", "kSplitQK"}
    flags = {
        "kKVFp8": spec.kv_dtype.is_fp8,
        "kRope": spec.pos_encoding is PosEncoding.ROPE_LLAMA,
        "kAlibi": spec.pos_encoding is PosEncoding.ALIBI,
        "kSwa": bool(spec.use_sliding_window),
        "kSoftCap": bool(spec.use_logits_soft_cap),
        "kCausal": spec.mask_mode is MaskMode.CAUSAL,
        "kCustom": spec.mask_mode is MaskMode.CUSTOM,
        "kPaged": spec.kv_storage is KVStorage.PAGED,
    }
    constants = [("int", name, str(value)) for name, value in layout.items() if name not in bool_names]
    constants += [("bool", name, "true" if layout[name] else "false") for name in sorted(bool_names)]
    constants += [("bool", name, "true" if value else "false") for name, value in flags.items()]
    constants.append(("int", "kPosCode", str({PosEncoding.NONE: 0, PosEncoding.ROPE_LLAMA: 1,
                                              PosEncoding.ALIBI: 2}[spec.pos_encoding])))
    constants.append(("float", "kLog2e", repr(_LOG2E) + "f"))
    return {
        "constants": constants,
        "smem_bytes": layout["kSmemBytes"],
    }


def context(spec: VariantSpec) -> dict[str, Any]:
    ctx = _attention_context(spec)
    if spec.target is Target.CUDA:
        ctx.update(_cuda_context(spec))
    return ctx


# ---- the tier: sm80 or sm90 ----------------------------------------------------------------

def tier(spec: VariantSpec, archs: tuple[str, ...] | None) -> str:
    """The cuda prefill tier for ``spec`` built for ``archs`` (None: unknown): ``"sm90"`` or ``"sm80"``.

    ``JITATTN_PREFILL_TIER``: ``auto`` (default) takes sm90 when every arch is 9.0a and the spec
    is supported; ``sm80`` always the generic tier; ``sm90`` the Hopper tier for every supported
    spec, also when the arch list is unknown (a ``ValueError`` when it names another arch).
    """
    choice = env.prefill_tier()
    if spec.q_dtype is not None and spec.q_dtype.is_fp8:
        return _fp8_tier(spec, archs, choice)
    if choice == "sm80" or spec.target is not Target.CUDA:
        return "sm80"
    if choice == "sm90" and archs is not None and not hardware.hopper_only(archs):
        raise ValueError(f"JITATTN_PREFILL_TIER=sm90 needs a 9.0a-only CUDA arch list, not {';'.join(archs)!r}: "
                         "set JITATTN_CUDA_ARCH_LIST=9.0a (H100/H200) or JITATTN_PREFILL_TIER=auto")
    if sm90_unsupported(spec) is not None:
        return "sm80"
    if choice == "sm90":
        return "sm90"
    return "sm90" if archs is not None and hardware.hopper_only(archs) else "sm80"


def _fp8_tier(spec: VariantSpec, archs: tuple[str, ...] | None, choice: str) -> str:
    """``tier`` of a spec whose query is fp8: only the sm90 tier runs one (an unknown arch list is taken as Hopper)."""
    reason = sm90_unsupported(spec)
    if reason is None and choice != "sm80" and (archs is None or hardware.hopper_only(archs)):
        return "sm90"
    why = reason or ("JITATTN_PREFILL_TIER is sm80" if choice == "sm80" else
                     f"the CUDA arch list {';'.join(archs)!r} is not 9.0a only")
    raise ValueError(f"{spec.uri}: an fp8 query runs on the sm90 prefill tier only (H100 / H200, a 9.0a arch "
                     f"list), but {why}; pass 16-bit q, k and v (single_prefill_with_kv_cache converts fp8 ones)")


def resident_blocks(spec: VariantSpec) -> int:
    """Blocks per SM the prefill kernel of ``spec`` keeps resident (what a split over SMs fills): one on
    the sm90 tier (a persistent grid of one block per SM), the layout's ``kMinBlocks`` on the sm80 tier."""
    if spec.target is not Target.CUDA:
        return TUNING["blocks_per_sm"]
    # no GPU and no arch list (None): nothing will launch; the generic tier's figure
    return _resident_blocks(spec, hardware.known_arch_list(), env.prefill_tier())


@functools.lru_cache(maxsize=256)
def _resident_blocks(spec: VariantSpec, archs: tuple[str, ...] | None, choice: str) -> int:
    """``resident_blocks`` for a given arch list and tier knob (``choice``: part of the key only)."""
    return 1 if tier(spec, archs) == "sm90" else cuda_layout(spec)["kMinBlocks"]


def entries(spec: VariantSpec) -> tuple[Entry, ...]:
    """The family hook: ``attention``; a custom-mask module of the sm90 tier also ``mask_states`` (the blocks'
    states a plan writes once for its launches, ``kernels.prefill_sm90``), on the same params struct."""
    base = _attention_entries(spec)
    custom = spec.mask_mode is MaskMode.CUSTOM and spec.target is Target.CUDA
    if custom and tier(spec, hardware.known_arch_list()) == "sm90":
        return base + (Entry("mask_states", base[0].fields),)
    return base


def select(spec: VariantSpec, archs: tuple[str, ...] | None) -> tuple[str, dict[str, Any]]:
    """(template path, context) of ``spec``'s module for a build targeting ``archs`` (the family hook)."""
    if spec.target is Target.CUDA and tier(spec, archs) == "sm90":
        return TEMPLATE_SM90, sm90_context(spec)
    return TEMPLATES[spec.target.value], context(spec)

"""Every benchmark case of ``python -m jitattn.bench`` and the work it counts.

A case is plain data: its shapes, options and the bytes / FLOPs it must move
or compute, by the formulas below (tested in ``tests/test_bench.py``):

- decode bytes = (tokens of KV read) * H_kv * (D + D_vo) * bytes/elem + q bytes + o bytes,
  where a sliding window ``window_left = w`` reads ``min(kv_len, w + 1)`` tokens (D_vo: v's width, D's by default);
- prefill FLOPs = 2 * (unmasked (query, key) pairs, bottom-right causal) * H_q * (D + D_vo);
- cascade bytes = the shared prefix's KV once + each request's own KV (+ q and o);
- MLA FLOPs = 2 * B * H * L * (576 + 512); MLA bytes = B * L * 576 * bytes/elem (of the latent cache);
- ops (``ops_cases``): RoPE bytes = q and k read + written (+ positions); block-sparse FLOPs =
  4 * (nonzero blocks * R * C) * H_q * D; a mixed batch (POD, BatchAttention): its chunk's prefill FLOPs + its
  decodes' (4 * B * kv_len * H_q * D).

Names are ``suite/name``. ``small()`` shrinks a case for the cpu target (same
name, same shape of the problem, ~1/16 of the tokens); ``QUICK`` lists the
``--quick`` subset.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import random
from dataclasses import dataclass, field, replace
from typing import Union

from .units import CPU_SCALE, DTYPE_BYTES, div_at_least as _div, visible_keys_fast
from .ops_cases import (BSR_CASES, DENSE_PREFILL, FP8_CASES, MIXED_CASES, ROPE_CASES, BlockSparse, Fp8Prefill,
                        Mixed, Rope)

SUITES = ("decode", "prefill", "cascade", "variants", "mla", "jit", "ops")


# ---- Cases ---------------------------------------------------------------- #
@dataclass(frozen=True)
class Attn:
    """A decode (one query per request) or prefill batch over paged or ragged KV."""

    name: str
    op: str  # "decode" | "prefill"
    kv_lens: tuple[int, ...]
    qo_lens: tuple[int, ...] | None = None  # prefill only; None = one query per request (decode)
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    head_dim_vo: int | None = None  # v's and the output's (None: head_dim); another one for ragged prefill only
    page_size: int = 16
    storage: str = "paged"  # "paged" | "ragged" (prefill)
    dtype: str = "bf16"  # q and o
    kv_dtype: str = "bf16"
    causal: bool = False
    custom_mask: bool = False  # prefill: a custom mask (custom-mask kernel) of the pattern custom_mask_kind
    # "causal": the bottom-right causal pattern; "tree": speculative decoding's verification of a draft tree (each
    # request's queries are its last kv tokens; a query sees the keys before them, its tree ancestors and itself).
    # Either way the work is counted over the causal pattern's pairs (the blocks the kernel computes).
    custom_mask_kind: str = "causal"
    window_left: int = -1
    logits_soft_cap: float = 0.0
    pos_encoding: str = "NONE"  # "NONE" | "ROPE_LLAMA" | "ALIBI"
    plain: str | None = None  # the plain case it is compared with (variants; sink and batch-invariant twins)
    sdpa: bool = True  # compare with torch SDPA
    note: str = ""
    sinks: bool = False  # run(sinks=...): per-head attention sinks (the sink build of the kernel)
    batch_invariant: bool = False  # plan(batch_invariant=True): fixed split-KV chunks

    @property
    def suite(self) -> str:
        return self.name.split("/", 1)[0]

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def queries(self) -> tuple[int, ...]:
        return self.qo_lens if self.qo_lens is not None else (1,) * self.batch

    @property
    def kind(self) -> str:
        return "bandwidth" if self.op == "decode" else "compute"

    @property
    def kv_tokens_read(self) -> int:
        """Tokens of KV a decode step reads (inside the window when there is one)."""
        if self.window_left >= 0:
            return sum(min(n, self.window_left + 1) for n in self.kv_lens)
        return sum(self.kv_lens)

    @property
    def pairs(self) -> int:
        masked = self.causal or self.custom_mask  # the custom mask has the causal pattern
        return sum(visible_keys_fast(q, k, masked, self.window_left) for q, k in zip(self.queries, self.kv_lens))

    @property
    def bytes(self) -> int:
        """Decode: KV read (inside the window) + q + o. Prefill: K/V once + q + o (for reference)."""
        kv = DTYPE_BYTES[self.kv_dtype]
        qo = DTYPE_BYTES[self.dtype]
        tokens = self.kv_tokens_read if self.op == "decode" else sum(self.kv_lens)
        return tokens * self.num_kv_heads * (self.head_dim + self.dim_vo) * kv + \
            sum(self.queries) * self.num_qo_heads * (self.head_dim + self.dim_vo) * qo

    @property
    def dim_vo(self) -> int:
        return self.head_dim if self.head_dim_vo is None else self.head_dim_vo

    @property
    def flops(self) -> int:
        return 2 * self.pairs * self.num_qo_heads * (self.head_dim + self.dim_vo)

    def params(self) -> dict:
        out = {
            "op": self.op, "batch": self.batch, "heads_qo": self.num_qo_heads, "heads_kv": self.num_kv_heads,
            "head_dim": self.head_dim, **({"head_dim_vo": self.dim_vo} if self.dim_vo != self.head_dim else {}),
            "dtype": self.dtype, "kv_dtype": self.kv_dtype, "storage": self.storage,
            "page_size": self.page_size if self.storage == "paged" else None,
        }
        lens = sorted(set(self.kv_lens))
        out["kv_len"] = lens[0] if len(lens) == 1 else {"min": lens[0], "max": lens[-1], "total": sum(self.kv_lens)}
        if self.qo_lens is not None:
            qlens = sorted(set(self.qo_lens))
            out["qo_len"] = qlens[0] if len(qlens) == 1 else {"min": qlens[0], "max": qlens[-1], "total": sum(self.qo_lens)}
            out["causal"] = self.causal
        for key, default in (("custom_mask", False), ("custom_mask_kind", "causal"), ("window_left", -1),
                             ("logits_soft_cap", 0.0), ("pos_encoding", "NONE"), ("sinks", False),
                             ("batch_invariant", False)):
            if getattr(self, key) != default:
                out[key] = getattr(self, key)
        return out

    def small(self) -> "Attn":
        """~1/16 of the tokens (and of the requests) for the cpu target."""
        keep = _div(self.batch, 16 if self.op == "decode" else 8)
        kv = tuple(_div(n, CPU_SCALE, 8) for n in self.kv_lens[:keep])
        qo = tuple(_div(n, CPU_SCALE, 8) for n in self.qo_lens[:keep]) if self.qo_lens is not None else None
        window = (self.window_left + 1) // CPU_SCALE - 1 if self.window_left >= 0 else -1
        return dataclasses.replace(self, kv_lens=kv, qo_lens=qo, window_left=window)


@dataclass(frozen=True)
class Cascade:
    """Decode over a shared prefix + a unique tail per request, beside flat decode over the same pages.

    ``branches`` > 0: a three-level prefix tree (an agent's fork): the root ``shared_len`` shared by all,
    then ``branches`` nodes of ``branch_len`` tokens each shared by ``batch / branches`` requests, then
    the tails; the case then also times the two-level cascade of the same pages (row ``NAME:two_level``:
    each branch's requests share root + branch as one node, so the root is read once per branch)."""

    name: str
    batch: int
    shared_len: int
    unique_len: int
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 16
    dtype: str = "bf16"
    kind: str = "bandwidth"
    branches: int = 0
    branch_len: int = 0

    @property
    def suite(self) -> str:
        return "cascade"

    @property
    def bytes(self) -> int:
        """Every tree node's KV once + each request's own KV + q + o."""
        e = DTYPE_BYTES[self.dtype]
        tokens = self.shared_len + self.branches * self.branch_len + self.batch * self.unique_len
        return 2 * tokens * self.num_kv_heads * self.head_dim * e + 2 * self.batch * self.num_qo_heads * self.head_dim * e

    @property
    def flops(self) -> int:
        kv_len = self.shared_len + (self.branch_len if self.branches else 0) + self.unique_len
        return 4 * self.batch * kv_len * self.num_qo_heads * self.head_dim

    def flat(self) -> Attn:
        """Flat paged decode over the same page table (the shared pages listed per request)."""
        kv_len = self.shared_len + (self.branch_len if self.branches else 0) + self.unique_len
        return Attn(self.name + ":flat", "decode", (kv_len,) * self.batch,
                    num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                    page_size=self.page_size, dtype=self.dtype, kv_dtype=self.dtype)

    def params(self) -> dict:
        tree = {"branches": self.branches, "branch_len": self.branch_len} if self.branches else {}
        return {"batch": self.batch, "shared_len": self.shared_len, "unique_len": self.unique_len,
                "heads_qo": self.num_qo_heads, "heads_kv": self.num_kv_heads, "head_dim": self.head_dim,
                "page_size": self.page_size, "dtype": self.dtype, "levels": 3 if self.branches else 2, **tree}

    def small(self) -> "Cascade":
        return dataclasses.replace(self, batch=_div(self.batch, 16, 2 * max(self.branches, 1)),
                                   shared_len=_div(self.shared_len, CPU_SCALE), unique_len=_div(self.unique_len, CPU_SCALE),
                                   branch_len=_div(self.branch_len, CPU_SCALE) if self.branches else 0)


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention decode (DeepSeek), through ``BatchMLAPagedAttentionWrapper``.

    Every row reports both TFLOP/s and TB/s (``tflops``, ``tb_per_s``); its ``kind`` picks the headline
    rate: compute for 128 heads (FLOP-bound), bandwidth for 16 (the latent cache read bounds it).
    ``kv_dtype``: the latent cache's dtype (default: ``dtype``, the queries' and output's). ``q_len`` > 1: that many
    query tokens per request (speculative decode, a prefill chunk), causal (bottom-right: the last token sees every
    key); its FLOPs count the visible pairs only.
    """

    name: str
    batch: int
    kv_len: int
    num_heads: int = 128
    page_size: int = 64
    ckv_dim: int = 512
    kpe_dim: int = 64
    dtype: str = "bf16"
    kv_dtype: str | None = None
    kind: str = "compute"
    note: str = ""
    twin: str | None = None  # a row this one reports its speed against (the fp8 row: its bf16 twin)
    q_len: int = 1

    @property
    def suite(self) -> str:
        return "mla"

    @property
    def cache_dtype(self) -> str:
        return self.kv_dtype or self.dtype

    @property
    def pairs(self) -> int:
        """(query token, key) pairs a request's query tokens see (causal for q_len > 1)."""
        return self.q_len * self.kv_len - self.q_len * (self.q_len - 1) // 2

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.num_heads * self.pairs * (self.ckv_dim + self.kpe_dim + self.ckv_dim)

    @property
    def bytes(self) -> int:
        return self.batch * self.kv_len * (self.ckv_dim + self.kpe_dim) * DTYPE_BYTES[self.cache_dtype]

    def params(self) -> dict:
        return {"batch": self.batch, "kv_len": self.kv_len, "heads": self.num_heads, "ckv": self.ckv_dim,
                "kpe": self.kpe_dim, "page_size": self.page_size, "dtype": self.dtype, "kv_dtype": self.cache_dtype,
                "q_len": self.q_len}

    def small(self) -> "MLA":
        """The cpu target's size: a few requests of a few hundred tokens, 16 heads."""
        return replace(self, batch=max(1, self.batch // 32), kv_len=max(64, self.kv_len // CPU_SCALE),
                       num_heads=min(self.num_heads, 16))


@dataclass(frozen=True)
class Jit:
    """Host-side costs: import, cold build / warm load, run() overhead, plan() time."""

    name: str
    what: str  # "import" | "build" | "run_overhead" | "plan" | "fast_plan"
    rows: tuple[str, ...] = ()  # the row names it produces (default: its own name)
    batch: int = 1
    kv_len: int = 16
    kind: str = "host"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def suite(self) -> str:
        return "jit"

    def small(self) -> "Jit":
        return self

    def params(self) -> dict:
        out = {"what": self.what}
        if self.what in ("run_overhead", "plan", "fast_plan"):
            out.update(batch=self.batch, kv_len=self.kv_len, heads_qo=32, heads_kv=8, head_dim=128, page_size=16)
        return out


Case = Union[Attn, Cascade, MLA, Jit, Rope, BlockSparse, Fp8Prefill, Mixed]


def _decode(name: str, batch: int, kv_len: int, **kw) -> Attn:
    return Attn("decode/" + name, "decode", (kv_len,) * batch, **kw)


def _prefill(name: str, batch: int, seq: int, causal: bool = True, storage: str = "ragged", **kw) -> Attn:
    return Attn("prefill/" + name, "prefill", (seq,) * batch, qo_lens=(seq,) * batch, causal=causal,
                storage=storage, **kw)


def varlen_lengths(n: int = 16, lo: int = 128, hi: int = 8192, seed: int = 0) -> tuple[int, ...]:
    """``prefill/llama8b_causal_varlen``'s lengths: uniform in [lo, hi] from a fixed seed."""
    rng = random.Random(seed)
    return tuple(rng.randint(lo, hi) for _ in range(n))


_VARLEN = varlen_lengths()


def _twin(plain: Attn, suffix: str, **kw) -> Attn:
    """``plain`` with one axis changed (sinks, batch-invariant mode, a soft cap), reported beside it (its rate / the
    plain rate)."""
    return dataclasses.replace(plain, name=plain.name + "_" + suffix, plain=plain.name, sdpa=False, **kw)


def _with_twins(plain: Attn, sinks: bool = True, batch_invariant: bool = True) -> list[Attn]:
    """``plain``, then its attention-sink twin (the target: within 3%) and batch-invariant twin (within 10%)."""
    out = [plain]
    if sinks:
        out.append(_twin(plain, "sinks", sinks=True, note="attention sinks (gpt-oss); compared with " + plain.name))
    if batch_invariant:
        out.append(_twin(plain, "batchinv", batch_invariant=True,
                         note="plan(batch_invariant=True); compared with " + plain.name))
    return out

DECODE: list[Attn] = [
    *_with_twins(_decode("llama8b_b64_s2048", 64, 2048)),
    *_with_twins(_decode("llama8b_b256_s4096", 256, 4096)),
    *_with_twins(_decode("llama8b_b1_s32768", 1, 32768), sinks=False),
    _decode("mha_b64_s2048_d128", 64, 2048, num_kv_heads=32),
    _decode("gemma2_softcap_b64_s4096_d256", 64, 4096, num_qo_heads=16, head_dim=256, logits_soft_cap=50.0),
    _decode("mistral_window4096_b32_s16384", 32, 16384, window_left=4095, note="SDPA over the window's 4096 keys"),
    _decode("mistral_window4096_b1_s32768", 1, 32768, window_left=4095, note="a split plan under a window"),
    _decode("phi3_d96_b64_s4096", 64, 4096, num_kv_heads=32, head_dim=96),
    *_with_twins(Attn("decode/skewed_b64", "decode", (32768,) + (512,) * 63, note="SDPA: one call per distinct length"),
                 sinks=False),
    # gpt-oss-120b's attention: 64 query heads, 8 KV heads, head_dim 64, alternating 128-token windows
    *_with_twins(_decode("gptoss_window128_b64_s8192", 64, 8192, num_qo_heads=64, head_dim=64, window_left=127,
                         note="SDPA over the window's 128 keys"), batch_invariant=False),
    *_with_twins(_decode("gptoss_b64_s8192", 64, 8192, num_qo_heads=64, head_dim=64)),
    *(_decode(f"gptoss_b{b}_s1024", b, 1024, num_qo_heads=64, head_dim=64,
              note=f"short requests, {8 * b} blocks: the short-items layout") for b in (64, 128)),
    _decode("fp8kv_b256_s4096", 256, 4096, kv_dtype="e4m3"),
    _decode("llama8b_b64_s2048_page1", 64, 2048, page_size=1),
    _decode("llama8b_b64_s2048_rope", 64, 2048, pos_encoding="ROPE_LLAMA"),
]

_D256_PREFILL = _prefill("d256_causal_b4_s4096", 4, 4096, num_qo_heads=16, head_dim=256)
_PAGED_PREFILL = _prefill("llama8b_causal_paged_b8_s4096", 8, 4096, storage="paged")
_GPTOSS_PREFILL = _prefill("gptoss_causal_b8_s4096", 8, 4096, num_qo_heads=64, head_dim=64)

PREFILL: list[Attn] = [
    *_with_twins(_prefill("llama8b_causal_b8_s4096", 8, 4096)),
    *_with_twins(_GPTOSS_PREFILL, batch_invariant=False),
    _twin(_GPTOSS_PREFILL, "window128", window_left=127, note="gpt-oss's sliding-window layers (128 keys back); "
          "TFLOP/s over the unmasked pairs, compared with " + _GPTOSS_PREFILL.name),
    _prefill("d64_causal_b16_s2048", 16, 2048, head_dim=64),
    _prefill("deepseek_mla_causal_b4_s4096", 4, 4096, num_qo_heads=16, num_kv_heads=16, head_dim=192, head_dim_vo=128,
             note="DeepSeek-V3's MLA prefill (q / k 192 = 128 nope + 64 rope, v 128), 16 heads (tensor-parallel 8)"),
    _D256_PREFILL,
    _twin(_D256_PREFILL, "softcap", logits_soft_cap=50.0,
          note="gemma-2's soft cap 50 (16 query heads of 256, group 2); compared with " + _D256_PREFILL.name),
    _prefill("llama8b_noncausal_b8_s4096", 8, 4096, causal=False),
    _PAGED_PREFILL,
    _twin(_PAGED_PREFILL, "fp8", kv_dtype="e4m3",
          note="e4m3 KV (JITATTN_PREFILL_FP8_UPCAST picks the kernel: off, the fp8 one; on, a 16-bit gather and the "
          "16-bit ragged one); compared with " + _PAGED_PREFILL.name),
    *_with_twins(Attn("prefill/llama8b_causal_varlen", "prefill", _VARLEN, qo_lens=_VARLEN, causal=True,
                      storage="ragged", note="16 lengths uniform in 128..8192 (seed 0); SDPA: one call per request"),
                 sinks=False),
]

CASCADE: list[Cascade] = [
    Cascade("cascade/b128_shared8192_u256", 128, 8192, 256),
    Cascade("cascade/b32_shared32768_u128", 32, 32768, 128),
    # an agent's fork: an 8k (32k: a root larger than L2) root shared by 128 requests, 4 branches of 2k shared by 32
    # each, 128-token tails; a wide one: 32 branches of 512 shared by 4 (two levels read the root once per branch)
    *(Cascade(f"cascade/agent_fork_b128_root{n}_{k}x{m}_u128", 128, n, 128, branches=k, branch_len=m)
      for n, k, m in ((8192, 4, 2048), (32768, 4, 2048), (32768, 32, 512))),
]

# Variants: each beside the plain kernel at equal work (the same tokens read / the same batch).
_PLAIN_DECODE = Attn("variants/plain_decode_b64_s4096", "decode", (4096,) * 64, sdpa=False)
# Speculative decoding's verification step: 32 requests, a 64-token draft tree each over 4096 tokens before it, paged.
_PLAIN_VERIFY = Attn("variants/plain_verify_causal_b32_q64_s4160", "prefill", (4160,) * 32, qo_lens=(64,) * 32,
                     causal=True, sdpa=False)

_PLAIN_PREFILL = Attn("variants/plain_prefill_causal_b4_s4096", "prefill", (4096,) * 4, qo_lens=(4096,) * 4,
                      causal=True, storage="ragged", sdpa=False)


def _variant(plain: Attn, name: str, **kw) -> Attn:
    return dataclasses.replace(plain, name="variants/" + name, plain=plain.name, **kw)


VARIANTS: list[Attn] = [
    _PLAIN_DECODE,
    _variant(_PLAIN_DECODE, "decode_softcap_b64_s4096", logits_soft_cap=50.0),
    _variant(_PLAIN_DECODE, "decode_window_b64_s8192_w4096", kv_lens=(8192,) * 64, window_left=4095,
             note="reads the same 4096 tokens per request as the plain case"),
    _variant(_PLAIN_DECODE, "decode_rope_b64_s4096", pos_encoding="ROPE_LLAMA"),
    _variant(_PLAIN_DECODE, "decode_alibi_b64_s4096", pos_encoding="ALIBI"),
    _PLAIN_PREFILL,
    _variant(_PLAIN_PREFILL, "prefill_softcap_causal_b4_s4096", logits_soft_cap=50.0),
    _variant(_PLAIN_PREFILL, "prefill_window1024_causal_b4_s4096", window_left=1023,
             note="compared by TFLOP/s over the unmasked pairs"),
    _variant(_PLAIN_PREFILL, "prefill_rope_causal_b4_s4096", pos_encoding="ROPE_LLAMA"),
    _variant(_PLAIN_PREFILL, "prefill_alibi_causal_b4_s4096", pos_encoding="ALIBI"),
    _PLAIN_VERIFY,
    _variant(_PLAIN_VERIFY, "verify_custom_tree_b32_q64_s4160", causal=False, custom_mask=True,
             custom_mask_kind="tree", note="a draft tree's mask (random parents, fixed seed); time compared with the "
             "causal verification of the same shape (TFLOP/s over its pairs)"),
    _variant(_PLAIN_PREFILL, "prefill_custom_causal_b4_s4096", causal=False, custom_mask=True,
             note="custom mask with the causal pattern"),
]

# FlashInfer 0.5.3's rates on the H200 and the targets jitattn aims for.
MLA_CASES: list[MLA] = [
    MLA("mla/b64_s4096_p64", 64, 4096, note="FlashInfer 0.5.3: 524 TFLOP/s; target >= 620 TFLOP/s"),
    MLA("mla/b128_s8192_p64", 128, 8192, note="FlashInfer 0.5.3: 525 TFLOP/s; target >= 620 TFLOP/s"),
    MLA("mla/h16_b128_s4096_p64", 128, 4096, num_heads=16, kind="bandwidth",
        note="FlashInfer 0.5.3: 3.83 TB/s; target >= 4.2 TB/s"),
    MLA("mla/h16_b128_s4096_p64_fp8", 128, 4096, num_heads=16, kv_dtype="e4m3", kind="bandwidth",
        note="e4m3 latent cache (k_scale/v_scale); target >= 1.7x the speed of its bf16 twin",
        twin="mla/h16_b128_s4096_p64"),
    # speculative decode and a prefill chunk on the same kernel: their TFLOP/s against the one-token row's
    MLA("mla/spec2_b64_s4096_p64", 64, 4096, q_len=2, twin="mla/b64_s4096_p64",
        note="2 query tokens a request (causal); target >= 0.9 of the one-token row's TFLOP/s"),
    MLA("mla/spec4_b64_s4096_p64", 64, 4096, q_len=4, twin="mla/b64_s4096_p64",
        note="4 query tokens a request (causal); target >= 0.9 of the one-token row's TFLOP/s"),
    MLA("mla/chunk64_b16_s4096_p64", 16, 4096, q_len=64, twin="mla/b64_s4096_p64",
        note="a 64-token prefill chunk a request (causal); target >= 0.9 of the one-token row's TFLOP/s"),
]

JIT: list[Jit] = [
    Jit("jit/import_jitattn", "import"),
    Jit("jit/build", "build", rows=("jit/cold_build_decode", "jit/cold_build_prefill", "jit/warm_load_decode",
                                    "jit/warm_load_prefill")),
    Jit("jit/run_overhead_decode", "run_overhead", batch=1, kv_len=16),
    Jit("jit/plan_decode_b256", "plan", batch=256, kv_len=4096),
    Jit("jit/fast_plan_decode_b256", "fast_plan", batch=256, kv_len=4096),
]

# Standalone ops (ops_cases): RoPE against the copy ceiling; block-sparse and fp8 prefill against their dense twin;
# the mixed batches (POD, BatchAttention) against their separate launches.
OPS: list[Case] = [
    *ROPE_CASES,
    Attn(DENSE_PREFILL, "prefill", (8192,), qo_lens=(8192,), causal=False, storage="ragged",
         note="the block-sparse rows' dense twin (same shape, every pair)"),
    *BSR_CASES,
    *FP8_CASES,
    *MIXED_CASES,
]

ALL_CASES: list[Case] = [*DECODE, *PREFILL, *CASCADE, *VARIANTS, *MLA_CASES, *JIT, *OPS]
BY_NAME: dict[str, Case] = {c.name: c for c in ALL_CASES}

QUICK: tuple[str, ...] = (
    "decode/llama8b_b64_s2048", "decode/llama8b_b1_s32768", "decode/skewed_b64", "decode/fp8kv_b256_s4096",
    "prefill/llama8b_causal_b8_s4096", "prefill/llama8b_causal_varlen", "cascade/b128_shared8192_u256",
    "variants/plain_decode_b64_s4096", "variants/decode_softcap_b64_s4096", "mla/b64_s4096_p64",
    "jit/import_jitattn", "jit/build", "jit/run_overhead_decode", "jit/plan_decode_b256",
)


def row_names(case: Case) -> tuple[str, ...]:
    """The rows a case produces (a cascade adds its flat-decode row ``NAME:flat``, a tree its two-level row, a
    mixed batch its separate launches ``NAME:prefill`` and ``NAME:decode``)."""
    if isinstance(case, Jit) and case.rows:
        return case.rows
    if isinstance(case, Mixed):
        return (case.name, *(part.name for part in case.parts()))
    if isinstance(case, Cascade):
        return (case.name, case.name + ":flat") + ((case.name + ":two_level",) if case.branches else ())
    return (case.name,)


def select(suite: str = "all", only: list[str] | None = None, quick: bool = False) -> list[Case]:
    """The cases of ``suite`` (or ``all``), narrowed by ``--only`` (names, row names, suites or globs)."""
    if suite != "all" and suite not in SUITES:
        raise ValueError(f"--suite {suite!r}: use one of all, {', '.join(SUITES)}")
    pool = [c for c in ALL_CASES if suite == "all" or c.suite == suite]
    cases = [c for c in pool if c.name in QUICK] if quick else pool
    if only is not None:
        wanted = [w.strip() for w in only if w.strip()]
        if not wanted:
            raise ValueError("--only names no case (an empty list); leave it out for the whole suite")
        unknown = [w for w in wanted if not any(_matches(c, w, fnmatch) for c in ALL_CASES)]
        if unknown:
            raise ValueError(f"--only: no case matches {', '.join(unknown)} (see --list)")
        cases = [c for c in pool if any(_matches(c, w, fnmatch) for w in wanted)]
        # A variant needs its plain case first (a block-sparse row its dense twin).
        names = {c.name for c in cases}
        for c in list(cases):
            needs = c.plain if isinstance(c, Attn) else getattr(c, "dense", None)
            if needs and needs not in names:
                cases.insert(0, BY_NAME[needs])
                names.add(needs)
        cases.sort(key=ALL_CASES.index)
    if not cases:
        raise ValueError(f"no case is in --suite {suite}{' and --quick' if quick else ''}"
                         f"{' and --only ' + ','.join(only) if only else ''} (see --list)")
    return cases


def _matches(case: Case, pattern: str, fnmatch) -> bool:
    return pattern == case.suite or any(fnmatch.fnmatchcase(n, pattern) for n in (case.name, *row_names(case)))

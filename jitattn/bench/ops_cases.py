"""The ``ops`` suite's cases: standalone RoPE, block-sparse prefill and fp8 prefill (``configs.OPS`` lists them
with the dense prefill the block-sparse and fp8 rows are compared with).

- RoPE bytes = q and k read + q and k written (``2 * nnz * (H_q + H_k) * D * bytes/elem``) + the position
  array (``nnz * 4``, int32; ``nnz * 8`` for the cos/sin-cache call, whose positions are int64 as SGLang's).
  The cos/sin table (``max_position * D * 4`` bytes, a few MiB re-read per token) is not counted. The rows
  are compared with the **copy** ceiling (bytes read + written), not read-stream: RoPE writes as much as it
  reads. Target: >= 0.9 of copy.
- Block-sparse FLOPs = 4 * (unmasked (q, k) pairs = nonzero blocks * R * C) * H_q * D: the useful work only.
  Target: its TFLOP/s >= 0.9 of the dense prefill's of the same shape (``dense``, reported as ``baseline``).
- fp8 prefill FLOPs = 4 * (unmasked pairs) * H_q * D, as a prefill row's. Target: >= 1,000 TFLOP/s (d128,
  non-causal); ``baseline``: the dense 16-bit prefill of the same shape.
- Mixed batches (POD, BatchAttention): FLOPs = the chunk's (4 * causal pairs * H_q * D) + the decodes'
  (4 * B * kv_len * H_q * D); bytes = the two parts' (``Attn.bytes``). Target: the one call's time against
  the sum of the separate launches' (rows ``NAME:prefill``, ``NAME:decode``), reported as ``baseline``
  (``ratio`` = their summed time / this row's time): POD >= 1 / 0.9, BatchAttention >= 0.95.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .units import CPU_SCALE, DTYPE_BYTES, div_at_least

ROPE_FUNCTIONS = {"pos_ids_inplace": "apply_rope_pos_ids_inplace", "pos_ids": "apply_rope_pos_ids",
                  "cos_sin_cache_inplace": "apply_rope_with_cos_sin_cache_inplace"}  # api -> the public function


@dataclass(frozen=True)
class Rope:
    """One call of a standalone RoPE function over ``nnz`` tokens (positions ``t % max_position``: a batch of
    ``nnz / max_position`` requests of consecutive positions).

    ``api``: ``pos_ids_inplace`` (``apply_rope_pos_ids_inplace``), ``pos_ids`` (``apply_rope_pos_ids``, new
    outputs) or ``cos_sin_cache_inplace`` (``apply_rope_with_cos_sin_cache_inplace`` as SGLang calls it:
    ``query``/``key`` strided column slices of one fused ``[nnz, (H_q + 2 H_k) * D]`` qkv buffer, int64
    positions, a float32 ``[max_position, D]`` table)."""

    name: str
    nnz: int
    num_q_heads: int = 32
    num_k_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    interleave: bool = False  # False: NeoX halves (i, i + D/2); True: GPT-J pairs (2i, 2i + 1)
    api: str = "pos_ids_inplace"
    max_position: int = 4096
    note: str = ""
    kind: str = "bandwidth"
    ceiling: str = "copy"  # the ceiling the row's fraction is against

    @property
    def suite(self) -> str:
        return "ops"

    @property
    def function(self) -> str:
        """The public function it times (the same name in jitattn and flashinfer)."""
        return ROPE_FUNCTIONS[self.api]

    @property
    def position_bytes(self) -> int:
        return 8 if self.api == "cos_sin_cache_inplace" else 4

    @property
    def bytes(self) -> int:
        """q and k read + written, and the positions read."""
        e = DTYPE_BYTES[self.dtype]
        return 2 * self.nnz * (self.num_q_heads + self.num_k_heads) * self.head_dim * e + self.nnz * self.position_bytes

    def params(self) -> dict:
        return {"function": self.function, "nnz": self.nnz, "heads_q": self.num_q_heads, "heads_k": self.num_k_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "interleave": self.interleave,
                "max_position": self.max_position}

    def small(self) -> "Rope":
        return replace(self, nnz=div_at_least(self.nnz, CPU_SCALE, 64),
                       max_position=div_at_least(self.max_position, CPU_SCALE, 64))


@dataclass(frozen=True)
class BlockSparse:
    """``BlockSparseAttentionWrapper`` over one ``seq x seq`` BSR pattern of ``block x block`` blocks (R = C),
    non-causal: each block row attends to ``round(density * column blocks)`` column blocks drawn at random
    (seeded by the name, sorted). ``dense``: the dense prefill of the same shape its rate is compared with."""

    name: str
    seq: int
    density: float
    block: int = 64
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    dense: str | None = None
    note: str = ""
    kind: str = "compute"

    def __post_init__(self) -> None:
        if self.seq % self.block:
            raise ValueError(f"{self.name}: seq {self.seq} is not a whole number of {self.block}-token blocks")

    @property
    def suite(self) -> str:
        return "ops"

    @property
    def row_blocks(self) -> int:
        return self.seq // self.block

    @property
    def blocks_per_row(self) -> int:
        return max(1, min(self.row_blocks, round(self.density * self.row_blocks)))

    @property
    def nonzero_blocks(self) -> int:
        return self.row_blocks * self.blocks_per_row

    @property
    def pairs(self) -> int:
        """Unmasked (query, key) pairs: every pair inside a nonzero block."""
        return self.nonzero_blocks * self.block * self.block

    @property
    def flops(self) -> int:
        return 4 * self.pairs * self.num_qo_heads * self.head_dim

    @property
    def bytes(self) -> int:
        """q, o, K and V once each (for reference; the rows are compute-bound)."""
        e = DTYPE_BYTES[self.dtype]
        return 2 * self.seq * (self.num_qo_heads + self.num_kv_heads) * self.head_dim * e

    def params(self) -> dict:
        return {"seq": self.seq, "R": self.block, "C": self.block, "density": self.density,
                "nonzero_blocks": self.nonzero_blocks, "of_blocks": self.row_blocks ** 2,
                "heads_qo": self.num_qo_heads, "heads_kv": self.num_kv_heads, "head_dim": self.head_dim,
                "dtype": self.dtype, "causal": False}

    def small(self) -> "BlockSparse":
        return replace(self, seq=max(2 * self.block, self.seq // CPU_SCALE // self.block * self.block))


@dataclass(frozen=True)
class Fp8Prefill:
    """``single_prefill_with_kv_cache`` of one request of ``seq`` queries over ``seq`` keys with q, k and v in the
    fp8 ``dtype`` (per-tensor scales) and an ``o_dtype`` output: the sm90 fp8 kernel on an H100 / H200, else the
    16-bit kernel over converted operands (the row's ``params`` say which). ``dense``: the 16-bit prefill of the
    same shape its rate is compared with."""

    name: str
    seq: int
    causal: bool = False
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "e4m3"
    o_dtype: str = "bf16"
    dense: str | None = None
    note: str = ""
    kind: str = "compute"

    @property
    def suite(self) -> str:
        return "ops"

    @property
    def pairs(self) -> int:
        return self.seq * (self.seq + 1) // 2 if self.causal else self.seq * self.seq

    @property
    def flops(self) -> int:
        return 4 * self.pairs * self.num_qo_heads * self.head_dim

    @property
    def bytes(self) -> int:
        """q, K and V read once (fp8), o written once (for reference; the rows are compute-bound)."""
        n, d = self.seq, self.head_dim
        return n * (self.num_qo_heads + 2 * self.num_kv_heads) * d * DTYPE_BYTES[self.dtype] + \
            n * self.num_qo_heads * d * DTYPE_BYTES[self.o_dtype]

    def params(self) -> dict:
        return {"seq": self.seq, "causal": self.causal, "heads_qo": self.num_qo_heads, "heads_kv": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "o_dtype": self.o_dtype, "scales": "per tensor"}

    def small(self) -> "Fp8Prefill":
        return replace(self, seq=div_at_least(self.seq, CPU_SCALE, 128))


@dataclass(frozen=True)
class Mixed:
    """One chunked-prefill request (``chunk`` queries over its own ``chunk`` keys, causal) and ``batch`` decode
    requests over ``kv_len`` tokens each (paged, ``page_size``), as one call of ``api``: ``pod``
    (``PODWithPagedKVCacheWrapper.run``, the chunk's k/v contiguous) or ``batch_attention`` (``BatchAttention``,
    the chunk paged too). The separate launches it is compared with are ``parts()``: the chunk alone
    (``single_prefill_with_kv_cache`` for POD, the paged prefill wrapper for BatchAttention) and the decode
    batch alone (``BatchDecodeWithPagedKVCacheWrapper``); ``target``: the least ``baseline`` ratio."""

    name: str
    api: str  # "pod" | "batch_attention"
    chunk: int = 2048
    batch: int = 64
    kv_len: int = 4096
    page_size: int = 16
    num_qo_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "bf16"
    target: float = 1.0
    note: str = ""
    kind: str = "compute"

    @property
    def suite(self) -> str:
        return "ops"

    def parts(self) -> tuple:
        """(the chunk's prefill, the decode batch) as ``Attn`` cases named ``NAME:prefill`` / ``NAME:decode``."""
        from .configs import Attn  # configs imports this module

        shape = dict(num_qo_heads=self.num_qo_heads, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                     page_size=self.page_size, dtype=self.dtype, kv_dtype=self.dtype, sdpa=False)
        storage = "ragged" if self.api == "pod" else "paged"
        how = "single_prefill_with_kv_cache" if self.api == "pod" else "BatchPrefillWithPagedKVCacheWrapper"
        return (Attn(self.name + ":prefill", "prefill", (self.chunk,), qo_lens=(self.chunk,), causal=True,
                     storage=storage, note=f"the chunk alone ({how})", **shape),
                Attn(self.name + ":decode", "decode", (self.kv_len,) * self.batch,
                     note="the decodes alone (BatchDecodeWithPagedKVCacheWrapper)", **shape))

    @property
    def flops(self) -> int:
        return sum(p.flops for p in self.parts())

    @property
    def bytes(self) -> int:
        return sum(p.bytes for p in self.parts())

    def params(self) -> dict:
        return {"api": self.api, "chunk": self.chunk, "chunk_causal": True, "decode_batch": self.batch,
                "decode_kv_len": self.kv_len, "page_size": self.page_size, "heads_qo": self.num_qo_heads,
                "heads_kv": self.num_kv_heads, "head_dim": self.head_dim, "dtype": self.dtype}

    def small(self) -> "Mixed":
        return replace(self, chunk=div_at_least(self.chunk, CPU_SCALE, self.page_size),
                       batch=div_at_least(self.batch, 16), kv_len=div_at_least(self.kv_len, CPU_SCALE, self.page_size))


ROPE_CASES: list[Rope] = [
    Rope("ops/rope_llama8b_nnz16384", 16384, note="apply_rope_pos_ids_inplace, NeoX; target >= 0.9 of copy"),
    Rope("ops/rope_interleave_llama8b_nnz16384", 16384, interleave=True,
         note="apply_rope_pos_ids_inplace, interleaved (GPT-J); target >= 0.9 of copy"),
    Rope("ops/rope_outofplace_llama8b_nnz16384", 16384, api="pos_ids",
         note="apply_rope_pos_ids (new q/k); target >= 0.9 of copy"),
    Rope("ops/rope_cos_sin_cache_nnz16384", 16384, api="cos_sin_cache_inplace",
         note="apply_rope_with_cos_sin_cache_inplace on fused-qkv slices (SGLang); target >= 0.9 of copy"),
]

DENSE_PREFILL = "ops/dense_prefill_noncausal_s8192"  # an Attn in configs.OPS

BSR_CASES: list[BlockSparse] = [
    BlockSparse(f"ops/bsr_r64_d{d:g}_s8192", 8192, d, dense=DENSE_PREFILL,
                note=f"density {d:g}; target TFLOP/s (unmasked pairs) >= 0.9 of {DENSE_PREFILL}")
    for d in (0.1, 0.3, 0.5)
]

FP8_CASES: list[Fp8Prefill] = [
    Fp8Prefill("ops/fp8_prefill_noncausal_s8192", 8192, dense=DENSE_PREFILL,
               note=f"q, k, v e4m3 (per-tensor scales), bf16 out; target >= 1,000 TFLOP/s; baseline {DENSE_PREFILL}"),
]

MIXED_CASES: list[Mixed] = [
    Mixed("ops/pod_chunk2048_decode64x4096", "pod", target=1 / 0.9,
          note="PODWithPagedKVCacheWrapper.run; target time <= 0.9 x (its :prefill + :decode rows)"),
    Mixed("ops/batch_attention_mixed", "batch_attention", target=0.95,
          note="BatchAttention, one call; target time within 5% of its :prefill + :decode rows"),
]

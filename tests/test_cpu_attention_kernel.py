"""The cpu-target attention kernel (templates/cpu/attention.cpp.jinja) against
the float64 reference, called through ``launch_attention`` directly.

Inputs are fresh ``torch.randn`` draws; the KV pool pages (and ragged tokens)
that no request owns, and the unused slots of last pages, hold NaN, so a read
outside a request's KV shows up; outputs and LSEs are NaN-poisoned before each
launch, so an element the kernel does not write fails. Tolerances: fp32 to
1e-5; 16-bit outputs to half an ulp of the output dtype (the kernel reads the
same rounded inputs as the reference and accumulates in fp32, so rounding o is
the only sizeable error).

The kernel compiles per (op, q, kv, o) dtype: the cases below reuse
``_PREFILL_DTYPES`` and ``_DECODE_DTYPES`` only, so the file builds 7 modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

import jitattn
from jitattn import reference as ref
from jitattn.runtime.launch import AttentionScalars, launch_attention
from jitattn.jit import KernelError
from jitattn.spec import KVLayout, PosEncoding, VariantSpec

_TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16,
          "e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_PREFILL_DTYPES = [("f32", "f32", "f32"), ("f16", "f16", "f16"), ("bf16", "bf16", "bf16"),
                   ("f16", "e4m3", "f16"), ("bf16", "e5m2", "bf16")]
_DECODE_DTYPES = [("f32", "f32", "f32"), ("bf16", "bf16", "bf16")]
# Relative error of rounding to the output dtype (half an ulp), plus fp32 noise.
_RTOL = {"f32": 1e-5, "f16": 2.0 ** -11 + 1e-5, "bf16": 2.0 ** -8 + 1e-5}
_ATOL = 1e-5
_POS_CODES = {PosEncoding.NONE: 0, PosEncoding.ROPE_LLAMA: 1, PosEncoding.ALIBI: 2}


def _module(op: str, dtypes: tuple[str, str, str]):
    q, kv, o = dtypes
    return jitattn.load(VariantSpec(op=op, target="cpu", q_dtype=q, kv_dtype=kv, o_dtype=o))


# --------------------------------------------------------------------------- #
# Inputs
# --------------------------------------------------------------------------- #
@dataclass
class Batch:
    """One launch's inputs, in the kernel's form and in the reference's form."""

    q: torch.Tensor
    k: torch.Tensor  # what the kernel reads (ragged [tokens, H, D] or paged 4-D view)
    v: torch.Tensor
    ref_kv: object  # the cache as the reference takes it (5-D tensor, (k, v) tuple or ragged pair)
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor | None
    kv_last_page_len: torch.Tensor | None
    page_size: int
    layout: KVLayout
    qo_lens: list[int]
    kv_lens: list[int]


def _randn(gen: torch.Generator, shape, dtype: torch.dtype) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        x = x * 3  # use more of the fp8 range than N(0, 1) does
    return x.to(dtype)


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)


def make_batch(
    *, qo_lens: list[int], kv_lens: list[int], num_qo_heads: int, num_kv_heads: int, head_dim_qk: int,
    head_dim_vo: int | None = None, q_dtype: str = "f32", kv_dtype: str | None = None, storage: str = "nhd5",
    page_size: int = 16, seed: int = 0, q_layout: str = "contiguous",
) -> Batch:
    """storage: 'nhd5'/'hnd5' (k, v = halves of one 5-D cache), 'nhd4'/'hnd4'
    (separate 4-D caches), 'ragged' ([tokens, H, D] k and v). q_layout:
    'contiguous', 'fused' (sliced from a [tokens, q + k + v heads, D] qkv
    projection) or 'head-major' (a [H, tokens, D] tensor transposed)."""
    gen = torch.Generator().manual_seed(seed)
    head_dim_vo = head_dim_qk if head_dim_vo is None else head_dim_vo
    kv_torch = _TORCH[kv_dtype or q_dtype]
    total_q = sum(qo_lens)
    if q_layout == "fused":
        qkv = _randn(gen, (total_q, num_qo_heads + 2 * num_kv_heads, head_dim_qk), _TORCH[q_dtype])
        q = qkv[:, :num_qo_heads]
    elif q_layout == "head-major":
        q = _randn(gen, (num_qo_heads, total_q, head_dim_qk), _TORCH[q_dtype]).transpose(0, 1)
    else:
        q = _randn(gen, (total_q, num_qo_heads, head_dim_qk), _TORCH[q_dtype])
    nan = float("nan")

    if storage == "ragged":
        spare = 5
        k = torch.full((sum(kv_lens) + spare, num_kv_heads, head_dim_qk), nan).to(kv_torch)
        v = torch.full((sum(kv_lens) + spare, num_kv_heads, head_dim_vo), nan).to(kv_torch)
        k[:sum(kv_lens)] = _randn(gen, (sum(kv_lens), num_kv_heads, head_dim_qk), kv_torch)
        v[:sum(kv_lens)] = _randn(gen, (sum(kv_lens), num_kv_heads, head_dim_vo), kv_torch)
        return Batch(q, k, v, (k[:sum(kv_lens)], v[:sum(kv_lens)]), _indptr(qo_lens), _indptr(kv_lens), None, None,
                     1, KVLayout.NHD, qo_lens, kv_lens)

    layout = KVLayout.NHD if storage.startswith("nhd") else KVLayout.HND
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    used = sum(pages_per)
    pool = used + 3  # spare pages stay NaN
    order = torch.randperm(pool, generator=gen)[:used].to(torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in kv_lens], dtype=torch.int32)

    def page_shape(dim):
        return (pool, page_size, num_kv_heads, dim) if layout is KVLayout.NHD else (pool, num_kv_heads, page_size, dim)

    if storage.endswith("5"):
        assert head_dim_qk == head_dim_vo, "a 5-D cache holds k and v of one head dim"
        shape = page_shape(head_dim_qk)
        cache = torch.full((shape[0], 2, *shape[1:]), nan)
        k_nhd = cache[:, 0] if layout is KVLayout.NHD else cache[:, 0].transpose(1, 2)
        v_nhd = cache[:, 1] if layout is KVLayout.NHD else cache[:, 1].transpose(1, 2)
    else:
        k_full, v_full = torch.full(page_shape(head_dim_qk), nan), torch.full(page_shape(head_dim_vo), nan)
        k_nhd = k_full if layout is KVLayout.NHD else k_full.transpose(1, 2)
        v_nhd = v_full if layout is KVLayout.NHD else v_full.transpose(1, 2)
    # Fill the used slots only (NHD views alias the cache): spare pages and slots stay NaN.
    first = 0
    for n in kv_lens:
        for j in range(n):
            page, slot = int(order[first + j // page_size]), j % page_size
            k_nhd[page, slot] = _randn(gen, (num_kv_heads, head_dim_qk), torch.float32)
            v_nhd[page, slot] = _randn(gen, (num_kv_heads, head_dim_vo), torch.float32)
        first += (n + page_size - 1) // page_size
    if storage.endswith("5"):
        cache = cache.to(kv_torch)
        k, v, ref_kv = cache[:, 0], cache[:, 1], cache
    else:
        k, v = k_full.to(kv_torch), v_full.to(kv_torch)
        ref_kv = (k, v)
    return Batch(q, k, v, ref_kv, _indptr(qo_lens), _indptr(pages_per), order, last, page_size, layout,
                 qo_lens, kv_lens)


def random_custom_mask(batch: Batch, seed: int, keep: float = 0.7) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed uint8 bits, int32 byte offsets per request, flat bool mask for the reference)."""
    gen = torch.Generator().manual_seed(seed)
    packed, flat, offsets = [], [], [0]
    for qo_len, kv_len in zip(batch.qo_lens, batch.kv_lens):
        bits = torch.rand((qo_len, kv_len), generator=gen) < keep
        flat.append(bits.reshape(-1))
        packed.append(ref.pack_custom_mask(bits))
        offsets.append(offsets[-1] + packed[-1].numel())
    return (torch.cat(packed), torch.tensor(offsets, dtype=torch.int32),
            torch.cat(flat) if flat else torch.zeros(0, dtype=torch.bool))


# --------------------------------------------------------------------------- #
# Launch and compare
# --------------------------------------------------------------------------- #
def scalars(head_dim_qk: int, *, causal=False, pos=PosEncoding.NONE, window_left=-1, sm_scale=None,
            soft_cap=0.0, rope_scale=1.0, rope_theta=1e4) -> AttentionScalars:
    return AttentionScalars(
        causal=causal, pos_encoding=pos, window_left=window_left,
        sm_scale=1.0 / math.sqrt(head_dim_qk) if sm_scale is None else sm_scale,
        logits_soft_cap=soft_cap, rope_scale=rope_scale, rope_theta=rope_theta,
    )


def run_kernel(module, batch: Batch, sc: AttentionScalars, *, o_dtype: str, custom_mask=None, mask_indptr=None,
               k_scale=1.0, v_scale=1.0, o=None, lse=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch on NaN-poisoned outputs (fresh ones unless given)."""
    num_tokens, num_qo_heads = batch.q.shape[:2]
    head_dim_vo = batch.v.shape[-1]
    if o is None:
        o = torch.empty(num_tokens, num_qo_heads, head_dim_vo, dtype=_TORCH[o_dtype])
    if lse is None:
        lse = torch.empty(num_tokens, num_qo_heads, dtype=torch.float32)
    o.fill_(float("nan"))
    lse.fill_(float("nan"))
    num_kv_heads = batch.k.shape[1] if batch.kv_indices is None or batch.layout is KVLayout.HND else batch.k.shape[2]
    launch_attention(
        module, q=batch.q, k=batch.k, v=batch.v, o=o, lse=lse, qo_indptr=batch.qo_indptr, kv_indptr=batch.kv_indptr,
        kv_indices=batch.kv_indices, kv_last_page_len=batch.kv_last_page_len, page_size=batch.page_size,
        kv_layout=batch.layout, custom_mask=custom_mask, mask_indptr=mask_indptr, num_kv_heads=num_kv_heads,
        scalars=sc, k_scale=k_scale, v_scale=v_scale,
    )
    return o, lse


def reference(batch: Batch, sc: AttentionScalars, *, decode=False, custom_mask=None, k_scale=None, v_scale=None):
    kwargs = dict(
        sm_scale=sc.sm_scale, window_left=sc.window_left, logits_soft_cap=sc.logits_soft_cap or None,
        pos_encoding_mode=_POS_CODES[sc.pos_encoding], rope_scale=sc.rope_scale, rope_theta=sc.rope_theta,
        k_scale=k_scale, v_scale=v_scale,
    )
    if batch.kv_indices is None:
        k, v = batch.ref_kv
        return ref.batch_ragged_attention(batch.q, k, v, batch.qo_indptr, batch.kv_indptr, causal=sc.causal,
                                          custom_mask=custom_mask, **kwargs)
    layout = batch.layout.value.upper()
    if decode:
        assert not sc.causal and custom_mask is None
        return ref.batch_decode_paged(batch.q, batch.ref_kv, batch.kv_indptr, batch.kv_indices,
                                      batch.kv_last_page_len, kv_layout=layout, **kwargs)
    return ref.batch_prefill_paged(batch.q, batch.ref_kv, batch.qo_indptr, batch.kv_indptr, batch.kv_indices,
                                   batch.kv_last_page_len, kv_layout=layout, causal=sc.causal,
                                   custom_mask=custom_mask, **kwargs)


def assert_matches(o, lse, expected, o_dtype: str) -> None:
    ref_o, ref_lse = expected
    assert not torch.isnan(o.float()).any(), "o has NaN: an element was not written (or a bad KV slot was read)"
    assert not torch.isnan(lse).any(), "lse has NaN: an element was not written (or a bad KV slot was read)"
    torch.testing.assert_close(o.float(), ref_o, atol=_ATOL, rtol=_RTOL[o_dtype])
    torch.testing.assert_close(lse, ref_lse, atol=_ATOL, rtol=1e-5)  # -inf must match -inf exactly


def check(op: str, dtypes, batch: Batch, sc: AttentionScalars, *, custom=None, k_scale=1.0, v_scale=1.0):
    packed, mask_indptr, flat = custom if custom is not None else (None, None, None)
    o, lse = run_kernel(_module(op, dtypes), batch, sc, o_dtype=dtypes[2], custom_mask=packed,
                        mask_indptr=mask_indptr, k_scale=k_scale, v_scale=v_scale)
    expected = reference(batch, sc, decode=op == "decode", custom_mask=flat, k_scale=k_scale, v_scale=v_scale)
    assert_matches(o, lse, expected, dtypes[2])
    return o, lse


# Lengths that exercise: kv_len 1 and qo_len 1, an empty request (0 pages: its
# queries see nothing), several pages and key blocks (the kernel works in
# blocks of 32 keys), a request with no queries.
_QO_LENS = [1, 3, 2, 5, 0, 4]
_KV_LENS = [1, 17, 0, 70, 9, 33]


# --------------------------------------------------------------------------- #
# Shapes, dtypes and KV storage
# --------------------------------------------------------------------------- #
# (dtypes, (head_dim_qk, head_dim_vo), (num_qo_heads, num_kv_heads), storage, page_size):
# every head dim, group size 1/4/5/7 and MQA, q dtype, fp8 kv dtype, layout,
# storage form and page size appears at least once.
_SHAPE_CASES = [
    (_PREFILL_DTYPES[0], (64, 64), (4, 4), "nhd5", 16),
    (_PREFILL_DTYPES[1], (72, 72), (8, 2), "hnd5", 1),
    (_PREFILL_DTYPES[2], (80, 80), (10, 2), "nhd4", 64),
    (_PREFILL_DTYPES[0], (96, 96), (7, 1), "hnd4", 16),
    (_PREFILL_DTYPES[3], (112, 112), (6, 1), "nhd5", 16),
    (_PREFILL_DTYPES[4], (128, 128), (8, 2), "hnd5", 64),
    (_PREFILL_DTYPES[2], (192, 192), (5, 1), "ragged", 1),
    (_PREFILL_DTYPES[1], (256, 256), (2, 2), "nhd5", 16),
    (_PREFILL_DTYPES[0], (192, 128), (8, 2), "nhd4", 16),
    (_PREFILL_DTYPES[4], (192, 128), (14, 2), "hnd4", 1),
    (_PREFILL_DTYPES[3], (128, 128), (10, 2), "ragged", 1),
    (_PREFILL_DTYPES[2], (64, 64), (7, 1), "hnd5", 16),
]


def _shape_id(case) -> str:
    dtypes, (dqk, dvo), (hq, hk), storage, page_size = case
    dims = f"hd{dqk}" if dqk == dvo else f"hd{dqk}x{dvo}"
    return f"{'-'.join(dict.fromkeys(dtypes))}-{dims}-h{hq}x{hk}-{storage}-p{page_size}"


@pytest.mark.parametrize("case", _SHAPE_CASES, ids=[_shape_id(c) for c in _SHAPE_CASES])
def test_prefill_matches_reference_over_shapes_dtypes_and_storage(case):
    dtypes, (dqk, dvo), (hq, hk), storage, page_size = case
    batch = make_batch(qo_lens=_QO_LENS, kv_lens=_KV_LENS, num_qo_heads=hq, num_kv_heads=hk, head_dim_qk=dqk,
                       head_dim_vo=dvo, q_dtype=dtypes[0], kv_dtype=dtypes[1], storage=storage,
                       page_size=page_size, seed=dqk + hq + page_size)
    fp8 = _TORCH[dtypes[1]].itemsize == 1
    check("prefill", dtypes, batch, scalars(dqk), k_scale=0.6 if fp8 else 1.0, v_scale=1.7 if fp8 else 1.0)


# --------------------------------------------------------------------------- #
# Masks, position encodings, logit transforms
# --------------------------------------------------------------------------- #
_FEATURES = {
    "causal": dict(causal=True),
    "rope": dict(pos=PosEncoding.ROPE_LLAMA),
    "rope-scaled": dict(pos=PosEncoding.ROPE_LLAMA, rope_scale=2.5, rope_theta=5e5),
    "alibi": dict(pos=PosEncoding.ALIBI),
    "window": dict(window_left=6),
    "window-causal": dict(window_left=4, causal=True),
    "softcap": dict(soft_cap=2.0, sm_scale=0.5),
    "sm-scale": dict(sm_scale=0.37),
    "custom-mask": dict(),
    "everything": dict(causal=True, pos=PosEncoding.ROPE_LLAMA, window_left=9, soft_cap=3.0),
    "alibi-causal-softcap": dict(causal=True, pos=PosEncoding.ALIBI, soft_cap=5.0),
}


@pytest.mark.parametrize("dtypes", [_PREFILL_DTYPES[0], _PREFILL_DTYPES[2]], ids=["f32", "bf16"])
@pytest.mark.parametrize("feature", list(_FEATURES))
def test_prefill_features_match_reference(feature, dtypes):
    # qo_len 6 > kv_len 3 (request 2): under causal its first 3 queries see nothing.
    # 12 heads: ALiBi's slopes for a head count that is not a power of two.
    batch = make_batch(qo_lens=[4, 1, 6, 7, 2], kv_lens=[40, 1, 3, 66, 0], num_qo_heads=12, num_kv_heads=4,
                       head_dim_qk=64, q_dtype=dtypes[0], storage="nhd5", page_size=16, seed=len(feature))
    custom = random_custom_mask(batch, seed=3) if feature in ("custom-mask", "everything") else None
    check("prefill", dtypes, batch, scalars(64, **_FEATURES[feature]), custom=custom)


def test_causal_rows_before_the_first_key_are_zero_with_neg_inf_lse():
    batch = make_batch(qo_lens=[5], kv_lens=[2], num_qo_heads=4, num_kv_heads=4, head_dim_qk=64, seed=11)
    o, lse = check("prefill", _PREFILL_DTYPES[0], batch, scalars(64, causal=True))
    # Queries 0..2 sit at positions -3..-1: no key is visible to them.
    assert torch.equal(o[:3], torch.zeros_like(o[:3]))
    assert torch.isneginf(lse[:3]).all()
    assert torch.isfinite(lse[3:]).all()


def test_fully_masked_row_and_empty_request_give_zero_and_neg_inf():
    batch = make_batch(qo_lens=[3, 2], kv_lens=[20, 0], num_qo_heads=4, num_kv_heads=2, head_dim_qk=64,
                       q_dtype="bf16", seed=12)
    packed, mask_indptr, flat = random_custom_mask(batch, seed=5, keep=1.0)
    flat[20:40] = False  # request 0, query 1: every key masked
    packed = ref.pack_custom_mask(flat)  # one request with keys, so the flat packing is FlashInfer's
    mask_indptr = torch.tensor([0, packed.numel(), packed.numel()], dtype=torch.int32)
    o, lse = check("prefill", _PREFILL_DTYPES[2], batch, scalars(64), custom=(packed, mask_indptr, flat))
    for row in (1, 3, 4):  # the masked query and both queries of the empty request
        assert torch.equal(o[row].float(), torch.zeros_like(o[row].float()))
        assert torch.isneginf(lse[row]).all()


def test_custom_mask_blocks_start_at_mask_indptr_bytes():
    # Per-request packing: request r's bits start at byte mask_indptr[r] (each block byte-aligned),
    # not at bit sum(qo_len * kv_len) of the earlier requests.
    batch = make_batch(qo_lens=[3, 2, 3], kv_lens=[5, 7, 11], num_qo_heads=2, num_kv_heads=1, head_dim_qk=64,
                       seed=13)
    check("prefill", _PREFILL_DTYPES[0], batch, scalars(64), custom=random_custom_mask(batch, seed=9, keep=0.5))


def test_single_request_matches_single_attention():
    batch = make_batch(qo_lens=[9], kv_lens=[50], num_qo_heads=6, num_kv_heads=3, head_dim_qk=128,
                       q_dtype="f16", storage="ragged", seed=14)
    sc = scalars(128, causal=True, window_left=20, pos=PosEncoding.ROPE_LLAMA)
    o, lse = run_kernel(_module("prefill", _PREFILL_DTYPES[1]), batch, sc, o_dtype="f16")
    k, v = batch.ref_kv
    expected = ref.single_attention(batch.q, k, v, causal=True, sm_scale=sc.sm_scale, window_left=20,
                                    pos_encoding_mode="ROPE_LLAMA")
    assert_matches(o, lse, expected, "f16")


# --------------------------------------------------------------------------- #
# Decode family (same template, one query per request)
# --------------------------------------------------------------------------- #
_DECODE_FEATURES = {
    "plain": dict(),
    "rope": dict(pos=PosEncoding.ROPE_LLAMA),
    "alibi": dict(pos=PosEncoding.ALIBI),
    "window": dict(window_left=10),
    "softcap": dict(soft_cap=1.5, sm_scale=0.4),
}


@pytest.mark.parametrize("dtypes", _DECODE_DTYPES, ids=["f32", "bf16"])
@pytest.mark.parametrize("storage,page_size,heads", [("nhd5", 16, (32, 8)), ("hnd5", 64, (4, 1)), ("nhd4", 1, (5, 5))],
                         ids=["nhd-p16-g4", "hnd-p64-mqa", "nhd4-p1-g1"])
@pytest.mark.parametrize("feature", list(_DECODE_FEATURES))
def test_decode_matches_reference(feature, storage, page_size, heads, dtypes):
    kv_lens = [1, 16, 0, 33, 100, 65]
    batch = make_batch(qo_lens=[1] * len(kv_lens), kv_lens=kv_lens, num_qo_heads=heads[0], num_kv_heads=heads[1],
                       head_dim_qk=128, q_dtype=dtypes[0], storage=storage, page_size=page_size,
                       seed=page_size + len(feature))
    check("decode", dtypes, batch, scalars(128, **_DECODE_FEATURES[feature]))


# --------------------------------------------------------------------------- #
# Strides, threads, large pools
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("q_layout", ["fused", "head-major"])
@pytest.mark.parametrize("dtypes", [_PREFILL_DTYPES[0], _PREFILL_DTYPES[1]], ids=["f32", "f16"])
def test_strided_q_o_and_lse(dtypes, q_layout):
    """q sliced from a fused qkv projection or transposed from head-major, o
    and lse views with padded strides."""
    batch = make_batch(qo_lens=[2, 5, 1], kv_lens=[7, 30, 18], num_qo_heads=8, num_kv_heads=2, head_dim_qk=64,
                       q_dtype=dtypes[0], storage="hnd5", seed=15, q_layout=q_layout)
    assert not batch.q.is_contiguous()
    o_full = torch.empty(8, 16, 64, dtype=_TORCH[dtypes[2]])
    lse_full = torch.empty(8, 11, dtype=torch.float32)
    o_full.fill_(7.0)
    lse_full.fill_(7.0)
    o, lse = o_full[:, ::2], lse_full[:, 1:9]  # o: head stride 128; lse: token stride 11
    sc = scalars(64, causal=True)
    run_kernel(_module("prefill", dtypes), batch, sc, o_dtype=dtypes[2], o=o, lse=lse)
    assert_matches(o, lse, reference(batch, sc), dtypes[2])
    assert (o_full[:, 1::2] == 7.0).all() and (lse_full[:, 0] == 7.0).all() and (lse_full[:, 9:] == 7.0).all(), \
        "the kernel wrote outside the o / lse views"


def test_lse_pointer_may_be_null():
    batch = make_batch(qo_lens=[3, 1], kv_lens=[12, 40], num_qo_heads=4, num_kv_heads=1, head_dim_qk=64, seed=16)
    o = torch.full((4, 4, 64), float("nan"))
    sc = scalars(64)
    launch_attention(
        _module("prefill", _PREFILL_DTYPES[0]), q=batch.q, k=batch.k, v=batch.v, o=o, lse=None,
        qo_indptr=batch.qo_indptr, kv_indptr=batch.kv_indptr, kv_indices=batch.kv_indices,
        kv_last_page_len=batch.kv_last_page_len, page_size=16, kv_layout=KVLayout.NHD, custom_mask=None,
        mask_indptr=None, num_kv_heads=1, scalars=sc,
    )
    torch.testing.assert_close(o, reference(batch, sc)[0], atol=_ATOL, rtol=_RTOL["f32"])


@pytest.mark.parametrize("op", ["prefill", "decode"])
def test_result_does_not_depend_on_the_thread_count(op):
    qo_lens = [1] * 6 if op == "decode" else [40, 1, 7, 0, 19, 3]
    batch = make_batch(qo_lens=qo_lens, kv_lens=[50, 3, 64, 10, 31, 0], num_qo_heads=8, num_kv_heads=2,
                       head_dim_qk=64, q_dtype="bf16", seed=17)
    sc = scalars(64, causal=op == "prefill")
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        o1, lse1 = run_kernel(_module(op, ("bf16",) * 3), batch, sc, o_dtype="bf16")
        torch.set_num_threads(max(2, saved))
        o2, lse2 = run_kernel(_module(op, ("bf16",) * 3), batch, sc, o_dtype="bf16")
    finally:
        torch.set_num_threads(saved)
    assert_matches(o1, lse1, reference(batch, sc, decode=op == "decode"), "bf16")
    assert torch.equal(o1, o2) and torch.equal(lse1, lse2), "work split changed the result"


def test_kv_pool_beyond_2_31_elements():
    """Page index x page stride overflows int32: offsets must be int64."""
    page_size, heads, dim = 16, 1, 64
    page_elems = 2 * page_size * heads * dim
    num_pages = (1 << 31) // page_elems + 16  # > 2^31 elements; fp8, so ~2 GiB of untouched virtual memory
    pool = torch.empty((num_pages, 2, page_size, heads, dim), dtype=torch.uint8)
    gen = torch.Generator().manual_seed(18)
    pages = torch.tensor([num_pages - 1, 3, num_pages - 9, num_pages - 2], dtype=torch.int32)
    small = _randn(gen, (4, 2, page_size, heads, dim), torch.float8_e4m3fn)
    pool[pages.long()] = small.view(torch.uint8)  # touches only these pages
    cache = pool.view(torch.float8_e4m3fn)
    assert int(pages[0]) * cache.stride(0) > 2 ** 31
    q = _randn(gen, (2, 4, dim), torch.float16)
    batch = Batch(q, cache[:, 0], cache[:, 1], small, _indptr([1, 1]), torch.tensor([0, 2, 4], dtype=torch.int32),
                  pages, torch.tensor([16, 5], dtype=torch.int32), page_size, KVLayout.NHD, [1, 1], [32, 21])
    sc = scalars(dim)
    o, lse = run_kernel(_module("prefill", _PREFILL_DTYPES[3]), batch, sc, o_dtype="f16", k_scale=0.5, v_scale=2.0)
    # The reference reads the same pages from a small copy of them (page p of `small` is pages[p]).
    local = Batch(q, None, None, small, batch.qo_indptr, batch.kv_indptr, torch.arange(4, dtype=torch.int32),
                  batch.kv_last_page_len, page_size, KVLayout.NHD, [1, 1], [32, 21])
    assert_matches(o, lse, reference(local, sc, k_scale=0.5, v_scale=2.0), "f16")


# --------------------------------------------------------------------------- #
# Errors
# --------------------------------------------------------------------------- #
def _launch_raw(batch: Batch, *, num_kv_heads: int, page_size: int) -> None:
    launch_attention(
        _module("prefill", _PREFILL_DTYPES[0]), q=batch.q, k=batch.k, v=batch.v,
        o=torch.empty(batch.q.shape), lse=None, qo_indptr=batch.qo_indptr, kv_indptr=batch.kv_indptr,
        kv_indices=batch.kv_indices, kv_last_page_len=batch.kv_last_page_len, page_size=page_size,
        kv_layout=KVLayout.NHD, custom_mask=None, mask_indptr=None, num_kv_heads=num_kv_heads, scalars=scalars(64),
    )


def test_rejects_qo_heads_not_a_multiple_of_kv_heads():
    batch = make_batch(qo_lens=[1], kv_lens=[4], num_qo_heads=6, num_kv_heads=4, head_dim_qk=64)
    with pytest.raises(KernelError, match="num_qo_heads=6 must be a positive multiple of num_kv_heads=4"):
        _launch_raw(batch, num_kv_heads=4, page_size=16)


def test_rejects_page_size_below_one():
    batch = make_batch(qo_lens=[1], kv_lens=[4], num_qo_heads=2, num_kv_heads=2, head_dim_qk=64)
    with pytest.raises(KernelError, match="page_size=0 must be >= 1"):
        _launch_raw(batch, num_kv_heads=2, page_size=0)


def test_rejects_last_page_len_beyond_page_size():
    batch = make_batch(qo_lens=[1, 1], kv_lens=[4, 20], num_qo_heads=2, num_kv_heads=2, head_dim_qk=64)
    batch.kv_last_page_len[1] = 17
    with pytest.raises(KernelError, match=r"kv_last_page_len\[1\]=17 is outside \[0, page_size=16\]"):
        _launch_raw(batch, num_kv_heads=2, page_size=16)


def test_prior_states_are_refused_outside_the_cuda_decode_kernel() -> None:
    """The cascade's in-kernel merge (prior_states) is the cuda decode kernel's alone: the cpu kernel
    refuses a plan that asks for it instead of ignoring it."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 64, generator=gen).to(torch.float16)
    k = torch.randn(5, 2, 64, generator=gen).to(torch.float16)
    v = torch.randn(5, 2, 64, generator=gen).to(torch.float16)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(_indptr([3]), _indptr([5]), 4, 2, 64, causal=True, q_data_type=torch.float16)
    wrapper.run(q, k, v)  # the plan itself runs
    wrapper._plan.launch.params.prior_states = 1
    with pytest.raises(KernelError, match="only the cuda decode kernel merges prior states"):
        wrapper.run(q, k, v)

"""GPU checks of the sm90 (Hopper) prefill tier's logits soft cap, sliding window, attention sinks, ALiBi, custom
masks and output dtypes: head_dim
64/128/256, causal or not, ragged and paged KV, GQA packed into the tile rows or not (q token- or
head-major), soft caps that barely bend the logits and ones that saturate them, windows of 0, below,
above and exactly a multiple of the KV block, wider than the keys; batches with qo_len < kv_len,
qo_len > kv_len and empty requests. Outputs are NaN-poisoned; K/V rows in KV blocks that no tile
may load (wholly before the window of a request's first query) are NaN too, so a block that is
loaded instead of skipped fails the test. Each case is compared with the float reference; a few also
with the sm80 tier on the same inputs. The GPU tests skip on GPUs other than sm_90; the check that
the cases cover what they claim runs anywhere."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch

import jitattn
import jitattn.jit
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.kernels import prefill, prefill_sm90
from jitattn.runtime import builder
from jitattn.jit import render
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import PagedBatch, assert_close_lse, assert_close_out, random_paged_batch

bf16, f16 = torch.bfloat16, torch.float16


@dataclass(frozen=True)
class Case:
    d: int
    hq: int
    hkv: int
    dtype: torch.dtype
    causal: bool
    window: int                 # window_left; -1: none
    cap: float | None           # logits_soft_cap; None: none
    qo_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]
    sm_scale: float | None = None
    paged: bool = False
    page: int = 16
    layout: str = "NHD"
    fmt: str = "5d"             # paged cache format: one 5-d tensor or a (k, v) tuple of 4-d ones
    q_head_major: bool = False  # q as a [heads, tokens, dim] tensor's transposed view
    sinks: bool = False         # run(sinks=...): one sink logit per query head (the spec's sink twin)
    alibi: bool = False         # pos_encoding_mode="ALIBI" (the standard slopes; not with a soft cap on this tier)
    mask: bool = False          # a custom mask (not causal): random (every 7th row of a request wholly masked), or:
    mask_kind: str = "random"   # "causal" (lower-triangular: the blocks past a tile's diagonal are hidden from all of
                                # its rows), "bands" (keys in bands of 200, every other band hidden, rows 64-191 none)
                                # or "tree" (a draft tree's verification: every key of the prefix, then a random
                                # ancestor set with the diagonal: the prefix's blocks are open to the whole tile)
    out: torch.dtype | None = None  # plan(o_data_type=...): an output dtype other than q's


# KV blocks: 128 tokens at head_dim 64 (three consumer warpgroups, 192-row tiles) and 128, 80 at 256 (paged: 128 at
# 64 and 128, 64 at 256).
CASES = {
    # ragged
    "d128_g4_bf16_causal_w40_cap30_batch": Case(128, 16, 4, bf16, True, 40, 30.0, (1000, 1, 129, 0, 300, 64),
                                                (1000, 700, 129, 5, 401, 64)),
    "d128_g4_bf16_full_w300": Case(128, 16, 4, bf16, False, 300, None, (513, 7, 256, 40), (77, 1300, 0, 900)),
    "d128_g3_f16_causal_w384_unpacked": Case(128, 6, 2, f16, True, 384, None, (300, 5), (310, 900)),
    "d128_g8_bf16_causal_w200_q_head_major": Case(128, 16, 2, bf16, True, 200, None, (333, 20), (1000, 600),
                                                  q_head_major=True),
    "d128_g4_bf16_causal_w0_short_queries": Case(128, 8, 2, bf16, True, 0, None, (200, 16, 3), (200, 4096, 100)),
    "d128_g4_bf16_causal_wide_window_cap30": Case(128, 8, 2, bf16, True, 100000, 30.0, (300, 2), (5000, 9)),
    "d128_g4_f16_full_cap5_saturated": Case(128, 8, 2, f16, False, -1, 5.0, (257, 64), (700, 64), sm_scale=0.3),
    "d64_mha_f16_causal_w100_cap5": Case(64, 4, 4, f16, True, 100, 5.0, (700, 33, 0), (900, 33, 10), sm_scale=0.3),
    "d64_g8_bf16_full_w500_cap50": Case(64, 8, 1, bf16, False, 500, 50.0, (130, 2), (257, 1000)),
    "d64_g4_bf16_causal_cap30": Case(64, 8, 2, bf16, True, -1, 30.0, (400, 1), (400, 300)),
    "d64_mha_bf16_causal_plain": Case(64, 4, 4, bf16, True, -1, None, (700, 1, 0, 129), (900, 1, 10, 129)),
    "d256_g2_bf16_causal_w20_cap50": Case(256, 8, 4, bf16, True, 20, 50.0, (300, 70), (300, 200)),
    "d256_mha_f16_full_w128": Case(256, 2, 2, f16, False, 128, None, (129, 3), (191, 500)),
    "d256_g8_bf16_causal_w150_head_major": Case(256, 16, 2, bf16, True, 150, None, (160, 7), (500, 160),
                                                q_head_major=True),
    # paged
    "paged_d128_g4_bf16_causal_p16_w40_cap30": Case(128, 16, 4, bf16, True, 40, 30.0, (1000, 1, 129, 0, 300, 64),
                                                    (1000, 700, 129, 5, 401, 64), paged=True),
    "paged_d128_g4_bf16_full_p16_w0_cap5": Case(128, 8, 2, bf16, False, 0, 5.0, (100, 5), (333, 40), sm_scale=0.3,
                                                paged=True, layout="HND"),
    "paged_d128_g3_f16_causal_p16_w176_unpacked": Case(128, 6, 2, f16, True, 176, None, (300, 5), (310, 900),
                                                       paged=True, fmt="tuple4"),
    "paged_d64_mha_f16_full_p1_hnd_w250": Case(64, 4, 4, f16, False, 250, None, (700, 33, 5), (900, 33, 1000),
                                               paged=True, page=1, layout="HND", fmt="tuple4"),
    "paged_d64_g8_bf16_causal_p64_cap30": Case(64, 8, 1, bf16, True, -1, 30.0, (130, 2), (257, 1000), paged=True,
                                               page=64),
    "paged_d256_g2_bf16_causal_p64_w70_cap20": Case(256, 8, 4, bf16, True, 70, 20.0, (300, 70), (300, 400),
                                                    paged=True, page=64),
    "paged_d256_mha_f16_full_p16_w100_head_major": Case(256, 2, 2, f16, False, 100, None, (129, 40), (191, 900),
                                                        paged=True, q_head_major=True),
    # attention sinks (a row with no visible key: 0; the LSE returned stays the keys')
    "sinks_d128_g4_bf16_causal_w40_batch": Case(128, 16, 4, bf16, True, 40, None, (1000, 1, 129, 0, 300, 64),
                                                (1000, 700, 129, 5, 401, 64), sinks=True),
    "sinks_d64_g8_f16_full_cap30": Case(64, 8, 1, f16, False, -1, 30.0, (130, 2), (257, 1000), sinks=True),
    "sinks_paged_d256_g2_bf16_causal_p16_w70": Case(256, 8, 4, bf16, True, 70, None, (300, 70), (300, 400),
                                                    paged=True, sinks=True),
    "sinks_paged_d128_g4_bf16_causal_p64": Case(128, 16, 4, bf16, True, -1, None, (200, 1, 0), (1000, 65, 3),
                                                paged=True, page=64, sinks=True),
    # ALiBi (slopes of 12 heads: not a power of two, so both halves of the standard sequence), GQA packed and not,
    # keys before and after the queries (non-causal: positive biases), with a window and with sinks
    "alibi_d128_g4_bf16_causal_batch": Case(128, 12, 3, bf16, True, -1, None, (1000, 1, 129, 0, 300, 64),
                                            (1000, 700, 129, 5, 401, 64), alibi=True),
    "alibi_d128_g3_f16_full_w300_unpacked": Case(128, 6, 2, f16, False, 300, None, (513, 7, 40), (77, 1300, 900),
                                                 alibi=True),
    "alibi_d64_mha_bf16_causal": Case(64, 12, 12, bf16, True, -1, None, (700, 33, 0), (900, 33, 10), alibi=True),
    "alibi_d256_g2_f16_full": Case(256, 8, 4, f16, False, -1, None, (129, 3), (191, 500), alibi=True),
    "alibi_paged_d128_g4_bf16_causal_p16_w40_sinks": Case(128, 16, 4, bf16, True, 40, None, (300, 1, 64),
                                                          (700, 129, 64), paged=True, sinks=True, alibi=True),
    "alibi_paged_d64_g8_f16_full_p64": Case(64, 8, 1, f16, False, -1, None, (130, 2), (257, 1000), paged=True, page=64,
                                            alibi=True),
    # custom masks: rows of a request start at any bit of a byte (kv_len not a multiple of 8), GQA packed and not,
    # with a window, a soft cap, ALiBi, sinks
    "mask_d128_g4_bf16_batch": Case(128, 16, 4, bf16, False, -1, None, (300, 1, 129, 0, 64), (700, 129, 5, 401, 64),
                                    mask=True),
    "mask_d128_g3_f16_w100_cap30_unpacked": Case(128, 6, 2, f16, False, 100, 30.0, (257, 3), (333, 1000), mask=True),
    "mask_d64_mha_bf16_alibi": Case(64, 4, 4, bf16, False, -1, None, (200, 33), (431, 33), mask=True, alibi=True),
    "mask_d256_g2_f16": Case(256, 8, 4, f16, False, -1, None, (129, 7), (191, 500), mask=True),
    "mask_paged_d128_g4_bf16_p16_sinks": Case(128, 16, 4, bf16, False, -1, None, (300, 1, 64), (701, 129, 64),
                                              paged=True, sinks=True, mask=True),
    "mask_paged_d64_g8_f16_p64_w300": Case(64, 8, 1, f16, False, 300, None, (130, 2), (257, 1003), paged=True, page=64,
                                           mask=True),
    "mask_causal_d128_g4_bf16_batch": Case(128, 16, 4, bf16, False, -1, None, (1000, 1, 300), (1000, 700, 1300),
                                           mask=True, mask_kind="causal"),
    "mask_bands_d64_mha_f16_alibi": Case(64, 4, 4, f16, False, -1, None, (700, 33), (1500, 900), mask=True,
                                         mask_kind="bands", alibi=True),
    "mask_tree_d128_g4_bf16_batch": Case(128, 16, 4, bf16, False, -1, None, (64, 63, 5), (4160, 1000, 300), mask=True,
                                         mask_kind="tree"),
    "mask_tree_paged_d64_g8_f16_p16": Case(64, 8, 1, f16, False, -1, None, (48, 1), (2100, 777), paged=True, mask=True,
                                           mask_kind="tree"),
    "mask_bands_paged_d256_g2_bf16_p16": Case(256, 8, 4, bf16, False, -1, None, (300, 5), (1000, 401), paged=True,
                                              mask=True, mask_kind="bands"),
    # page 5: the gathered loads, which load every block (the TMA loads skip blocks a tile does not need)
    "mask_bands_paged_d128_g4_bf16_p5": Case(128, 16, 4, bf16, False, -1, None, (300, 5), (1000, 401), paged=True,
                                             page=5, mask=True, mask_kind="bands"),
    # an output dtype other than q's: float32 (paired 8-byte stores) and the other 16-bit type
    "out_f32_d128_g4_bf16_causal": Case(128, 16, 4, bf16, True, -1, None, (300, 1, 129), (700, 129, 129), out=torch.float32),
    "out_bf16_paged_d64_mha_f16_full_alibi": Case(64, 4, 4, f16, False, -1, None, (130, 2), (257, 1000), paged=True,
                                                  alibi=True, out=bf16),
    "out_f32_d256_g2_bf16_mask": Case(256, 8, 4, bf16, False, -1, None, (129, 7), (191, 500), mask=True,
                                      out=torch.float32),
}
AGREE_WITH_SM80 = ["d128_g4_bf16_causal_w40_cap30_batch", "paged_d128_g4_bf16_causal_p16_w40_cap30",
                   "d64_mha_f16_causal_w100_cap5", "d256_g2_bf16_causal_w20_cap50", "alibi_d128_g4_bf16_causal_batch",
                   "alibi_paged_d64_g8_f16_full_p64", "mask_d128_g4_bf16_batch", "mask_paged_d64_g8_f16_p64_w300"]


def _spec(c: Case):
    return attention_spec(
        Op.PREFILL, Target.CUDA, q_dtype=c.dtype, kv_dtype=c.dtype, o_dtype=c.out or c.dtype, head_dim_qk=c.d,
        head_dim_vo=c.d,
        num_qo_heads=c.hq, num_kv_heads=c.hkv, pos_encoding=PosEncoding.ALIBI if c.alibi else PosEncoding.NONE,
        use_sliding_window=c.window >= 0,
        use_logits_soft_cap=c.cap is not None,
        mask_mode=MaskMode.CUSTOM if c.mask else MaskMode.CAUSAL if c.causal else MaskMode.NONE,
        kv_layout=KVLayout.parse(c.layout, "layout"), kv_storage=KVStorage.PAGED if c.paged else KVStorage.RAGGED,
    )


GPU_SPECS = [_spec(c) for c in CASES.values()] + [_spec(c).replace(use_sinks=True) for c in CASES.values() if c.sinks]


@pytest.fixture
def hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the sm90 prefill tier needs an sm_90 GPU")


def _indptr(lens) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(list(lens)).cumsum(0).tolist(), dtype=torch.int32)


def _never_loaded(c: Case, kv_block: int) -> list[int]:
    """Per request: the keys before its first KV block any tile walks (the block holding the window
    start of its first query): no tile may load them."""
    if c.window < 0:
        return [0] * len(c.kv_lens)
    return [max(0, kv - qo - c.window) // kv_block * kv_block for qo, kv in zip(c.qo_lens, c.kv_lens)]


def _queries(c: Case, gen: torch.Generator) -> torch.Tensor:
    n = sum(c.qo_lens)
    if c.q_head_major:  # strides (1 * d, n * d, 1): the packed Q box lands head-major in shared memory
        return torch.randn(c.hq, n, c.d, generator=gen).to(c.dtype).cuda().transpose(0, 1)
    return torch.randn(n, c.hq, c.d, generator=gen).to(c.dtype).cuda()


def _mask(c: Case) -> torch.Tensor | None:
    """The flattened bool mask of a mask case (each request's qo_len x kv_len rows, concatenated), else None."""
    if not c.mask:
        return None
    gen = torch.Generator().manual_seed(sum(c.qo_lens) * 31 + sum(c.kv_lens))
    rows = []
    for qo, kv in zip(c.qo_lens, c.kv_lens):
        if c.mask_kind == "causal":
            m = torch.arange(kv)[None, :] <= torch.arange(qo)[:, None] + (kv - qo)
        elif c.mask_kind == "tree":
            m = torch.ones(qo, kv, dtype=torch.bool)
            m[:, kv - qo:] = (torch.rand(qo, qo, generator=gen) < 0.5).tril()
            m[:, kv - qo:] |= torch.eye(qo, dtype=torch.bool)
        elif c.mask_kind == "bands":
            m = (torch.arange(kv)[None, :] // 200 % 2 == 0).expand(qo, kv).clone()
            m[64:192] = False
        else:
            m = torch.rand(qo, kv, generator=gen) < 0.6
            m[::7] = False
        rows.append(m.flatten())
    return torch.cat(rows)


def _plan_kw(c: Case) -> dict:
    return dict(causal=c.causal, window_left=c.window, logits_soft_cap=c.cap, sm_scale=c.sm_scale, q_data_type=c.dtype,
                kv_data_type=c.dtype, pos_encoding_mode="ALIBI" if c.alibi else "NONE", custom_mask=_mask(c),
                o_data_type=c.out or c.dtype)


def _ref_kw(c: Case) -> dict:
    return dict(causal=c.causal, window_left=c.window, logits_soft_cap=c.cap, sm_scale=c.sm_scale,
                pos_encoding_mode="ALIBI" if c.alibi else "NONE", custom_mask=_mask(c))


def _sinks(c: Case, seed: int) -> torch.Tensor | None:
    """Sink logits from "the sink dominates" to "negligible" against lse ~ log(kv_len), or None."""
    if not c.sinks:
        return None
    return (torch.randn(c.hq, generator=torch.Generator().manual_seed(seed)) * 3 + 4).cuda()


def _run(wrapper, q: torch.Tensor, *kv, sinks: torch.Tensor | None = None,
         out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.full((q.shape[0], q.shape[1], q.shape[2]), float("nan"), dtype=out_dtype or q.dtype, device="cuda")
    lse = torch.full((q.shape[0], q.shape[1]), float("nan"), device="cuda")
    if sinks is None:
        wrapper.run(q, *kv, out=out, lse=lse)
    else:
        wrapper.run(q, *kv, out=out, lse=lse, sinks=sinks)
    return out, lse


def _workspace() -> torch.Tensor:
    return torch.empty(1 << 20, dtype=torch.uint8, device="cuda")


# ---- ragged ---------------------------------------------------------------------------------

def _ragged_kv(c: Case, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    n = sum(c.kv_lens)
    return tuple(torch.randn(n, c.hkv, c.d, generator=gen).to(c.dtype).cuda() for _ in range(2))


def _ragged_wrapper(c: Case):
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    wrapper.plan(_indptr(c.qo_lens), _indptr(c.kv_lens), c.hq, c.hkv, c.d, **_plan_kw(c))
    return wrapper


def _poison_ragged(c: Case, k: torch.Tensor, v: torch.Tensor, kv_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = k.clone(), v.clone()
    starts = _indptr(c.kv_lens).tolist()
    for r, n in enumerate(_never_loaded(c, kv_block)):
        k[starts[r]:starts[r] + n] = float("nan")
        v[starts[r]:starts[r] + n] = float("nan")
    return k, v


# ---- paged ----------------------------------------------------------------------------------

def _slot_rows(c: Case, batch: PagedBatch, page_id: int, slots: slice) -> list[torch.Tensor]:
    """Views of K's and V's rows in slots ``slots`` of page ``page_id`` (all heads)."""
    if c.fmt == "5d":
        cache = batch.cache
        return [cache[page_id, :, slots] if c.layout == "NHD" else cache[page_id, :, :, slots]]
    return [t[page_id, slots] if c.layout == "NHD" else t[page_id, :, slots] for t in batch.cache]


def _paged_batch(c: Case, gen: torch.Generator, kv_block: int | None) -> PagedBatch:
    """A random paged batch; with ``kv_block``: NaN in every unreferenced page, past each last page's
    length, and in the keys no tile may load."""
    batch = random_paged_batch(list(c.kv_lens), c.hkv, c.d, c.page, c.dtype, c.layout, c.fmt, "cuda", generator=gen,
                               spare_pages=5)
    if kv_block is None:
        return batch
    used = set(batch.kv_indices.tolist())
    pool = (batch.cache if c.fmt == "5d" else batch.cache[0]).shape[0]
    for page_id in range(pool):
        if page_id not in used:
            for rows in _slot_rows(c, batch, page_id, slice(None)):
                rows.fill_(float("nan"))
    indptr, indices = batch.kv_indptr.tolist(), batch.kv_indices.tolist()
    for r, (n, skipped) in enumerate(zip(c.kv_lens, _never_loaded(c, kv_block))):
        if n == 0:
            continue
        last = int(batch.kv_last_page_len[r])
        for rows in _slot_rows(c, batch, indices[indptr[r + 1] - 1], slice(last, c.page)):
            rows.fill_(float("nan"))
        for key in range(skipped):
            page_id = indices[indptr[r] + key // c.page]
            for rows in _slot_rows(c, batch, page_id, slice(key % c.page, key % c.page + 1)):
                rows.fill_(float("nan"))
    return batch


def _paged_wrapper(c: Case, batch: PagedBatch):
    wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(_workspace(), c.layout)
    wrapper.plan(_indptr(c.qo_lens), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, c.hq, c.hkv, c.d,
                 c.page, **_plan_kw(c))
    return wrapper


def _paged_reference(c: Case, q: torch.Tensor, batch: PagedBatch):
    return reference.batch_prefill_paged(q, batch.cache, _indptr(c.qo_lens), batch.kv_indptr, batch.kv_indices,
                                         batch.kv_last_page_len, kv_layout=c.layout, **_ref_kw(c))


# ---- the tests ------------------------------------------------------------------------------

def test_the_cases_exercise_what_they_claim():
    """Windows meet their kernel's KV block from below, above and at a multiple of it; some requests have
    keys no tile loads (the skip is tested), some rows see no key."""
    for case_id, c in CASES.items():
        assert prefill_sm90.sm90_unsupported(_spec(c)) is None, case_id
    block = {case_id: prefill_sm90.sm90_layout(_spec(c))["kBN"] for case_id, c in CASES.items()}
    windows = [(c.window, block[case_id]) for case_id, c in CASES.items() if c.window >= 0]
    assert any(w < b for w, b in windows) and any(w > b and w % b for w, b in windows)
    assert any(w > 0 and w % b == 0 for w, b in windows) and any(w == 0 for w, b in windows)
    assert sum(any(_never_loaded(c, block[case_id])) for case_id, c in CASES.items()) >= 8
    assert all(any(c.paged == paged and c.d == d for c in CASES.values())
               for d in (64, 128, 256) for paged in (False, True))
    assert any(prefill_sm90.sm90_pack(_spec(c)) > 1 for c in CASES.values())
    assert any(prefill_sm90.sm90_pack(_spec(c)) == 1 and c.hq > c.hkv for c in CASES.values())
    alibi = [c for c in CASES.values() if c.alibi]
    assert {c.d for c in alibi} == {64, 128, 256} and {c.paged for c in alibi} == {False, True}
    assert any(c.causal for c in alibi) and any(not c.causal for c in alibi)
    assert any(prefill_sm90.sm90_pack(_spec(c)) > 1 for c in alibi) and any(c.hq & (c.hq - 1) for c in alibi)
    assert not any(c.alibi and c.cap is not None for c in CASES.values())  # not on this tier (it falls back)
    assert {c.out for c in CASES.values()} == {None, torch.float32, bf16}
    masks = [c for c in CASES.values() if c.mask]
    assert {c.mask_kind for c in masks} == {"random", "causal", "bands", "tree"}
    assert {c.d for c in masks} == {64, 128, 256} and {c.paged for c in masks} == {False, True}
    assert not any(c.causal for c in masks) and any(kv % 8 for c in masks for kv in c.kv_lens)
    assert any(prefill_sm90.sm90_pack(_spec(c)) > 1 for c in masks)
    assert any(prefill_sm90.sm90_pack(_spec(c)) == 1 for c in masks)


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", list(CASES))
def test_sm90_variant_axes_match_reference(case_id, hopper):
    _check_against_reference(case_id)


# SM90_TUNING row_sum_mma: the P V GEMM of these head dims sums P's rows (8 more columns reading a block of ones).
# Each case builds its own module here; JITATTN_DEV_SM90_TUNING='{"row_sum_mma": 1}' runs every test of the sm90
# files with it instead (their modules pre-built in parallel).
ROW_SUM_CASES = [case_id for case_id, c in CASES.items() if c.d in prefill_sm90.ROW_SUM_MMA_DIMS]


def test_row_sum_mma_layout():
    """With row_sum_mma the ones sit after every V stage (each P V descriptor's lbo reaches them forward, within
    its 14-bit field) and inside the block's shared memory; other head dims, and the knob off, keep their layout."""
    d64, d128 = _spec(CASES[ROW_SUM_CASES[0]]), _spec(CASES["d128_g4_bf16_full_w300"])
    before = {spec: prefill_sm90.sm90_layout(spec) for spec in (d64, d128)}
    saved = dict(prefill_sm90.SM90_TUNING)
    try:
        prefill_sm90.SM90_TUNING["row_sum_mma"] = 1
        on = prefill_sm90.sm90_layout(d64)
        assert on["kRowSumMma"] == 1 and on["kOnesBytes"] == 16 * 128 and on["kOffOnes"] % 1024 == 0
        assert on["kOffOnes"] >= on["kOffV"] + on["kStages"] * on["kVBytes"]
        assert on["kOffOnes"] - on["kOffV"] < 1 << 18 and on["kOffOnes"] + on["kOnesBytes"] + 1024 <= on["kSmemBytes"]
        template, context = prefill.select(d64, ("9.0a",))
        assert template == prefill_sm90.TEMPLATE_SM90 and ("int", "kRowSumMma", "1") in context["constants"]
        assert prefill_sm90.sm90_layout(d128) == before[d128]
    finally:
        prefill_sm90.SM90_TUNING.clear()
        prefill_sm90.SM90_TUNING.update(saved)
    assert before[d64]["kRowSumMma"] == 0 and before[d64]["kOnesBytes"] == 0
    assert {c.d for c in map(CASES.get, ROW_SUM_CASES)} == {64} and len(ROW_SUM_CASES) >= 10


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", ROW_SUM_CASES)
def test_sm90_row_sum_mma_matches_reference(case_id, hopper, monkeypatch, fresh_registry):
    """Every head-dim-64 case (sinks, ALiBi, masks, windows, soft caps, paged, other output dtypes) with the row sums
    taken by the P V GEMM: the output the float reference's; the LSE is of the 16-bit P, so its bound is the plain
    kernel's 2e-3 plus P's rounding (2^-9 relative in the sum: ALiBi d64 measured 2.6e-3 on 2 of 8796 rows)."""
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "row_sum_mma", 1)
    jitattn.jit._registry.clear()
    assert prefill_sm90.sm90_layout(_spec(CASES[case_id]))["kRowSumMma"] == 1
    _check_against_reference(case_id, lse_atol=2e-3 + 2.0 ** -9)


def _check_against_reference(case_id: str, lse_atol: float = 2e-3) -> tuple[torch.Tensor, torch.Tensor]:
    """Case ``case_id`` on the sm90 tier against the float reference (K / V no tile may load poisoned); its output
    and LSE."""
    c = CASES[case_id]
    spec = _spec(c)
    assert "sm90 tier" in render(spec)["kernel.cu"]
    if c.sinks:
        assert "sm90 tier" in render(spec.replace(use_sinks=True))["kernel.cu"]
    kv_block = prefill_sm90.sm90_layout(spec)["kBN"]
    seed = sum(map(ord, case_id))
    q = _queries(c, torch.Generator().manual_seed(seed))
    sinks = _sinks(c, seed + 2)
    if c.paged:
        clean = _paged_batch(c, torch.Generator().manual_seed(seed + 1), None)
        poisoned = _paged_batch(c, torch.Generator().manual_seed(seed + 1), kv_block)  # the same values, plus NaN
        out, lse = _run(_paged_wrapper(c, poisoned), q, poisoned.cache, sinks=sinks, out_dtype=c.out)
        ref_o, ref_lse = _paged_reference(c, q, clean)
    else:
        k, v = _ragged_kv(c, torch.Generator().manual_seed(seed + 1))
        out, lse = _run(_ragged_wrapper(c), q, *_poison_ragged(c, k, v, kv_block), sinks=sinks, out_dtype=c.out)
        ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(c.qo_lens), _indptr(c.kv_lens), **_ref_kw(c))
    if sinks is not None:
        ref_o = reference.apply_sinks(ref_o, ref_lse, sinks)
    assert out.dtype == (c.out or c.dtype)
    assert_close_out(out, ref_o, c.dtype)
    assert_close_lse(lse, ref_lse, atol=lse_atol)
    return out, lse


# SM90_TUNING wg_skip: the causal or windowed cases (no custom mask) whose tiles hold one query head (each warpgroup
# 64 consecutive tokens)
WG_SKIP_CASES = [case_id for case_id, c in CASES.items()
                 if (c.causal or c.window >= 0) and not c.mask and prefill_sm90.sm90_layout(_spec(c))["kPackG"] == 1]


def test_wg_skip_takes_causal_tiles_of_one_query_head() -> None:
    """kWgSkip: causal or windowed tiles of 64 consecutive tokens a warpgroup (d64, unpacked d128) skip per
    warpgroup; packed GQA tiles (every warpgroup the tile's tokens), custom masks and full attention do not."""
    assert len(WG_SKIP_CASES) >= 5 and {64, 128, 256} <= {CASES[c].d for c in WG_SKIP_CASES}
    assert any(not CASES[c].causal for c in WG_SKIP_CASES) and any(CASES[c].window >= 0 for c in WG_SKIP_CASES)
    if not prefill_sm90.SM90_TUNING["wg_skip"]:
        pytest.skip("JITATTN_DEV_SM90_TUNING turned wg_skip off")
    for case_id, c in CASES.items():
        layout = prefill_sm90.sm90_layout(_spec(c))
        assert layout["kWgSkip"] == int(case_id in WG_SKIP_CASES), case_id
    assert any(CASES[c].paged for c in WG_SKIP_CASES) and any(not CASES[c].paged for c in WG_SKIP_CASES)


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", WG_SKIP_CASES)
def test_sm90_wg_skip_gives_the_same_bits(case_id, hopper, monkeypatch, fresh_registry):
    """A warpgroup skipping the blocks past its rows' keys (wg_skip 1) and computing them masked (0): the same bits,
    both the reference's."""
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "wg_skip", 1)  # (also under JITATTN_DEV_SM90_TUNING's wg_skip 0)
    jitattn.jit._registry.clear()
    assert prefill_sm90.sm90_layout(_spec(CASES[case_id]))["kWgSkip"] == 1
    skipped = _check_against_reference(case_id)
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "wg_skip", 0)
    jitattn.jit._registry.clear()
    assert prefill_sm90.sm90_layout(_spec(CASES[case_id]))["kWgSkip"] == 0
    computed = _check_against_reference(case_id)
    assert torch.equal(skipped[0], computed[0]) and torch.equal(skipped[1], computed[1])


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", AGREE_WITH_SM80)
def test_sm90_and_sm80_tiers_agree_on_the_variant_axes(case_id, hopper, monkeypatch, fresh_registry):
    c = CASES[case_id]
    seed = sum(map(ord, case_id)) + 7
    q = _queries(c, torch.Generator().manual_seed(seed))
    if c.paged:
        batch = _paged_batch(c, torch.Generator().manual_seed(seed + 1), None)
    else:
        k, v = _ragged_kv(c, torch.Generator().manual_seed(seed + 1))
    results = {}
    for tier in ("sm90", "sm80"):
        monkeypatch.setenv("JITATTN_PREFILL_TIER", tier)
        jitattn.jit._registry.clear()
        assert ("sm90 tier" in render(_spec(c))["kernel.cu"]) == (tier == "sm90")
        if c.paged:
            results[tier] = _run(_paged_wrapper(c, batch), q, batch.cache)
        else:
            results[tier] = _run(_ragged_wrapper(c), q, k, v)
    assert_close_out(results["sm90"][0], results["sm80"][0].float(), c.dtype)
    assert_close_lse(results["sm90"][1], results["sm80"][1])


# A custom variant on the sm90 tier: a logits mask and transform reading the request, positions and heads, and an
# output transform reading a per-(request, head) parameter tensor; GQA packed (d128) and not (d64).
BIAS_GATE = jitattn.AttentionVariant(
    "biasgate", logits_mask="(kv_idx + q_idx) % 5 != 3",
    logits_transform="logits + slope * float(kv_idx - (kv_len - qo_len + q_idx)) + 0.1f * float(qo_head % 3)",
    output_transform="out * gate[request * gate_size1 + qo_head]",
    params=(jitattn.VariantParam("slope", "f32"), jitattn.VariantParam("gate", "f32", rank=2)),
)


@pytest.mark.gpu
@pytest.mark.parametrize("d,hq,hkv,causal", [(128, 16, 4, True), (64, 8, 2, False)])
def test_sm90_custom_variant_matches_reference(d, hq, hkv, causal, hopper):
    gen = torch.Generator().manual_seed(d + hq)
    qo_lens, kv_lens = (300, 1, 129, 0), (700, 129, 129, 9)
    q = torch.randn(sum(qo_lens), hq, d, generator=gen).to(bf16).cuda()
    k, v = (torch.randn(sum(kv_lens), hkv, d, generator=gen).to(bf16).cuda() for _ in range(2))
    slope, gate = 0.03, torch.rand(len(qo_lens), hq, generator=gen) + 0.5
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace())
    wrapper.plan(_indptr(qo_lens), _indptr(kv_lens), hq, hkv, d, causal=causal, q_data_type=bf16, variant=BIAS_GATE)
    assert "sm90 tier" in render(_spec(Case(d, hq, hkv, bf16, causal, -1, None, qo_lens, kv_lens)).replace(
        variant=BIAS_GATE))["kernel.cu"]
    out, lse = wrapper.run(q, k, v, return_lse=True, slope=slope, gate=gate.cuda())
    ref_o, ref_lse = reference.variant_attention(
        q.cpu(), k.cpu(), v.cpu(), _indptr(qo_lens), _indptr(kv_lens), causal=causal,
        logits_mask=lambda q_idx, kv_idx, **_: (kv_idx + q_idx) % 5 != 3,
        logits_transform=lambda logits, q_idx, kv_idx, qo_len, kv_len, qo_head, **_:
            logits + slope * (kv_idx - (kv_len - qo_len + q_idx)) + 0.1 * (qo_head % 3),
        output_transform=lambda out, request, qo_head, **_: out * gate.double()[request][qo_head])
    assert_close_out(out, ref_o, bf16)
    assert_close_lse(lse, ref_lse)


MASK_CASES = [case_id for case_id, c in CASES.items() if c.mask]


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", MASK_CASES)
def test_sm90_mask_states_give_the_in_kernel_classifications_bits(case_id, hopper):
    """A custom-mask plan writes its blocks' states once (``mask_states``) and its launches read them; a launch
    without them classifies each block from the mask rows itself. Both give the same bits (the states decide only
    what is skipped or left unmasked), and the states are what the plan wrote: hidden, masked or open."""
    c = CASES[case_id]
    seed = sum(map(ord, case_id)) + 7
    q = _queries(c, torch.Generator().manual_seed(seed))
    if c.paged:
        batch = _paged_batch(c, torch.Generator().manual_seed(seed + 1), None)
        wrapper, kv = _paged_wrapper(c, batch), (batch.cache,)
    else:
        wrapper, kv = _ragged_wrapper(c), _ragged_kv(c, torch.Generator().manual_seed(seed + 1))
    plan = wrapper._plan  # (the plan's own fields: this test checks the two paths through one plan)
    assert plan.mask_states is not None and plan.launch.params.workspace == plan.mask_states.data_ptr()
    stride = int(plan.mask_states[:4].view(torch.int32).item())
    assert stride > 0 and stride % 4 == 0
    with_states = _run(wrapper, q, *kv, out_dtype=c.out)
    plan.launch.params.workspace, plan.launch.params.workspace_bytes = None, 0
    without = _run(wrapper, q, *kv, out_dtype=c.out)
    assert torch.equal(with_states[0], without[0]) and torch.equal(with_states[1], without[1])
    rows = plan.mask_states[prefill_sm90.MASK_STATES_HEADER:].cpu()
    expected_states, expected_ends = _expected_states(c, stride)
    assert expected_states == {at: int(rows[at]) for at in expected_states}
    ends = {at: int(rows[at:at + 4].view(torch.int32).item()) for at in expected_ends}
    assert expected_ends == ends and any(ends.values())


@pytest.mark.gpu
def test_sm90_mask_states_under_cuda_graphs_follow_each_plan(hopper, monkeypatch):
    """Under CUDA graphs each plan writes its blocks' states into the wrapper's buffer (made by its first custom-mask
    plan, at its address from then on): a run captured on one plan replays every later plan's mask exactly, and a
    plan whose states do not fit the buffer finds a header of 0 there, its kernel classifying blocks itself."""
    monkeypatch.setattr(builder, "GRAPH_MASK_STATES_HEADROOM", 1)  # the buffer: the first plan's bytes exactly
    monkeypatch.setattr(builder, "GRAPH_MASK_STATES_MIN", 0)
    first = CASES["mask_causal_d128_g4_bf16_batch"]
    plans = [first, replace(first, mask_kind="random"),  # the same bytes: states
             replace(first, qo_lens=(64, 63, 5), kv_lens=(4160, 1000, 300), mask_kind="tree"),  # fewer: states
             replace(first, kv_lens=(1000, 700, 8000))]  # more KV blocks a row: header 0
    gen = torch.Generator().manual_seed(5)
    rows, kv_rows = max(sum(c.qo_lens) for c in plans), max(sum(c.kv_lens) for c in plans)
    q = torch.randn(rows, first.hq, first.d, generator=gen).to(bf16).cuda()
    k, v = (torch.randn(kv_rows, first.hkv, first.d, generator=gen).to(bf16).cuda() for _ in range(2))
    out = torch.empty_like(q)
    lse = torch.empty(rows, first.hq, device="cuda")
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(
        _workspace(), use_cuda_graph=True, qo_indptr_buf=torch.empty(4, dtype=torch.int32, device="cuda"),
        kv_indptr_buf=torch.empty(4, dtype=torch.int32, device="cuda"),
        custom_mask_buf=torch.empty(1 << 20, dtype=torch.uint8, device="cuda"),
        mask_indptr_buf=torch.empty(4, dtype=torch.int32, device="cuda"))
    graph = torch.cuda.CUDAGraph()
    for i, c in enumerate(plans):
        wrapper.plan(_indptr(c.qo_lens), _indptr(c.kv_lens), c.hq, c.hkv, c.d, **_plan_kw(c))
        states = wrapper._plan.mask_states
        if i == 0:
            wrapper.run(q, k, v, out=out, lse=lse)  # loads the module outside the capture
            torch.cuda.synchronize()
            buffer = states
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
                wrapper.run(q, k, v, out=out, lse=lse)
        assert states.data_ptr() == buffer.data_ptr() == wrapper._plan.launch.params.workspace
        assert (int(states[:4].view(torch.int32).item()) > 0) == (i < 3)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        n = sum(c.qo_lens)
        ref_o, ref_lse = reference.batch_ragged_attention(q[:n], k, v, _indptr(c.qo_lens), _indptr(c.kv_lens),
                                                          **_ref_kw(c))
        assert_close_out(out[:n], ref_o, bf16)
        assert_close_lse(lse[:n], ref_lse, atol=2e-3)


# SM90_TUNING q_buffers 2: the mask cases whose tile fits shared memory with a second query buffer
Q_BUFFERS_MASK_CASES = ["mask_bands_d64_mha_f16_alibi", "mask_tree_paged_d64_g8_f16_p16",
                        "mask_bands_paged_d128_g4_bf16_p5"]


def test_the_two_query_buffer_cases_are_mask_cases_that_fit(monkeypatch):
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "q_buffers", 2)
    for case_id in Q_BUFFERS_MASK_CASES:
        assert CASES[case_id].mask and prefill_sm90.sm90_layout(_spec(CASES[case_id]))["kQBufs"] == 2


@pytest.mark.gpu
@pytest.mark.parametrize("case_id", Q_BUFFERS_MASK_CASES)
def test_sm90_custom_masks_with_two_query_buffers(case_id, hopper, monkeypatch, fresh_registry):
    """With two query buffers a tile's walk (its hidden tail trimmed by the plan's states) reaches the consumers in
    its query buffer's word: each of the two tiles in flight walks its own count, and the output is the
    reference's."""
    monkeypatch.setitem(prefill_sm90.SM90_TUNING, "q_buffers", 2)
    jitattn.jit._registry.clear()
    assert prefill_sm90.sm90_layout(_spec(CASES[case_id]))["kQBufs"] == 2
    _check_against_reference(case_id)


@pytest.mark.gpu
def test_sm90_custom_mask_plans_and_runs_an_empty_batch(hopper):
    """A custom-mask plan of no requests has no blocks' states to write: it plans and runs (an empty output)."""
    c = CASES["mask_d128_g4_bf16_batch"]
    empty = torch.zeros(1, dtype=torch.int32)
    for use_cuda_graph in (False, True):
        graph_bufs = dict(qo_indptr_buf=torch.empty(4, dtype=torch.int32, device="cuda"),
                          kv_indptr_buf=torch.empty(4, dtype=torch.int32, device="cuda"),
                          custom_mask_buf=torch.empty(64, dtype=torch.uint8, device="cuda"),
                          mask_indptr_buf=torch.empty(4, dtype=torch.int32, device="cuda")) if use_cuda_graph else {}
        wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(_workspace(), use_cuda_graph=use_cuda_graph,
                                                               **graph_bufs)
        wrapper.plan(empty, empty, c.hq, c.hkv, c.d, custom_mask=torch.zeros(0, dtype=torch.bool), q_data_type=c.dtype)
        assert wrapper._plan.mask_states is None
        q = torch.empty(0, c.hq, c.d, dtype=c.dtype, device="cuda")
        k = torch.empty(0, c.hkv, c.d, dtype=c.dtype, device="cuda")
        assert wrapper.run(q, k, k).shape == (0, c.hq, c.d)


def _expected_states(c: Case, stride: int) -> tuple[dict[int, int], dict[int, int]]:
    """Byte offset -> state (0 hidden, 1 masked, 2 open) of every (virtual tile, block) pair the kernel walks, and
    byte offset -> one past the last block some query of the tile sees (0: none) of every virtual tile, from the
    case's mask (a request's tiles last first, and from the block of the first query's window start, as the
    kernel's decode_item)."""
    layout = prefill_sm90.sm90_layout(_spec(c))
    bm, bn, pack = layout["kBM"], layout["kBN"], layout["kPackG"]
    mask, offset, states, ends = _mask(c), 0, {}, {}
    starts = _indptr(c.qo_lens).tolist()
    for r, (qo, kv) in enumerate(zip(c.qo_lens, c.kv_lens)):
        rows = mask[offset:offset + qo * kv].view(qo, kv)
        offset += qo * kv
        tiles = -(-qo * pack // bm)
        for local in range(tiles):
            tok0 = (tiles - 1 - local) * bm // pack
            tile = rows[tok0:tok0 + bm // pack]
            first = max(0, kv - qo + tok0 - c.window) // bn if c.window >= 0 else 0  # the window's first block
            row = (r + starts[r] * pack // bm + local) * (4 + stride)
            ends[row] = 0
            for j in range(first, -(-kv // bn)):
                seen = tile[:, j * bn:(j + 1) * bn]
                states[row + 4 + j] = 2 if bool(seen.all()) else 1 if bool(seen.any()) else 0
                ends[row] = j + 1 if bool(seen.any()) else ends[row]
    return states, ends

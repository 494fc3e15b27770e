"""Tests proving the float64 reference (jitattn/reference.py) is itself right.

Each test checks the reference against an independent formulation (torch SDPA,
explicit logits, hand-computed values, algebraic identities).
"""

from __future__ import annotations

import importlib.util
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F


def _load_reference():
    try:
        from jitattn import reference as mod  # type: ignore

        return mod
    except Exception:
        path = pathlib.Path(__file__).resolve().parents[1] / "jitattn" / "reference.py"
        spec = importlib.util.spec_from_file_location("_jitattn_reference_under_test", path)
        mod = importlib.util.module_from_spec(spec)
        assert spec.loader is not None
        spec.loader.exec_module(mod)
        return mod


ref = _load_reference()

F64 = torch.float64
ATOL = 1e-5
RTOL = 1e-5


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _randn(g, *shape, dtype=F64):
    return torch.randn(*shape, generator=g, dtype=F64).to(dtype)


def _sdpa(q, k, v, *, attn_mask=None, scale=None, is_causal=False):
    """SDPA on [len, H, D] tensors (same number of heads), float64."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).to(F64),
        k.transpose(0, 1).to(F64),
        v.transpose(0, 1).to(F64),
        attn_mask=attn_mask,
        scale=scale,
        is_causal=is_causal,
    )
    return out.transpose(0, 1)


def _bottom_right_causal(qo_len, kv_len):
    i = torch.arange(qo_len)[:, None]
    j = torch.arange(kv_len)[None, :]
    return j <= (kv_len - qo_len) + i


def _explicit_logits(q, k, scale):
    """[H, qo, kv] logits with GQA via repeat_interleave, float64."""
    group = q.shape[1] // k.shape[1]
    kk = k.to(F64).repeat_interleave(group, dim=1)
    return torch.einsum("qhd,khd->hqk", q.to(F64), kk) * scale


def assert_close_f64(a, b, atol=ATOL, rtol=RTOL):
    torch.testing.assert_close(a.to(F64), b.to(F64), atol=atol, rtol=rtol)


# --------------------------------------------------------------------------- #
# single_attention vs SDPA
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("qo_len,kv_len", [(1, 1), (5, 9), (7, 7), (16, 3)])
def test_plain_matches_sdpa(qo_len, kv_len):
    g = _gen(100 + qo_len * 31 + kv_len)
    q, k, v = _randn(g, qo_len, 4, 16), _randn(g, kv_len, 4, 16), _randn(g, kv_len, 4, 24)
    o, lse = ref.single_attention(q, k, v)
    assert o.dtype == torch.float32 and lse.dtype == torch.float32
    assert o.shape == (qo_len, 4, 24) and lse.shape == (qo_len, 4)
    assert_close_f64(o, _sdpa(q, k, v))


def test_sm_scale_is_used():
    g = _gen(1)
    q, k, v = _randn(g, 6, 2, 8), _randn(g, 10, 2, 8), _randn(g, 10, 2, 8)
    o, _ = ref.single_attention(q, k, v, sm_scale=0.37)
    assert_close_f64(o, _sdpa(q, k, v, scale=0.37))
    o_default, _ = ref.single_attention(q, k, v)
    assert not torch.allclose(o, o_default, atol=1e-3)


@pytest.mark.parametrize("qo_len,kv_len", [(5, 12), (8, 8), (1, 6)])
def test_causal_bottom_right_matches_sdpa(qo_len, kv_len):
    g = _gen(200 + qo_len + kv_len)
    q, k, v = _randn(g, qo_len, 3, 16), _randn(g, kv_len, 3, 16), _randn(g, kv_len, 3, 16)
    o, lse = ref.single_attention(q, k, v, causal=True)
    assert_close_f64(o, _sdpa(q, k, v, attn_mask=_bottom_right_causal(qo_len, kv_len)))
    if qo_len == kv_len:
        assert_close_f64(o, _sdpa(q, k, v, is_causal=True))
    # causal must differ from non-causal when qo_len > 1
    if qo_len > 1:
        o_nc, _ = ref.single_attention(q, k, v)
        assert not torch.allclose(o, o_nc, atol=1e-3)


def test_causal_more_queries_than_keys_rows_are_empty():
    g = _gen(3)
    q, k, v = _randn(g, 6, 2, 8), _randn(g, 3, 2, 8), _randn(g, 3, 2, 8)
    o, lse = ref.single_attention(q, k, v, causal=True)
    # query i at position 3 - 6 + i; rows 0..2 see nothing
    assert torch.all(o[:3] == 0) and torch.all(torch.isneginf(lse[:3]))
    assert not torch.isnan(o).any() and not torch.isnan(lse).any()
    assert_close_f64(o[3:], _sdpa(q[3:], k, v, attn_mask=_bottom_right_causal(3, 3)))


def test_empty_kv_gives_zero_and_neg_inf():
    g = _gen(4)
    q = _randn(g, 4, 2, 8)
    k, v = torch.empty(0, 2, 8, dtype=F64), torch.empty(0, 2, 8, dtype=F64)
    o, lse = ref.single_attention(q, k, v)
    assert o.shape == (4, 2, 8) and torch.all(o == 0)
    assert torch.all(torch.isneginf(lse))


@pytest.mark.parametrize("h_qo,h_kv", [(8, 2), (6, 3), (4, 1)])
def test_gqa_matches_repeat_interleave_sdpa(h_qo, h_kv):
    g = _gen(300 + h_qo * 10 + h_kv)
    q, k, v = _randn(g, 7, h_qo, 16), _randn(g, 11, h_kv, 16), _randn(g, 11, h_kv, 16)
    group = h_qo // h_kv
    o, _ = ref.single_attention(q, k, v, causal=True)
    kk, vv = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    assert_close_f64(o, _sdpa(q, kk, vv, attn_mask=_bottom_right_causal(7, 11)))
    if h_kv > 1:
        # query head h must use kv head h // group, not h % h_kv (the tiled mapping)
        wrong_k, wrong_v = k.repeat(1, group, 1), v.repeat(1, group, 1)
        o_wrong = _sdpa(q, wrong_k, wrong_v, attn_mask=_bottom_right_causal(7, 11))
        assert not torch.allclose(o.to(F64), o_wrong, atol=1e-3)


def test_gqa_rejects_indivisible_heads():
    g = _gen(5)
    with pytest.raises(ValueError):
        ref.single_attention(_randn(g, 2, 6, 8), _randn(g, 3, 4, 8), _randn(g, 3, 4, 8))


def test_lse_matches_logsumexp_of_explicit_logits():
    g = _gen(6)
    q, k, v = _randn(g, 9, 4, 16), _randn(g, 13, 2, 16), _randn(g, 13, 2, 16)
    scale = 0.21
    _, lse = ref.single_attention(q, k, v, sm_scale=scale, causal=True)
    logits = _explicit_logits(q, k, scale)
    logits = logits.masked_fill(~_bottom_right_causal(9, 13), float("-inf"))
    assert_close_f64(lse, torch.logsumexp(logits, dim=-1).transpose(0, 1))
    # natural log, not log2
    _, lse_nc = ref.single_attention(q, k, v, sm_scale=scale)
    direct = torch.log(torch.exp(_explicit_logits(q, k, scale)).sum(-1)).transpose(0, 1)
    assert_close_f64(lse_nc, direct)


# --------------------------------------------------------------------------- #
# soft cap, window, custom mask
# --------------------------------------------------------------------------- #
def test_soft_cap_direct_formula():
    g = _gen(7)
    q, k, v = _randn(g, 2, 1, 4) * 3, _randn(g, 3, 1, 4) * 3, _randn(g, 3, 1, 4)
    cap, scale = 1.5, 0.5
    o, lse = ref.single_attention(q, k, v, sm_scale=scale, logits_soft_cap=cap)
    for i in range(2):
        raw = [scale * float((q[i, 0] * k[j, 0]).sum()) for j in range(3)]
        capped = [cap * math.tanh(x / cap) for x in raw]
        z = sum(math.exp(c) for c in capped)
        assert abs(float(lse[i, 0]) - math.log(z)) < 1e-6
        expect = sum(math.exp(capped[j]) / z * v[j, 0] for j in range(3))
        assert_close_f64(o[i, 0], expect)
    # cap must actually change the result; None and 0 disable it
    o_nocap, _ = ref.single_attention(q, k, v, sm_scale=scale)
    assert not torch.allclose(o, o_nocap, atol=1e-4)
    o_zero, _ = ref.single_attention(q, k, v, sm_scale=scale, logits_soft_cap=0.0)
    assert_close_f64(o_zero, o_nocap, atol=0, rtol=0)


@pytest.mark.parametrize("causal", [True, False])
def test_window_left_matches_explicit_mask(causal):
    g = _gen(8 + int(causal))
    qo_len, kv_len, w = 6, 15, 3
    q, k, v = _randn(g, qo_len, 2, 8), _randn(g, kv_len, 2, 8), _randn(g, kv_len, 2, 8)
    o, lse = ref.single_attention(q, k, v, causal=causal, window_left=w)
    p = (kv_len - qo_len + torch.arange(qo_len))[:, None]
    j = torch.arange(kv_len)[None, :]
    mask = j >= p - w
    if causal:
        mask &= j <= p
    assert_close_f64(o, _sdpa(q, k, v, attn_mask=mask))
    logits = _explicit_logits(q, k, 1 / math.sqrt(8)).masked_fill(~mask, float("-inf"))
    assert_close_f64(lse, torch.logsumexp(logits, -1).transpose(0, 1))


def test_custom_mask_matches_sdpa():
    g = _gen(10)
    q, k, v = _randn(g, 5, 2, 8), _randn(g, 9, 2, 8), _randn(g, 9, 2, 8)
    mask = torch.rand(5, 9, generator=g) > 0.4
    mask[:, 0] = True  # keep every row non-empty for SDPA
    o, _ = ref.single_attention(q, k, v, custom_mask=mask)
    assert_close_f64(o, _sdpa(q, k, v, attn_mask=mask))
    o_c, _ = ref.single_attention(q, k, v, custom_mask=mask, causal=True)
    assert_close_f64(o_c, _sdpa(q, k, v, attn_mask=mask & _bottom_right_causal(5, 9)))


def test_fully_masked_row_custom_mask_no_nan():
    g = _gen(11)
    q, k, v = _randn(g, 3, 2, 8), _randn(g, 4, 2, 8), _randn(g, 4, 2, 8)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[1] = False
    o, lse = ref.single_attention(q, k, v, custom_mask=mask)
    assert torch.all(o[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert not torch.isnan(o).any()


def test_fp8_scales_dequantize():
    g = _gen(12)
    q = _randn(g, 4, 2, 16)
    k8 = _randn(g, 7, 2, 16).to(torch.float8_e4m3fn)
    v8 = _randn(g, 7, 2, 16).to(torch.float8_e4m3fn)
    o, lse = ref.single_attention(q, k8, v8, k_scale=0.5, v_scale=2.0)
    kd, vd = k8.to(F64) * 0.5, v8.to(F64) * 2.0
    o2, lse2 = ref.single_attention(q, kd, vd)
    assert_close_f64(o, o2)
    assert_close_f64(lse, lse2)
    assert_close_f64(o, _sdpa(q, kd, vd))


# --------------------------------------------------------------------------- #
# Position encodings
# --------------------------------------------------------------------------- #
def _hf_rope(x, positions, theta, scale):
    """Independent HF-style rotate_half implementation."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=F64) / d))
    freqs = torch.outer(positions.to(F64) / scale, inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    rot = torch.cat([-x2, x1], dim=-1)
    return x.to(F64) * cos + rot * sin


def test_rope_position_zero_is_identity():
    g = _gen(13)
    x = _randn(g, 5, 3, 16)
    out = ref.apply_rope_llama(x, torch.zeros(5, dtype=torch.int64))
    assert out.dtype == F64
    assert_close_f64(out, x, atol=0, rtol=0)


def test_rope_matches_hf_rotate_half():
    g = _gen(14)
    x = _randn(g, 6, 2, 32)
    pos = torch.tensor([0, 1, 5, 17, 100, 1023])
    out = ref.apply_rope_llama(x, pos, rope_scale=2.0, rope_theta=5e5)
    assert_close_f64(out, _hf_rope(x, pos, 5e5, 2.0), atol=1e-10, rtol=1e-10)
    # rotation preserves norms and is not the identity
    assert_close_f64(out.norm(dim=-1), x.norm(dim=-1), atol=1e-10, rtol=1e-10)
    assert not torch.allclose(out[1:], x[1:])


def test_rope_relative_property():
    g = _gen(15)
    q, k = _randn(g, 4, 2, 16), _randn(g, 4, 2, 16)
    pq, pk = torch.tensor([3, 7, 11, 20]), torch.tensor([0, 2, 9, 20])
    base = (ref.apply_rope_llama(q, pq) * ref.apply_rope_llama(k, pk)).sum(-1)
    for off in (1, 13, 500):
        shifted = (ref.apply_rope_llama(q, pq + off) * ref.apply_rope_llama(k, pk + off)).sum(-1)
        assert_close_f64(shifted, base, atol=1e-9, rtol=1e-9)
    # different relative offset must change the dot product
    other = (ref.apply_rope_llama(q, pq + 1) * ref.apply_rope_llama(k, pk)).sum(-1)
    assert not torch.allclose(other, base, atol=1e-4)


def test_attention_rope_mode_equals_prerotated_sdpa():
    g = _gen(16)
    qo_len, kv_len = 5, 12
    q, k, v = _randn(g, qo_len, 4, 16), _randn(g, kv_len, 2, 16), _randn(g, kv_len, 2, 16)
    o, _ = ref.single_attention(
        q, k, v, causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=1.5, rope_theta=1e3
    )
    qpos = torch.arange(qo_len) + kv_len - qo_len
    qr = _hf_rope(q, qpos, 1e3, 1.5)
    kr = _hf_rope(k, torch.arange(kv_len), 1e3, 1.5).repeat_interleave(2, dim=1)
    vv = v.repeat_interleave(2, dim=1)
    assert_close_f64(o, _sdpa(qr, kr, vv, attn_mask=_bottom_right_causal(qo_len, kv_len)))


def test_alibi_slopes_8_heads():
    s = ref.alibi_slopes(8)
    assert s.dtype == F64
    expect = torch.tensor([2.0 ** -(i + 1) for i in range(8)], dtype=F64)
    assert_close_f64(s, expect, atol=0, rtol=0)


def _hf_get_alibi_slopes(n):
    def pow2(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(n).is_integer():
        return pow2(n)
    closest = 2 ** math.floor(math.log2(n))
    return pow2(closest) + pow2(2 * closest)[0::2][: n - closest]


@pytest.mark.parametrize("n", [1, 2, 5, 12, 32, 40])
def test_alibi_slopes_match_hf(n):
    assert_close_f64(ref.alibi_slopes(n), torch.tensor(_hf_get_alibi_slopes(n), dtype=F64),
           atol=1e-15, rtol=1e-12)


def test_alibi_attention_matches_explicit_bias():
    g = _gen(17)
    qo_len, kv_len, h = 4, 10, 4
    q, k, v = _randn(g, qo_len, h, 8), _randn(g, kv_len, h, 8), _randn(g, kv_len, h, 8)
    o, lse = ref.single_attention(q, k, v, causal=True, pos_encoding_mode="ALIBI")
    slopes = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], dtype=F64)
    p = (kv_len - qo_len + torch.arange(qo_len))[:, None]
    j = torch.arange(kv_len)[None, :]
    bias = slopes[:, None, None] * (j - p).to(F64)[None]
    bias = bias.masked_fill(~_bottom_right_causal(qo_len, kv_len), float("-inf"))
    assert_close_f64(o, _sdpa(q, k, v, attn_mask=bias))
    logits = _explicit_logits(q, k, 1 / math.sqrt(8)) + bias
    assert_close_f64(lse, torch.logsumexp(logits, -1).transpose(0, 1))


def test_alibi_then_soft_cap_order():
    g = _gen(18)
    q, k, v = _randn(g, 1, 2, 4), _randn(g, 3, 2, 4), _randn(g, 3, 2, 4)
    cap = 0.8
    _, lse = ref.single_attention(q, k, v, pos_encoding_mode="ALIBI", logits_soft_cap=cap)
    slopes = [0.0625, 0.00390625]  # 2**(-8*1/2), 2**(-8*2/2)
    for h in range(2):
        raw = [0.5 * float((q[0, h] * k[j, h]).sum()) + slopes[h] * (j - 2) for j in range(3)]
        z = sum(math.exp(cap * math.tanh(x / cap)) for x in raw)
        assert abs(float(lse[0, h]) - math.log(z)) < 1e-6


# --------------------------------------------------------------------------- #
# Merging states
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("causal", [False, True])
def test_merge_state_of_two_kv_halves_equals_full(causal):
    g = _gen(19 + int(causal))
    qo_len, kv_len, split = 4, 14, 6
    q, k, v = _randn(g, qo_len, 4, 16), _randn(g, kv_len, 2, 16), _randn(g, kv_len, 2, 16)
    o_full, lse_full = ref.single_attention(q, k, v)
    o_a, s_a = ref.single_attention(q, k[:split], v[:split])
    o_b, s_b = ref.single_attention(q, k[split:], v[split:])
    o_m, s_m = ref.merge_state(o_a, s_a, o_b, s_b)
    assert_close_f64(o_m, o_full)
    assert_close_f64(s_m, lse_full)
    # the halves alone must differ from the full result
    assert not torch.allclose(o_a, o_full, atol=1e-3)


def test_merge_states_three_chunks_equals_full():
    g = _gen(21)
    q, k, v = _randn(g, 3, 2, 8), _randn(g, 15, 2, 8), _randn(g, 15, 2, 8)
    o_full, lse_full = ref.single_attention(q, k, v)
    bounds = [(0, 4), (4, 11), (11, 15)]
    parts = [ref.single_attention(q, k[a:b], v[a:b]) for a, b in bounds]
    vs = torch.stack([p[0] for p in parts], dim=1)
    ss = torch.stack([p[1] for p in parts], dim=1)
    o_m, s_m = ref.merge_states(vs, ss)
    assert_close_f64(o_m, o_full)
    assert_close_f64(s_m, lse_full)


def test_merge_state_empty_states():
    g = _gen(22)
    v_a, v_b = _randn(g, 3, 2, 8), _randn(g, 3, 2, 8)
    ninf = torch.full((3, 2), float("-inf"))
    o, s = ref.merge_state(v_a, ninf, v_b, ninf)
    assert not torch.isnan(o).any() and not torch.isnan(s).any()
    assert torch.all(o == 0) and torch.all(torch.isneginf(s))
    # one empty side: result equals the other side exactly
    s_b = _randn(g, 3, 2)
    o2, s2 = ref.merge_state(v_a, ninf, v_b, s_b)
    assert_close_f64(o2, v_b)
    assert_close_f64(s2, s_b)
    # large LSEs do not overflow
    o3, s3 = ref.merge_state(v_a, torch.full((3, 2), 1000.0), v_b, torch.full((3, 2), 1000.0))
    assert_close_f64(o3, (v_a + v_b) / 2)
    assert_close_f64(s3, torch.full((3, 2), 1000.0 + math.log(2)))


# --------------------------------------------------------------------------- #
# Ragged batch
# --------------------------------------------------------------------------- #
def test_batch_ragged_matches_per_request_and_flat_mask():
    g = _gen(23)
    qo_lens, kv_lens = [3, 0, 5, 2], [7, 4, 5, 0]
    qo_indptr = torch.tensor([0] + list(torch.tensor(qo_lens).cumsum(0)), dtype=torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(kv_lens).cumsum(0)), dtype=torch.int32)
    q = _randn(g, sum(qo_lens), 4, 8)
    k, v = _randn(g, sum(kv_lens), 2, 8), _randn(g, sum(kv_lens), 2, 8)
    masks = [torch.rand(a, b, generator=g) > 0.3 for a, b in zip(qo_lens, kv_lens)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    o, lse = ref.batch_ragged_attention(
        q, k, v, qo_indptr, kv_indptr, custom_mask=flat, causal=True, logits_soft_cap=2.0
    )
    assert o.shape == (10, 4, 8) and lse.shape == (10, 4)
    for r in range(4):
        qs, qe = int(qo_indptr[r]), int(qo_indptr[r + 1])
        ks, ke = int(kv_indptr[r]), int(kv_indptr[r + 1])
        o_r, lse_r = ref.single_attention(
            q[qs:qe], k[ks:ke], v[ks:ke], custom_mask=masks[r], causal=True, logits_soft_cap=2.0
        )
        assert_close_f64(o[qs:qe], o_r, atol=0, rtol=0)
        assert_close_f64(lse[qs:qe], lse_r, atol=0, rtol=0)
    # last request has kv_len 0: zero output, -inf lse
    assert torch.all(o[8:] == 0) and torch.all(torch.isneginf(lse[8:]))
    # request 0 vs SDPA (explicit) to tie to an independent implementation
    m0 = masks[0] & _bottom_right_causal(3, 7)
    if bool(m0.any(dim=1).all()):
        vv = v[:7].repeat_interleave(2, 1)
        logits = _explicit_logits(q[:3], k[:7], 1 / math.sqrt(8))
        logits = 2.0 * torch.tanh(logits / 2.0)
        logits = logits.masked_fill(~m0, float("-inf"))
        p = torch.softmax(logits, -1)
        assert_close_f64(o[:3], torch.einsum("hqk,khd->qhd", p, vv))


# --------------------------------------------------------------------------- #
# Mask packing
# --------------------------------------------------------------------------- #
def test_pack_unpack_hand_case():
    bits = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0, 1, 1], dtype=torch.bool)
    packed = ref.pack_custom_mask(bits)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [1, 3]
    assert ref.unpack_custom_mask(torch.tensor([0b10100101], dtype=torch.uint8), 8).tolist() == [
        True, False, True, False, False, True, False, True
    ]


def test_pack_unpack_round_trip():
    g = _gen(24)
    for n in (1, 7, 8, 9, 64, 333):
        m = torch.rand(n, generator=g) > 0.5
        packed = ref.pack_custom_mask(m)
        assert packed.numel() == (n + 7) // 8
        assert torch.equal(ref.unpack_custom_mask(packed, n), m)
        try:
            import numpy as np
        except ImportError:
            continue
        np_packed = np.packbits(m.numpy(), bitorder="little")
        assert packed.tolist() == np_packed.tolist()


# --------------------------------------------------------------------------- #
# Paged KV cache
# --------------------------------------------------------------------------- #
def _make_paged(g, kv_lens, page_size, h, d, num_pages_total, fmt):
    """Scatter random ragged k/v into a paged cache with random page order.

    Returns (cache, k_ragged, v_ragged, kv_indptr, kv_indices, last_page_len).
    """
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    assert sum(pages_per) <= num_pages_total
    perm = torch.randperm(num_pages_total, generator=g)
    kv_indices = perm[: sum(pages_per)].to(torch.int32)
    kv_indptr = torch.tensor([0] + list(torch.tensor(pages_per).cumsum(0)), dtype=torch.int32)
    last = torch.tensor(
        [(n - (p - 1) * page_size) if p > 0 else 0 for n, p in zip(kv_lens, pages_per)],
        dtype=torch.int32,
    )
    # NHD page storage, filled with random garbage everywhere
    kp = _randn(g, num_pages_total, page_size, h, d)
    vp = _randn(g, num_pages_total, page_size, h, d)
    ks, vs = [], []
    for r, n in enumerate(kv_lens):
        kr, vr = _randn(g, n, h, d), _randn(g, n, h, d)
        ks.append(kr)
        vs.append(vr)
        for t in range(n):
            page = int(kv_indices[int(kv_indptr[r]) + t // page_size])
            kp[page, t % page_size] = kr[t]
            vp[page, t % page_size] = vr[t]
    k_rag, v_rag = torch.cat(ks), torch.cat(vs)
    if fmt == "tuple_nhd":
        cache = (kp.clone(), vp.clone())
    elif fmt == "tuple_hnd":
        cache = (kp.transpose(1, 2).contiguous(), vp.transpose(1, 2).contiguous())
    elif fmt == "single_nhd":
        cache = torch.stack([kp, vp], dim=1).contiguous()
    elif fmt == "single_hnd":
        cache = torch.stack([kp.transpose(1, 2), vp.transpose(1, 2)], dim=1).contiguous()
    elif fmt == "3d":
        assert page_size == 1
        cache = (kp[:, 0].clone(), vp[:, 0].clone())
    else:
        raise AssertionError(fmt)
    return cache, k_rag, v_rag, kv_indptr, kv_indices, last


_FORMATS = [
    ("tuple_nhd", "NHD", 4),
    ("tuple_hnd", "HND", 4),
    ("single_nhd", "NHD", 3),
    ("single_hnd", "HND", 5),
    ("3d", "NHD", 1),
]


@pytest.mark.parametrize("fmt,layout,page_size", _FORMATS)
def test_paged_kv_to_ragged_round_trip(fmt, layout, page_size):
    g = _gen(25 + page_size)
    kv_lens = [9, 0, 4, 1, 12]
    cache, k_rag, v_rag, indptr, indices, last = _make_paged(g, kv_lens, page_size, 2, 8, 40, fmt)
    k, v, seq_indptr = ref.paged_kv_to_ragged(cache, indptr, indices, last, kv_layout=layout)
    assert seq_indptr.dtype == torch.int64
    assert seq_indptr.tolist() == [0, 9, 9, 13, 14, 26]
    assert torch.equal(k, k_rag) and torch.equal(v, v_rag)
    assert ref.get_seq_lens(indptr, last, page_size).tolist() == kv_lens


def test_paged_layout_mismatch_gives_different_data():
    g = _gen(26)
    cache, k_rag, _, indptr, indices, last = _make_paged(g, [5, 6], 4, 4, 4, 10, "tuple_hnd")
    k, _, _ = ref.paged_kv_to_ragged(cache, indptr, indices, last, kv_layout="NHD")
    assert not torch.equal(k, k_rag)


def test_get_seq_lens_hand_case():
    indptr = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    last = torch.tensor([2, 0, 16], dtype=torch.int32)
    out = ref.get_seq_lens(indptr, last, 16)
    assert out.dtype == torch.int32 and out.tolist() == [34, 0, 16]


def test_get_batch_indices_positions_hand_case():
    append_indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    seq_lens = torch.tensor([7, 3, 3], dtype=torch.int32)
    bi, pos = ref.get_batch_indices_positions(append_indptr, seq_lens, 5)
    assert bi.dtype == torch.int32 and pos.dtype == torch.int32
    assert bi.tolist() == [0, 0, 2, 2, 2]
    assert pos.tolist() == [5, 6, 0, 1, 2]


@pytest.mark.parametrize("fmt,layout,page_size", _FORMATS)
def test_append_then_read_back(fmt, layout, page_size):
    g = _gen(27 + page_size)
    # cache state AFTER append: lengths kv_lens; the last `app` tokens are new
    kv_lens, app = [10, 3, 0, 7], [4, 3, 0, 1]
    cache, k_old, v_old, indptr, indices, last = _make_paged(g, kv_lens, page_size, 2, 8, 40, fmt)
    append_indptr = torch.tensor([0] + list(torch.tensor(app).cumsum(0)), dtype=torch.int32)
    nnz = sum(app)
    new_k, new_v = _randn(g, nnz, 2, 8), _randn(g, nnz, 2, 8)
    seq_lens = ref.get_seq_lens(indptr, last, page_size)
    bi, pos = ref.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    ref.append_paged_kv_cache(new_k, new_v, bi, pos, cache, indices, indptr, last, kv_layout=layout)
    k, v, seq_indptr = ref.paged_kv_to_ragged(cache, indptr, indices, last, kv_layout=layout)
    exp_k, exp_v = k_old.clone(), v_old.clone()
    t = 0
    for r in range(len(kv_lens)):
        base = int(seq_indptr[r])
        for i in range(app[r]):
            p = kv_lens[r] - app[r] + i
            exp_k[base + p], exp_v[base + p] = new_k[t], new_v[t]
            t += 1
    assert torch.equal(k, exp_k) and torch.equal(v, exp_v)
    assert not torch.equal(k, k_old)


def test_append_out_of_range_position_raises():
    g = _gen(28)
    cache, _, _, indptr, indices, last = _make_paged(g, [5], 4, 1, 4, 4, "tuple_nhd")
    with pytest.raises(IndexError):
        ref.append_paged_kv_cache(
            _randn(g, 1, 1, 4), _randn(g, 1, 1, 4), torch.tensor([0]), torch.tensor([5]),
            cache, indices, indptr, last,
        )


# --------------------------------------------------------------------------- #
# Paged decode / prefill
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("fmt,layout,page_size", [("tuple_hnd", "HND", 4), ("single_nhd", "NHD", 3)])
def test_batch_decode_paged_matches_sdpa(fmt, layout, page_size):
    g = _gen(29 + page_size)
    kv_lens = [9, 1, 0, 6]
    cache, k_rag, v_rag, indptr, indices, last = _make_paged(g, kv_lens, page_size, 2, 8, 30, fmt)
    q = _randn(g, 4, 4, 8)
    o, lse = ref.batch_decode_paged(q, cache, indptr, indices, last, kv_layout=layout)
    off = 0
    for r, n in enumerate(kv_lens):
        if n == 0:
            assert torch.all(o[r] == 0) and torch.all(torch.isneginf(lse[r]))
            continue
        kk = k_rag[off:off + n].repeat_interleave(2, 1)
        vv = v_rag[off:off + n].repeat_interleave(2, 1)
        assert_close_f64(o[r:r + 1], _sdpa(q[r:r + 1], kk, vv))
        logits = _explicit_logits(q[r:r + 1], k_rag[off:off + n], 1 / math.sqrt(8))
        assert_close_f64(lse[r:r + 1], torch.logsumexp(logits, -1).transpose(0, 1))
        off += n
    # decode query sits at position kv_len-1: window_left=2 sees 3 keys
    o_w, _ = ref.batch_decode_paged(q, cache, indptr, indices, last, kv_layout=layout, window_left=2)
    kk, vv = k_rag[6:9].repeat_interleave(2, 1), v_rag[6:9].repeat_interleave(2, 1)
    assert_close_f64(o_w[0:1], _sdpa(q[0:1], kk, vv))


def test_batch_prefill_paged_matches_ragged():
    g = _gen(31)
    kv_lens, qo_lens = [9, 5, 12], [3, 5, 1]
    cache, k_rag, v_rag, indptr, indices, last = _make_paged(g, kv_lens, 4, 2, 8, 20, "single_hnd")
    qo_indptr = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
    kv_seq = torch.tensor([0, 9, 14, 26], dtype=torch.int32)
    q = _randn(g, 9, 4, 8)
    mask = torch.rand(sum(a * b for a, b in zip(qo_lens, kv_lens)), generator=g) > 0.3
    kw = dict(causal=True, custom_mask=mask, pos_encoding_mode="ROPE_LLAMA", window_left=6)
    o, lse = ref.batch_prefill_paged(q, cache, qo_indptr, indptr, indices, last, kv_layout="HND", **kw)
    o2, lse2 = ref.batch_ragged_attention(q, k_rag, v_rag, qo_indptr, kv_seq, **kw)
    assert_close_f64(o, o2, atol=0, rtol=0)
    assert_close_f64(lse, lse2, atol=0, rtol=0)

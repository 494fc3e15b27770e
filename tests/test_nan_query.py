"""A NaN in q gives NaN in that row's output and LSE (decode, split-KV decode, prefill, the merges),
on both targets; a row that sees no key still gives o = 0, lse = -inf, NaN query or not.

Inputs are fresh random data; outputs are poisoned with a finite sentinel (NaN is a legitimate
result here), so an unwritten element fails the comparison with the reference."""

from __future__ import annotations

import os
import random

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.kernels.decode import mma_eligible
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec

from attention_cases import devices, random_paged_batch, tolerance

SEED = int(os.environ.get("JITATTN_TEST_SEED", random.randrange(2**31)))
POISON = 7777.0
bf16, f16, e4m3 = torch.bfloat16, torch.float16, torch.float8_e4m3fn


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((SEED * 1000003 + salt) % 2**63)


def _poisoned(shape, dtype, device):
    return torch.full(shape, POISON, dtype=dtype, device=device)


def _poison_q(q: torch.Tensor, rows: list[tuple[int, int]], g: torch.Generator) -> None:
    """NaN into q[token, head]: the whole row for the first, one random element for the others."""
    for i, (t, h) in enumerate(rows):
        if i == 0:
            q[t, h] = float("nan")
        else:
            q[t, h, int(torch.randint(q.shape[-1], (1,), generator=g))] = float("nan")


def _check(out, lse, ref_o, ref_lse, dtype, nan_rows, empty_rows) -> None:
    """NaN exactly where the reference has it; everything else close; the rows named as NaN / empty are."""
    out, lse, ref_o, ref_lse = out.float().cpu(), lse.float().cpu(), ref_o.float().cpu(), ref_lse.float().cpu()
    assert not (out == POISON).any() and not (lse == POISON).any(), f"seed {SEED}: unwritten output"
    for t, h in nan_rows:
        assert torch.isnan(out[t, h]).all() and torch.isnan(lse[t, h]), f"seed {SEED}: row {(t, h)} must be NaN"
    for t, h in empty_rows:
        assert (out[t, h] == 0).all() and torch.isneginf(lse[t, h]), f"seed {SEED}: row {(t, h)} must be 0, -inf"
    assert torch.equal(torch.isnan(out), torch.isnan(ref_o)), f"seed {SEED}: NaN pattern of o differs"
    assert torch.equal(torch.isnan(lse), torch.isnan(ref_lse)), f"seed {SEED}: NaN pattern of lse differs"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), f"seed {SEED}: -inf pattern of lse differs"
    tol = tolerance(dtype)
    torch.testing.assert_close(out, ref_o, atol=tol, rtol=tol, equal_nan=True)
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=2e-3, rtol=1e-4)


# -- decode ------------------------------------------------------------------------------------------
# (head_dim, qo_heads, kv_heads, q dtype, kv dtype, pos, split): on cuda the cases named tensor_cores
# take the tensor-core path (fp8 KV and RoPE included), the cuda_cores ones the CUDA-core path (RoPE
# with fp8 KV, a head dim not a multiple of 32 with RoPE); split cuts every request into chunks.
DECODE = {
    "tensor_cores": (128, 8, 2, bf16, bf16, "NONE", False),
    "tensor_cores_fp8": (64, 8, 2, bf16, e4m3, "NONE", False),
    "tensor_cores_rope": (128, 8, 2, f16, f16, "ROPE_LLAMA", False),
    "cuda_cores_rope_fp8": (64, 8, 2, bf16, e4m3, "ROPE_LLAMA", False),
    "split_kv": (128, 8, 2, bf16, bf16, "NONE", True),
    "split_kv_cuda_cores_rope": (72, 4, 1, bf16, bf16, "ROPE_LLAMA", True),
}
KV_LENS = [1, 70, 0, 300, 33]
PAGE = 16


def _decode_spec(case, target: Target) -> VariantSpec:
    d, hq, hkv, qd, kvd, pos, _ = case
    return attention_spec(
        Op.DECODE, target, q_dtype=qd, kv_dtype=kvd, o_dtype=qd, head_dim_qk=d, head_dim_vo=d, num_qo_heads=hq,
        num_kv_heads=hkv, pos_encoding=PosEncoding.parse(pos.lower().replace("rope_llama", "rope"), "pos"),
        use_sliding_window=False, use_logits_soft_cap=False, mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD,
        kv_storage=KVStorage.PAGED,
    )


GPU_SPECS = list(dict.fromkeys(_decode_spec(c, Target.CUDA) for c in DECODE.values()))


def test_decode_cases_take_the_paths_they_name() -> None:
    for case_id, case in DECODE.items():
        assert mma_eligible(_decode_spec(case, Target.CUDA)) == ("cuda_cores" not in case_id), case_id


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(DECODE))
def test_decode_nan_query(case_id: str, device: str) -> None:
    d, hq, hkv, qd, kvd, pos, split = DECODE[case_id]
    g = _gen(sum(map(ord, case_id)))
    batch = random_paged_batch(KV_LENS, hkv, d, PAGE, kvd, "NHD", "5d", device, generator=g)
    q = torch.randn(len(KV_LENS), hq, d, generator=g).to(qd)
    # Request 3: head 1 all NaN, head 0 (same GQA group) one NaN element; request 1: the last head;
    # request 2 has no KV: its NaN query still gives 0 and -inf.
    nan_rows = [(3, 1), (3, 0), (1, hq - 1)]
    _poison_q(q, nan_rows + [(2, 0)], g)
    q = q.to(device)
    k_scale, v_scale = (0.6, 1.4) if kvd == e4m3 else (None, None)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, PAGE, pos_encoding_mode=pos,
                 q_data_type=qd, kv_data_type=kvd, **({"fixed_split_size": 2} if split else {"disable_split_kv": True}))
    if split:
        assert wrapper._plan.split.num_chunks > len(KV_LENS), "the case must split the KV"
    out = _poisoned((len(KV_LENS), hq, d), qd, device)
    lse = _poisoned((len(KV_LENS), hq), torch.float32, device)
    wrapper.run(q, batch.cache, out=out, lse=lse, k_scale=k_scale, v_scale=v_scale)
    ref_o, ref_lse = reference.batch_decode_paged(q, batch.cache, batch.kv_indptr, batch.kv_indices,
                                                  batch.kv_last_page_len, pos_encoding_mode=pos, k_scale=k_scale,
                                                  v_scale=v_scale)
    _check(out, lse, ref_o, ref_lse, qd, nan_rows, [(2, h) for h in range(hq)])


# -- prefill -----------------------------------------------------------------------------------------
# (head_dim, qo_heads, kv_heads, dtype, causal, pos, window, custom mask, storage)
PREFILL = {
    "ragged_causal": (64, 4, 2, f16, True, "NONE", -1, False, "ragged"),
    "ragged_bf16_rope_window": (128, 8, 2, bf16, True, "ROPE_LLAMA", 20, False, "ragged"),
    "ragged_custom_mask": (64, 4, 4, bf16, False, "NONE", -1, True, "ragged"),
    "ragged_window_not_causal": (64, 4, 1, f16, False, "NONE", 10, False, "ragged"),
    "paged_alibi": (96, 6, 2, f16, True, "ALIBI", -1, False, "paged"),
    "paged_hd256_bf16_rope_not_causal": (256, 4, 2, bf16, False, "ROPE_LLAMA", -1, False, "paged"),
}
QO_LENS = [40, 5, 70]


def _kv_lens(causal: bool) -> list[int]:
    return [90, 5 if causal else 0, 80]  # without causal, request 1 sees no key (kv_len 0)


def _prefill_spec(case, target: Target) -> VariantSpec:
    d, hq, hkv, dt, causal, pos, window, custom, storage = case
    mask = MaskMode.CUSTOM if custom else MaskMode.CAUSAL if causal else MaskMode.NONE
    return attention_spec(
        Op.PREFILL, target, q_dtype=dt, kv_dtype=dt, o_dtype=dt, head_dim_qk=d, head_dim_vo=d, num_qo_heads=hq,
        num_kv_heads=hkv, pos_encoding=PosEncoding.parse(pos.lower().replace("rope_llama", "rope"), "pos"),
        use_sliding_window=window >= 0, use_logits_soft_cap=False, mask_mode=mask, kv_layout=KVLayout.NHD,
        kv_storage=KVStorage.parse(storage, "storage"),
    )


GPU_SPECS += list(dict.fromkeys(_prefill_spec(c, Target.CUDA) for c in PREFILL.values()))


def _indptr(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("case_id", list(PREFILL))
def test_prefill_nan_query(case_id: str, device: str) -> None:
    d, hq, hkv, dt, causal, pos, window, custom, storage = PREFILL[case_id]
    g = _gen(sum(map(ord, case_id)))
    kv_lens = _kv_lens(causal)
    total = sum(QO_LENS)
    q = torch.randn(total, hq, d, generator=g).to(dt)
    r2 = QO_LENS[0] + QO_LENS[1]  # first token of request 2
    # Visible rows: request 0 token 3 (all NaN), request 0 token 39, request 2 token 25 (one element
    # each); rows that see no key (request 1 without causal, a custom-masked row) get NaN queries too.
    nan_rows = [(3, 0), (39, hq - 1), (r2 + 25, 1)]
    empty_rows = [] if causal else [(QO_LENS[0] + i, h) for i in range(QO_LENS[1]) for h in range(hq)]
    nan_empty = [] if causal else [(QO_LENS[0], 0), (QO_LENS[0] + 4, hq - 1)]
    mask = None
    if custom:
        mask = torch.rand(sum(q * k for q, k in zip(QO_LENS, kv_lens)), generator=g) < 0.7
        mask[5 * kv_lens[0]:6 * kv_lens[0]] = False  # request 0 token 5 sees no key
        for t in (3, 39):  # ... while the NaN rows see at least one
            mask[t * kv_lens[0]] = True
        mask[QO_LENS[0] * kv_lens[0] + 25 * kv_lens[2]] = True
        empty_rows += [(5, h) for h in range(hq)]
        nan_empty += [(5, 0)]
    _poison_q(q, nan_rows + nan_empty, g)
    q = q.to(device)
    plan_kw = dict(causal=causal, pos_encoding_mode=pos, window_left=window, q_data_type=dt, custom_mask=mask)
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    out = _poisoned((total, hq, d), dt, device)
    lse = _poisoned((total, hq), torch.float32, device)
    ref_kw = dict(causal=causal, pos_encoding_mode=pos, window_left=window, custom_mask=mask)
    if storage == "ragged":
        k = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dt).to(device)
        v = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dt).to(device)
        wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(_indptr(QO_LENS), _indptr(kv_lens), hq, hkv, d, **plan_kw)
        wrapper.run(q, k, v, out=out, lse=lse)
        ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(QO_LENS), _indptr(kv_lens),
                                                          **ref_kw)
    else:
        batch = random_paged_batch(kv_lens, hkv, d, PAGE, dt, "NHD", "5d", device, generator=g)
        wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace)
        wrapper.plan(_indptr(QO_LENS), batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, PAGE,
                     **plan_kw)
        wrapper.run(q, batch.cache, out=out, lse=lse)
        ref_o, ref_lse = reference.batch_prefill_paged(q, batch.cache, _indptr(QO_LENS), batch.kv_indptr,
                                                       batch.kv_indices, batch.kv_last_page_len, **ref_kw)
    _check(out, lse, ref_o, ref_lse, dt, nan_rows, empty_rows)


@pytest.mark.parametrize("device", devices())
def test_prefill_nan_key_reaches_only_the_rows_that_see_it(device: str) -> None:
    """NaN in K still propagates (to the rows whose mask lets them see that key, and no others)."""
    d, hq, hkv, dt, causal, pos, window, custom, storage = PREFILL["ragged_causal"]
    g = _gen(77)
    kv_lens = _kv_lens(causal)
    q = torch.randn(sum(QO_LENS), hq, d, generator=g).to(dt).to(device)
    k = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dt)
    v = torch.randn(sum(kv_lens), hkv, d, generator=g).to(dt).to(device)
    k[70, 0, 3] = float("nan")  # request 0, key 70, kv head 0: queries at positions >= 70 see it
    k = k.to(device)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(_indptr(QO_LENS), _indptr(kv_lens), hq, hkv, d, causal=True, q_data_type=dt)
    out = _poisoned((sum(QO_LENS), hq, d), dt, device)
    lse = _poisoned((sum(QO_LENS), hq), torch.float32, device)
    wrapper.run(q, k, v, out=out, lse=lse)
    ref_o, ref_lse = reference.batch_ragged_attention(q, k, v, _indptr(QO_LENS), _indptr(kv_lens), causal=True)
    group = hq // hkv
    first_seeing = 70 - (kv_lens[0] - QO_LENS[0])  # query index of position 70
    nan_rows = [(t, h) for t in range(first_seeing, QO_LENS[0]) for h in range(group)]
    _check(out, lse, ref_o, ref_lse, dt, nan_rows, [])
    assert torch.isfinite(out[:first_seeing].float()).all(), "rows that cannot see the NaN key stay finite"


# -- merges ------------------------------------------------------------------------------------------
GPU_SPECS.append(VariantSpec("merge", "cuda", o_dtype="bf16"))


def _states(g: torch.Generator, seq: int, n: int, heads: int, dim: int, device: str):
    v = torch.randn(seq, n, heads, dim, generator=g).to(bf16)
    s = torch.randn(seq, n, heads, generator=g) * 3
    s[0, :, 0] = float("-inf")                   # empty everywhere: 0, -inf
    s[1, 0, 0] = float("nan")                    # one NaN state among finite ones: NaN
    s[2, :, 1] = float("-inf")
    s[2, n - 1, 1] = float("nan")                # a NaN state among empty ones: NaN
    return v.to(device), s.to(device)


@pytest.mark.parametrize("device", devices())
def test_merge_state_propagates_nan(device: str) -> None:
    v, s = _states(_gen(5), 6, 2, 4, 64, device)
    got_v, got_s = jitattn.merge_state(v[:, 0], s[:, 0].contiguous(), v[:, 1], s[:, 1].contiguous())
    ref_v, ref_s = reference.merge_state(v[:, 0], s[:, 0], v[:, 1], s[:, 1])
    _check(got_v, got_s, ref_v, ref_s, bf16, [(1, 0), (2, 1)], [(0, 0)])

    in_v, in_s = v[:, 0].clone(), s[:, 0].contiguous().clone()
    jitattn.merge_state_in_place(in_v, in_s, v[:, 1], s[:, 1].contiguous())
    _check(in_v, in_s, ref_v, ref_s, bf16, [(1, 0), (2, 1)], [(0, 0)])


@pytest.mark.parametrize("device", devices())
def test_merge_states_propagates_nan(device: str) -> None:
    v, s = _states(_gen(6), 6, 5, 4, 64, device)
    got_v, got_s = jitattn.merge_states(v, s)
    ref_v, ref_s = reference.merge_states(v, s)
    _check(got_v, got_s, ref_v, ref_s, bf16, [(1, 0), (2, 1)], [(0, 0)])

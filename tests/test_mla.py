"""BatchMLAPagedAttentionWrapper and append_paged_mla_kv_cache against the float64 reference.

Decode (one query per request), speculative multi-token decode (2-8 queries, causal) and chunked
prefill over a paged latent cache, on the cpu target and (marked ``gpu``) on cuda; lengths include 0.
"""

from __future__ import annotations

import math

import pytest
import torch

import jitattn
from jitattn import reference

from attention_cases import assert_close_lse, assert_close_out, devices

CKV, KPE = 512, 64
SM_SCALE = 1.0 / math.sqrt(192)


def _gpu_specs() -> list:
    from jitattn.attention.specs import attention_spec
    from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

    return [attention_spec(Op.PREFILL, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                           o_dtype=torch.bfloat16, head_dim_qk=CKV + KPE, head_dim_vo=CKV, num_qo_heads=heads,
                           num_kv_heads=1, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
                           use_logits_soft_cap=False, mask_mode=mask, kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED)
            for heads in (16, 64, 128) for mask in (MaskMode.NONE, MaskMode.CAUSAL)]


GPU_SPECS = _gpu_specs()


def _latent_cache(kv_lens: list[int], page_size: int, dtype: torch.dtype, device: str, gen: torch.Generator,
                  joined: bool):
    """(ckv_cache, kpe_cache, kv_indptr, kv_indices, kv_len_arr): pages handed out in random order."""
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages_per)
    pool = total + 2
    buffer = torch.randn(pool, page_size, CKV + KPE, generator=gen).to(dtype).to(device)
    if joined:
        ckv, kpe = buffer[..., :CKV], buffer[..., CKV:]
    else:
        ckv, kpe = buffer[..., :CKV].contiguous(), buffer[..., CKV:].contiguous()
    indices = torch.randperm(pool, generator=gen)[:total].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages_per).cumsum(0).tolist(), dtype=torch.int32)
    return ckv, kpe, indptr, indices, torch.tensor(kv_lens, dtype=torch.int32)


def _request_kv(ckv, kpe, indptr, indices, kv_len: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    pages = indices[int(indptr[r]): int(indptr[r + 1])].long()
    keys = torch.cat([ckv, kpe], dim=-1)[pages.to(ckv.device)].reshape(-1, CKV + KPE)[:kv_len].cpu()
    values = ckv[pages.to(ckv.device)].reshape(-1, CKV)[:kv_len].cpu()
    return keys.unsqueeze(1), values.unsqueeze(1)  # one latent head


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("num_heads", [16, 64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("mode", ["decode", "speculative", "chunked_prefill"])
def test_mla_matches_the_reference(device: str, num_heads: int, page_size: int, mode: str) -> None:
    if device == "cuda" and (num_heads, page_size) not in ((16, 16), (128, 1), (128, 64), (64, 16)):
        pytest.skip("a representative subset on the GPU")
    gen = torch.Generator().manual_seed(num_heads * 7 + page_size)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    kv_lens = [37, 0, 130, 5] if mode == "decode" else [37, 9, 130, 5]
    qo_lens = {"decode": [1, 1, 1, 1], "speculative": [2, 8, 4, 3], "chunked_prefill": [20, 9, 64, 5]}[mode]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, page_size, dtype, device, gen, joined=mode != "speculative")
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    q_nope = torch.randn(sum(qo_lens), num_heads, CKV, generator=gen).to(dtype).to(device)
    q_pe = torch.randn(sum(qo_lens), num_heads, KPE, generator=gen).to(dtype).to(device)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=device))
    causal = mode != "decode"
    wrapper.plan(qo_indptr, indptr, indices, lens, num_heads, CKV, KPE, page_size, causal, SM_SCALE, dtype, dtype)
    out = torch.full((sum(qo_lens), num_heads, CKV), float("nan"), dtype=dtype, device=device)
    out, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=out, return_lse=True)
    for r, (qo_len, kv_len) in enumerate(zip(qo_lens, kv_lens)):
        lo, hi = int(qo_indptr[r]), int(qo_indptr[r + 1])
        keys, values = _request_kv(ckv, kpe, indptr, indices, kv_len, r)
        q = torch.cat([q_nope[lo:hi], q_pe[lo:hi]], dim=-1).cpu()
        ref_out, ref_lse = reference.single_attention(q, keys, values, causal=causal, sm_scale=SM_SCALE)
        assert_close_out(out[lo:hi], ref_out, dtype)
        assert_close_lse(lse[lo:hi], ref_lse)


@pytest.mark.parametrize("device", devices())
def test_append_paged_mla_kv_cache_writes_both_parts(device: str) -> None:
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    page_size, kv_lens = 16, [20, 3]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, page_size, dtype, device, gen, joined=True)
    last = torch.tensor([(n - 1) % page_size + 1 for n in kv_lens], dtype=torch.int32)
    append_indptr = torch.tensor([0, 4, 6], dtype=torch.int32)  # the last 4 and 2 tokens of each request
    batch, positions = jitattn.get_batch_indices_positions(append_indptr, lens, 6)
    new_ckv = torch.randn(6, CKV, generator=gen).to(dtype).to(device)
    new_kpe = torch.randn(6, KPE, generator=gen).to(dtype).to(device)
    jitattn.page.append_paged_mla_kv_cache(new_ckv, new_kpe, batch.to(device), positions.to(device), ckv, kpe,
                                           indices.to(device), indptr.to(device), last.to(device))
    for t in range(6):
        r, pos = int(batch[t]), int(positions[t])
        page = int(indices[int(indptr[r]) + pos // page_size])
        assert torch.equal(ckv[page, pos % page_size].cpu(), new_ckv[t].cpu())
        assert torch.equal(kpe[page, pos % page_size].cpu(), new_kpe[t].cpu())


def test_mla_plan_checks_lengths_against_the_pages() -> None:
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs 3 pages"):
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                     torch.tensor([0, 1], dtype=torch.int32), torch.tensor([40], dtype=torch.int32), 16, CKV, KPE, 16,
                     False, SM_SCALE, torch.float32, torch.float32)
    with pytest.raises(NotImplementedError, match="use_profiler"):
        wrapper.plan(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
                     torch.tensor([0], dtype=torch.int32), torch.tensor([10], dtype=torch.int32), 16, CKV, KPE, 16,
                     False, SM_SCALE, torch.float32, torch.float32, use_profiler=True)

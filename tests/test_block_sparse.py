"""Block-sparse attention (BSR and variable blocks) against the float reference; its refusals.

Fresh random inputs each case, outputs and LSE buffers poisoned before the run, block rows with no
block included (output 0, LSE -inf). The non-causal reference is ordinary attention under the
pattern's dense mask, independent of the page-table composition under test.
"""

from __future__ import annotations

import math

import pytest
import torch

import jitattn
import jitattn.flashinfer as fi
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.ops.sparse import convert_bsr_mask_layout
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_lse, assert_close_out, devices

bf16, f16 = torch.bfloat16, torch.float16
LOG2E = 1.0 / math.log(2.0)

# id: (R, C, M, N, qo_heads, kv_heads, head_dim, dtype, density, mode, shuffled indices)
BSR_CASES = {
    "r1_c1_mha_f16": (1, 1, 19, 23, 2, 2, 64, f16, 0.3, "none", False),
    "r4_c8_n_not_multiple_g2_bf16_causal": (4, 8, 37, 29, 4, 2, 64, bf16, 0.5, "causal", False),
    "r64_c64_g4_f16_mask": (64, 64, 130, 200, 8, 2, 64, f16, 0.5, "mask", False),
    "r16_c4_mqa_bf16_packed_mask": (16, 4, 50, 42, 3, 1, 64, bf16, 0.4, "packed", False),
    "r1_c64_dense_f16_causal": (1, 64, 9, 150, 4, 4, 128, f16, 1.0, "causal", False),
    "r8_c3_g4_bf16_sparse_shuffled_mask": (8, 3, 40, 31, 8, 2, 64, bf16, 0.15, "mask", True),
    "r2_c5_g2_f16_shuffled_causal": (2, 5, 14, 33, 4, 2, 64, f16, 0.6, "causal", True),
}


def _spec(hq: int, hkv: int, d: int, dtype: torch.dtype, o_dtype: torch.dtype, mask: MaskMode) -> object:
    return attention_spec(Op.PREFILL, Target.CUDA, q_dtype=dtype, kv_dtype=dtype, o_dtype=o_dtype, head_dim_qk=d,
                          head_dim_vo=d, num_qo_heads=hq, num_kv_heads=hkv, pos_encoding=PosEncoding.NONE,
                          use_sliding_window=False, use_logits_soft_cap=False, mask_mode=mask,
                          kv_layout=KVLayout.NHD, kv_storage=KVStorage.PAGED)


_MASK_MODES = {"none": MaskMode.NONE, "causal": MaskMode.CAUSAL, "mask": MaskMode.CUSTOM, "packed": MaskMode.CUSTOM}
GPU_SPECS = [_spec(c[4], c[5], c[6], c[7], c[7], _MASK_MODES[c[9]]) for c in BSR_CASES.values()]


def random_bsr(M: int, N: int, R: int, C: int, density: float, gen: torch.Generator, shuffled: bool = False):
    """(indptr, indices) of a random pattern of ceil(M/R) x ceil(N/C) blocks; with ``shuffled`` each row's
    column blocks are listed in random order."""
    blocks = torch.rand(-(-M // R), -(-N // C), generator=gen) < density
    indptr = torch.tensor([0] + blocks.sum(1).cumsum(0).tolist(), dtype=torch.int32)
    rows = []
    for row in blocks:
        cols = row.nonzero().flatten()
        rows.append(cols[torch.randperm(cols.numel(), generator=gen)] if shuffled else cols)
    return indptr, torch.cat(rows).to(torch.int32)


def _packed_layout_mask(mask: torch.Tensor, indptr: torch.Tensor, indices: torch.Tensor, M: int, N: int, R: int,
                        C: int) -> torch.Tensor:
    """The per-block mask bit-packed as FlashInfer's ``packed_mask``: block row i's [rows, selected columns]
    bits row-major, each block row from a byte (built here block row by block row)."""
    widths = [min(C, N - j * C) for j in range(-(-N // C))]
    parts = []
    for i in range(len(indptr) - 1):
        rows = min(R, M - i * R)
        blocks = list(range(int(indptr[i]), int(indptr[i + 1])))
        if not blocks:
            continue
        parts.append(reference.pack_custom_mask(torch.cat([mask[b, :rows, :widths[int(indices[b])]] for b in blocks],
                                                          dim=1)))
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.uint8)


def _bsr_case(case, device: str, gen: torch.Generator):
    R, C, M, N, hq, hkv, d, dtype, density, mode, shuffled = case
    indptr, indices = random_bsr(M, N, R, C, density, gen, shuffled)
    q = torch.randn(M, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(N, hkv, d, generator=gen).to(dtype).to(device)
    v = torch.randn(N, hkv, d, generator=gen).to(dtype).to(device)
    mask = torch.rand(indices.numel(), R, C, generator=gen) > 0.5 if mode in ("mask", "packed") else None
    return indptr, indices, q, k, v, mask


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("case_id", list(BSR_CASES))
def test_block_sparse_matches_reference(case_id: str, return_lse: bool, device: str) -> None:
    case = BSR_CASES[case_id]
    R, C, M, N, hq, hkv, d, dtype, density, mode, _ = case
    gen = torch.Generator().manual_seed(list(BSR_CASES).index(case_id))
    indptr, indices, q, k, v, mask = _bsr_case(case, device, gen)
    wrapper = jitattn.BlockSparseAttentionWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=device))
    mask_args = {"mask": mask.to(device)} if mode == "mask" else (
        {"packed_mask": _packed_layout_mask(mask, indptr, indices, M, N, R, C).to(device)} if mode == "packed" else {})
    wrapper.plan(indptr.to(device), indices.to(device), M, N, R, C, hq, hkv, d, causal=mode == "causal",
                 q_data_type=dtype, o_data_type=dtype, **mask_args)
    assert (wrapper.M, wrapper.N, wrapper.R, wrapper.C) == (M, N, R, C)
    out = torch.full((M, hq, d), float("nan"), dtype=dtype, device=device)
    lse = torch.full((M, hq), float("nan"), device=device)
    result = wrapper.run(q, k, v, out=out, lse=lse, return_lse=return_lse)
    expected_o, expected_lse = reference.block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), indptr, indices, R, C,
                                                                mask=mask, causal=mode == "causal")
    if return_lse:
        assert result[0] is out and result[1] is lse
    else:
        assert result is out
    assert_close_out(out, expected_o, dtype)
    assert_close_lse(lse, expected_lse)


@pytest.mark.parametrize("device", devices())
def test_empty_block_rows_write_zero_and_minus_inf(device: str) -> None:
    """A block row with no block (and one whose mask hides every column) sees no key: o = 0, lse = -inf."""
    M, N, R, C, hq, hkv, d = 12, 16, 4, 4, 2, 1, 64
    indptr = torch.tensor([0, 0, 2, 3], dtype=torch.int32)  # block row 0 empty
    indices = torch.tensor([3, 0, 1], dtype=torch.int32)
    mask = torch.ones(3, R, C, dtype=torch.bool)
    mask[2] = False  # block row 2 masked whole
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(f16).to(device) for n, h in ((M, hq), (N, hkv), (N, hkv)))
    wrapper = jitattn.BlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8, device=device))
    wrapper.plan(indptr, indices, M, N, R, C, hq, hkv, d, mask=mask.to(device))
    out, lse = wrapper.run(q, k, v, out=torch.full((M, hq, d), float("nan"), dtype=f16, device=device),
                           return_lse=True)
    assert torch.equal(out[:4].cpu(), torch.zeros(4, hq, d, dtype=f16)) and torch.isneginf(lse[:4]).all()
    assert torch.equal(out[8:].cpu(), torch.zeros(4, hq, d, dtype=f16)) and torch.isneginf(lse[8:]).all()
    expected_o, expected_lse = reference.block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), indptr, indices, R, C,
                                                                mask=mask)
    assert_close_out(out, expected_o, f16)
    assert_close_lse(lse, expected_lse)


@pytest.mark.parametrize("device", devices())
def test_output_dtype_defaults_to_float16_as_flashinfer(device: str) -> None:
    """FlashInfer's ``o_data_type`` default is float16 whatever q is; a bf16 plan without it writes fp16."""
    gen = torch.Generator().manual_seed(8)
    M, N, R, C, h, d = 16, 32, 4, 8, 2, 64
    indptr, indices = random_bsr(M, N, R, C, 0.6, gen)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(bf16).to(device) for n in (M, N, N))
    wrapper = jitattn.BlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8, device=device))
    wrapper.plan(indptr, indices, M, N, R, C, h, h, d, q_data_type=bf16)
    out = wrapper.run(q, k, v)
    assert out.dtype == f16
    expected_o, _ = reference.block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), indptr, indices, R, C)
    assert_close_out(out, expected_o, f16)


GPU_SPECS += [_spec(2, 2, 64, bf16, f16, MaskMode.NONE), _spec(2, 1, 64, f16, f16, MaskMode.CUSTOM)]


@pytest.mark.parametrize("device", devices())
def test_scales_soft_cap_and_forward_options(device: str) -> None:
    """Per-tensor ``scale_q``/``scale_k`` multiply the logits and ``scale_v`` the output; ``forward``'s options
    replace the planned ones (the soft cap and sm_scale here)."""
    gen = torch.Generator().manual_seed(9)
    M, N, R, C, hq, hkv, d = 20, 24, 4, 4, 4, 2, 64
    indptr, indices = random_bsr(M, N, R, C, 0.5, gen)
    q = (torch.randn(M, hq, d, generator=gen) * 2).to(f16).to(device)
    k, v = (torch.randn(N, hkv, d, generator=gen).to(f16).to(device) for _ in range(2))
    wrapper = jitattn.BlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8, device=device))
    wrapper.plan(indptr, indices, M, N, R, C, hq, hkv, d, q_data_type=f16)
    out = wrapper.run(q, k, v, 0.5, torch.tensor([1.5]), 2.0)
    expected_o, _ = reference.block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), indptr, indices, R, C,
                                                     sm_scale=0.75 / math.sqrt(d))
    assert_close_out(out.float() / 2.0, expected_o, f16)
    out = wrapper.forward(q, k, v, logits_soft_cap=3.0, sm_scale=0.2)
    expected_o, _ = reference.block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), indptr, indices, R, C, sm_scale=0.2,
                                                     logits_soft_cap=3.0)
    assert_close_out(out, expected_o, f16)


def _partition(total: int, parts: int, gen: torch.Generator, allow_empty: bool = False) -> list[int]:
    """``parts`` block sizes summing to ``total`` (each >= 1 unless ``allow_empty``)."""
    if allow_empty:
        cuts = sorted(torch.randint(0, total + 1, (parts - 1,), generator=gen).tolist())
    else:
        cuts = sorted((torch.randperm(total - 1, generator=gen)[:parts - 1] + 1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


# id: (kv_heads, group, head_dim, qo_len, kv_len, row blocks, col blocks, dtype, density, causal, rows of 0 allowed)
VARIABLE_CASES = {
    "h1_g1_f16": (1, 1, 64, 23, 31, 4, 6, f16, 0.5, False, False),
    "h2_g3_bf16_causal": (2, 3, 64, 40, 33, 5, 7, bf16, 0.6, True, False),
    "h3_g2_f16_sparse": (3, 2, 128, 17, 50, 3, 10, f16, 0.2, False, False),
    "h2_g4_bf16_empty_row_blocks_causal": (2, 4, 64, 12, 20, 4, 5, bf16, 0.4, True, True),
}
GPU_SPECS += [_spec(c[1], 1, c[2], c[7], c[7], MaskMode.CAUSAL if c[9] else MaskMode.NONE)
              for c in VARIABLE_CASES.values()]


def _variable_case(case, device: str, gen: torch.Generator):
    heads, group, d, qo_len, kv_len, mb, nb, dtype, density, causal, empty_rows = case
    rows = torch.tensor([_partition(qo_len, mb, gen, empty_rows) for _ in range(heads)], dtype=torch.int32)
    cols = torch.tensor([_partition(kv_len, nb, gen) for _ in range(heads)], dtype=torch.int32)
    blocks = torch.rand(heads, mb, nb, generator=gen) < density
    q = torch.randn(heads * group, qo_len, d, generator=gen).to(dtype).to(device)
    k, v = (torch.randn(heads, kv_len, d, generator=gen).to(dtype).to(device) for _ in range(2))
    return rows, cols, blocks, q, k, v


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "lse"])
@pytest.mark.parametrize("case_id", list(VARIABLE_CASES))
def test_variable_block_sparse_matches_reference(case_id: str, return_lse: bool, device: str) -> None:
    case = VARIABLE_CASES[case_id]
    heads, group, d, qo_len, kv_len, _, _, dtype, _, causal, _ = case
    gen = torch.Generator().manual_seed(100 + list(VARIABLE_CASES).index(case_id))
    rows, cols, blocks, q, k, v = _variable_case(case, device, gen)
    wrapper = jitattn.VariableBlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8, device=device))
    wrapper.plan(blocks.to(device), rows.to(device), cols.to(device), heads * group, heads, d, causal=causal,
                 q_data_type=dtype)
    out = torch.full((heads * group, qo_len, d), float("nan"), dtype=dtype, device=device)
    lse = torch.full((heads * group, qo_len), float("nan"), device=device)
    result = wrapper.run(q, k, v, out=out, lse=lse, return_lse=return_lse)
    assert (result[0] is out and result[1] is lse) if return_lse else result is out
    expected_o, expected_lse = reference.variable_block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), blocks, rows,
                                                                         cols, causal=causal)
    assert_close_out(out, expected_o, dtype)
    assert_close_lse(lse, expected_lse)


def test_convert_bsr_mask_layout_puts_each_block_row_side_by_side() -> None:
    gen = torch.Generator().manual_seed(3)
    indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    mask = torch.rand(5, 3, 4, generator=gen) > 0.5
    expected = torch.cat([mask[s:e].transpose(0, 1).reshape(-1) for s, e in ((0, 2), (2, 2), (2, 5))])
    assert torch.equal(convert_bsr_mask_layout(mask, indptr), expected)


@pytest.mark.parametrize("positional", [False, True], ids=["lse_keyword", "lse_positional"])
def test_flashinfer_namespace_returns_base2_lse(positional: bool) -> None:
    gen = torch.Generator().manual_seed(4)
    M, N, R, C, h, d = 12, 20, 4, 5, 2, 64
    indptr, indices = random_bsr(M, N, R, C, 0.7, gen)
    q, k, v = (torch.randn(n, h, d, generator=gen).to(f16) for n in (M, N, N))
    results = []
    for module in (fi, jitattn):
        wrapper = module.BlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
        wrapper.plan(indptr, indices, M, N, R, C, h, h, d)
        lse = torch.full((M, h), 7777.0)
        out = wrapper.run(q, k, v, None, None, None, None, lse) if positional else wrapper.run(q, k, v, lse=lse)
        results.append((out, lse))
    torch.testing.assert_close(results[0][1], results[1][1] * LOG2E)
    assert torch.equal(results[0][0], results[1][0])
    rows, cols, blocks, qv, kv_, vv = _variable_case(VARIABLE_CASES["h1_g1_f16"], "cpu", gen)
    pairs = []
    for module in (fi, jitattn):
        wrapper = module.VariableBlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
        wrapper.plan(blocks, rows, cols, 1, 1, 64)
        pairs.append(wrapper.run(qv, kv_, vv, return_lse=True))
    assert torch.equal(pairs[0][0], pairs[1][0])
    torch.testing.assert_close(pairs[0][1], pairs[1][1] * LOG2E)
    assert jitattn.flashinfer.sparse.BlockSparseAttentionWrapper is fi.BlockSparseAttentionWrapper


def _planned_bsr():
    wrapper = jitattn.BlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    return wrapper, dict(indptr=torch.tensor([0, 1, 2], dtype=torch.int32), indices=torch.tensor([0, 1], dtype=torch.int32),
                         M=8, N=8, R=4, C=4, num_qo_heads=2, num_kv_heads=2, head_dim=64)


@pytest.mark.parametrize("change,error,match", [
    (dict(indptr=torch.tensor([0, 1, 2, 2], dtype=torch.int32)), ValueError, r"ceil\(M / R\) = 2 block rows"),
    (dict(indices=torch.tensor([0, 2], dtype=torch.int32)), ValueError, r"indices\[1\] = 2 is out of range"),
    (dict(indices=torch.tensor([0, -1], dtype=torch.int32)), ValueError, r"out of range"),
    (dict(indptr=torch.tensor([0, 2, 1], dtype=torch.int32)), ValueError, "never decrease"),
    (dict(indptr=torch.tensor([0, 1, 2], dtype=torch.int32), indices=torch.tensor([0, 1, 1], dtype=torch.int32)),
     ValueError, "must agree"),
    (dict(indptr=torch.tensor([0, 2, 2], dtype=torch.int32), indices=torch.tensor([1, 1], dtype=torch.int32)),
     ValueError, "lists column block 1 twice"),
    (dict(indices=torch.tensor([0.0, 1.0])), TypeError, "integer tensor"),
    (dict(R=0), ValueError, "R=0 must be a positive int"),
    (dict(mask=torch.ones(2, 4, 3, dtype=torch.bool)), ValueError, r"expected \[nnz, R, C\]"),
    (dict(mask=torch.ones(2, 4, 4)), TypeError, "bool"),
    # the block-sparse signature's own name (not the paged prefill's packed_custom_mask), and what to pass
    (dict(packed_mask=torch.zeros(3, dtype=torch.uint8)), ValueError, "^packed_mask has 3 bytes; expected .* mask"),
    (dict(packed_mask=torch.zeros(3, dtype=torch.int32)), TypeError, "^packed_mask has dtype int32"),
    (dict(pos_encoding_mode="ROPE_LLAMA"), ValueError, "apply RoPE to q and k before"),
    (dict(num_qo_heads=3), ValueError, "multiple"),
    (dict(head_dim="64"), ValueError, "^head_dim='64' must be a positive int"),  # the signature's name
])
def test_bsr_plan_refuses_bad_patterns(change: dict, error: type, match: str) -> None:
    wrapper, args = _planned_bsr()
    with pytest.raises(error, match=match):
        wrapper.plan(**{**args, **change})


@pytest.mark.parametrize("name", ["indptr", "indices"])
def test_bsr_plan_refuses_meta_index_arrays_by_name(name: str) -> None:
    wrapper, args = _planned_bsr()
    with pytest.raises(ValueError, match=f"^{name} is on the meta device, which holds no data"):
        wrapper.plan(**{**args, name: args[name].to("meta")})


@pytest.mark.parametrize("position", [0, 1, 2], ids=["block_mask_map", "block_row_sz", "block_col_sz"])
def test_variable_plan_refuses_a_meta_pattern_by_name(position: int) -> None:
    pattern = [torch.ones(2, 2, 3, dtype=torch.bool), torch.tensor([[3, 2], [1, 4]], dtype=torch.int32),
               torch.tensor([[2, 2, 2], [1, 1, 4]], dtype=torch.int32)]
    name = ("block_mask_map", "block_row_sz", "block_col_sz")[position]
    pattern[position] = pattern[position].to("meta")
    wrapper = jitattn.VariableBlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"^{name} is on the meta device, which holds no data"):
        wrapper.plan(*pattern, 4, 2, 64)


@pytest.mark.parametrize("call", ["keyword", "positional"])
def test_flashinfer_sparse_run_names_itself_on_arguments_that_do_not_fit(call: str) -> None:
    """The base-2 LSE shim binds the arguments to find a positional ``lse``: arguments that do not fit raise
    Python's own error, which names the method (the shim's bind said only "too many positional arguments")."""
    wrapper = fi.BlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    q = torch.randn(8, 2, 64).half()
    args, kwargs = ((q, q, q), {"foo": 1}) if call == "keyword" else ((q, q, q) + (None,) * 7 + ("extra",), {})
    with pytest.raises(TypeError, match=r"BlockSparseAttentionWrapper\.run\(\) (got an unexpected|takes from)"):
        wrapper.run(*args, **kwargs)


def test_bsr_run_refuses_before_plan_and_mismatched_tensors() -> None:
    wrapper, args = _planned_bsr()
    q, k = torch.randn(8, 2, 64).half(), torch.randn(8, 2, 64).half()
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q, k, k)
    wrapper.plan(**args)
    with pytest.raises(ValueError, match="N=8 keys"):
        wrapper.run(q, k[:7], k[:7])
    with pytest.raises(ValueError, match="M=8 queries"):
        wrapper.run(q[:5], k, k)
    with pytest.raises(NotImplementedError, match="per-head scales"):
        wrapper.run(q, k, k, scale_q=torch.ones(2))
    with pytest.raises(ValueError, match="the plan expects"):
        wrapper.run(torch.randn(8, 3, 64).half(), k, k)
    with pytest.raises(ValueError, match="block rows"):
        wrapper.plan(**{**args, "R": 3})
    with pytest.raises(RuntimeError, match="without a plan"):  # a failed plan leaves the wrapper unplanned
        wrapper.run(q, k, k)


def test_variable_plan_and_run_refuse_bad_input() -> None:
    wrapper = jitattn.VariableBlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    blocks = torch.ones(2, 2, 3, dtype=torch.bool)
    rows = torch.tensor([[3, 2], [1, 4]], dtype=torch.int32)
    cols = torch.tensor([[2, 2, 2], [1, 1, 4]], dtype=torch.int32)
    q, kv = torch.randn(4, 5, 64).half(), torch.randn(2, 6, 64).half()
    with pytest.raises(RuntimeError, match="without a plan"):
        wrapper.run(q, kv, kv)
    with pytest.raises(ValueError, match="every head's blocks must cover the same length"):
        wrapper.plan(blocks, torch.tensor([[3, 2], [1, 5]], dtype=torch.int32), cols, 4, 2, 64)
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        wrapper.plan(blocks, rows, cols, 6, 3, 64)
    with pytest.raises(TypeError, match="bool"):
        wrapper.plan(blocks.int(), rows, cols, 4, 2, 64)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        wrapper.plan(blocks, rows, cols, 3, 2, 64)
    wrapper.plan(blocks, rows, cols, 4, 2, 64)
    with pytest.raises(ValueError, match=r"q has shape \(4, 6, 64\)"):
        wrapper.run(torch.randn(4, 6, 64).half(), kv, kv)
    with pytest.raises(ValueError, match="out is"):
        wrapper.run(q, kv, kv, out=torch.empty(4, 5, 32).half())



@pytest.mark.parametrize("block_row_sz,block_col_sz,last_block_only,name", [
    ([[4]], [[2**30, 2**30]], False, "kv_indptr"),  # one head, 2^31 keys gathered
    ([[4], [4]], [[2**30], [2**30]], False, "kv_indptr"),  # two heads of 2^30
    ([[1] * 16], [[2**28]], False, "kv_indptr"),  # 16 query blocks each over all 2^28 keys: 2^32 gathered
    ([[4], [4]], [[2**30, 1], [2**30, 1]], True, "kv_indices"),  # 2 keys gathered, head 1's at 2^31 + 1
])
def test_variable_plan_refuses_a_pattern_past_int32_before_building_it(block_row_sz, block_col_sz, last_block_only,
                                                                       name) -> None:
    """The index arrays hold one entry per gathered key (key h * kv_len + column of kv head h): past int32 the plan
    is refused from the sizes alone (building them first asked numpy for 16-32 GiB)."""
    rows, cols = torch.tensor(block_row_sz, dtype=torch.int64), torch.tensor(block_col_sz, dtype=torch.int64)
    mask = torch.ones(rows.shape[0], rows.shape[1], cols.shape[1], dtype=torch.bool)
    if last_block_only:
        mask[..., :-1] = False
    wrapper = jitattn.VariableBlockSparseAttentionWrapper(torch.empty(0, dtype=torch.uint8))
    with pytest.raises(ValueError, match=f"{name} exceeds int32 .*too large for one plan"):
        wrapper.plan(mask, rows, cols, rows.shape[0], rows.shape[0], 64)

def _variable_wrapper():
    """A variable-block wrapper planned for 2 kv heads (group 2) of 5 query rows and 6 keys, head_dim 64."""
    wrapper = jitattn.VariableBlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8))
    wrapper.plan(torch.ones(2, 2, 3, dtype=torch.bool), torch.tensor([[3, 2], [1, 4]], dtype=torch.int32),
                 torch.tensor([[2, 2, 2], [1, 1, 4]], dtype=torch.int32), 4, 2, 64, q_data_type=f16)
    return wrapper, torch.randn(4, 5, 64).half(), torch.randn(2, 6, 64).half()


@pytest.mark.parametrize("block_mask_map,block_row_sz", [
    (torch.ones(2, 3, 2, dtype=torch.bool), torch.zeros(2, 3, dtype=torch.int32)),
    (torch.ones(2, 0, 2, dtype=torch.bool), torch.zeros(2, 0, dtype=torch.int32)),
], ids=["row_blocks_of_no_rows", "no_row_blocks"])
def test_variable_pattern_of_no_query_rows_returns_empty_outputs(block_mask_map, block_row_sz) -> None:
    wrapper = jitattn.VariableBlockSparseAttentionWrapper(torch.empty(128 << 20, dtype=torch.uint8))
    wrapper.plan(block_mask_map, block_row_sz, torch.tensor([[10, 20], [5, 25]], dtype=torch.int32), 4, 2, 64,
                 q_data_type=f16)
    q, kv = torch.randn(4, 0, 64).half(), torch.randn(2, 30, 64).half()
    out, lse = wrapper.run(q, kv, kv, return_lse=True)
    assert out.shape == (4, 0, 64) and out.dtype == f16 and lse.shape == (4, 0) and lse.dtype == torch.float32
    out_buffer, lse_buffer = torch.empty(4, 0, 64, dtype=f16), torch.empty(4, 0)
    out, lse = wrapper.run(q, kv, kv, out=out_buffer, lse=lse_buffer, return_lse=True)
    assert out is out_buffer and lse is lse_buffer


def _re_shape(shape: tuple) -> str:
    """``shape`` as a regular expression matching its tuple's text."""
    return r"\(" + ", ".join(map(str, shape)) + r"\)"


@pytest.mark.parametrize("name,shape,expected", [
    ("q", (4, 5, 128), (4, 5, 64)),
    ("k", (2, 6, 32), (2, 6, 64)),
    ("v", (2, 6, 32), (2, 6, 64)),
])
def test_variable_run_quotes_the_callers_shapes_on_a_head_dim_mismatch(name: str, shape: tuple,
                                                                       expected: tuple) -> None:
    wrapper, q, kv = _variable_wrapper()
    tensors = {"q": q, "k": kv, "v": kv, name: torch.randn(shape).half()}
    expected_message = rf"^{name} has shape {_re_shape(shape)}; the plan expects {_re_shape(expected)}"
    with pytest.raises(ValueError, match=expected_message):
        wrapper.run(tensors["q"], tensors["k"], tensors["v"])


@pytest.mark.parametrize("name,plan_arg", [("q", "q_data_type"), ("k", "kv_data_type")])
def test_variable_run_says_how_to_agree_on_a_dtype(name: str, plan_arg: str) -> None:
    wrapper, q, kv = _variable_wrapper()
    tensors = {"q": q, "k": kv, "v": kv, name: {"q": q, "k": kv}[name].float()}
    with pytest.raises(TypeError, match=rf"^{name} has dtype float32 but the plan has {plan_arg}=float16; pass "
                                        rf"{plan_arg}=torch.float32 to plan\(\) \(or cast {name} to float16\)"):
        wrapper.run(tensors["q"], tensors["k"], tensors["v"])


@pytest.mark.parametrize("name,buffer,error,match", [
    ("out", torch.empty(4, 5, 64), TypeError, "out has dtype float32; expected one of float16"),
    ("lse", torch.empty(4, 5, dtype=f16), TypeError, "lse has dtype float16; expected one of float32"),
    ("lse", torch.empty(5, 4), ValueError, r"lse is \(5, 4\)"),
    ("out", [0.0], TypeError, "out must be a torch.Tensor, got list"),
])
def test_variable_run_refuses_a_wrong_out_or_lse(name: str, buffer, error: type, match: str) -> None:
    wrapper, q, kv = _variable_wrapper()
    with pytest.raises(error, match=match):
        wrapper.run(q, kv, kv, return_lse=True, **{name: buffer})


@pytest.mark.parametrize("overlap", ["lse_in_out", "out_in_k", "out_is_q", "expanded_out"])
def test_variable_run_refuses_outputs_that_share_memory(overlap: str) -> None:
    """out / lse over each other or over q, k, v are refused as every wrapper refuses them (they gave a wrong out, or
    overwrote the caller's k), and so is an expand()ed out (it failed in torch's copy after the whole compute)."""
    wrapper, q, kv = _variable_wrapper()
    out, lse = torch.empty(4, 5, 64, dtype=f16), torch.empty(4, 5)
    if overlap == "lse_in_out":
        lse, match = out.view(-1)[:40].view(torch.float32).view(4, 5), "out and lse share memory"
    elif overlap == "out_in_k":
        buffer = torch.randn(2048).half()  # k: its first 768 elements; out: 1280 from element 256
        kv, out, match = buffer[:768].view(2, 6, 64), buffer[256:1536].view(4, 5, 64), "out shares memory with k"
    elif overlap == "out_is_q":
        out, match = q, "out shares memory with q"
    else:
        out, match = torch.empty(1, 5, 64, dtype=f16).expand(4, 5, 64), "elements that share memory"
    before = (q.clone(), kv.clone())
    with pytest.raises(ValueError, match=match):
        wrapper.run(q, kv, kv, out=out, lse=lse, return_lse=True)
    assert torch.equal(q, before[0]) and torch.equal(kv, before[1]), "a refused run() wrote nothing"


@pytest.mark.parametrize("name", ["out", "lse"])
def test_bsr_run_refuses_an_out_or_lse_that_is_not_a_tensor(name: str) -> None:
    wrapper, args = _planned_bsr()
    wrapper.plan(**args)
    q, k = torch.randn(8, 2, 64).half(), torch.randn(8, 2, 64).half()
    with pytest.raises(TypeError, match=f"{name} must be a torch.Tensor, got list"):
        wrapper.run(q, k, k, return_lse=True, **{name: [0.0]})


@pytest.mark.parametrize("return_lse", ["no", None, 2, torch.tensor(True)])
@pytest.mark.parametrize("variable", [False, True], ids=["bsr", "variable"])
def test_sparse_return_lse_must_be_a_bool(variable: bool, return_lse) -> None:
    if variable:
        wrapper, q, k = _variable_wrapper()
    else:
        wrapper, args = _planned_bsr()
        wrapper.plan(**args)
        q, k = torch.randn(8, 2, 64).half(), torch.randn(8, 2, 64).half()
    with pytest.raises(TypeError, match="return_lse=.* must be True or False"):
        wrapper.run(q, k, k, return_lse=return_lse)

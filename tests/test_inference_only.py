"""Inputs that require grad, in grad mode: every public op gives the bits it gives without grad, and a backward
through its result raises a clear error naming the op (not torch's "does not have a grad_fn" far from the call).
Under no_grad nothing changes: the results require no grad and ``out=`` is returned itself."""

from __future__ import annotations

import pytest
import torch

import jitattn

from attention_cases import random_paged_batch

HQ, HKV, D, PAGE = 4, 2, 64, 4
WS = 8 << 20


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(5)


def _batch_decode(ts):
    batch = random_paged_batch([9, 3], HKV, D, PAGE, torch.float32, generator=_gen())
    w = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(WS, dtype=torch.uint8))
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type=torch.float32)
    return lambda: w.run(ts["q2"], batch.cache), "BatchDecodeWithPagedKVCacheWrapper.run"


def _ragged_prefill(ts):
    w = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(WS, dtype=torch.uint8))
    indptr = torch.tensor([0, 3, 5], dtype=torch.int32)
    kv_indptr = torch.tensor([0, 4, 7], dtype=torch.int32)
    w.plan(indptr, kv_indptr, HQ, HKV, D, causal=True, q_data_type=torch.float32)
    return lambda: w.run(ts["q5"], ts["k7"], ts["v7"]), "BatchPrefillWithRaggedKVCacheWrapper.run"


def _cascade(ts):
    batch = random_paged_batch([6, 6], HKV, D, PAGE, torch.float32, generator=_gen())
    w = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(WS, dtype=torch.uint8))
    shared = batch.kv_indices[:1]  # the first page shared by both requests, then each its own
    own = batch.kv_indices[1:]
    w.plan([torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32)],
           [torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)],
           [shared, own[:3]], [torch.tensor([PAGE], dtype=torch.int32), torch.tensor([PAGE, 2], dtype=torch.int32)],
           HQ, HKV, D, PAGE, q_data_type=torch.float32)
    return lambda: w.run(ts["q2"], batch.cache), "MultiLevelCascadeAttentionWrapper.run"


def _block_sparse(ts):
    w = jitattn.BlockSparseAttentionWrapper(torch.empty(WS, dtype=torch.uint8))
    w.plan(torch.tensor([0, 1, 3], dtype=torch.int32), torch.tensor([0, 0, 1], dtype=torch.int32), 4, 7, 2, 4, HQ,
           HKV, D, q_data_type=torch.float32)
    return lambda: w.run(ts["q4"], ts["k7"], ts["v7"]), "BlockSparseAttentionWrapper.run"


def _mla(ts):
    w = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(WS, dtype=torch.uint8))
    w.plan(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([0, 2, 3], dtype=torch.int32),
           torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([7, 3], dtype=torch.int32), 16, 512, 64, 4, False,
           0.07, torch.float32, torch.float32)
    return (lambda: w.run(ts["q_nope"], ts["q_pe"], ts["ckv"], ts["kpe"], return_lse=True),
            "BatchMLAPagedAttentionWrapper.run")


def _pod(ts):
    batch = random_paged_batch([9, 3], HKV, D, PAGE, torch.float32, generator=_gen())
    w = jitattn.PODWithPagedKVCacheWrapper(torch.empty(WS, dtype=torch.uint8))
    w.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE, q_data_type=torch.float32)
    return lambda: w.run(ts["q5"], ts["k7"], ts["v7"], ts["q2"], batch.cache), "PODWithPagedKVCacheWrapper.run"


def _batch_attention(ts):
    batch = random_paged_batch([9, 3], HKV, D, PAGE, torch.float32, generator=_gen())
    w = jitattn.BatchAttention(device="cpu")
    w.plan(torch.tensor([0, 1, 5], dtype=torch.int32), batch.kv_indptr, batch.kv_indices,
           torch.tensor([9, 3], dtype=torch.int32), HQ, HKV, D, D, PAGE, causal=True, q_data_type=torch.float32,
           kv_data_type=torch.float32)
    return lambda: w.run(ts["q5"], batch.cache), "BatchAttention.run"


CALLS = {
    "single_prefill": lambda ts: (lambda: jitattn.single_prefill_with_kv_cache(ts["q5"], ts["k7"], ts["v7"]),
                                  "single_prefill_with_kv_cache"),
    "single_decode": lambda ts: (lambda: jitattn.single_decode_with_kv_cache(ts["q2"][0], ts["k7"], ts["v7"]),
                                 "single_decode_with_kv_cache"),
    "batch_decode": _batch_decode,
    "ragged_prefill": _ragged_prefill,
    "cascade": _cascade,
    "block_sparse": _block_sparse,
    "mla": _mla,
    "pod": _pod,
    "batch_attention": _batch_attention,
    "merge_state": lambda ts: (lambda: jitattn.merge_state(ts["v_a"], ts["s_a"], ts["v_b"], ts["s_b"]), "merge_state"),
    "merge_states": lambda ts: (lambda: jitattn.merge_states(ts["vs"], ts["ss"]), "merge_states"),
    "rmsnorm": lambda ts: (lambda: jitattn.rmsnorm(ts["x"], ts["w"]), "rmsnorm"),
    "silu_and_mul": lambda ts: (lambda: jitattn.silu_and_mul(ts["x"]), "silu_and_mul"),
    "apply_rope_pos_ids": lambda ts: (lambda: jitattn.apply_rope_pos_ids(ts["q5"], ts["k7"][:5], ts["pos"]),
                                      "apply_rope_pos_ids"),
}


def _tensors(requires_grad: bool) -> dict:
    gen = torch.Generator().manual_seed(11)
    shapes = {"q2": (2, HQ, D), "q4": (4, HQ, D), "q5": (5, HQ, D), "k7": (7, HKV, D), "v7": (7, HKV, D),
              "q_nope": (2, 16, 512), "q_pe": (2, 16, 64), "ckv": (4, 4, 512), "kpe": (4, 4, 64),
              "v_a": (3, HQ, D), "s_a": (3, HQ), "v_b": (3, HQ, D), "s_b": (3, HQ), "vs": (3, 2, HQ, D),
              "ss": (3, 2, HQ), "x": (3, 2 * D), "w": (2 * D,)}
    ts = {name: torch.randn(shape, generator=gen).requires_grad_(requires_grad) for name, shape in shapes.items()}
    ts["pos"] = torch.arange(5, dtype=torch.int32)
    return ts


def _flat(result) -> list[torch.Tensor]:
    if isinstance(result, torch.Tensor):
        return [result]
    return [t for part in result for t in _flat(part)]


@pytest.mark.parametrize("case", list(CALLS))
def test_grad_inputs_give_the_same_bits_and_a_clear_backward_error(case: str) -> None:
    with torch.no_grad():
        call, _ = CALLS[case](_tensors(False))
        expected = _flat(call())
    call, name = CALLS[case](_tensors(True))
    result = _flat(call())
    assert [t.shape for t in result] == [t.shape for t in expected]
    for got, want in zip(result, expected):
        assert torch.equal(got.detach(), want)
    assert result[0].requires_grad
    with pytest.raises(RuntimeError, match=f"{name} is inference-only.*torch.no_grad"):
        result[0].float().sum().backward()


@pytest.mark.parametrize("case", ["single_prefill", "batch_decode", "rmsnorm"])
def test_without_grad_mode_results_are_plain_tensors(case: str) -> None:
    with torch.no_grad():
        call, _ = CALLS[case](_tensors(True))
        result = _flat(call())
    assert not any(t.requires_grad for t in result)
    call, _ = CALLS[case](_tensors(False))  # grad mode on, nothing requires grad: plain tensors too
    assert not any(t.requires_grad for t in _flat(call()))


def test_out_is_returned_itself_and_filled() -> None:
    ts = _tensors(True)
    x, w = ts["x"], ts["w"]
    y = torch.empty(3, 2 * D)
    normed = jitattn.rmsnorm(x, w, out=y)
    assert normed is y and normed.requires_grad
    with torch.no_grad():
        assert torch.equal(y, jitattn.rmsnorm(x, w))

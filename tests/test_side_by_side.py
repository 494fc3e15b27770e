"""A mixed batch's prefill and decode parts side by side (``jitattn.runtime.side_by_side``): the estimate that
caps the prefill's grid, and on the GPU that a capped sm90 prefill grid and the side streams change no bit of
the results (POD against its parts launched alone, eager and replayed from a CUDA graph)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import jitattn
from jitattn import hardware
from jitattn.kernels import prefill as prefill_family
from jitattn.ops.prefill import plan_single_prefill
from jitattn.runtime import side_by_side as sbs

from attention_cases import random_paged_batch

bf16 = torch.bfloat16


@pytest.mark.parametrize("qo,kv", [(1, 1), (5, 5), (5, 9), (9, 5), (1, 40), (40, 1), (0, 7), (7, 0)])
@pytest.mark.parametrize("causal", [True, False])
def test_prefill_flops_count_the_visible_pairs(qo: int, kv: int, causal: bool) -> None:
    # bottom-right causal: query i sees keys j <= kv - qo + i
    pairs = sum(1 for i in range(qo) for j in range(kv) if not causal or j <= kv - qo + i)
    assert sbs.prefill_flops([qo], [kv], 3, 16, 8, causal) == 2 * pairs * 3 * (16 + 8)
    assert sbs.prefill_flops([qo, qo], [kv, kv], 3, 16, 8, causal) == 4 * pairs * 3 * (16 + 8)


@pytest.mark.parametrize("qo,kv", [(1, 1), (5, 9), (9, 5), (1, 40), (40, 40), (0, 7), (7, 0)])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [0, 3, 100])
def test_prefill_flops_under_a_window_count_the_keys_it_shows(qo: int, kv: int, causal: bool, window: int) -> None:
    # query i at position p = kv - qo + i sees keys j >= p - window (and j <= p when causal)
    def pairs(qo, kv):
        return sum(1 for i in range(qo) for j in range(kv)
                   if j >= kv - qo + i - window and (not causal or j <= kv - qo + i))
    assert sbs.prefill_flops([qo], [kv], 3, 16, 8, causal, window) == 2 * pairs(qo, kv) * 3 * (16 + 8)
    both = sbs.prefill_flops([qo, 3], [kv, 11], 3, 16, 8, causal, window)
    assert both == 2 * (pairs(qo, kv) + pairs(3, 11)) * 3 * (16 + 8)


def test_prefill_flops_refuse_lengths_of_two_batch_sizes() -> None:
    for window in (-1, 2):
        with pytest.raises(ValueError, match="qo_lens has 2 requests but kv_lens has 1"):
            sbs.prefill_flops([1, 2], [3], 1, 64, 64, True, window)


def test_decode_bytes_under_a_window_count_the_windows_keys() -> None:
    assert sbs.decode_bytes([4096, 100], 8, 128, 128, 2) == (4096 + 100) * 8 * 256 * 2
    assert sbs.decode_bytes([4096, 100], 8, 128, 128, 2, window_left=127) == (128 + 100) * 8 * 256 * 2


def test_prefill_sms_share_the_sms_by_the_parts_estimated_times() -> None:
    decode = sbs.DECODE_BYTES_PER_S * 1e-4  # 100 us of decode reads
    half = sbs.PREFILL_FLOPS_PER_S * 0.5e-4  # 50 us of prefill
    assert sbs.prefill_sms(half, decode, 132) == 66
    assert sbs.prefill_sms(half * 0.3, decode, 132) == 20  # ceil(132 * 0.15)
    assert sbs.prefill_sms(half * 2.5, decode, 132) == 132  # the prefill is the longer part: no cap
    assert sbs.prefill_sms(1.0, decode, 132) == sbs.MIN_PREFILL_SMS  # never starved
    assert sbs.prefill_sms(half, 0.0, 132) == 132  # nothing to run beside it
    assert sbs.prefill_sms(1.0, decode, 4) == 4  # a GPU smaller than the floor


def test_prefill_blocks_read_the_plans_of_both_parts(monkeypatch) -> None:
    """The cap of a cuda prefill plan beside a decode plan, from their lengths, heads, head dims and dtypes (plans
    stood in for: the arithmetic runs on the cpu), and no cap on the cpu target."""
    from types import SimpleNamespace as NS

    monkeypatch.setattr(sbs, "num_sms", lambda index: 132)
    prefill = NS(qo_indptr=NS(device=torch.device("cuda", 0)), index=NS(kv_lens=(2048,)), num_qo_heads=32,
                 head_dim_qk=128, head_dim_vo=128, scalars=NS(causal=True, window_left=-1))
    decode = NS(index=NS(kv_lens=(4096,) * 64), num_kv_heads=8, head_dim_qk=128, head_dim_vo=128, kv_dtype=bf16,
                scalars=NS(window_left=-1))
    flops = sbs.prefill_flops([2048], [2048], 32, 128, 128, True)
    read = 64 * 4096 * 8 * 256 * 2
    assert sbs.prefill_blocks(prefill, np.array([2048]), decode) == sbs.prefill_sms(flops, read, 132) == 67
    # under a window (gpt-oss's 128 tokens) both parts shrink: the decode reads 128 keys a request
    prefill.scalars.window_left = decode.scalars.window_left = 127
    flops = sbs.prefill_flops([2048], [2048], 32, 128, 128, True, 127)
    read = 64 * 128 * 8 * 256 * 2
    assert sbs.prefill_blocks(prefill, np.array([2048]), decode) == sbs.prefill_sms(flops, read, 132)
    prefill.qo_indptr = NS(device=torch.device("cpu"))
    assert sbs.prefill_blocks(prefill, np.array([2048]), decode) == 0


def test_side_by_side_on_the_cpu_runs_both_parts_in_order() -> None:
    calls = []
    a, b = sbs.side_by_side(lambda: calls.append("first") or 1, lambda: calls.append("second") or 2,
                            torch.device("cpu"))
    assert (a, b, calls) == (1, 2, ["first", "second"])


def _sm90_or_skip(plan) -> None:
    if prefill_family.tier(plan.spec, hardware.known_arch_list()) != "sm90":
        pytest.skip("the grid cap applies to the sm90 prefill tier (a Hopper GPU)")


@pytest.mark.gpu
@pytest.mark.parametrize("blocks", [1, 3, 17, 10_000])
def test_a_capped_sm90_prefill_grid_gives_the_same_bits(blocks: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    q = torch.randn(700, 32, 128, generator=gen, device="cuda", dtype=bf16)
    k, v = (torch.randn(900, 8, 128, generator=gen, device="cuda", dtype=bf16) for _ in range(2))
    wrapper, kv = plan_single_prefill(q, k, v, causal=True)
    _sm90_or_skip(wrapper.current_plan)
    full = wrapper.run(q, kv, return_lse=True)
    with wrapper.current_plan.launch.grid_at_most(blocks):
        capped = wrapper.run(q, kv, return_lse=True)
    after = wrapper.run(q, kv, return_lse=True)  # the cap ends with the ``with``
    for got in (capped, after):
        assert torch.equal(got[0], full[0]) and torch.equal(got[1], full[1])


def _pod_case(chunk: int, decode_kv: list[int]):
    gen = torch.Generator().manual_seed(23)
    hq, hkv, d, page = 32, 8, 128, 16
    batch = random_paged_batch(decode_kv, hkv, d, page, bf16, layout="NHD", device="cuda", generator=gen)
    q_d = torch.randn(len(decode_kv), hq, d, generator=gen).to(bf16).cuda()
    q_p = torch.randn(chunk, hq, d, generator=gen).to(bf16).cuda()
    k_p, v_p = (torch.randn(chunk, hkv, d, generator=gen).to(bf16).cuda() for _ in range(2))
    return (hq, hkv, d, page), batch, q_d, (q_p, k_p, v_p)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk,decode_kv", [(256, [2048] * 48), (2048, [300, 17, 1200, 64])],
                         ids=["decode_heavy_prefill_capped", "prefill_heavy_uncapped"])
def test_pod_side_by_side_equals_its_parts_launched_alone(chunk: int, decode_kv: list[int]) -> None:
    (hq, hkv, d, page), batch, q_d, (q_p, k_p, v_p) = _pod_case(chunk, decode_kv)
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    pod = jitattn.PODWithPagedKVCacheWrapper(workspace)
    pod.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page, q_data_type=bf16)
    decode = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    decode.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, hq, hkv, d, page, q_data_type=bf16)
    wrapper, _ = plan_single_prefill(q_p, k_p, v_p, causal=True)
    blocks = sbs.prefill_blocks(wrapper.current_plan, [chunk], decode.current_plan)
    if decode_kv[0] == 2048:
        assert 0 < blocks < hardware.num_sms(torch.cuda.current_device())  # this case does cap the grid
    alone_p = jitattn.single_prefill_with_kv_cache(q_p, k_p, v_p, causal=True, return_lse=True)
    alone_d = decode.run(q_d, batch.cache, return_lse=True)
    for _ in range(3):  # the side streams reused, their outputs' memory recycled between runs
        (out_p, out_d), (lse_p, lse_d) = pod.run(q_p, k_p, v_p, q_d, batch.cache, causal_p=True, return_lse_p=True,
                                                 return_lse_d=True)
        torch.cuda.synchronize()
        assert torch.equal(out_p, alone_p[0]) and torch.equal(lse_p, alone_p[1])
        assert torch.equal(out_d, alone_d[0]) and torch.equal(lse_d, alone_d[1])


@pytest.mark.gpu
def test_batch_pod_side_by_side_equals_its_parts_launched_alone() -> None:
    (hq, hkv, d, page), decode, q_d, _ = _pod_case(1, [2048] * 48)
    gen = torch.Generator().manual_seed(29)
    prefill = random_paged_batch([300, 700], hkv, d, page, bf16, layout="NHD", device="cuda", generator=gen)
    qo_indptr_p = torch.tensor([0, 300, 800], dtype=torch.int32)
    q_p = torch.randn(800, hq, d, generator=gen).to(bf16).cuda()
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    pod = jitattn.BatchPODWithPagedKVCacheWrapper(workspace)
    pod.plan(qo_indptr_p, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len,
             torch.arange(49, dtype=torch.int32), decode.kv_indptr, decode.kv_indices, decode.kv_last_page_len,
             hq, hkv, d, page, q_data_type=bf16)
    alone_p = jitattn.BatchPrefillWithPagedKVCacheWrapper(torch.empty_like(workspace))
    alone_p.plan(qo_indptr_p, prefill.kv_indptr, prefill.kv_indices, prefill.kv_last_page_len, hq, hkv, d, page,
                 causal=True, q_data_type=bf16)
    alone_d = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty_like(workspace))
    alone_d.plan(decode.kv_indptr, decode.kv_indices, decode.kv_last_page_len, hq, hkv, d, page, q_data_type=bf16)
    expected = (alone_p.run(q_p, prefill.cache, return_lse=True), alone_d.run(q_d, decode.cache, return_lse=True))
    _sm90_or_skip(alone_p.current_plan)
    blocks = sbs.prefill_blocks(alone_p.current_plan, [300, 500], alone_d.current_plan)
    assert 0 < blocks < hardware.num_sms(torch.cuda.current_device())  # the prefill part is capped
    for _ in range(2):
        (out_p, out_d), (lse_p, lse_d) = pod.run(q_p, prefill.cache, q_d, decode.cache, causal_p=True,
                                                 return_lse=True)
        torch.cuda.synchronize()
        assert torch.equal(out_p, expected[0][0]) and torch.equal(lse_p, expected[0][1])
        assert torch.equal(out_d, expected[1][0]) and torch.equal(lse_d, expected[1][1])


@pytest.mark.gpu
def test_side_by_side_forks_and_joins_inside_a_cuda_graph_capture() -> None:
    """The side streams join a capture and the capturing stream waits for them, so a replay runs both parts."""
    a = torch.randn(1 << 20, device="cuda")
    b = torch.randn(1 << 20, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x, y = sbs.side_by_side(lambda: a * 2, lambda: b + 1, a.device)
        z = x + y  # on the capturing stream, after the join
    a.copy_(torch.randn_like(a))
    b.copy_(torch.randn_like(b))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, a * 2 + (b + 1))


@pytest.mark.gpu
def test_side_by_side_runs_the_first_part_at_a_higher_priority_than_the_second() -> None:
    """The persistent prefill (first) must be placed before the decode's blocks when both wait for SMs: its
    stream has the higher priority (a lower number); both are side streams, neither the caller's."""
    device = torch.device("cuda")
    caller = torch.cuda.current_stream(device)
    seen = sbs.side_by_side(lambda: torch.cuda.current_stream(device), lambda: torch.cuda.current_stream(device),
                            device)
    assert seen[0].priority < seen[1].priority
    assert caller not in seen and torch.cuda.current_stream(device) == caller

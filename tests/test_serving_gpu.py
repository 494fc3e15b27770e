"""Serving behaviour on the GPU: no syncs or hidden allocations in run(), CUDA graphs, capture safety."""

from __future__ import annotations

import time

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.specs import attention_spec
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import assert_close_out, random_paged_batch

pytestmark = pytest.mark.gpu

HQ, HKV, D, PAGE = 32, 8, 128, 16
GPU_SPECS = [attention_spec(
    Op.DECODE, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, o_dtype=torch.bfloat16,
    head_dim_qk=D, head_dim_vo=D, num_qo_heads=HQ, num_kv_heads=HKV, pos_encoding=PosEncoding.NONE,
    use_sliding_window=False, use_logits_soft_cap=False, mask_mode=MaskMode.NONE, kv_layout=KVLayout.NHD,
    kv_storage=KVStorage.PAGED,
)]


def _planned(kv_lens, **wrapper_kw):
    batch = random_paged_batch(kv_lens, HKV, D, PAGE, torch.bfloat16, device="cuda")
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), **wrapper_kw)
    wrapper.plan(batch.kv_indptr, batch.kv_indices, batch.kv_last_page_len, HQ, HKV, D, PAGE,
                 q_data_type=torch.bfloat16)
    q = torch.randn(len(kv_lens), HQ, D, dtype=torch.bfloat16, device="cuda")
    return wrapper, batch, q


def _random_page_table(gen: torch.Generator, batch_size: int, max_pages: int, max_len: int):
    """(indptr, indices, last_page_len) on the host: random lengths in [1, max_len), pages in random order."""
    lens = torch.randint(1, max_len, (batch_size,), generator=gen).tolist()
    pages = [(n + PAGE - 1) // PAGE for n in lens]
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.randperm(max_pages, generator=gen)[: sum(pages)].to(torch.int32)
    last = torch.tensor([(n - 1) % PAGE + 1 for n in lens], dtype=torch.int32)
    return indptr, indices, last


def test_run_does_not_synchronise() -> None:
    wrapper, batch, q = _planned([300, 4000, 17])
    out = torch.empty(3, HQ, D, dtype=torch.bfloat16, device="cuda")
    wrapper.run(q, batch.cache, out=out)  # warm-up
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000 // 1000 * 200)  # a few hundred ms of GPU busy-wait
    started = time.perf_counter()
    wrapper.run(q, batch.cache, out=out)
    host_seconds = time.perf_counter() - started
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "run() waited for the GPU (a hidden synchronisation)"
    assert host_seconds < 0.05


def test_run_allocates_only_its_outputs() -> None:
    wrapper, batch, q = _planned([300, 4000, 17])
    out = torch.empty(3, HQ, D, dtype=torch.bfloat16, device="cuda")
    lse = torch.empty(3, HQ, dtype=torch.float32, device="cuda")
    wrapper.run(q, batch.cache, out=out, lse=lse)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["allocation.all.allocated"]
    wrapper.run(q, batch.cache, out=out, lse=lse)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before, "run() with out/lse allocated memory"
    wrapper.run(q, batch.cache, return_lse=True)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == before + 2, "run() allocated beyond out and lse"


def test_capture_without_graph_mode_is_refused() -> None:
    wrapper, batch, q = _planned([30, 40])
    wrapper.run(q, batch.cache)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="use_cuda_graph=True"):
        with torch.cuda.graph(graph):
            wrapper.run(q, batch.cache)


def test_cuda_graph_replays_after_replanning() -> None:
    gen = torch.Generator().manual_seed(7)
    batch_size, max_pages = 8, 8 * 64
    pool = torch.randn(max_pages, 2, PAGE, HKV, D, generator=gen).to(torch.bfloat16).cuda()
    indptr_buf = torch.empty(batch_size + 1, dtype=torch.int32, device="cuda")
    indices_buf = torch.empty(max_pages, dtype=torch.int32, device="cuda")
    last_buf = torch.empty(batch_size, dtype=torch.int32, device="cuda")
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf,
        paged_kv_last_page_len_buffer=last_buf)
    q = torch.randn(batch_size, HQ, D, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty(batch_size, HQ, D, dtype=torch.bfloat16, device="cuda")

    def random_table():
        return _random_page_table(gen, batch_size, max_pages, max_len=64 * PAGE)

    table = random_table()
    wrapper.plan(*table, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
    wrapper.run(q, pool, out=out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, pool, out=out)
    for _ in range(20):
        table = random_table()
        wrapper.plan(*table, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
        out.fill_(float("nan"))
        graph.replay()
        expected, _ = reference.batch_decode_paged(q, pool, *table)
        assert_close_out(out, expected, torch.bfloat16)


def test_fixed_split_size_is_bit_identical_across_batch_compositions() -> None:
    gen = torch.Generator().manual_seed(9)
    pool = torch.randn(400, 2, PAGE, HKV, D, generator=gen).to(torch.bfloat16).cuda()
    target_pages = torch.randperm(400, generator=gen)[:63].to(torch.int32)  # a 1000-token request
    q_target = torch.randn(1, HQ, D, generator=gen).to(torch.bfloat16).cuda()
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")

    def run_batch(others: list[int]) -> torch.Tensor:
        pages = [63] + [(n + PAGE - 1) // PAGE for n in others]
        rest = torch.randint(0, 400, (sum(pages[1:]),), generator=gen, dtype=torch.int32)
        indices = torch.cat([target_pages, rest])
        indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
        last = torch.tensor([1000 - 62 * PAGE] + [(n - 1) % PAGE + 1 for n in others], dtype=torch.int32)
        q = torch.cat([q_target, torch.randn(len(others), HQ, D, generator=gen).to(torch.bfloat16).cuda()])
        wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(workspace)
        wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.bfloat16, fixed_split_size=4)
        return wrapper.run(q, pool)[0]

    alone = run_batch([])
    for others in ([5], [3000, 17, 900], [64] * 100):
        assert torch.equal(run_batch(others), alone), f"output changed with batch composition {others[:3]}..."
    assert alone.isfinite().all()


def test_device_index_tensors_plan_like_host_ones() -> None:
    wrapper, batch, q = _planned([300, 4000, 17])
    expected = wrapper.run(q, batch.cache)
    wrapper.plan(batch.kv_indptr.cuda(), batch.kv_indices.cuda(), batch.kv_last_page_len.cuda(), HQ, HKV, D, PAGE,
                 q_data_type=torch.bfloat16)
    assert torch.equal(wrapper.run(q, batch.cache), expected)


def test_fast_decode_plan_between_graph_replays() -> None:
    """SGLang's loop: capture once, then fast_decode_plan (device arrays, host indptr) before each replay."""
    gen = torch.Generator().manual_seed(8)
    batch_size, max_pages = 6, 6 * 48
    pool = torch.randn(max_pages, 2, PAGE, HKV, D, generator=gen).to(torch.bfloat16).cuda()
    buffers = [torch.empty(n, dtype=torch.int32, device="cuda") for n in (batch_size + 1, max_pages, batch_size)]
    wrapper = jitattn.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), *buffers)
    q = torch.randn(batch_size, HQ, D, generator=gen).to(torch.bfloat16).cuda()
    out = torch.empty(batch_size, HQ, D, dtype=torch.bfloat16, device="cuda")

    def random_table():
        return _random_page_table(gen, batch_size, max_pages, max_len=48 * PAGE)

    table = random_table()
    jitattn.fast_decode_plan(wrapper, *(t.cuda() for t in table), HQ, HKV, D, PAGE, q_data_type=torch.bfloat16,
                             global_override_indptr_cpu=table[0])
    wrapper.run(q, pool, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q, pool, out=out)
    for _ in range(10):
        table = random_table()
        jitattn.fast_decode_plan(wrapper, *(t.cuda() for t in table), HQ, HKV, D, PAGE,
                                 q_data_type=torch.bfloat16, global_override_indptr_cpu=table[0])
        out.fill_(float("nan"))
        graph.replay()
        expected, _ = reference.batch_decode_paged(q, pool, *table)
        assert_close_out(out, expected, torch.bfloat16)


def test_cascade_run_is_capturable_and_replays_after_replanning() -> None:
    gen = torch.Generator().manual_seed(9)
    batch_size, pool_pages = 4, 96
    pool = torch.randn(pool_pages, 2, PAGE, HKV, D, generator=gen).to(torch.bfloat16).cuda()
    sizes = [(2, 8), (batch_size + 1, 64)]  # (indptr entries, page capacity) per level: shared, unique
    bufs = [[torch.empty(n, dtype=torch.int32, device="cuda") for _ in range(2)] for n, _ in sizes]
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(
        2, torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), use_cuda_graph=True,
        qo_indptr_buf_arr=[b[0] for b in bufs], paged_kv_indptr_buf_arr=[b[1] for b in bufs],
        paged_kv_indices_buf_arr=[torch.empty(c, dtype=torch.int32, device="cuda") for _, c in sizes],
        paged_kv_last_page_len_buf_arr=[torch.empty(n - 1, dtype=torch.int32, device="cuda") for n, _ in sizes])
    q = torch.randn(batch_size, HQ, D, generator=gen).to(torch.bfloat16).cuda()

    def plan():
        order = torch.randperm(pool_pages, generator=gen).to(torch.int32)
        shared_pages = int(torch.randint(1, 8, (1,), generator=gen))
        unique = torch.randint(1, 10, (batch_size,), generator=gen)
        u_indptr = torch.tensor([0] + unique.cumsum(0).tolist(), dtype=torch.int32)
        levels = [
            (torch.tensor([0, batch_size], dtype=torch.int32), torch.tensor([0, shared_pages], dtype=torch.int32),
             order[:shared_pages], torch.tensor([PAGE], dtype=torch.int32)),
            (torch.arange(batch_size + 1, dtype=torch.int32), u_indptr,
             order[shared_pages: shared_pages + int(u_indptr[-1])],
             torch.randint(1, PAGE + 1, (batch_size,), generator=gen).to(torch.int32)),
        ]
        wrapper.plan(*[[lv[i] for lv in levels] for i in range(4)], HQ, HKV, D, PAGE, q_data_type=torch.bfloat16)
        return levels

    levels = plan()
    wrapper.run(q, pool)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = wrapper.run(q, pool)
    for _ in range(8):
        levels = plan()
        out.fill_(float("nan"))
        graph.replay()
        shared, unique = levels
        indptr = torch.tensor([0] + [int(shared[1][1]) + int(unique[1][r + 1] - unique[1][r])
                                     for r in range(batch_size)], dtype=torch.int32).cumsum(0).to(torch.int32)
        indices = torch.cat([torch.cat([shared[2], unique[2][int(unique[1][r]): int(unique[1][r + 1])]])
                             for r in range(batch_size)])
        expected, _ = reference.batch_decode_paged(q, pool, indptr, indices, unique[3])
        assert_close_out(out, expected, torch.bfloat16)

"""The SGLang and vLLM call sequences where CUDA graphs matter (bf16, Llama-3-8B attention shapes).

- SGLang: the decode wrapper of a graph bucket is planned with ``begin_forward`` once, then
  ``begin_forward`` is bound to ``fast_decode_plan``; the model's per-layer
  ``forward(q, (k, v), sm_scale=..., logits_soft_cap=0.0)`` is captured, and before each replay
  the step's page table (device index tensors, host indptr) goes through ``fast_decode_plan``.
- vLLM: a ``use_cuda_graph=True`` decode wrapper per batch size over 5-D paged caches; ``plan()``
  (host indptr/last_page_len, device indices) before each replay of the captured ``run(..., out=)``.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

import jitattn
import jitattn.flashinfer
from jitattn.runtime.specs import attention_spec
from jitattn.serving.reference import torch_attention
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

pytestmark = pytest.mark.gpu

HQ, HKV, D, LAYERS = 32, 8, 128, 4
DTYPE = torch.bfloat16
GPU_SPECS = [attention_spec(
    Op.DECODE, Target.CUDA, q_dtype=DTYPE, kv_dtype=DTYPE, o_dtype=DTYPE, head_dim_qk=D, head_dim_vo=D,
    num_qo_heads=HQ, num_kv_heads=HKV, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
    use_logits_soft_cap=False, mask_mode=MaskMode.NONE, kv_layout=layout, kv_storage=KVStorage.PAGED,
) for layout in (KVLayout.NHD, KVLayout.HND)]


@pytest.fixture
def flashinfer(monkeypatch):
    """``import flashinfer`` (and its submodules) gives ``jitattn.flashinfer``, as ``jitattn.flashinfer.install()``
    sets it up (base-2 LSE: the backends merge with the namespace's own ``merge_state``)."""
    monkeypatch.setitem(sys.modules, "flashinfer", jitattn.flashinfer)
    for sub, module in jitattn.flashinfer.SUBMODULES.items():
        monkeypatch.setitem(sys.modules, f"flashinfer.{sub}", module)
    import flashinfer as module

    return module


def _check(out: torch.Tensor, q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor]) -> None:
    for r in range(q.shape[0]):
        expected = torch_attention(q[r:r + 1].float(), ks[r].float(), vs[r].float())
        torch.testing.assert_close(out[r:r + 1].float(), expected, rtol=2e-2, atol=2e-2)


def test_sglang_graph_decode_with_fast_decode_plan_between_replays(flashinfer) -> None:
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper, fast_decode_plan

    gen = torch.Generator().manual_seed(0)
    bs, pool_tokens, max_len = 8, 8 * 600, 600
    k_buffer = [torch.randn(pool_tokens, HKV, D, generator=gen).to(DTYPE).cuda() for _ in range(LAYERS)]
    v_buffer = [torch.randn(pool_tokens, HKV, D, generator=gen).to(DTYPE).cuda() for _ in range(LAYERS)]
    kv_indptr_buf = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    kv_indices_buf = torch.zeros(pool_tokens, dtype=torch.int32, device="cuda")
    kv_last_page_len = torch.ones(bs, dtype=torch.int32, device="cuda")
    workspace = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
    wrapper = BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_cuda_graph=True,
                                                 paged_kv_indptr_buffer=kv_indptr_buf,
                                                 paged_kv_indices_buffer=kv_indices_buf,
                                                 paged_kv_last_page_len_buffer=kv_last_page_len)

    def table():
        lens = torch.randint(1, max_len, (bs,), generator=gen)
        slots = torch.randperm(pool_tokens, generator=gen)[: int(lens.sum())].to(torch.int32)
        indptr_cpu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
        return indptr_cpu, slots

    indptr_cpu, slots = table()
    wrapper.begin_forward(indptr_cpu.cuda(), slots.cuda(), kv_last_page_len, HQ, HKV, D, 1, data_type=DTYPE,
                          q_data_type=DTYPE, non_blocking=True)  # the capture-time plan
    wrapper.begin_forward = functools.partial(fast_decode_plan, wrapper)
    q = torch.randn(bs, HQ, D, generator=gen).to(DTYPE).cuda()
    outs = [torch.empty(bs, HQ, D, dtype=DTYPE, device="cuda") for _ in range(LAYERS)]

    def model_step():
        for layer in range(LAYERS):
            outs[layer].copy_(wrapper.forward(q, (k_buffer[layer], v_buffer[layer]), sm_scale=D ** -0.5,
                                              logits_soft_cap=0.0, k_scale=None, v_scale=None))

    model_step()  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model_step()
    for _ in range(5):
        indptr_cpu, slots = table()
        slots_dev = slots.cuda()
        wrapper.begin_forward(indptr_cpu.cuda(), slots_dev, kv_last_page_len, HQ, HKV, D, 1, data_type=DTYPE,
                              q_data_type=DTYPE, non_blocking=True, global_override_indptr_cpu=indptr_cpu)
        q.copy_(torch.randn(bs, HQ, D, generator=gen).to(DTYPE))
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            rows = [slots[indptr_cpu[r]: indptr_cpu[r + 1]].long().cuda() for r in range(bs)]
            _check(outs[layer], q, [k_buffer[layer][i] for i in rows], [v_buffer[layer][i] for i in rows])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_vllm_graph_decode_with_plan_between_replays(flashinfer, layout) -> None:
    from flashinfer import BatchDecodeWithPagedKVCacheWrapper

    gen = torch.Generator().manual_seed(1)
    bs, block, num_blocks, max_blocks = 6, 16, 6 * 40, 40
    physical = (num_blocks, 2, block, HKV, D) if layout == "NHD" else (num_blocks, 2, HKV, block, D)
    caches = [torch.randn(physical, generator=gen).to(DTYPE).cuda() for _ in range(LAYERS)]
    buffers = [torch.zeros(n, dtype=torch.int32, device="cuda") for n in (bs + 1, num_blocks, bs)]
    wrapper = BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(128 << 20, dtype=torch.uint8, device="cuda"), layout, use_cuda_graph=True,
        paged_kv_indptr_buffer=buffers[0], paged_kv_indices_buffer=buffers[1], paged_kv_last_page_len_buffer=buffers[2],
        use_tensor_cores=True)

    def plan():
        lens = torch.randint(1, max_blocks * block, (bs,), generator=gen)
        pages = (lens + block - 1) // block
        indptr = torch.cat([torch.zeros(1, dtype=torch.int32), pages.cumsum(0).to(torch.int32)])
        indices = torch.randperm(num_blocks, generator=gen)[: int(pages.sum())].to(torch.int32)
        last = ((lens - 1) % block + 1).to(torch.int32)
        wrapper.plan(indptr, indices.cuda(), last, HQ, HKV, D, block, pos_encoding_mode="NONE", sm_scale=D ** -0.5,
                     window_left=-1, logits_soft_cap=None, q_data_type=DTYPE, kv_data_type=DTYPE)
        return lens, indptr, indices

    def tokens(cache, which, lens, indptr, indices, r):
        pages = indices[indptr[r]: indptr[r + 1]].long().cuda()
        part = cache[pages, which]  # [pages, block, H, D] or [pages, H, block, D]
        if layout == "HND":
            part = part.transpose(1, 2)
        return part.reshape(-1, HKV, D)[: int(lens[r])]

    lens, indptr, indices = plan()
    q = torch.randn(bs, HQ, D, generator=gen).to(DTYPE).cuda()
    output = torch.empty(LAYERS, bs, HQ, D, dtype=DTYPE, device="cuda")

    def model_step():
        for layer in range(LAYERS):
            wrapper.run(q, caches[layer], k_scale=1.0, v_scale=1.0, out=output[layer])

    model_step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        model_step()
    for _ in range(5):
        lens, indptr, indices = plan()
        output.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(LAYERS):
            ks = [tokens(caches[layer], 0, lens, indptr, indices, r) for r in range(bs)]
            vs = [tokens(caches[layer], 1, lens, indptr, indices, r) for r in range(bs)]
            _check(output[layer], q, ks, vs)

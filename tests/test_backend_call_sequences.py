"""jitattn driven exactly as the FlashInfer backends of SGLang and vLLM drive FlashInfer.

The two mini-backends below repeat those backends' call sequences (read from SGLang's
``python/sglang/srt/layers/attention/flashinfer_backend.py`` and vLLM's
``vllm/v1/attention/backends/flashinfer.py``), with ``jitattn.flashinfer`` installed as ``flashinfer`` in
``sys.modules`` so the backend code imports it by the name it expects:

- SGLang: one global float workspace shared by the ragged-prefill, paged-prefill and decode
  wrappers; a token pool (page size 1) of per-layer ``(k, v)`` buffers; ``begin_forward`` once
  per step and ``forward``/``forward_return_lse`` per layer; extend = ragged part (the new
  tokens, causal) + paged part (the cached prefix, not causal) merged by ``merge_state``; decode
  plans through ``fast_decode_plan`` bound with ``functools.partial`` and host
  ``global_override_indptr_cpu``; index tensors on the device; ``logits_soft_cap=0.0`` for "off".
- vLLM: one workspace shared by the prefill and decode wrappers; a 5-D paged cache per layer
  ``[blocks, 2, block_size, H_kv, D]`` (or its HND permutation); the step's KV written by slot
  mapping first; a mixed batch with the decodes first, ``plan()`` once per step with host
  indptr / device indices, ``run(..., out=...)`` per layer into slices of one output.

Every layer's output is checked against float torch attention over each request's full history.
"""

from __future__ import annotations

import functools
import sys

import pytest
import torch

import jitattn
import jitattn.flashinfer
from jitattn.serving.reference import torch_attention

HQ, HKV, D, LAYERS = 4, 2, 64, 3
DTYPE = torch.float32


@pytest.fixture
def flashinfer(monkeypatch):
    """``import flashinfer`` (and its submodules) gives ``jitattn.flashinfer``, as ``jitattn.flashinfer.install()``
    sets it up (base-2 LSE: the backends merge with the namespace's own ``merge_state``)."""
    monkeypatch.setitem(sys.modules, "flashinfer", jitattn.flashinfer)
    for sub, module in jitattn.flashinfer.SUBMODULES.items():
        monkeypatch.setitem(sys.modules, f"flashinfer.{sub}", module)
    import flashinfer as module

    return module


class History:
    """Each request's keys and values per layer (the reference's view: no pages)."""

    def __init__(self, num_requests: int) -> None:
        self.k = [[torch.empty(0, HKV, D, dtype=DTYPE) for _ in range(num_requests)] for _ in range(LAYERS)]
        self.v = [[torch.empty(0, HKV, D, dtype=DTYPE) for _ in range(num_requests)] for _ in range(LAYERS)]

    def add(self, layer: int, r: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k[layer][r] = torch.cat([self.k[layer][r], k.cpu().float()])
        self.v[layer][r] = torch.cat([self.v[layer][r], v.cpu().float()])

    def attend(self, layer: int, r: int, q: torch.Tensor) -> torch.Tensor:
        return torch_attention(q.cpu().float(), self.k[layer][r], self.v[layer][r])


def _new_qkv(gen: torch.Generator, tokens: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.randn(tokens, h, D, generator=gen).to(device=device, dtype=DTYPE) for h in (HQ, HKV, HKV))


def _indptr(counts: list[int], device) -> torch.Tensor:
    return torch.tensor([0] + torch.tensor(counts).cumsum(0).tolist(), dtype=torch.int32, device=device)


# --- SGLang ---------------------------------------------------------------------------------------

class SGLangStyleBackend:
    """SGLang's FlashInferAttnBackend call sequence on a token pool (page size 1)."""

    def __init__(self, flashinfer, pool_tokens: int, device, use_fast_decode_plan: bool) -> None:
        from flashinfer import (BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper,
                                BatchPrefillWithRaggedKVCacheWrapper, fast_decode_plan)
        from flashinfer.cascade import merge_state

        self.merge_state, self.device = merge_state, device
        self.workspace = torch.empty(64 << 20, dtype=torch.uint8, device=device)  # the global workspace
        self.prefill_wrapper_ragged = BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
        self.prefill_wrapper_paged = BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD", use_tensor_cores=False)
        if use_fast_decode_plan:  # what SGLang binds for its CUDA-graph decode wrappers
            self.decode_wrapper.begin_forward = functools.partial(fast_decode_plan, self.decode_wrapper)
        self.use_fast_decode_plan = use_fast_decode_plan
        self.k_buffer = [torch.zeros(pool_tokens, HKV, D, dtype=DTYPE, device=device) for _ in range(LAYERS)]
        self.v_buffer = [torch.zeros(pool_tokens, HKV, D, dtype=DTYPE, device=device) for _ in range(LAYERS)]
        self.scaling = D ** -0.5

    def get_kv_buffer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer], self.v_buffer[layer]

    def set_kv_buffer(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer][loc] = k
        self.v_buffer[layer][loc] = v

    def init_extend(self, prefix_slots: list[list[int]], extend_lens: list[int]) -> None:
        dev = self.device
        qo_indptr = _indptr(extend_lens, dev)
        kv_indptr = _indptr([len(s) for s in prefix_slots], dev)
        kv_indices = torch.tensor([t for s in prefix_slots for t in s], dtype=torch.int32, device=dev)
        kv_last_page_len = torch.ones(len(extend_lens), dtype=torch.int32, device=dev)
        self.extend_no_prefix = not any(prefix_slots)
        self.prefill_wrapper_ragged.begin_forward(qo_indptr, qo_indptr, HQ, HKV, D, q_data_type=DTYPE)
        self.prefill_wrapper_paged.begin_forward(qo_indptr, kv_indptr, kv_indices, kv_last_page_len, HQ, HKV, D, 1,
                                                 q_data_type=DTYPE, kv_data_type=DTYPE, custom_mask=None,
                                                 non_blocking=True)

    def forward_extend(self, layer: int, q, k, v, cache_loc: torch.Tensor) -> torch.Tensor:
        if self.extend_no_prefix:
            o = self.prefill_wrapper_ragged.forward(q, k, v, causal=True, sm_scale=self.scaling, logits_soft_cap=0.0)
        else:
            o1, s1 = self.prefill_wrapper_ragged.forward_return_lse(q, k, v, causal=True, sm_scale=self.scaling,
                                                                    logits_soft_cap=0.0)
            o2, s2 = self.prefill_wrapper_paged.forward_return_lse(q, self.get_kv_buffer(layer), causal=False,
                                                                   sm_scale=self.scaling, logits_soft_cap=0.0)
            o, _ = self.merge_state(o1, s1, o2, s2)
        self.set_kv_buffer(layer, cache_loc, k, v)  # after attention, as SGLang's ragged path does
        return o

    def init_decode(self, slots: list[list[int]]) -> None:
        dev = self.device
        counts = [len(s) for s in slots]
        kv_indptr = _indptr(counts, dev)
        kv_indices = torch.tensor([t for s in slots for t in s], dtype=torch.int32, device=dev)
        kv_last_page_len = torch.ones(len(slots), dtype=torch.int32, device=dev)
        extra = {"global_override_indptr_cpu": _indptr(counts, "cpu")} if self.use_fast_decode_plan else {}
        self.decode_wrapper.begin_forward(kv_indptr, kv_indices, kv_last_page_len, HQ, HKV, D, 1, data_type=DTYPE,
                                          q_data_type=DTYPE, non_blocking=True, **extra)
        self._decode_indices = kv_indices  # fast_decode_plan reads them in place: keep them alive

    def forward_decode(self, layer: int, q, k, v, cache_loc: torch.Tensor) -> torch.Tensor:
        self.set_kv_buffer(layer, cache_loc, k, v)  # decode writes first, then reads the pool
        return self.decode_wrapper.forward(q, self.get_kv_buffer(layer), sm_scale=self.scaling, logits_soft_cap=0.0,
                                           k_scale=None, v_scale=None)


@pytest.mark.parametrize("fast_plan", [False, True], ids=["begin_forward", "fast_decode_plan"])
def test_sglang_call_sequence(flashinfer, fast_plan, device="cpu") -> None:
    # 3 + 4 + 4 + 4 requests over the four rounds, every layer compared with torch attention
    assert _sglang_steps(flashinfer, fast_plan, device) == 15 * LAYERS


def _sglang_steps(flashinfer, fast_plan: bool, device) -> int:
    """Drive the SGLang-style backend; every output is compared with torch attention. Returns the comparisons."""
    gen = torch.Generator().manual_seed(0)
    backend = SGLangStyleBackend(flashinfer, 512, device, fast_plan)
    history = History(4)
    free = list(torch.randperm(512, generator=gen).tolist())
    slots: list[list[int]] = [[] for _ in range(4)]
    # tokens per request and round (0: not in the batch): an extend without any prefix, an extend on cached
    # prefixes (chunked prefill / radix hits) where request 3 arrives with none (its paged part is empty), decodes
    rounds = [("extend", [9, 1, 30, 0]), ("extend", [5, 12, 1, 7]), ("decode", [1] * 4), ("decode", [1] * 4)]
    compared = 0
    for kind, all_lens in rounds:
        batch = [r for r in range(4) if all_lens[r]]
        lens = [all_lens[r] for r in batch]
        new_slots = {r: [free.pop() for _ in range(all_lens[r])] for r in batch}
        if kind == "extend":
            backend.init_extend([slots[r] for r in batch], lens)
        else:
            backend.init_decode([slots[r] + new_slots[r] for r in batch])
        cache_loc = torch.tensor([t for r in batch for t in new_slots[r]], dtype=torch.long, device=device)
        for layer in range(LAYERS):  # one plan, every layer
            q, k, v = _new_qkv(gen, sum(lens), device)
            forward = backend.forward_extend if kind == "extend" else backend.forward_decode
            out = forward(layer, q, k, v, cache_loc)
            start = 0
            for r, n in zip(batch, lens):
                history.add(layer, r, k[start:start + n], v[start:start + n])
                torch.testing.assert_close(out[start:start + n].cpu().float(), history.attend(layer, r, q[start:start + n]),
                                           rtol=1e-4, atol=1e-4)
                compared += 1
                start += n
        for r in batch:
            slots[r] += new_slots[r]
    return compared


# --- vLLM -----------------------------------------------------------------------------------------

class VLLMStyleBackend:
    """vLLM's v1 FlashInfer backend call sequence: 5-D paged caches, mixed decode+prefill batches."""

    def __init__(self, flashinfer, num_blocks: int, block_size: int, layout: str, device) -> None:
        from flashinfer import BatchDecodeWithPagedKVCacheWrapper, BatchPrefillWithPagedKVCacheWrapper

        self.block_size, self.layout, self.device = block_size, layout, device
        self.workspace = torch.zeros(64 << 20, dtype=torch.uint8, device=device)
        self.prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(self.workspace, layout)
        self.decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(self.workspace, layout, use_tensor_cores=True)
        # allocated in the layout's physical order; the logical view is always [blocks, 2, block, H, D]
        physical = (num_blocks, 2, block_size, HKV, D) if layout == "NHD" else (num_blocks, 2, HKV, block_size, D)
        self.stride_order = (0, 1, 2, 3, 4) if layout == "NHD" else (0, 1, 3, 2, 4)
        self.kv_caches = [torch.zeros(physical, dtype=DTYPE, device=device).permute(*self.stride_order)
                          for _ in range(LAYERS)]
        self.scale = D ** -0.5

    def write_kv(self, layer: int, k, v, slot_mapping: torch.Tensor) -> None:
        """reshape_and_cache_flash: token t goes to block slot // block_size, offset slot % block_size."""
        cache = self.kv_caches[layer]
        blocks, offsets = slot_mapping // self.block_size, slot_mapping % self.block_size
        cache[blocks, 0, offsets] = k
        cache[blocks, 1, offsets] = v

    def plan(self, block_tables: list[list[int]], seq_lens: list[int], query_lens: list[int], num_decodes: int) -> None:
        bs = self.block_size
        pages = [-(-n // bs) for n in seq_lens]
        indptr_cpu = _indptr(pages, "cpu")
        indices = torch.tensor([b for t, p in zip(block_tables, pages) for b in t[:p]], dtype=torch.int32,
                               device=self.device)
        last_cpu = torch.tensor([(n - 1) % bs + 1 for n in seq_lens], dtype=torch.int32)
        split = int(indptr_cpu[num_decodes])
        self.num_decode_tokens = num_decodes
        if num_decodes:
            self.decode_wrapper.plan(indptr_cpu[: num_decodes + 1], indices[:split], last_cpu[:num_decodes], HQ, HKV,
                                     D, bs, pos_encoding_mode="NONE", sm_scale=self.scale, window_left=-1,
                                     logits_soft_cap=None, q_data_type=DTYPE, kv_data_type=DTYPE)
        self.has_prefill = num_decodes < len(seq_lens)
        if self.has_prefill:
            qo_indptr_cpu = _indptr(query_lens[num_decodes:], "cpu")
            self.prefill_wrapper.plan(qo_indptr_cpu, indptr_cpu[num_decodes:] - split, indices[split:],
                                      last_cpu[num_decodes:], HQ, HKV, D, bs, causal=True, sm_scale=self.scale,
                                      window_left=-1, logits_soft_cap=None, q_data_type=DTYPE, kv_data_type=DTYPE)

    def forward(self, layer: int, q, k, v, slot_mapping: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
        self.write_kv(layer, k, v, slot_mapping)
        kv_cache_permute = self.kv_caches[layer].permute(*self.stride_order)  # back to the physical layout
        n = self.num_decode_tokens
        if self.has_prefill:
            # vLLM asserts FlashInfer's private plan attributes before every run()
            assert self.prefill_wrapper._causal
            assert self.prefill_wrapper._window_left == -1
            assert self.prefill_wrapper._logits_soft_cap == 0.0
            assert self.prefill_wrapper._sm_scale == self.scale
            self.prefill_wrapper.run(q[n:], kv_cache_permute, k_scale=1.0, v_scale=1.0, out=output[n:])
        if n:
            assert self.decode_wrapper._window_left == -1
            assert self.decode_wrapper._logits_soft_cap == 0.0
            assert self.decode_wrapper._sm_scale == self.scale
            self.decode_wrapper.run(q[:n], kv_cache_permute, k_scale=1.0, v_scale=1.0, out=output[:n])
        return output


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_vllm_call_sequence(flashinfer, layout, device="cpu") -> None:
    # 1 + 4 + 4 + 4 requests over the four steps, every layer compared with torch attention
    assert _vllm_steps(flashinfer, layout, device) == 13 * LAYERS


def _vllm_steps(flashinfer, layout: str, device) -> int:
    """Drive the vLLM-style backend; every output is compared with torch attention. Returns the comparisons."""
    gen = torch.Generator().manual_seed(1)
    block_size, num_blocks = 16, 64
    backend = VLLMStyleBackend(flashinfer, num_blocks, block_size, layout, device)
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = [[free_blocks.pop() for _ in range(8)] for _ in range(4)]
    history = History(4)
    seq_lens = [0, 0, 0, 0]
    # (requests that decode, then the prefill chunks of the others): chunked prefill beside running decodes
    steps = [[0, 0, 0, 0, 20], [1, 1, 17, 5, 3], [1, 1, 1, 40, 1], [1, 1, 1, 1, 1]]
    compared = 0
    for step in steps:
        query_lens = step[:4]
        order = sorted(range(4), key=lambda r: (query_lens[r] != 1, r))  # decodes first
        order = [r for r in order if query_lens[r] or step[4] and r == 0]
        lens = {r: (query_lens[r] or step[4]) for r in order}
        num_decodes = sum(1 for r in order if lens[r] == 1 and seq_lens[r] > 0)
        new_lens = [seq_lens[r] + lens[r] for r in order]
        backend.plan([block_tables[r] for r in order], new_lens, [lens[r] for r in order], num_decodes)
        slots = torch.tensor([block_tables[r][p // block_size] * block_size + p % block_size
                              for r in order for p in range(seq_lens[r], seq_lens[r] + lens[r])], device=device)
        tokens = sum(lens.values())
        output = torch.empty(tokens, HQ, D, dtype=DTYPE, device=device)
        for layer in range(LAYERS):
            q, k, v = _new_qkv(gen, tokens, device)
            output.fill_(float("nan"))
            backend.forward(layer, q, k, v, slots, output)
            start = 0
            for r in order:
                n = lens[r]
                history.add(layer, r, k[start:start + n], v[start:start + n])
                torch.testing.assert_close(output[start:start + n].cpu().float(),
                                           history.attend(layer, r, q[start:start + n]), rtol=1e-4, atol=1e-4)
                compared += 1
                start += n
        for r in order:
            seq_lens[r] += lens[r]
    return compared


# --- a wrapper bug the SGLang sequence found ------------------------------------------------------

def test_forward_after_fast_decode_plan_takes_options_equal_to_the_planned_ones() -> None:
    """SGLang plans its graph decode wrappers without sm_scale/soft cap, then calls
    ``forward(sm_scale=layer.scaling, logits_soft_cap=0.0)``: the same kernel and scalars as the plan's
    defaults (``head_dim ** -0.5`` differs from ``1 / sqrt(head_dim)`` in the last float64 bit for
    head_dim 128), so it must run, not ask for a re-plan; a really different option still raises."""
    gen = torch.Generator().manual_seed(5)
    head_dim, pages = 128, 6
    cache = torch.randn(pages, 2, 4, HKV, head_dim, generator=gen)
    indptr, indices, last = torch.tensor([0, 2, 6], dtype=torch.int32), torch.arange(pages, dtype=torch.int32), \
        torch.tensor([3, 4], dtype=torch.int32)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(8 << 20, dtype=torch.uint8))
    jitattn.fast_decode_plan(wrapper, indptr, indices, last, HQ, HKV, head_dim, 4, q_data_type=DTYPE,
                             global_override_indptr_cpu=indptr)
    q = torch.randn(2, HQ, head_dim, generator=gen)
    expected = wrapper.run(q, cache)
    out = wrapper.forward(q, cache, sm_scale=head_dim ** -0.5, logits_soft_cap=0.0, k_scale=None, v_scale=None)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="differs from the last fast_decode_plan"):
        wrapper.forward(q, cache, sm_scale=0.5)

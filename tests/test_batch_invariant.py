"""Batch-invariant mode: a request's output is bitwise the same whatever else is in the batch.

For decode (split-KV), paged and ragged prefill and cascade: one target request is run alone, then
inside many random batches (other companions, sizes, its position in the batch, its KV on other
pages), with ``plan(..., batch_invariant=True)``; every run must give exactly the alone bits, and
repeating a run must too. On cuda the decode batches are also replayed from CUDA graphs.
"""

from __future__ import annotations

import random

import pytest
import torch

import jitattn
from jitattn.runtime.specs import attention_spec, merge_spec
from jitattn.kv_split import BATCH_INVARIANT_CHUNK_TOKENS
from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

from attention_cases import devices

f16, bf16 = torch.float16, torch.bfloat16
PAGE = 16
HQ, HKV, D = 8, 2, 64
TRIALS = 12


def _spec(op: Op, dtype: torch.dtype, storage: KVStorage, mask: MaskMode | None, sinks: bool,
          window: bool = False) -> object:
    return attention_spec(
        op, Target.CUDA, q_dtype=dtype, kv_dtype=dtype, o_dtype=dtype, head_dim_qk=D, head_dim_vo=D,
        num_qo_heads=HQ, num_kv_heads=HKV, pos_encoding=PosEncoding.NONE, use_sliding_window=window,
        use_logits_soft_cap=False, mask_mode=mask, kv_layout=KVLayout.NHD, kv_storage=storage,
    ).replace(use_sinks=sinks)


GPU_SPECS = (
    [_spec(Op.DECODE, dt, KVStorage.PAGED, None, s) for dt in (f16, bf16) for s in (False, True)]
    + [attention_spec(Op.DECODE, Target.CUDA, q_dtype=bf16, kv_dtype=bf16, o_dtype=bf16, head_dim_qk=72,
                      head_dim_vo=72, num_qo_heads=6, num_kv_heads=2, pos_encoding=PosEncoding.NONE,
                      use_sliding_window=w, use_logits_soft_cap=False, mask_mode=None, kv_layout=KVLayout.NHD,
                      kv_storage=KVStorage.PAGED).replace(use_sinks=s) for s, w in ((False, False), (True, False),
                                                                                   (False, True))]
    + [_spec(Op.DECODE, f16, KVStorage.PAGED, None, False, window=True)]
    + [_spec(Op.PREFILL, f16, st, m, s) for st in (KVStorage.PAGED, KVStorage.RAGGED)
       for m in (MaskMode.CAUSAL, MaskMode.NONE) for s in (False, True)]
    + [merge_spec(Target.CUDA, f16), merge_spec(Target.CUDA, f16, True)]
)


class Pool:
    """A paged KV pool whose pages are handed out in random order."""

    def __init__(self, num_pages: int, dtype: torch.dtype, device: str, rng: random.Random, hkv: int = HKV,
                 d: int = D):
        self.cache = torch.randn(num_pages, 2, PAGE, hkv, d).to(dtype).to(device)
        self.free = list(range(num_pages))
        rng.shuffle(self.free)

    def place(self, tokens: torch.Tensor) -> list[int]:
        """Write ``tokens`` ``[2, n, HKV, D]`` into fresh pages; returns the page indices."""
        n = tokens.shape[1]
        pages = [self.free.pop() for _ in range((n + PAGE - 1) // PAGE)]
        for i, page in enumerate(pages):
            chunk = tokens[:, i * PAGE:(i + 1) * PAGE]
            self.cache[page, :, :chunk.shape[1]] = chunk
        return pages


def _page_table(requests: list[list[int]], lens: list[int]):
    indptr = torch.tensor([0] + torch.tensor([len(p) for p in requests]).cumsum(0).tolist(), dtype=torch.int32)
    indices = torch.tensor([p for r in requests for p in r], dtype=torch.int32)
    last = torch.tensor([(n - 1) % PAGE + 1 if n else 0 for n in lens], dtype=torch.int32)
    return indptr, indices, last


def _decode(device: str, dtype: torch.dtype, target_q: torch.Tensor, target_kv: torch.Tensor, companions, rng,
            sinks: torch.Tensor | None, position: int | None = None, window_left: int = -1):
    """The target's (out, lse) decoded in one batch with ``companions`` (list of (q, kv)), at ``position``, under a
    sliding window of ``window_left`` (-1: none)."""
    members = list(companions)
    position = rng.randrange(len(members) + 1) if position is None else position
    members.insert(position, (target_q, target_kv))
    hq, (hkv, d) = target_q.shape[0], target_kv.shape[2:]
    pool = Pool(sum((kv.shape[1] + PAGE - 1) // PAGE for _, kv in members) + 7, dtype, device, rng, hkv, d)
    pages = [pool.place(kv) for _, kv in members]
    lens = [kv.shape[1] for _, kv in members]
    indptr, indices, last = _page_table(pages, lens)
    q = torch.stack([m[0] for m in members])
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(indptr, indices, last, hq, hkv, d, PAGE, q_data_type=dtype, batch_invariant=True,
                 window_left=window_left)
    out, lse = wrapper.run(q, pool.cache, return_lse=True, sinks=sinks)
    return out[position], lse[position], wrapper._plan.split


def _random_kv(n: int, dtype: torch.dtype, device: str, gen: torch.Generator, hkv: int = HKV,
               d: int = D) -> torch.Tensor:
    return torch.randn(2, n, hkv, d, generator=gen).to(dtype).to(device)


# (q heads, kv heads, head dim, dtype): the tensor-core decode path, and the CUDA-core one (head dim 72)
DECODE_SHAPES = {"g4_d64_f16": (HQ, HKV, D, f16), "g3_d72_bf16": (6, 2, 72, bf16)}


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
@pytest.mark.parametrize("target_len", [1, 700, 2 * BATCH_INVARIANT_CHUNK_TOKENS + 333])
def test_decode_request_is_bitwise_the_same_in_any_batch(device: str, shape: str, with_sinks: bool,
                                                         target_len: int) -> None:
    hq, hkv, d, dtype = DECODE_SHAPES[shape]
    rng = random.Random(target_len)
    gen = torch.Generator().manual_seed(target_len)
    target_q = torch.randn(hq, d, generator=gen).to(dtype).to(device)
    target_kv = _random_kv(target_len, dtype, device, gen, hkv, d)
    sinks = (torch.randn(hq, generator=gen) * 2).to(device) if with_sinks else None
    alone_out, alone_lse, split = _decode(device, dtype, target_q, target_kv, [], rng, sinks)
    if target_len > BATCH_INVARIANT_CHUNK_TOKENS:
        assert split.num_chunks > 1, "the long target must be split (the split path is what is tested)"
    for trial in range(TRIALS):
        companions = []
        for _ in range(rng.choice([1, 2, 5, 17])):
            n = rng.choice([0, 1, rng.randrange(1, 300), rng.randrange(300, 5000)])
            companions.append((torch.randn(hq, d, generator=gen).to(dtype).to(device),
                               _random_kv(n, dtype, device, gen, hkv, d)))
        out, lse, _ = _decode(device, dtype, target_q, target_kv, companions, rng, sinks)
        assert torch.equal(out, alone_out), f"trial {trial}: the output changed with the batch"
        assert torch.equal(lse, alone_lse), f"trial {trial}: the lse changed with the batch"
    again, again_lse, _ = _decode(device, dtype, target_q, target_kv, [], rng, sinks)
    assert torch.equal(again, alone_out) and torch.equal(again_lse, alone_lse), "not run-to-run reproducible"


WINDOW_LEFT = 2 * BATCH_INVARIANT_CHUNK_TOKENS + 100  # a window of 2149 tokens: three chunks counted from its start


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("shape", list(DECODE_SHAPES))
@pytest.mark.parametrize("target_len", [700, 3 * BATCH_INVARIANT_CHUNK_TOKENS + 333])
def test_windowed_decode_request_is_bitwise_the_same_in_any_batch(device: str, shape: str, target_len: int) -> None:
    """Under a sliding window the split chunks start at the window's first token (``kv_len - 1 - window_left``),
    which depends on the request alone: its bits do not change with the batch either."""
    hq, hkv, d, dtype = DECODE_SHAPES[shape]
    rng = random.Random(target_len + 1)
    gen = torch.Generator().manual_seed(target_len + 1)
    target_q = torch.randn(hq, d, generator=gen).to(dtype).to(device)
    target_kv = _random_kv(target_len, dtype, device, gen, hkv, d)
    alone_out, alone_lse, split = _decode(device, dtype, target_q, target_kv, [], rng, None, window_left=WINDOW_LEFT)
    if target_len > WINDOW_LEFT:
        assert split.num_chunks == 3, "the window's 2149 tokens make three chunks of the fixed size"
    for trial in range(TRIALS // 2):
        companions = []
        for _ in range(rng.choice([1, 3, 9])):
            n = rng.choice([1, rng.randrange(1, WINDOW_LEFT), rng.randrange(WINDOW_LEFT, 6000)])
            companions.append((torch.randn(hq, d, generator=gen).to(dtype).to(device),
                               _random_kv(n, dtype, device, gen, hkv, d)))
        out, lse, _ = _decode(device, dtype, target_q, target_kv, companions, rng, None, window_left=WINDOW_LEFT)
        assert torch.equal(out, alone_out), f"trial {trial}: the output changed with the batch"
        assert torch.equal(lse, alone_lse), f"trial {trial}: the lse changed with the batch"


def test_batch_invariant_knob_sets_the_plan_default(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    kv = _random_kv(40, f16, "cpu", gen)
    pool = Pool(4, f16, "cpu", random.Random(0))
    indptr, indices, last = _page_table([pool.place(kv)], [40])
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    monkeypatch.setenv("JITATTN_BATCH_INVARIANT", "1")
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=f16)
    assert wrapper._plan.split.kv_chunk_size == BATCH_INVARIANT_CHUNK_TOKENS
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=f16, batch_invariant=False)
    assert wrapper._plan.split.kv_chunk_size != BATCH_INVARIANT_CHUNK_TOKENS, "the argument wins over the knob"
    monkeypatch.setenv("JITATTN_BATCH_INVARIANT", "maybe")
    with pytest.raises(ValueError, match="JITATTN_BATCH_INVARIANT"):
        wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=f16)
    with pytest.raises(TypeError, match="batch_invariant"):
        wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=f16, batch_invariant="yes")


# -- prefill ---------------------------------------------------------------------------------------

def _prefill(device: str, target, companions, rng, paged: bool, sinks: torch.Tensor | None, causal: bool = True):
    """The target's (out, lse) rows from one prefill batch; target/companions are (q [n, HQ, D], kv [2, m, HKV, D])."""
    members = list(companions)
    position = rng.randrange(len(members) + 1)
    members.insert(position, target)
    qo_lens = [q.shape[0] for q, _ in members]
    kv_lens = [kv.shape[1] for _, kv in members]
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.cat([m[0] for m in members])
    workspace = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    if paged:
        pool = Pool(sum((n + PAGE - 1) // PAGE for n in kv_lens) + 5, q.dtype, device, rng)
        indptr, indices, last = _page_table([pool.place(kv) for _, kv in members], kv_lens)
        wrapper = jitattn.BatchPrefillWithPagedKVCacheWrapper(workspace)
        wrapper.plan(qo_indptr, indptr, indices, last, HQ, HKV, D, PAGE, causal=causal, q_data_type=q.dtype,
                     batch_invariant=True)
        out, lse = wrapper.run(q, pool.cache, return_lse=True, sinks=sinks)
    else:
        kv_indptr = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32)
        k = torch.cat([kv[0] for _, kv in members])
        v = torch.cat([kv[1] for _, kv in members])
        wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(workspace)
        wrapper.plan(qo_indptr, kv_indptr, HQ, HKV, D, causal=causal, q_data_type=q.dtype, batch_invariant=True)
        out, lse = wrapper.run(q, k, v, return_lse=True, sinks=sinks)
    rows = slice(int(qo_indptr[position]), int(qo_indptr[position + 1]))
    return out[rows], lse[rows]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("paged", [True, False], ids=["paged", "ragged"])
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_prefill_request_is_bitwise_the_same_in_any_batch(device: str, paged: bool, with_sinks: bool) -> None:
    dtype = f16
    rng = random.Random(int(paged) * 2 + int(with_sinks))
    gen = torch.Generator().manual_seed(7)
    qo_len, kv_len = 37, 250
    target = (torch.randn(qo_len, HQ, D, generator=gen).to(dtype).to(device), _random_kv(kv_len, dtype, device, gen))
    sinks = (torch.randn(HQ, generator=gen) * 2).to(device) if with_sinks else None
    alone = _prefill(device, target, [], rng, paged, sinks)
    for trial in range(TRIALS):
        companions = []
        for _ in range(rng.choice([1, 3, 8])):
            n = rng.choice([1, rng.randrange(1, 64), rng.randrange(64, 600)])
            m = n + rng.choice([0, rng.randrange(0, 400)])
            companions.append((torch.randn(n, HQ, D, generator=gen).to(dtype).to(device),
                               _random_kv(m, dtype, device, gen)))
        out, lse = _prefill(device, target, companions, rng, paged, sinks)
        assert torch.equal(out, alone[0]), f"trial {trial}: the output changed with the batch"
        assert torch.equal(lse, alone[1]), f"trial {trial}: the lse changed with the batch"
    again = _prefill(device, target, [], rng, paged, sinks)
    assert torch.equal(again[0], alone[0]) and torch.equal(again[1], alone[1]), "not run-to-run reproducible"


# -- cascade ---------------------------------------------------------------------------------------

def _cascade(device: str, prefix, target, sharers, others, rng, sinks: torch.Tensor | None):
    """Two levels: prefix nodes (a shared level: non-causal, split by chunks), then each request's own KV
    (causal). The target and ``sharers`` are under node ``prefix`` (kv [2, p, HKV, D]), each of ``others``
    under its own node; requests are (q [n, HQ, D], own kv [2, m, HKV, D]), others (q, prefix kv, own kv).
    Returns the target's output rows and the level's chunk counts. Another node's longer prefix changes how
    many chunks the level has, never how the target's prefix is cut; sharers change the target's row in
    its node's query tiles.
    """
    node = list(sharers)
    position = rng.randrange(len(node) + 1)
    node.insert(position, target)
    nodes = [(prefix, node)] + [(kv, [(q, own)]) for q, kv, own in others]
    rng.shuffle(nodes)
    dtype = target[0].dtype
    members = [m for _, reqs in nodes for m in reqs]
    prefix_lens = [kv.shape[1] for kv, _ in nodes]
    own_lens = [own.shape[1] for _, own in members]
    pool = Pool(sum((n + PAGE - 1) // PAGE for n in prefix_lens + own_lens) + 3, dtype, device, rng)
    prefix_table = _page_table([pool.place(kv) for kv, _ in nodes], prefix_lens)
    own_table = _page_table([pool.place(own) for _, own in members], own_lens)
    qo_lens = [q.shape[0] for q, _ in members]
    qo = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    node_q = [sum(q.shape[0] for q, _ in reqs) for _, reqs in nodes]
    node_qo = torch.tensor([0] + torch.tensor(node_q).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.cat([m[0] for m in members])
    wrapper = jitattn.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8, device=device))
    wrapper.plan([node_qo, qo], [prefix_table[0], own_table[0]], [prefix_table[1], own_table[1]],
                 [prefix_table[2], own_table[2]], HQ, HKV, D, PAGE, causal=True, q_data_type=dtype,
                 batch_invariant=True)
    out, lse = wrapper.run(q, pool.cache, return_lse=True, sinks=sinks)
    index = next(i for i, m in enumerate(members) if m is target)
    rows = slice(int(qo[index]), int(qo[index + 1]))
    return out[rows], lse[rows], wrapper._level_chunks


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_cascade_request_is_bitwise_the_same_in_any_batch(device: str, with_sinks: bool) -> None:
    dtype = f16
    rng = random.Random(5 + int(with_sinks))
    gen = torch.Generator().manual_seed(9)

    def request(n: int):
        return (torch.randn(n, HQ, D, generator=gen).to(dtype).to(device),
                _random_kv(n + rng.randrange(0, 300), dtype, device, gen))

    prefix = _random_kv(BATCH_INVARIANT_CHUNK_TOKENS + 100, dtype, device, gen)
    target = request(3)
    sinks = (torch.randn(HQ, generator=gen) * 2).to(device) if with_sinks else None
    alone = _cascade(device, prefix, target, [], [], rng, sinks)
    assert alone[2][0] == 2, "the target's prefix is cut into two chunks"
    chunk_counts = set()
    for trial in range(TRIALS // 2):
        sharers = [request(rng.randrange(1, 6)) for _ in range(rng.choice([0, 1, 3, 7]))]
        prefix_lens = [rng.choice([0, 5, rng.randrange(1, 4000)]) for _ in range(rng.choice([1, 4, 9]))]
        if trial % 2:
            prefix_lens[0] = 3500  # longer than the target's prefix: more chunks in the level
        others = [(q, _random_kv(n, dtype, device, gen), own)
                  for n, (q, own) in zip(prefix_lens, [request(rng.randrange(1, 6)) for _ in prefix_lens])]
        out, lse, chunks = _cascade(device, prefix, target, sharers, others, rng, sinks)
        chunk_counts.add(chunks[0])
        assert torch.equal(out, alone[0]), f"trial {trial}: the output changed with the batch"
        assert torch.equal(lse, alone[1]), f"trial {trial}: the lse changed with the batch"
    assert len(chunk_counts) > 1, "the companions must change the level's chunk count (the case under test)"


# -- CUDA graphs (decode) --------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks"])
def test_decode_under_cuda_graphs_is_bitwise_the_same_as_alone(with_sinks: bool) -> None:
    """A batch-invariant CUDA-graph decode wrapper is split too; replays after re-plans match the eager alone run."""
    device, dtype, batch = "cuda", f16, 8
    rng = random.Random(17)
    gen = torch.Generator().manual_seed(17)
    target_q = torch.randn(HQ, D, generator=gen).to(dtype).to(device)
    target_kv = _random_kv(2 * BATCH_INVARIANT_CHUNK_TOKENS + 77, dtype, device, gen)
    sinks = (torch.randn(HQ, generator=gen) * 2).to(device) if with_sinks else None
    alone_out, alone_lse, _ = _decode(device, dtype, target_q, target_kv, [], rng, sinks)

    max_pages = 4096
    pool = Pool(max_pages, dtype, device, rng)
    indptr_buf = torch.zeros(batch + 1, dtype=torch.int32, device=device)
    indices_buf = torch.zeros(max_pages, dtype=torch.int32, device=device)
    last_buf = torch.zeros(batch, dtype=torch.int32, device=device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(64 << 20, dtype=torch.uint8, device=device), use_cuda_graph=True,
        paged_kv_indptr_buffer=indptr_buf, paged_kv_indices_buffer=indices_buf, paged_kv_last_page_len_buffer=last_buf)
    q = torch.zeros(batch, HQ, D, dtype=dtype, device=device)
    out = torch.zeros(batch, HQ, D, dtype=dtype, device=device)
    lse = torch.zeros(batch, HQ, dtype=torch.float32, device=device)
    graph = None
    for trial in range(TRIALS // 2 + 1):
        pool.free = list(range(max_pages))
        rng.shuffle(pool.free)
        position = rng.randrange(batch)
        kvs = [_random_kv(rng.choice([0, 1, rng.randrange(1, 3000)]), dtype, device, gen) for _ in range(batch)]
        kvs[position] = target_kv
        qs = [torch.randn(HQ, D, generator=gen).to(dtype).to(device) for _ in range(batch)]
        qs[position] = target_q
        indptr, indices, last = _page_table([pool.place(kv) for kv in kvs], [kv.shape[1] for kv in kvs])
        wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype, batch_invariant=True)
        q.copy_(torch.stack(qs))
        if graph is None:  # capture once (after a warm-up run), replay for every later plan
            wrapper.run(q, pool.cache, out=out, lse=lse, sinks=sinks)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wrapper.run(q, pool.cache, out=out, lse=lse, sinks=sinks)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[position], alone_out), f"trial {trial}: the replayed output differs from alone"
        assert torch.equal(lse[position], alone_lse), f"trial {trial}: the replayed lse differs from alone"


# -- the schedules themselves (pure) ---------------------------------------------------------------

def test_batch_invariant_schedules_cut_each_request_by_its_own_length() -> None:
    from jitattn.kv_split import decode_kv_split, split_level_page_table
    from jitattn.page_table import check_paged_index

    chunk = BATCH_INVARIANT_CHUNK_TOKENS
    for lens in ([5000], [5000, 1], [1, 5000, 20000, 0], [5000] * 7):
        split = decode_kv_split(tuple(lens), num_kv_heads=8, num_sms=132, page_size=PAGE, batch_invariant=True)
        assert split.kv_chunk_size == chunk
        r = lens.index(5000)
        assert split.split_indptr[r + 1] - split.split_indptr[r] == 5, "5000 tokens are 5 chunks of 1024, always"
    assert decode_kv_split((0, 0), num_kv_heads=8, num_sms=132, page_size=PAGE, batch_invariant=True).kv_chunk_size, \
        "even a batch with nothing to cut is a split plan (the captured launch must not change kind)"
    assert decode_kv_split((64,), num_kv_heads=1, num_sms=1, page_size=16, fixed_split_size=2,
                           batch_invariant=True).split_indptr == (0, 2)
    # A cascade level: the first node's chunks are the same pages whatever the second node's length.
    pages_per_chunk = chunk // PAGE
    cuts = []
    for other in (16, 40 * PAGE, 200 * PAGE):
        lens = [150 * PAGE + 3, other]
        pages = [(n + PAGE - 1) // PAGE for n in lens]
        indptr = torch.tensor([0, pages[0], pages[0] + pages[1]], dtype=torch.int32)
        index = check_paged_index(indptr, torch.arange(sum(pages), dtype=torch.int32),
                                  torch.tensor([(n - 1) % PAGE + 1 for n in lens], dtype=torch.int32), PAGE)
        num_chunks = -(-max(pages) // pages_per_chunk)
        _, table = split_level_page_table(torch.tensor([0, 1, 2], dtype=torch.int32), index, num_chunks,
                                          pages_per_chunk)
        first = [table.kv_lens[c * 2] for c in range(num_chunks)]
        cuts.append([n for n in first if n])
    assert cuts[0] == cuts[1] == cuts[2] == [1024, 1024, 150 * PAGE + 3 - 2048]


@pytest.mark.parametrize("device", devices())
def test_fast_decode_plan_batch_invariant_gives_the_plan_bits(device: str) -> None:
    """fast_decode_plan(batch_invariant=True) cuts like plan() (chunks end on pages), so the bits are the same."""
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    lens = [2 * BATCH_INVARIANT_CHUNK_TOKENS + 5, 1, 0, 900]
    kvs = [_random_kv(n, f16, device, gen) for n in lens]
    pool = Pool(sum((n + PAGE - 1) // PAGE for n in lens) + 2, f16, device, rng)
    indptr, indices, last = _page_table([pool.place(kv) for kv in kvs], lens)
    q = torch.randn(len(lens), HQ, D, generator=gen).to(f16).to(device)
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(16 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=f16, batch_invariant=True)
    planned = wrapper.run(q, pool.cache)
    jitattn.fast_decode_plan(wrapper, indptr.to(device), indices.to(device), last.to(device), HQ, HKV, D, PAGE,
                             q_data_type=f16, global_override_indptr_cpu=indptr, batch_invariant=True)
    assert wrapper._plan.split.num_chunks == 3 + 1 + 1 + 1
    assert torch.equal(wrapper.run(q, pool.cache), planned)


def _batch_attention(device: str, members, position: int, rng, causal: bool):
    """The out / lse rows of member ``position`` (``members``: (q [n, HQ, D], kv [2, len, HKV, D])) of one
    ``BatchAttention`` call with ``batch_invariant=True``."""
    pool = Pool(sum((kv.shape[1] + PAGE - 1) // PAGE for _, kv in members) + 7, f16, device, rng)
    pages = [pool.place(kv) for _, kv in members]
    lens = [kv.shape[1] for _, kv in members]
    indptr, indices, _ = _page_table(pages, lens)
    qo = torch.tensor([0] + torch.tensor([q.shape[0] for q, _ in members]).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.cat([m[0] for m in members])
    wrapper = jitattn.BatchAttention(kv_layout="NHD", device=device)
    wrapper.plan(qo, indptr, indices, torch.tensor(lens, dtype=torch.int32), HQ, HKV, D, D, PAGE, causal=causal,
                 q_data_type=f16, kv_data_type=f16, batch_invariant=True)
    out, lse = wrapper.run(q, pool.cache)
    rows = slice(int(qo[position]), int(qo[position + 1]))
    return out[rows], lse[rows]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize("queries, target_len", [(1, 2 * BATCH_INVARIANT_CHUNK_TOKENS + 333), (1, 700), (5, 900)],
                         ids=["decode_split", "decode", "prefill"])
def test_batch_attention_request_is_bitwise_the_same_in_any_batch(device: str, queries: int, target_len: int) -> None:
    rng = random.Random(queries * 7919 + target_len)
    gen = torch.Generator().manual_seed(target_len)
    target = (torch.randn(queries, HQ, D, generator=gen).to(f16).to(device), _random_kv(target_len, f16, device, gen))
    alone = _batch_attention(device, [target], 0, rng, causal=True)
    for trial in range(TRIALS // 2):
        members = [(torch.randn(rng.choice([1, 1, 3, 40]), HQ, D, generator=gen).to(f16).to(device),
                    _random_kv(rng.choice([40, rng.randrange(40, 300), rng.randrange(300, 4000)]), f16, device, gen))
                   for _ in range(rng.choice([1, 3, 9]))]
        position = rng.randrange(len(members) + 1)
        members.insert(position, target)
        out, lse = _batch_attention(device, members, position, rng, causal=True)
        assert torch.equal(out, alone[0]), f"trial {trial}: the output changed with the batch"
        assert torch.equal(lse, alone[1]), f"trial {trial}: the lse changed with the batch"


def _pod_decode(device: str, members, position: int, rng, prefill):
    """The decode out / lse of member ``position`` of a ``PODWithPagedKVCacheWrapper`` run with
    ``batch_invariant=True`` (``prefill``: its (q, k, v) part, the same in every call)."""
    pool = Pool(sum((kv.shape[1] + PAGE - 1) // PAGE for _, kv in members) + 7, f16, device, rng)
    pages = [pool.place(kv) for _, kv in members]
    indptr, indices, last = _page_table(pages, [kv.shape[1] for _, kv in members])
    wrapper = jitattn.PODWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=device))
    wrapper.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=f16, batch_invariant=True)
    (_, out_d), (_, lse_d) = wrapper.run(*prefill, torch.stack([q for q, _ in members]), pool.cache, causal_p=True,
                                         return_lse_p=True, return_lse_d=True)
    return out_d[position], lse_d[position]


@pytest.mark.parametrize("device", devices())
def test_pod_decode_request_is_bitwise_the_same_in_any_batch(device: str) -> None:
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    prefill = tuple(torch.randn(n, h, D, generator=gen).to(f16).to(device) for n, h in ((32, HQ), (96, HKV), (96, HKV)))
    target = (torch.randn(HQ, D, generator=gen).to(f16).to(device),
              _random_kv(2 * BATCH_INVARIANT_CHUNK_TOKENS + 333, f16, device, gen))
    alone = _pod_decode(device, [target], 0, rng, prefill)
    for trial in range(TRIALS // 2):
        members = [(torch.randn(HQ, D, generator=gen).to(f16).to(device),
                    _random_kv(rng.choice([1, rng.randrange(1, 300), rng.randrange(300, 5000)]), f16, device, gen))
                   for _ in range(rng.choice([1, 3, 9]))]
        position = rng.randrange(len(members) + 1)
        members.insert(position, target)
        out, lse = _pod_decode(device, members, position, rng, prefill)
        assert torch.equal(out, alone[0]) and torch.equal(lse, alone[1]), f"trial {trial}: changed with the batch"


@pytest.mark.parametrize("make", ["BatchAttention", "PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper",
                                  "BlockSparseAttentionWrapper", "VariableBlockSparseAttentionWrapper"])
def test_the_mixed_and_sparse_plans_take_batch_invariant_after_flashinfers_arguments(make: str) -> None:
    import inspect

    parameter = inspect.signature(getattr(jitattn, make).plan).parameters["batch_invariant"]
    assert parameter.kind is inspect.Parameter.KEYWORD_ONLY and parameter.default is None


def test_batch_attention_refuses_a_batch_invariant_that_is_not_a_bool() -> None:
    rng = random.Random(3)
    target = (torch.randn(1, HQ, D).to(f16), _random_kv(50, f16, "cpu", torch.Generator().manual_seed(3)))
    pool = Pool(8, f16, "cpu", rng)
    indptr, indices, _ = _page_table([pool.place(target[1])], [50])
    with pytest.raises(TypeError, match="batch_invariant='yes' must be True, False or None"):
        jitattn.BatchAttention(device="cpu").plan(torch.tensor([0, 1], dtype=torch.int32), indptr, indices,
                                                  torch.tensor([50], dtype=torch.int32), HQ, HKV, D, D, PAGE,
                                                  batch_invariant="yes")

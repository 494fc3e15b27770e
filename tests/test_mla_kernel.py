"""The dedicated sm90 MLA kernel (``jitattn.runtime.mla_kernel``, ``jitattn.kernels.mla_plan``, ``jitattn.kernels.mla``).

cpu: the work list (tiles, causal block counts, split-KV chunks, workspace fitting, order), the kernel choice
(device, arch list, dtypes, dims, CUDA graphs, ``JITATTN_MLA_KERNEL``), the ``mla`` op's spec and its template.
gpu: the kernel against the float reference across heads 16/64/128, page sizes 1/16/64, decode, speculative
and chunked-prefill query counts, lengths including 0, split and unsplit plans, f16 and bf16, NaN-poisoned
outputs; the forced fallback gives the prefill kernels' result.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import jitattn
from jitattn import env
from jitattn.kernels import mla as family
from jitattn.ops.mla import BatchMLAPagedAttentionWrapper
from jitattn.runtime.mla_kernel import (GraphArrays, kernel_spec, layout_problem, narrow_kernel, select_kernel,
                                        unsupported_reason)
from jitattn.kernels.mla_plan import MIN_CHUNK_BLOCKS, graph_item_capacity, padded, plan_work
from jitattn.spec import VariantSpec

from test_mla import CKV, KPE, SM_SCALE, _indptr, _latent_cache, _queries, _reference

from attention_cases import assert_close_lse, assert_close_out

GPU_SPECS = [kernel_spec(torch.bfloat16), kernel_spec(torch.float16), kernel_spec(torch.bfloat16, torch.float8_e4m3fn),
             kernel_spec(torch.float16, torch.float8_e5m2)]
ROWS, BLOCK = family.ROWS, family.KV_BLOCK


# -- the work list -------------------------------------------------------------------------------------
def _visible_blocks(qo_len: int, kv_len: int, heads: int, row0: int, causal: bool) -> int:
    """KV blocks some row of the tile starting at row0 sees (brute force over its rows)."""
    seen = 0
    for rho in range(row0, min(row0 + ROWS, qo_len * heads)):
        token = rho // heads
        seen = max(seen, max(0, min(kv_len, kv_len - qo_len + token + 1)) if causal else kv_len)
    return -(-seen // BLOCK)


def _check_work(work, qo_lens, kv_lens, heads, causal, sms):
    """Every row of every request is in exactly one tile; each tile's items cover its visible blocks exactly once."""
    items = work.items.tolist()
    assert work.items.shape == (len(items), family.ITEM_INTS) and work.items.dtype == torch.int32
    assert 1 <= work.grid <= max(1, min(len(items), sms))
    spans: dict[tuple[int, int], list[tuple[int, int, int]]] = {}
    for r, row0, begin, end, part, *rest in items:
        assert rest == [0, 0, 0] and row0 % ROWS == 0 and 0 <= begin <= end
        spans.setdefault((r, row0), []).append((begin, end, part))
    expected_tiles = {(r, row0) for r, q in enumerate(qo_lens) for row0 in range(0, q * heads, ROWS)}
    assert set(spans) == expected_tiles
    merges = {(m[0], m[1]): m for m in work.merges.tolist()}
    used_rows: set[int] = set()
    for (r, row0), parts in spans.items():
        nblk = _visible_blocks(qo_lens[r], kv_lens[r], heads, row0, causal)
        parts.sort()
        assert parts[0][0] == 0 and parts[-1][1] == nblk
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), "chunks are contiguous and disjoint"
        if len(parts) == 1:
            assert parts[0][2] == -1 and (r, row0) not in merges
            continue
        _, _, chunks, first = merges[(r, row0)]
        assert chunks == len(parts)
        assert [p for _, _, p in parts] == [first + ROWS * c for c in range(chunks)]
        rows = set(range(first, first + ROWS * chunks))
        assert not rows & used_rows and max(rows) < work.workspace_rows
        used_rows |= rows
    assert len(merges) == sum(len(p) > 1 for p in spans.values())
    sizes = [end - begin for _, _, begin, end, *_ in items]
    assert sizes == sorted(sizes, reverse=True), "heaviest items first"


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("heads", [16, 64, 128])
def test_work_list_covers_every_row_and_visible_block(causal: bool, heads: int) -> None:
    rng = random.Random(heads * 2 + causal)
    for trial in range(20):
        batch = rng.randint(1, 12)
        qo_lens = [rng.choice([0, 1, 1, 2, 5, 8, 70]) for _ in range(batch)]
        kv_lens = [max(q, rng.choice([0, 1, 63, 64, 65, 300, 5000])) if causal else rng.choice([0, 1, 64, 900, 5000])
                   for q in qo_lens]
        sms = rng.choice([1, 8, 132])
        work = plan_work(qo_lens, kv_lens, heads, causal, sms, workspace_capacity_rows=1 << 20)
        _check_work(work, qo_lens, kv_lens, heads, causal, sms)


def test_small_batches_split_and_large_ones_do_not() -> None:
    one = plan_work([1], [8192], 128, False, 132, 1 << 20)  # 2 tiles of 128 blocks on 132 SMs
    assert one.num_merges == 2 and one.chunk_blocks == MIN_CHUNK_BLOCKS and one.num_items == 64
    _check_work(one, [1], [8192], 128, False, 132)
    big = plan_work([1] * 64, [4096] * 64, 128, False, 132, 1 << 20)  # 128 tiles: enough for the SMs
    assert big.num_merges == 0 and big.workspace_rows == 0 and big.num_items == 128 and big.grid == 128
    assert big.chunk_blocks == 0
    unsplit = plan_work([1], [8192], 128, False, 132, 1 << 20, split=False)
    assert unsplit.num_items == 2 and unsplit.num_merges == 0


def test_split_chunks_widen_to_fit_the_workspace() -> None:
    roomy = plan_work([1], [64 * 400], 16, False, 132, 1 << 20)
    tight = plan_work([1], [64 * 400], 16, False, 132, 64 * 20)
    assert roomy.workspace_rows > 64 * 20 >= tight.workspace_rows > 0
    assert tight.chunk_blocks > roomy.chunk_blocks
    _check_work(tight, [1], [64 * 400], 16, False, 132)
    none = plan_work([1], [64 * 400], 16, False, 132, 0)
    assert none.num_merges == 0 and none.workspace_rows == 0 and none.num_items == 1


def test_empty_and_zero_length_requests() -> None:
    empty = plan_work([], [], 16, False, 132, 1 << 20)
    assert empty.num_items == 0 and empty.num_merges == 0
    zero = plan_work([1, 0, 3], [0, 0, 2], 16, True, 132, 1 << 20)
    _check_work(zero, [1, 0, 3], [0, 0, 2], 16, True, 132)
    assert sorted(zero.items[:, 3].tolist()) == [0, 1], "kv_len 0 -> a tile of no blocks (o = 0, lse = -inf)"
    with pytest.raises(ValueError, match="num_heads"):
        plan_work([1], [1], 0, False, 132, 0)


@pytest.mark.parametrize("heads", [16, 128])
def test_graph_capacity_bounds_every_work_list_of_a_batch_shape(heads: int) -> None:
    """A CUDA-graph plan sizes its launch once per (batch, query tokens): no lengths may need more items or
    merges than ``graph_item_capacity`` gives, split or not, causal or not, whatever the workspace."""
    rng = random.Random(heads)
    for trial in range(300):
        batch = rng.randint(1, 16)
        qo_lens = [rng.choice([1, 1, 2, 5, 8, 40]) for _ in range(batch)]
        sms = rng.choice([1, 8, 132])
        items, merges = graph_item_capacity(sum(qo_lens), batch, heads, sms)
        for _ in range(4):
            kv_lens = [rng.choice([0, 1, 63, 64, 65, rng.randint(1, 40000)]) + q for q in qo_lens]
            causal = rng.random() < 0.5
            work = plan_work(qo_lens, kv_lens, heads, causal, sms, rng.choice([0, 64 * 8, 1 << 20]))
            assert work.num_items <= items and work.num_merges <= merges, (qo_lens, kv_lens, sms)


def test_padded_work_lists_end_in_items_and_merges_of_the_sentinel_request() -> None:
    work = plan_work([1, 2], [9000, 300], 16, True, 132, 1 << 20)
    assert work.num_merges > 0, "the case must split"
    full = padded(work, work.num_items + 5, work.num_merges + 3, request=2)
    assert torch.equal(full.items[: work.num_items], work.items) and torch.equal(full.merges[: work.num_merges],
                                                                                 work.merges)
    assert full.items[work.num_items:].tolist() == [[2, 0, 0, 0, -1, 0, 0, 0]] * 5, "no rows, no blocks, direct"
    assert full.merges[work.num_merges:].tolist() == [[2, 0, 0, 0]] * 3
    assert full.workspace_rows == work.workspace_rows
    with pytest.raises(RuntimeError, match="capacity"):
        padded(work, work.num_items - 1, work.num_merges, request=2)


def test_graph_arrays_refuse_a_plan_the_captured_launch_cannot_replay() -> None:
    baked = (128, 64, False, 0.07, torch.bfloat16, torch.bfloat16)
    arrays = GraphArrays(torch.device("cpu"), batch=8, total_q=8, pages=128, workspace_rows=64 * 10, baked=baked,
                         num_sms=132)
    assert (arrays.items, arrays.merges) == graph_item_capacity(8, 8, 128, 132) and arrays.grid == 132
    assert arrays.buffer.numel() >= sum(arrays.sizes) and arrays.sizes[2] == 10, "qo_indptr and the sentinel"
    arrays.refuse(8, 8, 128, baked)  # the same shape: fine
    with pytest.raises(ValueError, match="9 requests and 9 query tokens.*8 and 8"):
        arrays.refuse(9, 9, 10, baked)
    with pytest.raises(ValueError, match=r"page_size 64 -> 16"):
        arrays.refuse(8, 8, 10, baked[:1] + (16,) + baked[2:])
    with pytest.raises(ValueError, match="129 pages"):
        arrays.refuse(8, 8, 129, baked)
    no_split = GraphArrays(torch.device("cpu"), 8, 8, 128, 0, baked, 132)
    assert no_split.merges == 0, "a workspace of no rows never splits: no merge launch"


# -- the kernel choice ---------------------------------------------------------------------------------
_OK = dict(device=torch.device("cuda", 0), q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, head_dim_ckv=512,
           head_dim_kpe=64, capability=(9, 0), archs=("9.0a",))


@pytest.mark.parametrize("change, why", [
    (dict(device=torch.device("cpu")), "cuda kernel"),
    (dict(capability=(8, 0)), "sm_80"),
    (dict(archs=("8.0", "9.0a")), "9.0a only"),
    (dict(archs=None), "9.0a only"),
    (dict(kv_dtype=torch.float16), "queries' dtype or fp8"),
    (dict(q_dtype=torch.float32, kv_dtype=torch.float32), "f16 or bf16 queries"),
    (dict(head_dim_ckv=256), "head_dim_ckv=512"),
])
def test_unsupported_plans_say_why(change: dict, why: str) -> None:
    assert unsupported_reason(**_OK) is None
    assert unsupported_reason(**(_OK | dict(q_dtype=torch.float16, kv_dtype=torch.float16))) is None
    for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
        assert unsupported_reason(**(_OK | dict(kv_dtype=fp8))) is None
    assert why in unsupported_reason(**(_OK | change))


def test_the_knob_forces_a_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JITATTN_MLA_KERNEL", raising=False)
    assert select_kernel(None) == "sm90" and select_kernel("no GPU") == "prefill"
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "prefill")
    assert select_kernel(None) == "prefill"
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    assert select_kernel(None) == "sm90"
    with pytest.raises(ValueError, match="JITATTN_MLA_KERNEL=sm90.*no GPU"):
        select_kernel("no GPU")
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "fast")
    with pytest.raises(ValueError, match="not an MLA kernel choice"):
        env.mla_kernel()


def test_cpu_plans_keep_the_prefill_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JITATTN_MLA_KERNEL", raising=False)
    gen = torch.Generator().manual_seed(1)
    ckv, kpe, indptr, indices, lens = _latent_cache([9], 16, torch.float32, "cpu", gen, joined=True)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(_indptr([1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, torch.float32, torch.float32)
    assert wrapper.kernel == "prefill"
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    with pytest.raises(ValueError, match="cuda kernel"):
        wrapper.plan(_indptr([1]), indptr, indices, lens, 16, CKV, KPE, 16, False, SM_SCALE, torch.float32,
                     torch.float32)


def _aligned_tensors(dtype: torch.dtype = torch.bfloat16, kv_dtype: torch.dtype | None = None):
    """q_nope, q_pe, ckv, kpe, out as the kernel's tests pass them: slices of joined [.., 576] buffers."""
    q = torch.randn(3, 4, CKV + KPE).to(dtype)
    cache = torch.randn(5, 16, CKV + KPE).to(kv_dtype or dtype)
    return q[..., :CKV], q[..., CKV:], cache[..., :CKV], cache[..., CKV:], torch.empty(3, 4, CKV, dtype=dtype)


def test_layout_problem_names_the_tensor_the_kernel_cannot_read() -> None:
    assert layout_problem(*_aligned_tensors()) is None
    assert layout_problem(*_aligned_tensors(torch.float16, torch.float8_e4m3fn)) is None
    q_nope, q_pe, ckv, kpe, out = _aligned_tensors()
    shifted = torch.randn(3, 4, CKV + 1).to(torch.bfloat16)[..., 1:]  # rows start 2 bytes in
    assert "q_nope" in layout_problem(shifted, q_pe, ckv, kpe, out)
    odd_rows = torch.randn(3, 4, KPE + 4).to(torch.bfloat16)[..., :KPE]  # row stride 136 bytes
    assert "q_pe" in layout_problem(q_nope, odd_rows, ckv, kpe, out)
    fp8 = torch.randn(5, 16, CKV + 8).to(torch.float8_e4m3fn)  # 520-byte rows: 8-byte, not 16-byte, aligned
    assert "ckv_cache" in layout_problem(q_nope, q_pe, fp8[..., :CKV], kpe, out)
    odd_out = torch.empty(3 * 4 * CKV + 1, dtype=torch.bfloat16)[1:].view(3, 4, CKV)
    assert "out" in layout_problem(q_nope, q_pe, ckv, kpe, odd_out)


class _FakeKernel:
    """Stands in for an sm90 ``KernelPlan`` on the cpu: records launches."""

    def __init__(self, page_size: int, host_arrays: tuple[torch.Tensor, ...]) -> None:
        self.params = type("Params", (), {"page_size": page_size})()
        self.host_arrays = host_arrays  # the plan's copies of qo_indptr, kv_indptr, kv_indices
        self.launches = 0

    def launch(self, *args, **kwargs) -> None:
        self.launches += 1

    relaunch = launch  # KernelPlan.relaunch: the launch of tensors like the last launch's


class _FakedBatch:
    """A small latent batch on the cpu and an MLA wrapper whose sm90 plans are faked (``_FakeKernel``; a plan
    with sm_scale=None is refused as the real one is), so its run() paths can be followed without a GPU."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
        self.fakes: list[_FakeKernel] = []
        self.inner_plans: list[int] = []  # the prefill kernels' plans

        def fake_plan(wrapper, qo_indptr, indptr, kv_indices, lens, last_page_len, num_heads, head_dim_ckv,
                      head_dim_kpe, page_size, causal, sm_scale, *rest, **kw):
            if sm_scale is None:
                raise ValueError("sm_scale=None must be a positive float")
            wrapper._kernel = _FakeKernel(page_size, (qo_indptr.clone(), indptr.clone(), kv_indices.clone()))
            self.fakes.append(wrapper._kernel)
            return wrapper._kernel

        real_inner_plan = jitattn.BatchPrefillWithPagedKVCacheWrapper.plan
        monkeypatch.delenv("JITATTN_MLA_KERNEL", raising=False)
        monkeypatch.setattr(BatchMLAPagedAttentionWrapper, "_sm90_plan", fake_plan)
        monkeypatch.setattr(jitattn.BatchPrefillWithPagedKVCacheWrapper, "plan",
                            lambda w, *a, **kw: self.inner_plans.append(1) or real_inner_plan(w, *a, **kw))
        self.gen = torch.Generator().manual_seed(seed)
        self.kv_lens, self.qo_lens, self.heads = [40, 7], [2, 1], 4
        self.ckv, self.kpe, self.indptr, self.indices, self.lens = _latent_cache(
            self.kv_lens, 16, torch.float32, "cpu", self.gen, joined=True)
        self.q_nope, self.q_pe = _queries(self.qo_lens, self.heads, torch.float32, "cpu", self.gen)
        self.wrapper = BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.uint8))

    def plan(self, indptr=None, indices=None, sm_scale: float | None = SM_SCALE) -> None:
        self.wrapper.plan(_indptr(self.qo_lens), self.indptr if indptr is None else indptr,
                          self.indices if indices is None else indices, self.lens, self.heads, CKV, KPE, 16, True,
                          sm_scale, torch.float32, torch.float32)

    def reference(self):
        return _reference(self.q_nope, self.q_pe, self.ckv, self.kpe, self.indptr, self.indices, self.qo_lens,
                          self.kv_lens, True)

    def run(self, q_nope: torch.Tensor, **kw):
        return self.wrapper.run(q_nope, self.q_pe, self.ckv, self.kpe, **kw)

    def off_16_bytes(self) -> torch.Tensor:
        """q_nope with its own strides, rows 4 bytes off 16: the sm90 kernel cannot read it."""
        offset = torch.empty(self.q_nope.numel() + 1)[1:].view(self.q_nope.shape)
        return offset.copy_(self.q_nope)


def test_an_sm90_plan_runs_unreadable_tensors_on_the_prefill_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel's layout rules fail at run(): auto plans the prefill kernels once and gives their result;
    JITATTN_MLA_KERNEL=sm90 raises instead."""
    b = _FakedBatch(monkeypatch, 4)
    b.plan()
    assert b.wrapper.kernel == "sm90" and not b.inner_plans
    b.run(b.q_nope)  # readable: the kernel launches
    assert b.fakes[-1].launches == 1 and not b.inner_plans
    ref_out, ref_lse = b.reference()
    torch.testing.assert_close(b.run(b.off_16_bytes()), ref_out, atol=1e-4, rtol=1e-4)  # same strides, pointer off
    assert b.fakes[-1].launches == 1 and len(b.inner_plans) == 1
    shifted = torch.randn(sum(b.qo_lens), b.heads, CKV + 1, generator=b.gen)[..., 1:]  # other strides, rows off
    shifted.copy_(b.q_nope)
    for _ in range(2):
        out = torch.full((sum(b.qo_lens), b.heads, CKV), float("nan"))
        _, lse = b.run(shifted, out=out, return_lse=True)
        torch.testing.assert_close(out, ref_out, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(lse, ref_lse, atol=1e-4, rtol=1e-4)
    assert b.fakes[-1].launches == 1 and len(b.inner_plans) == 1, "the prefill kernels are planned once per plan()"
    b.run(b.q_nope)  # readable again: the kernel
    assert b.fakes[-1].launches == 2
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    with pytest.raises(ValueError, match="JITATTN_MLA_KERNEL=sm90.*q_nope"):
        b.run(shifted)
    b.plan()
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "auto")
    b.run(shifted)
    assert len(b.inner_plans) == 2, "a new plan() plans the fallback again"


def test_the_fallback_plans_this_batchs_arrays_not_the_callers_later_contents(monkeypatch: pytest.MonkeyPatch) -> None:
    """plan() from host arrays the caller refills for its next batch before run(): a run() that falls back to
    the prefill kernels still attends over the planned pages."""
    b = _FakedBatch(monkeypatch, 4)
    staged, staged_indptr = b.indices.clone(), b.indptr.clone()  # the caller's host staging tensors
    b.plan(staged_indptr, staged)
    staged.copy_(staged.flip(0))
    staged_indptr.fill_(0)
    torch.testing.assert_close(b.run(b.off_16_bytes()), b.reference()[0], atol=1e-4, rtol=1e-4)


def test_repeated_runs_keep_every_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a launch, run() of tensors like its tensors skips the checks they passed; anything else is checked
    again (a wrong shape, an output of another shape, a pointer off 16 bytes, a new plan)."""
    b = _FakedBatch(monkeypatch, 6)
    b.plan()
    with pytest.raises(TypeError, match="q_nope must be a torch.Tensor"):  # before any launch too
        b.run(b.q_nope.numpy())
    b.run(b.q_nope)
    b.run(b.q_nope.clone())  # other memory, same layout: launched without the checks
    assert b.fakes[-1].launches == 2 and not b.inner_plans
    with pytest.raises(ValueError, match="q_nope has shape"):
        b.run(b.q_nope[:1])
    with pytest.raises(ValueError, match="out has shape"):
        b.run(b.q_nope, out=torch.empty(1, b.heads, CKV))
    with pytest.raises(TypeError, match="q_nope must be a torch.Tensor"):
        b.run(b.q_nope.numpy())
    torch.testing.assert_close(b.run(b.off_16_bytes()), b.reference()[0], atol=1e-4, rtol=1e-4)
    assert b.fakes[-1].launches == 2 and len(b.inner_plans) == 1  # the off-16 query took the prefill kernels
    b.plan()
    b.run(b.q_nope)
    assert b.fakes[-1].launches == 1  # the new plan's kernel


def test_a_failed_plan_leaves_nothing_to_run(monkeypatch: pytest.MonkeyPatch) -> None:
    b = _FakedBatch(monkeypatch, 5)
    b.plan()
    with pytest.raises(ValueError, match="sm_scale"):
        b.plan(sm_scale=None)
    with pytest.raises(RuntimeError, match="without a plan"):
        b.run(b.q_nope)


# -- the op and its template ---------------------------------------------------------------------------
def test_the_mla_op_is_a_cuda_spec_with_a_readable_uri() -> None:
    spec = kernel_spec(torch.bfloat16)
    assert spec.uri == "mla_cuda_bf16_hd576x512" and spec.kernel_name == "jitattn_mla_bf16_hd576x512"
    assert VariantSpec.from_dict(spec.to_dict()) == spec
    with pytest.raises(ValueError, match="no kernel for target='cpu'"):
        VariantSpec(op="mla", target="cpu", q_dtype="f32", kv_dtype="f32", o_dtype="f32")
    with pytest.raises(ValueError, match="head_dim_qk is required"):
        VariantSpec(op="mla", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16")


def test_the_template_renders_the_layout() -> None:
    from jitattn.jit.render import render

    spec = kernel_spec(torch.float16)
    sources = render(spec)
    kernel = sources["kernel.cu"]
    lay = family.layout(spec)
    assert lay["kSmemBytes"] <= 227 << 10 and lay["kOffP"] == 3 * lay["kTileBytes"]
    for name, value in lay.items():
        assert f"constexpr int {name} = {value};" in kernel
    assert "using q_t = __half;" in kernel and f"{spec.kernel_name}_merge" in kernel
    assert "struct MlaParams" in sources["params.h"]
    with pytest.raises(ValueError, match="16-bit"):
        family.layout(VariantSpec(op="mla", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="f32",
                                  head_dim_qk=576, head_dim_vo=512))
    fp8 = kernel_spec(torch.bfloat16, torch.float8_e4m3fn)
    assert fp8.uri == "mla_cuda_bf16_kve4m3_hd576x512"
    fp8_layout = family.layout(fp8)
    assert fp8_layout["kRawBytes"] == 64 * 576 and fp8_layout["kOffP"] == 2 * lay["kTileBytes"] + 2 * 64 * 576
    assert fp8_layout["kSmemBytes"] <= 227 << 10 and lay["kRawBytes"] == 0
    fp8_kernel = render(fp8)["kernel.cu"]
    assert "constexpr bool kKVFp8 = true;" in fp8_kernel and "kFp8Kind = __NV_E4M3;" in fp8_kernel
    assert "kFp8Kind = __NV_E5M2;" in render(kernel_spec(torch.float16, torch.float8_e5m2))["kernel.cu"]


def test_the_trace_renders_only_when_set(monkeypatch: pytest.MonkeyPatch, fresh_cache) -> None:
    """mla TUNING trace (tools/trace_mla.py): off, the source has no stamps (the tested kernel); on, every phase of
    both warpgroups is stamped and the module (built where nvcc is) exports the copy and clear entry points; other
    values are refused."""
    import ctypes
    import shutil

    from jitattn.jit.render import render

    spec = kernel_spec(torch.bfloat16)
    plain = render(spec)["kernel.cu"]
    assert "trace_stamp" not in plain and "clock64" not in plain
    monkeypatch.setitem(family.TUNING, "trace", 1)
    traced = render(spec)["kernel.cu"]
    assert all(f"trace_stamp(traced, j, {field}" in traced for field in (1, 2, 3, 7, 8, 11))
    assert all(f"constexpr int {name} = {value};" in traced for name, value in family.TRACE.items())
    assert all(f"wg ? {b} : {a}" in traced for a, b in ((0, 6), (4, 9), (5, 10)))
    assert "jitattn_mla_trace(void* dst)" in traced and "jitattn_mla_trace_clear()" in traced
    if shutil.which("nvcc") is not None:
        monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
        library = ctypes.CDLL(str(jitattn.load(spec).path))
        assert hasattr(library, "jitattn_mla_trace") and hasattr(library, "jitattn_mla_trace_clear")
    monkeypatch.setitem(family.TUNING, "trace", 2)
    with pytest.raises(ValueError, match="trace=2 must be 0 or 1"):
        family.layout(spec)


def test_the_module_holds_the_narrow_kernel_and_a_plan_picks_it_by_its_tile_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every MLA module holds the 64-row kernel and the narrow one (S^T = K Q^T, O^T = V^T P^T as m64n16
    products); a plan launches the narrow one when its tiles hold at most TUNING narrow_rows rows (heads x query
    tokens of a request, at most 64 a tile): 0 never, 64 always."""
    from jitattn.jit.render import render

    for spec in (kernel_spec(torch.bfloat16), kernel_spec(torch.float16, torch.float8_e5m2)):
        source = render(spec)["kernel.cu"]
        assert "_narrow(const MlaParams p" in source and "mma_n16<1>(o[m]" in source
        assert "wgmma.mma_async.sync.aligned.m64n16k16" in source and "mma_ss<kBN, q_t, 0>(sc" in source
    lens = np.array
    assert narrow_kernel(lens([1, 1, 1]), 16) and narrow_kernel(lens([2, 1]), 8) and narrow_kernel(lens([4]), 4)
    assert not narrow_kernel(lens([1, 2]), 16) and not narrow_kernel(lens([1]), 128)
    # batch-invariant plans: by the head count alone (a request's kernel, hence its bits, whatever the batch)
    assert narrow_kernel(lens([1, 2]), 16, batch_invariant=True) and narrow_kernel(lens([1]), 16, batch_invariant=True)
    assert not narrow_kernel(lens([1]), 32, batch_invariant=True)
    monkeypatch.setitem(family.TUNING, "narrow_rows", 0)
    assert not narrow_kernel(lens([1]), 1)
    monkeypatch.setitem(family.TUNING, "narrow_rows", 64)
    assert narrow_kernel(lens([8, 1]), 128) and narrow_kernel(lens([1]), 64)
    for bad in (-1, 65, True, 1.5):
        monkeypatch.setitem(family.TUNING, "narrow_rows", bad)
        with pytest.raises(ValueError, match="narrow_rows=.* must be an int in \\[0, 64\\]"):
            narrow_kernel(lens([1]), 16)


# -- gpu: the kernel against the reference ---------------------------------------------------------------
_CASES = {  # (kv_lens, qo_lens, causal)
    "decode": ([37, 0, 130, 5, 64], [1, 1, 1, 1, 1], False),
    "speculative": ([37, 9, 130, 8], [2, 8, 4, 3], True),
    "chunked_prefill": ([37, 9, 130, 5], [20, 9, 64, 5], True),
    "long_split": ([3000, 0, 777, 64], [1, 1, 2, 1], True),
    "long_split_noncausal": ([4100, 1], [1, 1], False),
}


def _run_case(kv_lens, qo_lens, causal, heads, page_size, dtype, seed, joined=True, kv_dtype=None, scales=(None, None)):
    gen = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, page_size, kv_dtype, "cuda", gen, joined=joined)
    q_nope, q_pe = _queries(qo_lens, heads, dtype, "cuda", gen)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, heads, CKV, KPE, page_size, causal, SM_SCALE, dtype,
                 kv_dtype)
    out = torch.full((sum(qo_lens), heads, CKV), float("nan"), dtype=dtype, device="cuda")
    lse = torch.full((sum(qo_lens), heads), float("nan"), dtype=torch.float32, device="cuda")
    wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, k_scale=scales[0], v_scale=scales[1])
    torch.cuda.synchronize()
    return wrapper, out, lse, (q_nope, q_pe, ckv, kpe, indptr, indices)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 64, 128])
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("case", list(_CASES))
def test_sm90_kernel_matches_the_reference(monkeypatch: pytest.MonkeyPatch, heads: int, page_size: int,
                                           case: str) -> None:
    """The 64-row kernel (narrow_rows 0: also for tiles of at most 16 rows) against the reference."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    monkeypatch.setitem(family.TUNING, "narrow_rows", 0)
    kv_lens, qo_lens, causal = _CASES[case]
    wrapper, out, lse, (q_nope, q_pe, ckv, kpe, indptr, indices) = _run_case(
        kv_lens, qo_lens, causal, heads, page_size, torch.bfloat16, heads + page_size + len(case))
    assert wrapper.kernel == "sm90" and not wrapper._kernel.narrow
    if case.startswith("long_split"):
        assert wrapper._kernel.work.num_merges > 0, "the case must exercise the split-KV merge"
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal)
    assert_close_out(out, ref_out, torch.bfloat16)
    assert_close_lse(lse, ref_lse)


_NARROW_CASES = {  # (kv_lens, qo_lens, causal, heads): tiles of at most 16 rows (heads x query tokens), then wider
    "decode_h16": ([37, 0, 130, 5, 64], [1] * 5, False, 16),
    "split_h16": ([4100, 1], [1, 1], False, 16),
    "many_items_h16": ([1000, 1001, 1063, 1064] * 70, [1] * 280, False, 16),
    "speculative_h8": ([37, 9, 130, 8], [2, 2, 2, 2], True, 8),
    "chunk_h4": ([37, 9, 130, 5], [4, 3, 4, 1], True, 4),
    "decode_h12": ([200, 65, 1], [1, 1, 1], False, 12),
    # narrow_rows 64: 16-row sub-tiles of 64-row tiles (a request of 128 rows spans two), split or not
    "wide_speculative_h16": ([37, 9, 130, 8], [2, 8, 4, 3], True, 16),
    "wide_split_h64": ([4100, 1], [1, 1], False, 64),
    "wide_decode_h128": ([37, 0, 130, 5, 64], [1] * 5, False, 128),
}


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("case", list(_NARROW_CASES))
@pytest.mark.parametrize("kv", ["bf16", "f16", "e4m3"])
def test_sm90_narrow_matches_the_reference(monkeypatch: pytest.MonkeyPatch, page_size: int, case: str,
                                           kv: str) -> None:
    """The narrow kernel (m64n16 products; plans of tiles of at most 16 rows take it): the reference's result, split
    plans, causal multi-token rows, several items per CTA and an fp8 cache with its scales included; and wider tiles
    as 16-row sub-tiles (narrow_rows 64)."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    if case.startswith("wide"):
        monkeypatch.setitem(family.TUNING, "narrow_rows", 64)
    kv_lens, qo_lens, causal, heads = _NARROW_CASES[case]
    dtype = torch.float16 if kv == "f16" else torch.bfloat16
    fp8 = kv == "e4m3"
    kv_dtype = torch.float8_e4m3fn if fp8 else dtype
    scales = (0.3, 1.7) if fp8 else (None, None)
    wrapper, out, lse, (q_nope, q_pe, ckv, kpe, indptr, indices) = _run_case(
        kv_lens, qo_lens, causal, heads, page_size, dtype, 5 * heads + page_size + len(case), kv_dtype=kv_dtype,
        scales=scales)
    assert wrapper.kernel == "sm90" and wrapper._kernel.narrow
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal,
                                  *((0.3, 1.7) if fp8 else ()))
    v_scale = 1.7 if fp8 else 1.0
    assert_close_out(out / v_scale, ref_out / v_scale, dtype)
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["decode", "speculative", "long_split"])
def test_sm90_kernel_f16_and_separate_tensors(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """f16, and ckv / kpe as two separate tensors (the kernel reads them through their own pointers)."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    kv_lens, qo_lens, causal = _CASES[case]
    wrapper, out, lse, (q_nope, q_pe, ckv, kpe, indptr, indices) = _run_case(
        kv_lens, qo_lens, causal, 32, 16, torch.float16, 77, joined=False)
    assert wrapper.kernel == "sm90"
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal)
    assert_close_out(out, ref_out, torch.float16)
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
def test_forced_fallback_runs_the_prefill_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    kv_lens, qo_lens, causal = _CASES["speculative"]
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    fast, out_fast, lse_fast, _ = _run_case(kv_lens, qo_lens, causal, 64, 16, torch.bfloat16, 5)
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "prefill")
    slow, out_slow, lse_slow, _ = _run_case(kv_lens, qo_lens, causal, 64, 16, torch.bfloat16, 5)
    assert (fast.kernel, slow.kernel) == ("sm90", "prefill")
    torch.testing.assert_close(out_fast.float(), out_slow.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse_fast, lse_slow, atol=2e-3, rtol=1e-4)


@pytest.mark.gpu
def test_sm90_kernel_reads_strided_queries_and_writes_strided_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """q_nope / q_pe as slices of one [tokens, heads, 576] tensor, out a slice of a wider buffer."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    gen = torch.Generator().manual_seed(9)
    kv_lens, qo_lens = [200, 65], [3, 1]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 64, torch.bfloat16, "cuda", gen, joined=True)
    q = torch.randn(4, 16, CKV + KPE, generator=gen).to(torch.bfloat16).cuda()
    wide = torch.full((4, 16, CKV + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = wide[..., :CKV]
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, 16, CKV, KPE, 64, True, SM_SCALE, torch.bfloat16,
                 torch.bfloat16)
    _, lse = wrapper.run(q[..., :CKV], q[..., CKV:], ckv, kpe, out=out, return_lse=True)
    ref_out, ref_lse = _reference(q[..., :CKV], q[..., CKV:], ckv, kpe, indptr, indices, qo_lens, kv_lens, True)
    assert_close_out(out, ref_out, torch.bfloat16)
    assert_close_lse(lse, ref_lse)
    assert torch.isnan(wide[..., CKV:].float()).all(), "nothing written past out's columns"


@pytest.mark.gpu
def test_sm90_runs_alternating_strides_each_read_with_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """run() relaunches tensors like the last launch's writing their addresses only: queries and outputs that
    alternate between strided slices and contiguous tensors (each a new signature) are each read with their own
    strides, also when the same signature comes back."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    gen = torch.Generator().manual_seed(10)
    kv_lens, qo_lens = [130, 64], [2, 1]
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 64, torch.bfloat16, "cuda", gen, joined=True)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, 16, CKV, KPE, 64, True, SM_SCALE, torch.bfloat16,
                 torch.bfloat16)
    for step, strided in enumerate((True, False, True, True, False, False)):
        if step == 5:  # a new plan's struct holds no strides yet: the same signature as before must set them
            wrapper.plan(_indptr(qo_lens), indptr, indices, lens, 16, CKV, KPE, 64, True, SM_SCALE, torch.bfloat16,
                         torch.bfloat16)
        q = torch.randn(3, 16, CKV + KPE, generator=gen).to(torch.bfloat16).cuda()
        q_nope, q_pe = (q[..., :CKV], q[..., CKV:]) if strided else (q[..., :CKV].contiguous(),
                                                                     q[..., CKV:].contiguous())
        wide = torch.full((3, 16, CKV + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = wide[..., :CKV] if strided else torch.full_like(q_nope, float("nan"))
        _, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=out, return_lse=True)
        ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, True)
        assert_close_out(out, ref_out, torch.bfloat16)
        assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("case", ["decode", "speculative", "chunked_prefill", "long_split"])
def test_sm90_kernel_fp8_cache_matches_the_fp8_reference(monkeypatch: pytest.MonkeyPatch, heads: int, page_size: int,
                                                         case: str) -> None:
    """An e4m3 latent cache with k_scale / v_scale: converted in shared memory, exact against the reference that
    dequantizes the same fp8 values."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    kv_lens, qo_lens, causal = _CASES[case]
    k_scale, v_scale = 0.3, 1.7
    wrapper, out, lse, (q_nope, q_pe, ckv, kpe, indptr, indices) = _run_case(
        kv_lens, qo_lens, causal, heads, page_size, torch.bfloat16, heads + page_size, kv_dtype=torch.float8_e4m3fn,
        scales=(k_scale, v_scale))
    assert wrapper.kernel == "sm90"
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal, k_scale, v_scale)
    assert_close_out(out / v_scale, ref_out / v_scale, torch.bfloat16)
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
def test_sm90_kernel_e5m2_cache_with_f16_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    kv_lens, qo_lens, causal = _CASES["long_split"]
    wrapper, out, lse, (q_nope, q_pe, ckv, kpe, indptr, indices) = _run_case(
        kv_lens, qo_lens, causal, 64, 16, torch.float16, 3, joined=False, kv_dtype=torch.float8_e5m2, scales=(0.5, 2.0))
    assert wrapper.kernel == "sm90" and wrapper._kernel.work.num_merges > 0
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal, 0.5, 2.0)
    assert_close_out(out / 2.0, ref_out / 2.0, torch.float16)
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("k_scale", [0.3, 1e-30])
@pytest.mark.parametrize("heads", [16, 128])
def test_sm90_fp8_cache_with_queries_of_every_magnitude(monkeypatch: pytest.MonkeyPatch, heads: int,
                                                        k_scale: float) -> None:
    """bf16 queries whose heads span 0 and 1e-30 .. 1e5 (logits to ~1e5; see the README's logit range) over an e4m3
    cache, blocks cut by kv_len, a logit scale down to ~1e-31: the reference's result."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    kv_lens, qo_lens, causal = [300, 65, 1000], [1, 1, 1], False
    gen = torch.Generator().manual_seed(heads)
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, torch.float8_e4m3fn, "cuda", gen, joined=True)
    q_nope, q_pe = _queries(qo_lens, heads, torch.bfloat16, "cuda", gen)
    factors = torch.tensor([1e-30, 1e-3, 1.0, 3e3, 1e5, 30.0, 0.01, 0.0])[torch.arange(heads) % 8]
    q_nope, q_pe = (x * factors.to("cuda")[None, :, None].to(x.dtype) for x in (q_nope, q_pe))
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), indptr, indices, lens, heads, CKV, KPE, 16, causal, SM_SCALE, torch.bfloat16,
                 torch.float8_e4m3fn)
    out = torch.full((sum(qo_lens), heads, CKV), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((sum(qo_lens), heads), float("nan"), dtype=torch.float32, device="cuda")
    wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse, k_scale=k_scale, v_scale=1.7)
    assert wrapper.kernel == "sm90" and wrapper._kernel.narrow == (heads == 16)
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal, k_scale, 1.7)
    assert_close_out(out / 1.7, ref_out / 1.7, torch.bfloat16)
    assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
def test_batch_invariant_plans_do_not_split_and_keep_each_requests_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """batch_invariant=True: a long request alone (which would split), inside a large batch and beside a request of
    two query tokens (32 rows a tile: the narrow kernel's sub-tiles, not the 64-row kernel) gives the same bits."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    gen = torch.Generator().manual_seed(17)
    kv_lens = [3000] + [300] * 199
    ckv, kpe, indptr, indices, lens = _latent_cache(kv_lens, 16, torch.bfloat16, "cuda", gen, joined=True)
    q_nope, q_pe = _queries([1] * 200, 16, torch.bfloat16, "cuda", gen)
    workspace = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    outs = []
    for qo_lens in ([1], [1] * 200, [1, 2]):
        batch, tokens = len(qo_lens), sum(qo_lens)
        wrapper = jitattn.BatchMLAPagedAttentionWrapper(workspace)
        wrapper.plan(_indptr(qo_lens), indptr[: batch + 1], indices, lens[:batch], 16, CKV, KPE, 16, False,
                     SM_SCALE, torch.bfloat16, torch.bfloat16, batch_invariant=True)
        assert wrapper.kernel == "sm90" and wrapper._kernel.work.num_merges == 0
        out, lse = wrapper.run(q_nope[:tokens], q_pe[:tokens], ckv, kpe, return_lse=True)
        outs.append((out[:1].clone(), lse[:1].clone()))
    for out, lse in outs[1:]:
        assert torch.equal(outs[0][0], out) and torch.equal(outs[0][1], lse)
    split = jitattn.BatchMLAPagedAttentionWrapper(workspace)
    split.plan(_indptr([1]), indptr[:2], indices, lens[:1], 16, CKV, KPE, 16, False, SM_SCALE, torch.bfloat16,
               torch.bfloat16)
    assert split._kernel.work.num_merges > 0, "without batch_invariant the lone long request splits"


@pytest.mark.gpu
def test_an_fp8_cache_on_8_byte_rows_runs_on_the_prefill_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """An e4m3 latent cache with 584-byte rows (8-byte aligned, not the 16 the sm90 kernel's cp.async needs):
    auto plans the kernel, and run() gives the prefill kernels' exact result instead of an error."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "auto")
    gen = torch.Generator().manual_seed(21)
    kv_lens, qo_lens, causal, heads, page_size = [300, 17], [1, 3], True, 16, 16
    pages = [(n + page_size - 1) // page_size for n in kv_lens]
    pool = sum(pages) + 1
    wide = (torch.randn(pool, page_size, CKV + KPE + 8, generator=gen) * 2).to(torch.float8_e4m3fn).cuda()
    ckv, kpe = wide[..., :CKV], wide[..., CKV:CKV + KPE]
    indptr, indices = _indptr(pages), torch.randperm(pool, generator=gen)[: sum(pages)].to(torch.int32)
    q_nope, q_pe = _queries(qo_lens, heads, torch.bfloat16, "cuda", gen)
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(_indptr(qo_lens), indptr, indices, torch.tensor(kv_lens, dtype=torch.int32), heads, CKV, KPE,
                 page_size, causal, SM_SCALE, torch.bfloat16, torch.float8_e4m3fn)
    assert wrapper.kernel == "sm90"
    out = torch.full((sum(qo_lens), heads, CKV), float("nan"), dtype=torch.bfloat16, device="cuda")
    _, lse = wrapper.run(q_nope, q_pe, ckv, kpe, out=out, return_lse=True, k_scale=0.5, v_scale=1.5)
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal, 0.5, 1.5)
    assert_close_out(out / 1.5, ref_out / 1.5, torch.bfloat16)
    assert_close_lse(lse, ref_lse)
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    with pytest.raises(ValueError, match="ckv_cache"):
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out)


@pytest.mark.gpu
@pytest.mark.parametrize("heads,qo_lens,causal,max_len", [
    (128, [1] * 8, False, 1024),      # decode, enough tiles: no split
    (16, [1, 1], False, 20000),       # two long requests: split items and their merges
    (64, [2, 4, 1], True, 3000),      # speculative tokens, causal
], ids=["decode_h128", "split_h16", "speculative_h64"])
def test_sm90_kernel_under_cuda_graphs_replays_after_replanning(monkeypatch: pytest.MonkeyPatch, heads: int,
                                                                qo_lens: list[int], causal: bool, max_len: int) -> None:
    """A run() captured once on the sm90 kernel replays every later plan of the batch shape (new lengths,
    pages and splits, lengths 0 included) into the same output and lse: each replay equals the reference."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    gen = torch.Generator().manual_seed(heads + len(qo_lens))
    batch, page_size, dtype = len(qo_lens), 64, torch.bfloat16
    max_pages = batch * (-(-max_len // page_size))
    buffers = dict(qo_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                   kv_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                   kv_indices=torch.empty(max_pages, dtype=torch.int32, device="cuda"),
                   kv_len_arr=torch.empty(batch, dtype=torch.int32, device="cuda"))
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), True,
                                                    **buffers)
    cache = torch.randn(max_pages, page_size, CKV + KPE, generator=gen).to(dtype).cuda()
    ckv, kpe = cache[..., :CKV], cache[..., CKV:]
    q_nope, q_pe = _queries(qo_lens, heads, dtype, "cuda", gen)
    out = torch.empty(sum(qo_lens), heads, CKV, dtype=dtype, device="cuda")
    lse = torch.empty(sum(qo_lens), heads, dtype=torch.float32, device="cuda")
    splits = []

    def plan(kv_lens):
        pages = [-(-n // page_size) for n in kv_lens]
        indices = torch.randperm(max_pages, generator=gen)[: sum(pages)].to(torch.int32)
        indptr = _indptr(pages)
        wrapper.plan(_indptr(qo_lens), indptr, indices, torch.tensor(kv_lens, dtype=torch.int32), heads, CKV, KPE,
                     page_size, causal, SM_SCALE, dtype, dtype)
        assert wrapper.kernel == "sm90"
        splits.append(wrapper._kernel.work.num_merges)
        return indptr, indices

    plan([max_len] * batch)
    wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)  # loads the module outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)
    for trial in range(5):
        kv_lens = [0 if trial == 1 and r == 0 and not causal else  # an empty request too
                   q + int(torch.randint(0, max_len - q + 1, (1,), generator=gen)) for r, q in enumerate(qo_lens)]
        indptr, indices = plan(kv_lens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, causal)
        assert_close_out(out, ref_out, dtype)
        assert_close_lse(lse, ref_lse)
    if heads == 16:
        assert max(splits) > 0, "the case must replay split plans"
    with pytest.raises(ValueError, match="batch shape"):
        wrapper.plan(_indptr(qo_lens[:-1]), _indptr([1] * (batch - 1)), torch.zeros(batch, dtype=torch.int32),
                     torch.ones(batch - 1, dtype=torch.int32), heads, CKV, KPE, page_size, causal, SM_SCALE, dtype,
                     dtype)


@pytest.mark.gpu
def test_sm90_graph_captured_on_the_narrow_kernel_replays_wider_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA-graph wrapper whose first plan took the narrow kernel (8 heads, one token a request) keeps it: a later
    plan of the batch shape whose tiles hold more rows (one request's 4 tokens: 32 rows) replays as 16-row
    sub-tiles, equal to the reference."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    gen = torch.Generator().manual_seed(21)
    heads, page_size, dtype = 8, 16, torch.bfloat16
    ckv, kpe, indptr, indices, lens = _latent_cache([300, 41, 77, 2], page_size, dtype, "cuda", gen, joined=True)
    buffers = dict(qo_indptr=torch.empty(5, dtype=torch.int32, device="cuda"),
                   kv_indptr=torch.empty(5, dtype=torch.int32, device="cuda"),
                   kv_indices=torch.empty(indices.numel(), dtype=torch.int32, device="cuda"),
                   kv_len_arr=torch.empty(4, dtype=torch.int32, device="cuda"))
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"), True,
                                                    **buffers)
    q_nope, q_pe = _queries([1] * 4, heads, dtype, "cuda", gen)
    out = torch.empty(4, heads, CKV, dtype=dtype, device="cuda")
    lse = torch.empty(4, heads, dtype=torch.float32, device="cuda")
    graph = None
    for qo_lens in ([1, 1, 1, 1], [4, 0, 0, 0], [1, 1, 1, 1]):
        wrapper.plan(_indptr(qo_lens), indptr, indices, lens, heads, CKV, KPE, page_size, True, SM_SCALE, dtype, dtype)
        assert wrapper.kernel == "sm90" and wrapper._kernel.narrow
        if graph is None:
            wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)  # loads the module outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                wrapper.run(q_nope, q_pe, ckv, kpe, out=out, lse=lse)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, lens.tolist(), True)
        assert_close_out(out, ref_out, dtype)
        assert_close_lse(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_lens", [[], [100, 0]], ids=["no_requests", "no_query_tokens"])
def test_sm90_graph_plans_with_no_query_rows_capture_and_replay(monkeypatch: pytest.MonkeyPatch,
                                                                kv_lens: list[int]) -> None:
    """A CUDA-graph wrapper whose batch shape has no query rows: run(), capture and replay launch nothing."""
    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    batch, heads, page_size = len(kv_lens), 16, 64
    buffers = dict(qo_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                   kv_indptr=torch.empty(batch + 1, dtype=torch.int32, device="cuda"),
                   kv_indices=torch.empty(8, dtype=torch.int32, device="cuda"),
                   kv_len_arr=torch.empty(max(batch, 1), dtype=torch.int32, device="cuda"))
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(16 << 20, dtype=torch.uint8, device="cuda"), True,
                                                    **buffers)
    pages = [-(-n // page_size) for n in kv_lens]
    wrapper.plan(_indptr([0] * batch), _indptr(pages), torch.arange(sum(pages), dtype=torch.int32),
                 torch.tensor(kv_lens, dtype=torch.int32), heads, CKV, KPE, page_size, False, SM_SCALE, torch.bfloat16,
                 torch.bfloat16)
    assert wrapper.kernel == "sm90"
    cache = torch.randn(8, page_size, CKV + KPE, device="cuda").to(torch.bfloat16)
    q_nope = torch.empty(0, heads, CKV, dtype=torch.bfloat16, device="cuda")
    q_pe = torch.empty(0, heads, KPE, dtype=torch.bfloat16, device="cuda")
    out = wrapper.run(q_nope, q_pe, cache[..., :CKV], cache[..., CKV:])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        wrapper.run(q_nope, q_pe, cache[..., :CKV], cache[..., CKV:], out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert out.shape == (0, heads, CKV)


@pytest.mark.gpu
def test_sm90_traced_build_is_exact_and_its_stamps_ordered(monkeypatch: pytest.MonkeyPatch, fresh_registry) -> None:
    """mla TUNING trace=1 (tools/trace_mla.py): the traced kernel gives the reference's result, and the stamps of
    each traced KV block come in phase order in each warpgroup (block in, S issued, S done, P shared, P V issued,
    P V done, next block in; block in, loads issued, P received, P V issued, P V done, next block in), warpgroup 1
    receiving P after warpgroup 0 shared it, with the item's block count filled in."""
    import ctypes

    import numpy as np

    monkeypatch.setenv("JITATTN_MLA_KERNEL", "sm90")
    monkeypatch.setitem(family.TUNING, "trace", 1)
    lib = ctypes.CDLL(str(jitattn.load(kernel_spec(torch.bfloat16)).path))  # the traced module (a spec of its own)
    assert lib.jitattn_mla_trace_clear() == 0
    kv_lens, qo_lens = [1280 + 64 * (i % 3) for i in range(64)], [1] * 64  # 128 items of 20-22 blocks: no split
    wrapper, out, lse, (q_nope, q_pe, ckv, kpe, indptr, indices) = _run_case(
        kv_lens, qo_lens, False, 128, 64, torch.bfloat16, 11)
    assert wrapper.kernel == "sm90" and wrapper._kernel.work.num_merges == 0
    ref_out, ref_lse = _reference(q_nope, q_pe, ckv, kpe, indptr, indices, qo_lens, kv_lens, False)
    assert_close_out(out, ref_out, torch.bfloat16)
    assert_close_lse(lse, ref_lse)
    ctas, count, fields = (family.TRACE[k] for k in ("kTraceCtas", "kTraceCount", "kTraceFields"))
    raw = (ctypes.c_longlong * (ctas * count * fields))()
    assert lib.jitattn_mla_trace(ctypes.byref(raw)) == ctas
    t = np.frombuffer(raw, dtype=np.int64).reshape(ctas, count, fields)
    ran = t[(t[:, :, 0] > 0).all(axis=1)]
    assert len(ran) >= 64, "every CTA's first item has the traced blocks"
    for fields in ((0, 1, 2, 3, 4, 5), (6, 7, 8, 9, 10)):
        phases = ran[:, :, list(fields)]
        assert (np.diff(phases, axis=2) >= 0).all(), f"stamps {fields} out of phase order"
        assert (ran[:, 1:, fields[0]] >= ran[:, :-1, fields[-1]]).all(), "a block in before the last one was done"
    assert (ran[:, :, 8] >= ran[:, :, 3]).all(), "P received before it was shared"
    assert np.isin(ran[:, :, 11], [20, 21, 22]).all()

"""The cuda paged-decode kernel against the float64 reference, through ``launch_attention``.

Every test draws fresh random inputs (never zeros) and poisons the outputs
with NaN before the launch, so an unwritten element fails. ``GPU_SPECS`` lists
every spec these tests load, for the parallel pre-build.

The split-KV plan used here (``split_plan``) is the planner's formula without a window: request r
gets ``max(1, ceil(kv_len[r] / kv_chunk_size))`` chunks (under a window, more than the planner's, counted from the
window's first token: the trailing ones are empty, which the kernel must handle too), ``split_indptr`` is
their exclusive prefix sum, and the workspace needs ``4 * num_qo_heads * (head_dim_vo + 1) * split_indptr[batch]``
bytes (``jitattn.kernels.decode.split_workspace_bytes``).
"""

from __future__ import annotations

import math

import pytest
import torch

import jitattn
from jitattn import reference
from jitattn.runtime.launch import AttentionScalars, launch_attention
from jitattn.kernels.decode import TUNING as DECODE_TUNING, mma_eligible, split_workspace_bytes
from jitattn.jit import KernelError
from jitattn.kv_split import SHORT_ITEMS_MIN_BLOCKS_PER_SM
from jitattn.spec import KVLayout, PosEncoding, VariantSpec

pytestmark = pytest.mark.gpu

bf16, f16 = torch.bfloat16, torch.float16
e4m3, e5m2 = torch.float8_e4m3fn, torch.float8_e5m2
_DT = {bf16: "bf16", f16: "f16", e4m3: "e4m3", e5m2: "e5m2"}
_TOL = {bf16: 2e-2, f16: 4e-3}


def dspec(q=bf16, kv=None, hd=128, hdv=None, g=4, pos="none", swa=False, cap=False, layout="nhd") -> VariantSpec:
    kv = q if kv is None else kv
    return VariantSpec(
        op="decode", target="cuda", q_dtype=_DT[q], kv_dtype=_DT[kv], o_dtype=_DT[q], head_dim_qk=hd,
        head_dim_vo=hd if hdv is None else hdv, group_size=g, pos_encoding=pos, use_sliding_window=swa,
        use_logits_soft_cap=cap, kv_layout=layout, kv_storage="paged",
    )


# -- the specs every test below loads --------------------------------------------------------------
BASE = dspec()
HEAD_DIMS = {64: dspec(hd=64), 72: dspec(hd=72), 96: dspec(hd=96), 128: BASE, 256: dspec(hd=256),
             "192x128": dspec(hd=192, hdv=128),
             # tiny head dims: 16 on the tensor-core path, 8 and 24 (and RoPE, fp8) on the CUDA-core path
             8: dspec(hd=8), 16: dspec(hd=16), 24: dspec(hd=24), "16_rope": dspec(hd=16, pos="rope"),
             "8_e4m3_g1": dspec(hd=8, kv=e4m3, g=1), "24_f16_e5m2_hnd": dspec(q=f16, kv=e5m2, hd=24, layout="hnd")}
GROUPS = {1: dspec(g=1), 4: BASE, 5: dspec(g=5), 7: dspec(g=7), 8: dspec(g=8), 16: dspec(g=16),
          20: dspec(g=20), "mqa32": dspec(g=32)}  # 20: a block of 80 threads (not whole warps)
KV_TYPES = {
    "f16": dspec(q=f16),
    "bf16_e4m3": dspec(q=bf16, kv=e4m3),
    "f16_e5m2": dspec(q=f16, kv=e5m2),
    "bf16_e4m3_hd72_hnd": dspec(q=bf16, kv=e4m3, hd=72, layout="hnd"),  # 72-byte rows: 8-byte copies
    "f16_e5m2_hd256_hnd_g8": dspec(q=f16, kv=e5m2, hd=256, g=8, layout="hnd"),
}
# fp8 KV on the tensor-core path (head dims multiples of 32, group <= 16), across its index mappings.
FP8_MMA = {
    "e4m3_g1": dspec(kv=e4m3, g=1),
    "e5m2_bf16_g16_hd64": dspec(kv=e5m2, hd=64, g=16),
    "e4m3_f16_hd96_g7_hnd": dspec(q=f16, kv=e4m3, hd=96, g=7, layout="hnd"),
    "e4m3_192x128_g8": dspec(kv=e4m3, hd=192, hdv=128, g=8),
    "e4m3_alibi_window_cap": dspec(kv=e4m3, g=5, pos="alibi", swa=True, cap=True),
}
HND = dspec(layout="hnd")
# RoPE on the tensor-core path (head dims multiples of 32, 16-bit KV) and on the CUDA-core path (the others).
ROPE = {"bf16_hd128": dspec(pos="rope"), "f16_hd72_hnd": dspec(q=f16, hd=72, pos="rope", layout="hnd"),
        "e4m3_hd64_g5": dspec(kv=e4m3, hd=64, g=5, pos="rope"), "bf16_hd256_g2": dspec(hd=256, g=2, pos="rope"),
        "f16_hd64_g16": dspec(q=f16, hd=64, g=16, pos="rope"), "bf16_hd96_g1_hnd": dspec(hd=96, g=1, pos="rope", layout="hnd")}
# RoPE on the tensor-core path at long positions: the turned K goes to the mma as tf32; head dims, both
# 16-bit types, one and two head tiles (groups up to 8 and up to 16).
ROPE_MMA = {"bf16_hd128_g4": ROPE["bf16_hd128"], "f16_hd128_g8": dspec(q=f16, g=8, pos="rope"),
            "f16_hd64_g16": ROPE["f16_hd64_g16"], "bf16_hd96_g16": dspec(hd=96, g=16, pos="rope"),
            "f16_hd128_g16": dspec(q=f16, g=16, pos="rope"), "bf16_192x128_g8": dspec(hd=192, hdv=128, g=8, pos="rope")}
ALIBI = dspec(g=7, pos="alibi")
SWA = dspec(swa=True)
SOFTCAP = dspec(cap=True)
SOFTCAP_HD256 = dspec(hd=256, g=2, cap=True)  # gemma-2
# Head dim 256 across groups, layouts and axes: the CUDA-core path, or with TUNING mma_d256 the tensor-core path
# (16-bit KV, groups up to 8, no RoPE; 512-byte rows swizzled within each 128-byte line, one block per SM).
HD256 = {"bf16_g1": dspec(hd=256, g=1), "f16_g8_hnd_window": dspec(q=f16, hd=256, g=8, swa=True, layout="hnd"),
         "bf16_g5_alibi_cap": dspec(hd=256, g=5, pos="alibi", cap=True)}
# Specs whose module has the short-items layout (three blocks of two stages; at head dim 64 four blocks of three
# 64-token stages): head dims 64 / 128, 16-bit KV, no RoPE.
SHORT_ITEMS = {"bf16_g4": BASE, "f16_g1": dspec(q=f16, g=1), "bf16_hd64_g8": dspec(hd=64, g=8), "window": SWA,
               "hd64_g8_window": dspec(hd=64, g=8, swa=True),
               "softcap": SOFTCAP, "alibi_g7_hnd": dspec(g=7, pos="alibi", layout="hnd")}
COMBO = dspec(pos="rope", swa=True, cap=True)
COMBO_ALIBI = dspec(q=f16, hd=96, g=5, pos="alibi", swa=True, cap=True, layout="hnd")

GPU_SPECS: list[VariantSpec] = list(dict.fromkeys([
    BASE, *HEAD_DIMS.values(), *GROUPS.values(), *KV_TYPES.values(), *FP8_MMA.values(), HND, *ROPE.values(),
    *ROPE_MMA.values(), ALIBI, SWA, SOFTCAP, *SHORT_ITEMS.values(),
    SOFTCAP_HD256, *HD256.values(), COMBO, COMBO_ALIBI,
]))


# -- inputs -----------------------------------------------------------------------------------------
class Paged:
    """A random KV pool (pages handed out in random order) and its page table."""

    def __init__(self, lens, hkv, dqk, dvo, page_size, dtype, layout="nhd", fmt="tuple", gen=None,
                 spare=5, device="cuda"):
        self.lens, self.page_size, self.layout, self.hkv = list(lens), page_size, layout, hkv
        pages_per = [-(-n // page_size) for n in lens]
        total = sum(pages_per)
        pool = total + spare
        self.kv_indices = torch.randperm(pool, generator=gen)[:total].to(torch.int32).to(device)
        self.kv_indptr = torch.tensor([0] + torch.tensor(pages_per, dtype=torch.int64).cumsum(0).tolist(),
                                      dtype=torch.int32, device=device)
        self.kv_last_page_len = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in lens],
                                             dtype=torch.int32, device=device)

        def rand(shape):
            return (torch.randn(shape, generator=gen) * (2 if dtype in (e4m3, e5m2) else 1)).to(dtype).to(device)

        if fmt == "5d":
            assert dqk == dvo
            shape = (pool, 2, page_size, hkv, dqk) if layout == "nhd" else (pool, 2, hkv, page_size, dqk)
            self.cache = rand(shape)
            self.k, self.v = self.cache[:, 0], self.cache[:, 1]
        else:
            def shape(d):
                return (pool, page_size, hkv, d) if layout == "nhd" else (pool, hkv, page_size, d)
            self.k, self.v = rand(shape(dqk)), rand(shape(dvo))
            self.cache = (self.k, self.v)


def split_plan(kv_lens, chunk, num_qo_heads, head_dim_vo, device="cuda"):
    """(split_indptr int32 [batch + 1], workspace uint8) for kv_chunk_size ``chunk``."""
    counts = [max(1, -(-n // chunk)) for n in kv_lens]  # the ABI: every request has a chunk (an empty one too)
    indptr = [0]
    for c in counts:
        indptr.append(indptr[-1] + c)
    nbytes = split_workspace_bytes(max(indptr[-1], 1), num_qo_heads, head_dim_vo)
    workspace = torch.full((nbytes,), 0xFF, dtype=torch.uint8, device=device)  # NaN-filled floats
    return torch.tensor(indptr, dtype=torch.int32, device=device), workspace


def run_decode(spec, q, kv: Paged, *, window=-1, cap=0.0, sm_scale=None, rope_scale=1.0, rope_theta=1e4,
               k_scale=1.0, v_scale=1.0, chunk=0, o=None, lse=None, workspace=None, split_indptr=None, pos=None,
               short_items=False):
    module = jitattn.load(spec)
    batch, hq, dqk = q.shape
    dvo = kv.v.shape[-1]
    if o is None:
        o = torch.full((batch, hq, dvo), float("nan"), dtype=q.dtype, device=q.device)
    if lse is None:
        lse = torch.full((batch, hq), float("nan"), dtype=torch.float32, device=q.device)
    if chunk and workspace is None:
        split_indptr, workspace = split_plan(kv.lens, chunk, hq, dvo)
    scalars = AttentionScalars(
        causal=False, pos_encoding=spec.pos_encoding if pos is None else pos, window_left=window,
        sm_scale=1.0 / math.sqrt(dqk) if sm_scale is None else sm_scale, logits_soft_cap=cap,
        rope_scale=rope_scale, rope_theta=rope_theta,
    )
    launch_attention(
        module, q=q, k=kv.k, v=kv.v, o=o, lse=lse,
        qo_indptr=torch.arange(batch + 1, dtype=torch.int32, device=q.device), kv_indptr=kv.kv_indptr,
        kv_indices=kv.kv_indices, kv_last_page_len=kv.kv_last_page_len, page_size=kv.page_size,
        kv_layout=KVLayout.parse(kv.layout, "kv_layout"), custom_mask=None, mask_indptr=None,
        num_kv_heads=kv.hkv, scalars=scalars, k_scale=k_scale, v_scale=v_scale,
        workspace=workspace, split_indptr=split_indptr, kv_chunk_size=chunk, short_items=short_items,
    )
    torch.cuda.synchronize()
    return o, lse


def ref_decode(spec, q, kv: Paged, *, window=-1, cap=0.0, sm_scale=None, rope_scale=1.0, rope_theta=1e4,
               k_scale=1.0, v_scale=1.0):
    pos = {"none": "NONE", "rope": "ROPE_LLAMA", "alibi": "ALIBI"}[spec.pos_encoding.value]
    return reference.batch_decode_paged(
        q, kv.cache, kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, kv_layout=kv.layout.upper(),
        sm_scale=sm_scale, window_left=window, logits_soft_cap=cap if cap > 0 else None, pos_encoding_mode=pos,
        rope_scale=rope_scale, rope_theta=rope_theta, k_scale=k_scale, v_scale=v_scale,
    )


def check(out, lse, ref, dtype, lse_atol=2e-3):
    ref_o, ref_lse = ref
    out, lse = out.float().cpu(), lse.cpu()
    assert not torch.isnan(out).any(), "output has NaN (unwritten or invalid)"
    assert not torch.isnan(lse).any(), "lse has NaN (unwritten or invalid)"
    tol = _TOL[dtype]
    torch.testing.assert_close(out, ref_o.float().cpu(), atol=tol, rtol=tol)
    ref_lse = ref_lse.cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse -inf pattern differs"
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[finite], ref_lse[finite], atol=lse_atol, rtol=1e-4)


def check_case(spec, lens, hkv, page_size, *, seed, layout=None, fmt="tuple", chunks=(0,), q_mult=1.0, **kw):
    """Random q (times ``q_mult``) and KV for ``spec``; run the kernel (each chunk size) and compare with the
    reference."""
    gen = torch.Generator().manual_seed(seed)
    layout = layout or spec.kv_layout.value
    kv = Paged(lens, hkv, spec.head_dim_qk, spec.head_dim_vo, page_size, spec.kv_dtype.torch_dtype, layout, fmt, gen)
    q = torch.randn(len(lens), hkv * spec.group_size, spec.head_dim_qk, generator=gen) * q_mult
    q = q.to(spec.q_dtype.torch_dtype)
    q = q.cuda()
    if spec.kv_dtype.is_fp8:
        kw.setdefault("k_scale", 0.7)
        kw.setdefault("v_scale", 1.3)
    ref = ref_decode(spec, q, kv, **kw)
    outs = []
    for chunk in chunks:
        o, lse = run_decode(spec, q, kv, chunk=chunk, **kw)
        check(o, lse, ref, spec.q_dtype.torch_dtype)
        for r, n in enumerate(lens):
            if n == 0:
                assert torch.all(o[r] == 0) and torch.all(torch.isneginf(lse[r])), "empty request: o = 0, lse = -inf"
        outs.append((o, lse))
    return outs


LENS = [1, 0, 37, 300, 16, 129]


# -- tests ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("hd", list(HEAD_DIMS))
def test_head_dims(hd):
    spec = HEAD_DIMS[hd]
    check_case(spec, LENS, 2, 16, seed=1, chunks=(0, 64))


@pytest.mark.parametrize("g", list(GROUPS))
def test_group_sizes(g):
    spec = GROUPS[g]
    hkv = 1 if g == "mqa32" else 2
    check_case(spec, LENS, hkv, 16, seed=2, chunks=(0, 48))


@pytest.mark.parametrize("name", list(KV_TYPES))
def test_kv_dtypes(name):
    spec = KV_TYPES[name]
    check_case(spec, LENS, 2, 16, seed=3, chunks=(0, 40), k_scale=0.6, v_scale=1.7)


@pytest.mark.parametrize("name", list(FP8_MMA))
def test_fp8_kv_on_tensor_cores(name):
    spec = FP8_MMA[name]
    assert mma_eligible(spec), "these cases are meant for the tensor-core path"
    kw = dict(window=45, cap=25.0) if spec.use_sliding_window else {}
    check_case(spec, LENS, 2 if spec.group_size > 4 else 3, 16, seed=31, chunks=(0, 40), k_scale=0.6, v_scale=1.7,
               **kw)
    check_case(spec, [1000, 2], 1, 64, seed=32, chunks=(0, 128), k_scale=1.9, v_scale=0.4, **kw)


@pytest.mark.parametrize("q_mult", [3e4, 1e-3])
def test_fp8_kv_bf16_queries_of_any_scale(q_mult):
    # with fp8 KV the tensor cores run in f16: bf16 queries past the f16 range (or tiny ones) are
    # scaled by a power of two first; sm_scale keeps the logits O(1) so the test sees the scaling
    spec = FP8_MMA["e4m3_g1"]
    check_case(spec, LENS, 2, 16, seed=33, chunks=(0, 64), sm_scale=1.0 / (q_mult * spec.head_dim_qk ** 0.5),
               q_mult=q_mult)


@pytest.mark.parametrize("hd", [128, 72])  # the tensor-core and the CUDA-core path
def test_queries_of_every_magnitude(hd):
    """Query heads scaled 0, 1e-30 .. 1e30 (logits to ~1e31: one-hot rows), split and not: the reference's output
    and LSE, no inf or NaN."""
    spec = HEAD_DIMS[hd]
    gen = torch.Generator().manual_seed(34)
    kv = Paged(LENS, 2, hd, hd, 16, bf16, "nhd", "tuple", gen)
    factors = torch.tensor([0.0, 1e-30, 1e-3, 1.0, 3e3, 1e5, 1e12, 1e30])
    q = (torch.randn(len(LENS), 2 * spec.group_size, hd, generator=gen) * factors[:, None]).to(bf16).cuda()
    ref = ref_decode(spec, q, kv)
    for chunk in (0, 64):
        check(*run_decode(spec, q, kv, chunk=chunk), ref, bf16)


@pytest.mark.parametrize("layout", ["nhd", "hnd"])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_layouts_page_sizes_5d_cache(layout, page_size):
    spec = BASE if layout == "nhd" else HND
    check_case(spec, [5, 1, 0, 200, 64, 65], 4, page_size, seed=4 + page_size, fmt="5d", chunks=(0, 32))


@pytest.mark.parametrize("name", list(ROPE))
def test_rope(name):
    spec = ROPE[name]
    check_case(spec, LENS, 2, 16, seed=5, chunks=(0, 64))
    check_case(spec, [700, 3], 2, 64, seed=6, rope_scale=2.5, rope_theta=5e5, chunks=(0, 128))


def test_rope_paths():
    # which path each RoPE case takes is part of what the cases are for
    assert [name for name, spec in ROPE.items() if mma_eligible(spec)] == ["bf16_hd128", "f16_hd64_g16", "bf16_hd96_g1_hnd"]


def test_rope_long_positions():
    # K rotated at positions up to 20k (angles far past 2 pi), split and not
    check_case(ROPE["bf16_hd128"], [20000, 4100, 1], 1, 16, seed=17, chunks=(0, 1024, 4096), rope_theta=5e5)


@pytest.mark.parametrize("name", list(ROPE_MMA))
def test_rope_tensor_cores_long_positions(name):
    # positions up to 32k: angles up to ~32k rad at frequency 1 (rope_theta 1e4), ~64k at 2 (rope_scale
    # 0.5); larger queries (peakier softmax) in the second case leave the LSE less averaging of errors
    spec = ROPE_MMA[name]
    assert mma_eligible(spec), "these cases are meant for the tensor-core path"
    check_case(spec, [32768, 7001, 2], 1, 16, seed=41, chunks=(0, 4096))
    check_case(spec, [32000, 300], 2, 64, seed=42, chunks=(0, 2048), rope_scale=0.5, rope_theta=5e5, q_mult=2.0)


def test_softcap_head_dim_256():
    check_case(SOFTCAP_HD256, LENS, 4, 16, seed=18, cap=30.0, chunks=(0, 64))
    check_case(SOFTCAP_HD256, [3000, 2], 2, 16, seed=19, cap=50.0, chunks=(0, 256))


def test_head_dim_256_paths():
    # which path each head-dim-256 case takes is part of what the cases are for
    on = {**DECODE_TUNING, "mma_d256": 1}
    assert all(mma_eligible(spec, on) for spec in (SOFTCAP_HD256, HEAD_DIMS[256], *HD256.values()))
    assert not any(mma_eligible(spec, on) for spec in (ROPE["bf16_hd256_g2"], KV_TYPES["f16_e5m2_hd256_hnd_g8"],
                                                       dspec(hd=256, g=16)))
    assert mma_eligible(SOFTCAP_HD256) == bool(DECODE_TUNING["mma_d256"])


@pytest.mark.parametrize("name", list(HD256))
def test_head_dim_256(name):
    spec = HD256[name]
    kw = {"window": 700} if spec.use_sliding_window else {}
    kw.update({"cap": 30.0} if spec.use_logits_soft_cap else {})
    check_case(spec, LENS, 2, 16, seed=43, chunks=(0, 64), **kw)
    check_case(spec, [3000, 2, 0], 3, 16, seed=44, chunks=(0, 256), **kw)


def test_split_counters_reset_between_launches():
    # the chunk counters the last block of each request resets: the same split plan launched again and
    # again (with a new query each time) must merge right every time
    spec = GROUPS[8]
    gen = torch.Generator().manual_seed(20)
    kv = Paged([900, 1, 0, 513], 2, 128, 128, 16, bf16, gen=gen)
    split_indptr, workspace = split_plan(kv.lens, 128, 16, 128)
    counters = torch.zeros(4 * 2, dtype=torch.int32, device="cuda")
    module = jitattn.load(spec)
    scalars = AttentionScalars(False, PosEncoding.NONE, -1, 1.0 / math.sqrt(128), 0.0, 1.0, 1e4)
    for _ in range(3):
        q = torch.randn(4, 16, 128, generator=gen).to(bf16).cuda()
        o = torch.full((4, 16, 128), float("nan"), dtype=bf16, device="cuda")
        lse = torch.full((4, 16), float("nan"), device="cuda")
        launch_attention(
            module, q=q, k=kv.k, v=kv.v, o=o, lse=lse, qo_indptr=torch.arange(5, dtype=torch.int32, device="cuda"),
            kv_indptr=kv.kv_indptr, kv_indices=kv.kv_indices, kv_last_page_len=kv.kv_last_page_len, page_size=16,
            kv_layout=KVLayout.NHD, custom_mask=None, mask_indptr=None, num_kv_heads=2, scalars=scalars,
            workspace=workspace, split_indptr=split_indptr, kv_chunk_size=128, split_counters=counters,
        )
        check(o, lse, ref_decode(spec, q, kv), bf16)
        assert torch.all(counters == 0), "the merging blocks leave the counters zeroed"


def test_alibi():
    check_case(ALIBI, LENS, 3, 16, seed=7, chunks=(0, 50))  # 21 query heads: non-power-of-two slopes


@pytest.mark.parametrize("window", [0, 1, 5, 63, 64, 1000])
def test_sliding_window(window):
    check_case(SWA, LENS, 2, 16, seed=8, window=window, chunks=(0, 32))


def test_sliding_window_disabled_at_run_time():
    check_case(SWA, LENS, 2, 16, seed=9, window=-1, chunks=(0, 64))


@pytest.mark.parametrize("cap", [0.0, 1.0, 30.0])
def test_softcap(cap):
    check_case(SOFTCAP, LENS, 2, 16, seed=10, cap=cap, sm_scale=0.3, chunks=(0, 64))


def test_rope_window_softcap():
    check_case(COMBO, LENS, 2, 16, seed=11, window=40, cap=20.0, rope_theta=5e4, chunks=(0, 32))


def test_alibi_window_softcap_hnd():
    check_case(COMBO_ALIBI, LENS, 2, 64, seed=12, window=77, cap=15.0, chunks=(0, 64))


@pytest.mark.parametrize("name", list(SHORT_ITEMS))
def test_short_items_layout_gives_the_default_layouts_bits(name):
    """The short-items layout (more resident blocks; fewer stages, or at head dim 64 shorter ones whose tokens each
    warp takes in the default layout's order) computes every tile as the default one does:
    against the reference, and bit for bit the default layout's output, whole and split (the split-KV merge
    stages through its smaller shared memory)."""
    spec = SHORT_ITEMS[name]
    assert jitattn.jit.has_short_items_layout(spec)
    lens = [1, 0, 37, 300, 16, 129, 64, 65, 1000, 2]
    gen = torch.Generator().manual_seed(61)
    kv = Paged(lens, 2, spec.head_dim_qk, spec.head_dim_vo, 16, spec.kv_dtype.torch_dtype, spec.kv_layout.value,
               gen=gen)
    q = torch.randn(len(lens), 2 * spec.group_size, spec.head_dim_qk, generator=gen)
    q = q.to(spec.q_dtype.torch_dtype).cuda()
    kw = {"window": 40} if spec.use_sliding_window else {"cap": 20.0} if spec.use_logits_soft_cap else {}
    ref = ref_decode(spec, q, kv, **kw)
    for chunk in (0, 64):
        default = run_decode(spec, q, kv, chunk=chunk, **kw)
        short = run_decode(spec, q, kv, chunk=chunk, short_items=True, **kw)
        check(*short, ref, spec.q_dtype.torch_dtype)
        assert torch.equal(short[0], default[0]) and torch.equal(short[1], default[1])


def test_short_items_is_refused_by_a_module_without_that_layout():
    spec = ROPE["bf16_hd128"]
    assert not jitattn.jit.has_short_items_layout(spec)
    gen = torch.Generator().manual_seed(3)
    kv = Paged([5, 9], 2, 128, 128, 16, bf16, gen=gen)
    q = torch.randn(2, 8, 128, generator=gen).to(bf16).cuda()
    with pytest.raises(KernelError, match=r"short_items=1 must be 0 \(this module has one layout\)"):
        run_decode(spec, q, kv, short_items=True)


def test_a_plan_of_many_short_requests_takes_the_short_items_layout():
    """The wrapper's plan marks an unsplit batch of at least SHORT_ITEMS_MIN_BLOCKS_PER_SM blocks per SM (here 256
    or more requests x 8 KV heads) for the short-items layout, and its output matches the reference; a small
    batch keeps the default layout."""
    gen = torch.Generator().manual_seed(67)
    hkv, g, d, page = 8, 4, 128, 16
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    batch = max(256, -(-SHORT_ITEMS_MIN_BLOCKS_PER_SM * sms // hkv))
    lens = torch.randint(1, 400, (batch,), generator=gen).tolist()
    kv = Paged(lens, hkv, d, d, page, bf16, fmt="5d", gen=gen)
    q = torch.randn(batch, hkv * g, d, generator=gen).to(bf16).cuda()
    wrapper = jitattn.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device="cuda"))
    wrapper.plan(kv.kv_indptr, kv.kv_indices, kv.kv_last_page_len, hkv * g, hkv, d, page, q_data_type=bf16)
    assert wrapper._plan.split.short_items and wrapper._plan.launch.params.short_items == 1
    out, lse = wrapper.run(q, kv.cache, return_lse=True)
    torch.cuda.synchronize()
    check(out, lse, ref_decode(BASE, q, kv), bf16)
    small = Paged(lens[:4], hkv, d, d, page, bf16, fmt="5d", gen=gen)
    wrapper.plan(small.kv_indptr, small.kv_indices, small.kv_last_page_len, hkv * g, hkv, d, page, q_data_type=bf16)
    assert not wrapper._plan.split.short_items and wrapper._plan.launch.params.short_items == 0


def test_split_matches_no_split():
    outs = check_case(GROUPS[8], [2000, 1, 0, 4097], 2, 16, seed=13, chunks=(0, 256, 100, 1))
    base_o, base_lse = outs[0]
    for o, lse in outs[1:]:
        torch.testing.assert_close(o.float(), base_o.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse, base_lse, atol=1e-4, rtol=1e-5)


def test_many_requests_split():
    # more requests than threads in a block: the chunk -> request search takes several rounds
    gen = torch.Generator().manual_seed(14)
    lens = torch.randint(0, 90, (333,), generator=gen).tolist()
    check_case(BASE, lens, 1, 16, seed=15, chunks=(0, 16, 1000))


def test_strided_q_from_fused_qkv():
    spec = GROUPS[5]
    gen = torch.Generator().manual_seed(16)
    hkv, d = 2, spec.head_dim_qk
    hq = hkv * spec.group_size
    kv = Paged(LENS, hkv, d, d, 16, bf16, "nhd", "5d", gen)
    qkv = torch.randn(len(LENS), (hq + 2 * hkv) * d, generator=gen).to(bf16).cuda()
    q = qkv[:, : hq * d].view(len(LENS), hq, d)
    assert not q.is_contiguous()
    ref = ref_decode(spec, q.contiguous(), kv)
    for chunk in (0, 64):
        o, lse = run_decode(spec, q, kv, chunk=chunk)
        check(o, lse, ref, bf16)


def test_strided_output():
    gen = torch.Generator().manual_seed(17)
    kv = Paged(LENS, 2, 128, 128, 16, bf16, "nhd", "tuple", gen)
    q = torch.randn(len(LENS), 8, 128, generator=gen).to(bf16).cuda()
    o_full = torch.full((len(LENS), 8, 256), float("nan"), dtype=bf16, device="cuda")
    lse_full = torch.full((8, len(LENS)), float("nan"), device="cuda")
    o, lse = o_full[:, :, 64:192], lse_full.t()
    ref = ref_decode(BASE, q, kv)
    run_decode(BASE, q, kv, o=o, lse=lse)
    check(o, lse, ref, bf16)
    assert torch.isnan(o_full[:, :, :64]).all() and torch.isnan(o_full[:, :, 192:]).all(), "wrote outside o"


def test_single_request_contiguous_kv_as_one_page():
    gen = torch.Generator().manual_seed(18)
    kv_len, hkv = 777, 2
    k = torch.randn(kv_len, hkv, 128, generator=gen).to(bf16).cuda()
    v = torch.randn(kv_len, hkv, 128, generator=gen).to(bf16).cuda()
    q = torch.randn(1, 8, 128, generator=gen).to(bf16).cuda()
    kv = Paged([kv_len], hkv, 128, 128, kv_len, bf16, "nhd", "tuple", gen, spare=0)
    kv.k, kv.v = k.unsqueeze(0), v.unsqueeze(0)
    kv.cache = (kv.k, kv.v)
    kv.kv_indices = torch.zeros(1, dtype=torch.int32, device="cuda")
    ref = reference.single_attention(q, k, v)
    for chunk in (0, 128):
        o, lse = run_decode(BASE, q, kv, chunk=chunk)
        check(o, lse, ref, bf16)


def test_lse_optional():
    gen = torch.Generator().manual_seed(19)
    kv = Paged(LENS, 2, 128, 128, 16, bf16, "nhd", "tuple", gen)
    q = torch.randn(len(LENS), 8, 128, generator=gen).to(bf16).cuda()
    ref = ref_decode(BASE, q, kv)
    module = jitattn.load(BASE)
    for chunk in (0, 64):
        o = torch.full((len(LENS), 8, 128), float("nan"), dtype=bf16, device="cuda")
        sp, ws = split_plan(LENS, chunk, 8, 128) if chunk else (None, None)
        launch_attention(
            module, q=q, k=kv.k, v=kv.v, o=o, lse=None,
            qo_indptr=torch.arange(len(LENS) + 1, dtype=torch.int32, device="cuda"), kv_indptr=kv.kv_indptr,
            kv_indices=kv.kv_indices, kv_last_page_len=kv.kv_last_page_len, page_size=16, kv_layout=KVLayout.NHD,
            custom_mask=None, mask_indptr=None, num_kv_heads=2,
            scalars=AttentionScalars(False, PosEncoding.NONE, -1, 128 ** -0.5, 0.0, 1.0, 1e4),
            workspace=ws, split_indptr=sp, kv_chunk_size=chunk,
        )
        torch.cuda.synchronize()
        torch.testing.assert_close(o.float().cpu(), ref[0].cpu(), atol=2e-2, rtol=2e-2)


def test_empty_batch():
    gen = torch.Generator().manual_seed(20)
    kv = Paged([], 2, 128, 128, 16, bf16, "nhd", "tuple", gen)
    q = torch.randn(0, 8, 128, generator=gen).to(bf16).cuda()
    o, lse = run_decode(BASE, q, kv)
    assert o.shape == (0, 8, 128)


def test_large_pool_64bit_offsets():
    # A pool over 8 GB with the used pages at its top: element offsets exceed 2^32.
    page_size, hkv, d = 16, 8, 128
    page_elems = 2 * page_size * hkv * d
    pool = (9 << 30) // (page_elems * 2) + 1
    assert pool * page_elems > 2 ** 32
    cache = torch.empty((pool, 2, page_size, hkv, d), dtype=bf16, device="cuda")
    gen = torch.Generator().manual_seed(21)
    lens = [40, 17, 1, 33]
    pages_per = [-(-n // page_size) for n in lens]
    total = sum(pages_per)
    top = torch.arange(pool - 1, pool - 1 - total, -1, dtype=torch.int64)
    top = top[torch.randperm(total, generator=gen)]
    cache[top.cuda()] = torch.randn((total, 2, page_size, hkv, d), generator=gen).to(bf16).cuda()
    kv = Paged(lens, hkv, d, d, page_size, bf16, "nhd", "tuple", gen, spare=0)
    kv.cache, kv.k, kv.v = cache, cache[:, 0], cache[:, 1]
    kv.kv_indices = top.to(torch.int32).cuda()
    q = torch.randn(len(lens), hkv * 4, d, generator=gen).to(bf16).cuda()
    ref = ref_decode(BASE, q, kv)
    for chunk in (0, 16):
        o, lse = run_decode(BASE, q, kv, chunk=chunk)
        check(o, lse, ref, bf16)
    del cache, kv
    torch.cuda.empty_cache()


def test_errors_are_reported():
    gen = torch.Generator().manual_seed(22)
    kv = Paged([10, 20], 2, 128, 128, 16, bf16, "nhd", "tuple", gen)
    q = torch.randn(2, 6, 128, generator=gen).to(bf16).cuda()  # 6 heads: group 3, module is group 4
    with pytest.raises(KernelError, match="group_size"):
        run_decode(BASE, q, kv)
    q = torch.randn(2, 8, 128, generator=gen).to(bf16).cuda()
    tiny = torch.empty(16, dtype=torch.uint8, device="cuda")
    sp = torch.tensor([0, 1, 2], dtype=torch.int32, device="cuda")
    with pytest.raises(KernelError, match="workspace too small"):
        run_decode(BASE, q, kv, chunk=16, workspace=tiny, split_indptr=sp)
    with pytest.raises(KernelError, match="pos_encoding"):
        run_decode(ROPE["bf16_hd128"], q, kv, pos=PosEncoding.NONE)


def test_workspace_smaller_than_plan_gives_nan():
    # The kernel cannot see split_indptr on the host; an undersized workspace must not corrupt memory
    # and must not pass silently.
    gen = torch.Generator().manual_seed(23)
    kv = Paged([100, 100], 2, 128, 128, 16, bf16, "nhd", "tuple", gen)
    q = torch.randn(2, 8, 128, generator=gen).to(bf16).cuda()
    sp, _ = split_plan(kv.lens, 10, 8, 128)  # 20 chunks
    guard = torch.full((split_workspace_bytes(20, 8, 128),), 0x7F, dtype=torch.uint8, device="cuda")
    ws = guard[: split_workspace_bytes(5, 8, 128)]
    o, lse = run_decode(BASE, q, kv, chunk=10, workspace=ws, split_indptr=sp)
    assert torch.isnan(o.float()).all() and torch.isnan(lse).all()
    assert (guard[ws.numel():] == 0x7F).all(), "wrote past the workspace"

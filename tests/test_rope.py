"""The RoPE functions (jitattn.ops.rope, FlashInfer's apply_rope* family) against the float64 reference.

q and k are strided views of one fused qkv buffer (as serving engines pass them), filled with fresh
random data each run; positions are random too (the seed is in every failure message: set
JITATTN_TEST_SEED to replay one). Out-of-place outputs are allocated poisoned (NaN), so an element
the kernel does not write fails the comparison; in-place runs must leave every byte they do not
own (the v heads, the dimensions past rotary_dim) untouched. Each test runs on the cpu target and,
marked ``gpu``, on cuda.
"""

from __future__ import annotations

import os
import random
import shutil

import pytest
import torch

import jitattn
from jitattn import reference as ref
from jitattn.kernels.rope import ROPE
from jitattn.jit import KernelError, load
from jitattn.runtime.rope import Angles, Positions, rotate
from jitattn.spec import VariantSpec
from jitattn.spec_text import parse_spec_text

SEED = int(os.environ.get("JITATTN_TEST_SEED", random.randrange(2**31)))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
GPU_SPECS = [VariantSpec(op="rope", target="cuda", q_dtype=d) for d in DTYPES] + [
    VariantSpec(op="rope", target="cuda", q_dtype=a, o_dtype=b) for a, b in (("bf16", "f16"), ("f16", "bf16"))]
# Output rounding (half an ulp of the dtype at |x| ~ 4) plus float32 angles at positions below ~600.
TOLERANCE = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SOURCES = ["indptr", "pos_ids", "indptr_llama31", "pos_ids_llama31", "cos_sin_cache"]
# (head_dim, rotary_dim, num_q_heads, num_k_heads): full and partial rotation, MHA and GQA/MQA.
SHAPES = [(64, 64, 4, 4), (128, 64, 8, 2), (256, 256, 4, 1), (256, 192, 2, 2), (16, 16, 3, 1), (16, 8, 2, 2)]
LLAMA31 = dict(low_freq_factor=1, high_freq_factor=4, old_context_len=8192)  # FlashInfer's defaults
CACHE_ROWS = 600


def _dtype_id(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((SEED * 1000003 + salt) % 2**63)


class Case:
    """A ragged batch (one request empty) of q/k heads viewed out of a fused [nnz, (Hq + 2 Hk) * D] buffer."""

    def __init__(self, device, dtype, head_dim, rotary_dim, num_q_heads, num_k_heads, *, salt=0,
                 index_dtype=torch.int32):
        g = _gen(salt)
        self.salt, self.head_dim, self.rotary_dim = salt, head_dim, rotary_dim
        self.hq, self.hk = num_q_heads, num_k_heads
        lens = torch.randint(1, 9, (4,), generator=g)
        lens[2] = 0
        self.nnz = int(lens.sum())
        self.qkv = (torch.randn(self.nnz, (num_q_heads + 2 * num_k_heads) * head_dim, generator=g) * 2).to(dtype)
        self.qkv = self.qkv.to(device)
        self.indptr = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)]).to(index_dtype).to(device)
        self.offsets = torch.randint(0, 500, (4,), generator=g).to(index_dtype).to(device)
        self.pos_ids = torch.randint(0, CACHE_ROWS, (self.nnz,), generator=g).to(index_dtype).to(device)
        wide = ref.rope.cos_sin_cache(CACHE_ROWS, rotary_dim, 1e4)
        # Rows of the table as a strided view (a wider buffer), as a slice of a model's cache would be.
        self.table = torch.cat([wide, torch.full((CACHE_ROWS, 6), float("nan"))], dim=1)[:, :rotary_dim].to(device)

    @property
    def q(self) -> torch.Tensor:
        return self.qkv[:, : self.hq * self.head_dim].view(self.nnz, self.hq, self.head_dim)

    @property
    def k(self) -> torch.Tensor:
        return self.qkv[:, self.hq * self.head_dim:(self.hq + self.hk) * self.head_dim].view(
            self.nnz, self.hk, self.head_dim)

    def positions(self, source: str) -> torch.Tensor:
        if source.startswith("indptr"):
            return ref.rope.positions_from_indptr(self.indptr, self.offsets)
        return self.pos_ids.cpu()

    def expected(self, source: str, interleave: bool) -> tuple[torch.Tensor, torch.Tensor]:
        pos = self.positions(source)
        if source == "cos_sin_cache":
            return tuple(ref.rope.apply_rope_cos_sin_cache(x, pos, self.table, interleave) for x in (self.q, self.k))
        kwargs = _angle_kwargs(source)
        llama31 = LLAMA31 if "llama31" in source else None
        return tuple(ref.rope.apply_rope(x, pos, self.rotary_dim, interleave, kwargs["rope_scale"],
                                         kwargs["rope_theta"], llama31) for x in (self.q, self.k))

    def where(self, what: str) -> str:
        return f"{what} (seed {SEED}, salt {self.salt})"


def _angle_kwargs(source: str) -> dict:
    if "llama31" in source:
        return dict(rope_scale=8, rope_theta=5e5)  # FlashInfer's llama31 defaults: the calls below omit them
    return dict(rope_scale=1, rope_theta=1e4) if source == "indptr" else dict(rope_scale=4.0, rope_theta=5e5)


def run(case: Case, source: str, interleave: bool, inplace: bool):
    """Call the public function for ``source``; returns the rotated (q, k) as [nnz, heads, head_dim]."""
    q, k, rot = case.q, case.k, case.rotary_dim
    suffix = "_inplace" if inplace else ""
    if source == "cos_sin_cache":
        query = case.qkv[:, : case.hq * case.head_dim]
        key = case.qkv[:, case.hq * case.head_dim:(case.hq + case.hk) * case.head_dim]
        fn = getattr(jitattn, "apply_rope_with_cos_sin_cache" + suffix)
        out = fn(case.pos_ids, query, key, case.head_dim, case.table, is_neox=not interleave)
        query, key = (query, key) if inplace else out
        return query.view(case.nnz, case.hq, case.head_dim), key.view(case.nnz, case.hk, case.head_dim)
    name = "apply_llama31_rope" if "llama31" in source else "apply_rope"
    positions = (case.indptr, case.offsets) if source.startswith("indptr") else (case.pos_ids,)
    if source.startswith("pos_ids"):
        name += "_pos_ids"
    angles = {} if "llama31" in source else _angle_kwargs(source)
    out = getattr(jitattn, name + suffix)(q, k, *positions, rotary_dim=rot, interleave=interleave, **angles)
    if inplace:
        assert out is None
        return q, k
    return out


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Every tensor torch.empty_like makes during the test starts as NaN; counts them."""
    made = []
    empty_like = torch.empty_like

    def poisoned(*args, **kwargs):
        t = empty_like(*args, **kwargs)
        made.append(t.fill_(float("nan")))
        return t

    monkeypatch.setattr(torch, "empty_like", poisoned)
    return made


def _assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(got.cpu().double(), want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


# --------------------------------------------------------------------------- #
# Results against the reference
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "hd{}_rot{}_q{}_k{}".format(*s))
@pytest.mark.parametrize("source", SOURCES)
def test_rope_matches_reference(device, dtype, interleave, shape, source, poisoned_outputs):
    case = Case(device, dtype, *shape, salt=hash((str(dtype), interleave, shape, source)) % 10**6)
    before = case.qkv.clone()
    want_q, want_k = case.expected(source, interleave)
    got_q, got_k = run(case, source, interleave, inplace=False)
    assert len(poisoned_outputs) == 2 and got_q.dtype == dtype and got_k.dtype == dtype
    assert tuple(got_q.shape) == tuple(case.q.shape) and tuple(got_k.shape) == tuple(case.k.shape)
    _assert_close(got_q, want_q, dtype, case.where(f"q, {source}"))
    _assert_close(got_k, want_k, dtype, case.where(f"k, {source}"))
    rot = shape[1]
    assert torch.equal(got_q[..., rot:], case.q[..., rot:]), case.where("q's unrotated dimensions are copied")
    assert torch.equal(got_k[..., rot:], case.k[..., rot:]), case.where("k's unrotated dimensions are copied")
    assert torch.equal(case.qkv, before), case.where("the inputs are left as they were")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
@pytest.mark.parametrize("source", SOURCES)
def test_inplace_equals_out_of_place(device, dtype, interleave, source):
    """The _inplace twin writes the same bits into q and k, and nothing else of the qkv buffer."""
    case = Case(device, dtype, 128, 96, 4, 2, salt=17 + SOURCES.index(source))
    want_q, want_k = (t.clone() for t in run(case, source, interleave, inplace=False))
    before = case.qkv.clone()
    got_q, got_k = run(case, source, interleave, inplace=True)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k), case.where(f"in place, {source}")
    v_from = (case.hq + case.hk) * case.head_dim
    assert torch.equal(case.qkv[:, v_from:], before[:, v_from:]), case.where("the v heads are untouched")
    assert torch.equal(got_q[..., 96:], before[:, : 4 * 128].view(-1, 4, 128)[..., 96:]), case.where("q's tail")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("llama31", [False, True], ids=["rope", "llama31"])
def test_int64_indices_and_both_position_sources_agree(device, llama31):
    """indptr + offsets and the equivalent pos_ids give the same bits, in int32 and in int64."""
    results = []
    for index_dtype in (torch.int32, torch.int64):
        case = Case(device, torch.float16, 64, 64, 4, 2, salt=23, index_dtype=index_dtype)
        pos_ids = ref.rope.positions_from_indptr(case.indptr, case.offsets).to(index_dtype).to(device)
        name = "apply_llama31_rope" if llama31 else "apply_rope"
        results.append(getattr(jitattn, name)(case.q, case.k, case.indptr, case.offsets))
        results.append(getattr(jitattn, name + "_pos_ids")(case.q, case.k, pos_ids))
    for q, k in results[1:]:
        assert torch.equal(q, results[0][0]) and torch.equal(k, results[0][1]), f"seed {SEED}"


@pytest.mark.parametrize("device", DEVICES)
def test_llama31_regimes_reduce_to_plain_rope(device):
    """A context so short that every wavelength is long divides every frequency by rope_scale; one so long
    that every wavelength is short keeps them all: both are plain RoPE, bit for bit. Defaults blend."""
    case = Case(device, torch.bfloat16, 64, 64, 2, 2, salt=29)
    q, k, pos = case.q, case.k, case.pos_ids
    scaled = jitattn.apply_llama31_rope_pos_ids(q, k, pos, rope_scale=8, rope_theta=5e5, old_context_len=1)
    kept = jitattn.apply_llama31_rope_pos_ids(q, k, pos, rope_scale=8, rope_theta=5e5, old_context_len=10**12)
    blended = jitattn.apply_llama31_rope_pos_ids(q, k, pos)
    plain_scaled = jitattn.apply_rope_pos_ids(q, k, pos, rope_scale=8, rope_theta=5e5)
    plain = jitattn.apply_rope_pos_ids(q, k, pos, rope_scale=1, rope_theta=5e5)
    assert torch.equal(scaled[0], plain_scaled[0]) and torch.equal(scaled[1], plain_scaled[1])
    assert torch.equal(kept[0], plain[0]) and torch.equal(kept[1], plain[1])
    assert not torch.equal(blended[0], plain[0]) and not torch.equal(blended[0], plain_scaled[0])


@pytest.mark.parametrize("device", DEVICES)
def test_head_major_strides(device):
    """q and k whose heads are further apart than their tokens (views of [heads, nnz, D] buffers)."""
    case = Case(device, torch.float32, 32, 16, 3, 2, salt=31)
    q_heads_first = case.q.transpose(0, 1).contiguous().transpose(0, 1)
    k_heads_first = case.k.transpose(0, 1).contiguous().transpose(0, 1)
    assert q_heads_first.stride(1) > q_heads_first.stride(0)
    want = jitattn.apply_rope_pos_ids(case.q.contiguous(), case.k.contiguous(), case.pos_ids, rotary_dim=16)
    got = jitattn.apply_rope_pos_ids(q_heads_first, k_heads_first, case.pos_ids, rotary_dim=16)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    jitattn.apply_rope_pos_ids_inplace(q_heads_first, k_heads_first, case.pos_ids, rotary_dim=16)
    assert torch.equal(q_heads_first, want[0]) and torch.equal(k_heads_first, want[1])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("interleave", [False, True], ids=["neox", "interleave"])
def test_rows_off_16_bytes_give_the_aligned_result(device, interleave):
    """Rows starting 2 bytes past a 16-byte boundary (the cuda kernel's element-per-load path) and rows
    starting on one (its 16-byte path), in and out of place: bit for bit the same."""
    case = Case(device, torch.bfloat16, 128, 64, 4, 2, salt=37)
    q_off = torch.empty(case.q.numel() + 1, dtype=case.q.dtype, device=device)[1:].view(case.q.shape)
    k_off = torch.empty(case.k.numel() + 1, dtype=case.k.dtype, device=device)[1:].view(case.k.shape)
    q_off.copy_(case.q)
    k_off.copy_(case.k)
    kw = dict(rotary_dim=case.rotary_dim, interleave=interleave, **_angle_kwargs("pos_ids"))
    want = jitattn.apply_rope_pos_ids(case.q.contiguous(), case.k.contiguous(), case.pos_ids, **kw)
    got = jitattn.apply_rope_pos_ids(q_off, k_off, case.pos_ids, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    jitattn.apply_rope_pos_ids_inplace(q_off, k_off, case.pos_ids, **kw)
    assert torch.equal(q_off, want[0]) and torch.equal(k_off, want[1])
    for what, got_x, ref_x in zip("qk", want, case.expected("pos_ids", interleave)):
        _assert_close(got_x, ref_x, torch.bfloat16, case.where(what))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("src, dst", [(torch.bfloat16, torch.float16), (torch.float16, torch.bfloat16)],
                         ids=["bf16_to_f16", "f16_to_bf16"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "off16"])
def test_rotation_into_the_other_16bit_dtype(device, src, dst, offset):
    """Out of place into the other 16-bit dtype (RoPE before a prefill kernel): each element rounded once from the
    float32 rotation, as the float32 kernel's result rounded to ``dst``; the unrotated tail converted; rows on 16
    bytes and 2 bytes past them (the cuda kernel's two paths) alike."""
    case = Case(device, src, 128, 96, 4, 2, salt=41)
    positions, angles = Positions(pos_ids=case.pos_ids), Angles(rope_scale=4.0, rope_theta=5e5)
    q_out = torch.full((case.q.numel() + offset,), float("nan"), dtype=dst, device=device)[offset:].view(case.q.shape)
    k_out = torch.full((case.k.numel() + offset,), float("nan"), dtype=dst, device=device)[offset:].view(case.k.shape)
    rotate(case.q, case.k, q_out, k_out, positions, 96, False, angles)
    q32, k32 = case.q.float(), case.k.float()
    want_q, want_k = torch.empty_like(q32), torch.empty_like(k32)
    rotate(q32, k32, want_q, want_k, positions, 96, False, angles)
    for got, want in ((q_out, want_q), (k_out, want_k)):
        torch.testing.assert_close(got.float(), want.to(dst).float(), rtol=0, atol=0) if device == "cpu" else \
            torch.testing.assert_close(got.float(), want.to(dst).float(), rtol=2e-3, atol=1e-3)
        assert torch.equal(got[..., 96:], want[..., 96:].to(dst))  # the tail converted exactly (no rotation)
    with pytest.raises(TypeError, match="the other 16-bit one"):
        rotate(case.q, case.k, q_out.float(), k_out.float(), positions, 96, False, angles)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches(device):
    q = torch.randn(0, 4, 64, device=device, dtype=torch.float16)
    k = torch.randn(0, 2, 64, device=device, dtype=torch.float16)
    none = torch.zeros(0, dtype=torch.int32, device=device)
    q_rope, k_rope = jitattn.apply_rope(q, k, torch.zeros(1, dtype=torch.int32, device=device), none)
    assert q_rope.shape == q.shape and k_rope.shape == k.shape
    out = jitattn.apply_rope_with_cos_sin_cache(none, q.flatten(1), k.flatten(1), 64,
                                                torch.zeros(8, 64, device=device))
    assert out[0].shape == (0, 256) and out[1].shape == (0, 128)


# --------------------------------------------------------------------------- #
# Bad input
# --------------------------------------------------------------------------- #
def _cpu_case() -> Case:
    return Case("cpu", torch.float16, 64, 64, 4, 2, salt=37)


BAD_INPUTS = [
    ("q 2-D", lambda c: jitattn.apply_rope_pos_ids(c.q.flatten(1), c.k, c.pos_ids), ValueError, "q must have 3 dim"),
    ("q int", lambda c: jitattn.apply_rope_pos_ids(c.q.int(), c.k, c.pos_ids), TypeError, "q has dtype int32"),
    ("q float64", lambda c: jitattn.apply_rope_pos_ids(c.q.double(), c.k.double(), c.pos_ids), TypeError,
     "expected one of float16, bfloat16, float32"),
    ("dtypes differ", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k.bfloat16(), c.pos_ids), TypeError,
     "q is float16 but k is bfloat16"),
    ("nnz differ", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k[1:], c.pos_ids), ValueError,
     "q has .* tokens but k has"),
    ("head_dim differ", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k[..., :32], c.pos_ids), ValueError,
     "head_dim 64 but k has 32"),
    ("last dim strided", lambda c: jitattn.apply_rope_pos_ids(c.q[..., ::2], c.k[..., ::2], c.pos_ids),
     ValueError, "contiguous in its last dimension"),
    ("rotary_dim odd", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, c.pos_ids, rotary_dim=33), ValueError,
     "rotary_dim=33 must be even"),
    ("rotary_dim > head_dim", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, c.pos_ids, rotary_dim=128),
     ValueError, r"rotary_dim=128 must be even and in \[2, head_dim=64\]"),
    ("rotary_dim 0", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, c.pos_ids, rotary_dim=0), ValueError,
     "rotary_dim=0"),
    ("rotary_dim float", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, c.pos_ids, rotary_dim=32.0), TypeError,
     "must be an int"),
    ("pos_ids short", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, c.pos_ids[1:]), ValueError,
     "pos_ids has .* entries; expected"),
    ("pos_ids float", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, c.pos_ids.float()), TypeError,
     "pos_ids has dtype float32; use int32 or int64"),
    ("offsets long", lambda c: jitattn.apply_rope(c.q, c.k, c.indptr, c.indptr), ValueError,
     "indptr has 5 entries and offsets 5: a batch of B requests takes B \\+ 1 entries of indptr and B of offsets"),
    ("indptr mixed dtypes", lambda c: jitattn.apply_rope(c.q, c.k, c.indptr.long(), c.offsets), TypeError,
     "indptr is int64 but offsets is int32"),
    ("indptr short of nnz", lambda c: jitattn.apply_rope(c.q[1:], c.k[1:], c.indptr, c.offsets), ValueError,
     "must start at 0, never decrease and end at nnz"),
    ("indptr decreasing", lambda c: jitattn.apply_rope(
        c.q, c.k, torch.tensor([0, c.nnz, 1, c.nnz, c.nnz], dtype=torch.int32), c.offsets), ValueError,
     "never decrease"),
    ("rope_scale 0", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, c.pos_ids, rope_scale=0), ValueError,
     "rope_scale=0 must be a finite number > 0"),
    ("rope_theta negative", lambda c: jitattn.apply_rope(c.q, c.k, c.indptr, c.offsets, rope_theta=-1.0),
     ValueError, "rope_theta"),
    ("llama31 high == low", lambda c: jitattn.apply_llama31_rope_pos_ids(c.q, c.k, c.pos_ids, high_freq_factor=1),
     ValueError, "high_freq_factor=1 must be larger than low_freq_factor=1"),
    ("q is k in place", lambda c: jitattn.apply_rope_pos_ids_inplace(c.q, c.q, c.pos_ids), ValueError,
     "q and k share head rows"),
    ("q and k overlap in place", lambda c: jitattn.apply_rope_pos_ids_inplace(
        c.qkv.view(c.nnz, -1, 64)[:, :4], c.qkv.view(c.nnz, -1, 64)[:, 2:4], c.pos_ids),
     ValueError, "q and k share head rows .* rotate those rows twice"),
    ("q and k of two token strides in place", lambda c: jitattn.apply_rope_pos_ids_inplace(  # rows 2 and 4 both
        c.qkv.view(-1, 1, 64)[1:c.nnz + 1], c.qkv.view(-1, 1, 64)[0:2 * c.nnz:2], c.pos_ids),
     ValueError, "q and k share head rows"),
    ("interleave a string", lambda c: jitattn.apply_rope(c.q, c.k, c.indptr, c.offsets, interleave="no"), TypeError,
     "interleave='no' must be True or False"),
    ("is_neox a string", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1), 64, c.table, is_neox="false"), TypeError,
     "is_neox='false' must be True or False"),
    ("expanded in place", lambda c: jitattn.apply_rope_pos_ids_inplace(c.q[:1].expand(c.nnz, -1, -1), c.k, c.pos_ids),
     ValueError, "share memory"),
    ("cache f16", lambda c: jitattn.apply_rope_with_cos_sin_cache(c.pos_ids, c.q.flatten(1), c.k.flatten(1), 64,
                                                                  c.table.half()), ValueError, "must be float32"),
    ("cache wider than head", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1), 32, c.table), ValueError, r"in \[2, head_size=32\]"),
    ("cache odd width", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1), 64, c.table[:, :31]), ValueError, "must be even"),
    ("position past the cache", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids.clamp(max=9), c.q.flatten(1), c.k.flatten(1), 64, c.table[:9]), IndexError,
     "outside cos_sin_cache's 9 rows; extend the cache"),
    ("negative position", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        torch.cat([c.pos_ids[:1] * 0 - 1, c.pos_ids[1:]]), c.q.flatten(1), c.k.flatten(1), 64, c.table), IndexError,
     r"positions\[0\]=-1 is outside cos_sin_cache's \d+ rows; positions index the cache's rows from 0"),
    ("head_size not dividing", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1), 48, c.table), ValueError, "num_heads \\* head_size"),
    # the vLLM / SGLang signature's errors name its arguments (positions, query, key), not pos_ids / q / k
    ("cache positions float", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids.float(), c.q.flatten(1), c.k.flatten(1), 64, c.table), TypeError,
     "^positions has dtype float32; use int32 or int64"),
    ("cache positions short", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids[1:], c.q.flatten(1), c.k.flatten(1), 64, c.table), ValueError, "^positions has .* entries; expected"),
    ("cache key tokens", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1)[1:], 64, c.table), ValueError,
     "^query has .* tokens but key has"),
    ("cache key dtype", lambda c: jitattn.apply_rope_with_cos_sin_cache_inplace(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1).double(), 64, c.table), TypeError, "^(key|query) .*float64"),
    # a missing position array is named as the caller's signature names it (not as offsets)
    ("pos_ids None", lambda c: jitattn.apply_rope_pos_ids(c.q, c.k, None), TypeError,
     "^pos_ids must be a torch.Tensor"),
    ("llama31 pos_ids None", lambda c: jitattn.apply_llama31_rope_pos_ids_inplace(c.q, c.k, None), TypeError,
     "^pos_ids must be a torch.Tensor"),
    ("cache positions None", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        None, c.q.flatten(1), c.k.flatten(1), 64, c.table), TypeError, "^positions must be a torch.Tensor"),
    # a missing cache is refused (it once rotated as plain RoPE with the default theta, silently)
    ("cos_sin_cache None", lambda c: jitattn.apply_rope_with_cos_sin_cache(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1), 64, None), TypeError, "^cos_sin_cache must be a torch.Tensor"),
    ("cos_sin_cache None inplace", lambda c: jitattn.apply_rope_with_cos_sin_cache_inplace(
        c.pos_ids, c.q.flatten(1), c.k.flatten(1), 64, None), TypeError, "^cos_sin_cache must be a torch.Tensor"),
    ("offsets None", lambda c: jitattn.apply_rope(c.q, c.k, c.indptr, None), TypeError,
     "^offsets must be a torch.Tensor"),
    ("odd head_dim", lambda c: jitattn.apply_rope_pos_ids(c.q[..., :63], c.k[..., :63], c.pos_ids), ValueError,
     "head_dim=63 is odd: .* pass an even rotary_dim"),
]


@pytest.mark.parametrize("build, error, match", [case[1:] for case in BAD_INPUTS], ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_is_refused_with_the_fix(build, error, match):
    case = _cpu_case()
    before = case.qkv.clone()
    with pytest.raises(error, match=match):
        build(case)
    assert torch.equal(case.qkv, before), "a refused call wrote nothing"


def test_cpu_kernel_reports_bad_positions_itself():
    """Past the Python checks, the cpu kernel still refuses an indptr it cannot cover, before writing."""
    case = _cpu_case()
    module = load(VariantSpec(op="rope", target="cpu", q_dtype="f16"))
    q = case.q
    names = [f.name for f in ROPE.fields]
    params = dict.fromkeys(names, 0)
    params.update(q=q.data_ptr(), k=q.data_ptr(), q_out=q.data_ptr(), k_out=q.data_ptr(),
                  indptr=case.indptr.data_ptr(), offsets=case.offsets.data_ptr(), pos_ids=None, cos_sin_cache=None,
                  nnz=case.nnz + 1, batch_size=4, num_q_heads=4, head_dim=64, rotary_dim=64, q_stride_n=q.stride(0),
                  q_stride_h=q.stride(1), q_out_stride_n=q.stride(0), q_out_stride_h=q.stride(1), index_bytes=4,
                  rope_rcp_scale=1.0, rope_theta=1e4, num_threads=1)
    before = case.qkv.clone()
    with pytest.raises(KernelError, match="indptr must start at 0 and end at nnz"):
        module.launch("rope", None, **params)
    assert torch.equal(case.qkv, before)


def test_rope_spec_names_and_axes():
    spec = VariantSpec(op="rope", target="cuda", q_dtype="f32")  # float32 rotates on cuda too
    assert (spec.uri, spec.kernel_name) == ("rope_cuda_f32", "jitattn_rope_f32")
    assert parse_spec_text("rope_cpu_bf16") == VariantSpec(op="rope", target="cpu", q_dtype="bf16")
    with pytest.raises(ValueError, match="head_dim_qk=64 is not a compile-time axis"):
        VariantSpec(op="rope", target="cpu", q_dtype="f16", head_dim_qk=64, head_dim_vo=64)
    other = VariantSpec(op="rope", target="cuda", q_dtype="bf16", o_dtype="f16")  # bf16 rows into f16 copies
    assert (other.uri, other.kernel_name) == ("rope_cuda_bf16_of16", "jitattn_rope_bf16_of16")
    assert parse_spec_text("rope_cuda_bf16_of16") == other
    for q, o in (("bf16", "bf16"), ("f32", "f16"), ("f16", "f32")):
        with pytest.raises(ValueError, match="the other 16-bit dtype only"):
            VariantSpec(op="rope", target="cpu", q_dtype=q, o_dtype=o)


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not installed")
def test_cuda_rope_compiles_for_hopper_without_a_gpu(monkeypatch, fresh_cache):
    monkeypatch.setenv("JITATTN_CUDA_ARCH_LIST", "9.0a")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    for spec in GPU_SPECS:
        module = load(spec)
        assert module.entry_names == ("rope",)
        assert f"{spec.kernel_name}_kernel".encode() in module.path.read_bytes()


# --------------------------------------------------------------------------- #
# cuda only: what the device cannot report
# --------------------------------------------------------------------------- #
@pytest.mark.gpu
@pytest.mark.parametrize("source", ["indptr", "cos_sin_cache"])
def test_cuda_invalid_device_positions_give_nan_not_a_fault(source):
    case = Case("cuda", torch.bfloat16, 64, 32, 2, 2, salt=41)
    if source == "indptr":
        indptr = case.indptr.clone()
        indptr[-1] -= 1  # the last token belongs to no request
        q, k = jitattn.apply_rope(case.q, case.k, indptr, case.offsets, rotary_dim=32)
    else:
        pos = case.pos_ids.clone()
        pos[-1] = CACHE_ROWS + 5
        q, k = jitattn.apply_rope_with_cos_sin_cache(pos, case.q.flatten(1), case.k.flatten(1), 64, case.table)
        q, k = q.view(case.nnz, 2, 64), k.view(case.nnz, 2, 64)
    torch.cuda.synchronize()
    for out, src in ((q, case.q), (k, case.k)):
        assert bool(out[-1, :, :32].isnan().all()), "the invalid token's rotated dims are NaN"
        assert not bool(out[:-1].isnan().any()), "every other token is rotated"
        assert torch.equal(out[:, :, 32:], src[:, :, 32:]), "unrotated dims are copied"


@pytest.mark.gpu
def test_cuda_mixed_devices_are_refused():
    case = Case("cuda", torch.float16, 64, 64, 2, 2, salt=43)
    with pytest.raises(ValueError, match="pos_ids is on cpu but q is on cuda"):
        jitattn.apply_rope_pos_ids(case.q, case.k, case.pos_ids.cpu())
    with pytest.raises(ValueError, match="tensors are on different devices"):
        jitattn.apply_rope_pos_ids(case.q, case.k.cpu(), case.pos_ids)
    with pytest.raises(ValueError, match="cos_sin_cache is on cpu"):
        jitattn.apply_rope_with_cos_sin_cache(case.pos_ids, case.q.flatten(1), case.k.flatten(1), 64,
                                              case.table.cpu())


def _share_an_element(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Brute force: the element offsets (from q's start) of q's and k's head rows intersect."""
    def elements(t: torch.Tensor) -> set[int]:
        base = (t.data_ptr() - q.data_ptr()) // t.element_size()
        return {base + i * t.stride(0) + h * t.stride(1) + e
                for i in range(t.shape[0]) for h in range(t.shape[1]) for e in range(t.shape[2])}
    return bool(elements(q) & elements(k))


def test_in_place_rope_refuses_exactly_the_layouts_whose_rows_meet() -> None:
    """q and k as random strided views of one buffer (one or two token strides, heads side by side or apart, NeoX's
    interleaved [nnz, heads, 3, d]): rotated in place only when no element is in both, refused when one is."""
    gen = random.Random(5)
    buf = torch.randn(4096)
    seen = {True: 0, False: 0}
    for _ in range(300):
        nnz, d = gen.randint(1, 5), gen.choice([2, 4, 8])
        views = []
        for heads in (gen.randint(1, 3), gen.randint(1, 3)):
            head_stride = gen.choice([d, 2 * d, 3 * d])
            token_stride = max(gen.randint(d, 4 * d * 3), (heads - 1) * head_stride + d)
            views.append(buf.as_strided((nnz, heads, d), (token_stride, head_stride, 1), gen.randint(0, 40)))
        q, k = views
        meet = _share_an_element(q, k)
        seen[meet] += 1
        pos = torch.arange(nnz, dtype=torch.int32)
        if meet:
            with pytest.raises(ValueError, match="q and k share head rows"):
                jitattn.apply_rope_pos_ids_inplace(q, k, pos)
        else:
            jitattn.apply_rope_pos_ids_inplace(q, k, pos)
    assert min(seen.values()) > 50, seen  # both kinds of layout were tried
    qkv = buf[:6 * 3 * 2 * 8].view(6, 2, 3, 8)  # NeoX: each head's q, k, v side by side
    jitattn.apply_rope_pos_ids_inplace(qkv[:, :, 0], qkv[:, :, 1], torch.arange(6, dtype=torch.int32))

"""append_paged_kv_cache, get_batch_indices_positions, get_seq_lens (jitattn.ops.page).

Every append test fills the cache with random bits first, runs the kernel and the
reference (jitattn.reference) on copies, and compares the *whole* cache bit for bit:
written slots must hold exactly torch's ``.to(cache dtype)`` of the input, every other
slot must be untouched. Inputs are fresh random data each run; the seed is in every
failure message (set JITATTN_TEST_SEED to replay one).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

import jitattn.runtime.page as page_impl
from jitattn import page, reference as ref
from jitattn.kernels.append import APPEND
from jitattn.jit import load
from jitattn.spec import VariantSpec

SEED = int(os.environ.get("JITATTN_TEST_SEED", random.randrange(2**31)))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
GPU_SPECS = [VariantSpec(op="append", target="cuda", kv_dtype=d) for d in ALL_DTYPES if d != torch.float32]
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def _supported(device: str, dtype: torch.dtype) -> None:
    if device == "cuda" and dtype == torch.float32:
        pytest.skip("float32 caches run on the cpu target only (VariantSpec rejects kv_dtype f32 on cuda)")


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((SEED * 1000003 + salt) % 2**63)


def _random_bits(shape, dtype, g) -> torch.Tensor:
    int_dtype = _BITS[torch.empty((), dtype=dtype).element_size()]
    info = torch.iinfo(int_dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=int_dtype).view(dtype)


def _make_cache(fmt, layout, num_pages, page_size, heads, dim, dtype, g):
    if fmt == "tuple3":
        assert page_size == 1
        return (_random_bits((num_pages, heads, dim), dtype, g), _random_bits((num_pages, heads, dim), dtype, g))
    inner = (page_size, heads, dim) if layout == "NHD" else (heads, page_size, dim)
    if fmt == "5d":
        return _random_bits((num_pages, 2, *inner), dtype, g)
    return (_random_bits((num_pages, *inner), dtype, g), _random_bits((num_pages, *inner), dtype, g))


def _cache_tensors(cache):
    return [cache] if isinstance(cache, torch.Tensor) else list(cache)


def _clone_cache(cache):
    return cache.clone() if isinstance(cache, torch.Tensor) else tuple(t.clone() for t in cache)


def _bits_cache(cache):
    return _bits(cache) if isinstance(cache, torch.Tensor) else tuple(_bits(t) for t in cache)


class Case:
    """A random batch: a page table with shuffled pages (plus unused ones) after the append."""

    def __init__(self, *, page_size, batch=4, heads=2, dim=64, fmt="5d", layout="NHD",
                 cache_dtype=torch.float16, src_dtype=None, extra_pages=5, salt=0):
        g = _gen(salt)
        self.salt, self.layout = salt, layout
        P = page_size
        old = torch.randint(0, 2 * P + 2, (batch,), generator=g)
        app = torch.randint(1, 2 * P + 3, (batch,), generator=g)
        app[batch // 2] = 0  # one request appends nothing
        seq = old + app
        num_req_pages = (seq + P - 1) // P
        total = int(num_req_pages.sum())
        self.num_pages = total + extra_pages
        self.kv_indices = torch.randperm(self.num_pages, generator=g)[:total].to(torch.int32)
        self.kv_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        self.kv_indptr[1:] = torch.cumsum(num_req_pages, 0)
        self.kv_last_page_len = torch.where(num_req_pages > 0, seq - (num_req_pages - 1) * P, 0).to(torch.int32)
        self.append_indptr = torch.zeros(batch + 1, dtype=torch.int32)
        self.append_indptr[1:] = torch.cumsum(app, 0)
        self.nnz = int(app.sum())
        self.seq_lens = seq.to(torch.int32)
        src_dtype = src_dtype or cache_dtype
        scale = 0.5 if cache_dtype.itemsize == 1 else 1.0
        gen_dtype = torch.float32 if src_dtype.itemsize == 1 else src_dtype
        self.key = (torch.randn(self.nnz, heads, dim, generator=g) * scale).to(gen_dtype).to(src_dtype)
        self.value = (torch.randn(self.nnz, heads, dim, generator=g) * scale).to(gen_dtype).to(src_dtype)
        self.cache = _make_cache(fmt, layout, self.num_pages, P, heads, dim, cache_dtype, g)
        self.cache_dtype = cache_dtype

    def indices(self):
        bi, pos = page.get_batch_indices_positions(self.append_indptr, self.seq_lens, self.nnz)
        return bi, pos

    def to(self, device):
        for name in ("kv_indices", "kv_indptr", "kv_last_page_len", "append_indptr", "seq_lens", "key", "value"):
            setattr(self, name, getattr(self, name).to(device))
        self.cache = self.cache.to(device) if isinstance(self.cache, torch.Tensor) else tuple(
            t.to(device) for t in self.cache)
        return self

    def expected(self, key=None, value=None):
        """The reference result on a copy of the cache, as integer bit views."""
        key = self.key if key is None else key
        value = self.value if value is None else value
        want = _bits_cache(_clone_cache(self.cache))
        bi, pos = ref.get_batch_indices_positions(self.append_indptr.cpu(), self.seq_lens.cpu(), self.nnz)
        ref.append_paged_kv_cache(
            _bits(key.to(self.cache_dtype)), _bits(value.to(self.cache_dtype)), bi, pos, want,
            self.kv_indices.cpu(), self.kv_indptr.cpu(), self.kv_last_page_len.cpu(), kv_layout=self.layout,
        )
        return want

    def check(self, want, what=""):
        got = _bits_cache(self.cache)
        for g_t, w_t in zip(_cache_tensors(got), _cache_tensors(want)):
            w_t = w_t.to(g_t.device)
            if not torch.equal(g_t, w_t):
                diff = (g_t != w_t).nonzero()
                raise AssertionError(
                    f"{what}: {diff.shape[0]} cache elements differ from the reference, first at "
                    f"{diff[0].tolist()} (seed {SEED}, salt {self.salt})"
                )


def _append(case, key=None, value=None, *, bi=None, pos=None, layout=None):
    if bi is None:
        bi, pos = case.indices()
    page.append_paged_kv_cache(
        case.key if key is None else key, case.value if value is None else value, bi, pos, case.cache,
        case.kv_indices, case.kv_indptr, case.kv_last_page_len, kv_layout=layout or case.layout,
    )


# --------------------------------------------------------------------------- #
# Correctness against the reference
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("fmt,layout,page_size", [
    ("5d", "NHD", 16), ("5d", "HND", 16), ("tuple4", "NHD", 16), ("tuple4", "HND", 64),
    ("5d", "NHD", 64), ("tuple4", "NHD", 1), ("5d", "HND", 1), ("tuple3", "NHD", 1),
])
def test_append_matches_reference(device, dtype, fmt, layout, page_size):
    _supported(device, dtype)
    salt = hash((str(dtype), fmt, layout, page_size)) % 10**6
    case = Case(page_size=page_size, fmt=fmt, layout=layout, cache_dtype=dtype, salt=salt).to(device)
    want = case.expected()
    _append(case)
    case.check(want, f"{fmt}/{layout}/page_size {page_size}/{dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cache_dtype", ALL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=lambda d: str(d).removeprefix("torch."))
def test_append_converts_source_dtype(device, cache_dtype, src_dtype):
    """Inputs of another dtype are rounded like torch's .to(cache dtype)."""
    _supported(device, cache_dtype)
    case = Case(page_size=16, cache_dtype=cache_dtype, src_dtype=src_dtype, heads=3, dim=40,
                salt=7 + ALL_DTYPES.index(cache_dtype)).to(device)
    scale = 1.0 if cache_dtype.itemsize == 1 else 1e3  # large values exercise f32 -> f16 rounding too
    case.key, case.value = (case.key.float() * scale).to(src_dtype), (case.value.float() * scale).to(src_dtype)
    want = case.expected()
    _append(case)
    case.check(want, f"{src_dtype} -> {cache_dtype}")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype,head_dim", [
    (torch.bfloat16, 128), (torch.float16, 36), (torch.float8_e4m3fn, 64), (torch.float32, 72),
])
def test_append_strided_key_value_from_fused_qkv(device, layout, dtype, head_dim):
    """append_key/value as views of one fused qkv tensor are read in place (no copies)."""
    _supported(device, dtype)
    src = torch.bfloat16 if dtype.itemsize == 1 else dtype
    heads_q, heads_kv = 4, 2
    case = Case(page_size=16, heads=heads_kv, dim=head_dim, layout=layout, cache_dtype=dtype, src_dtype=src,
                salt=11 + head_dim).to(device)
    g = _gen(99)
    qkv = torch.randn(case.nnz, (heads_q + 2 * heads_kv) * head_dim, generator=g).to(src).to(device)
    k = qkv[:, heads_q * head_dim:(heads_q + heads_kv) * head_dim].view(case.nnz, heads_kv, head_dim)
    v = qkv[:, (heads_q + heads_kv) * head_dim:].view(case.nnz, heads_kv, head_dim)
    assert not k.is_contiguous() and k.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    want = case.expected(k, v)
    _append(case, k, v)
    case.check(want, "fused qkv slices")


@pytest.mark.parametrize("device", DEVICES)
def test_append_host_and_device_index_arrays(device):
    """Index arrays may live on the host or on the cache's device; both give the same result."""
    case = Case(page_size=16, cache_dtype=torch.bfloat16, salt=3).to(device)
    want = case.expected()
    bi, pos = case.indices()
    page.append_paged_kv_cache(case.key, case.value, bi.cpu(), pos.cpu(), case.cache,
                               case.kv_indices.cpu(), case.kv_indptr.cpu(), case.kv_last_page_len.cpu())
    case.check(want, "host index arrays")


def _append_rows(x: torch.Tensor, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Appends the rows of x ``[tokens, 1, dim]`` (and NaN values) into fresh 3-D caches of dtype."""
    nnz, _, dim = x.shape
    k = torch.zeros((nnz, 1, dim), dtype=dtype, device=device)  # 3-D caches: page_size 1
    v = torch.zeros((nnz, 1, dim), dtype=dtype, device=device)
    arange = torch.arange(nnz, dtype=torch.int32)
    page.append_paged_kv_cache(x.to(device), torch.full_like(x, math.nan).to(device), arange,
                               torch.zeros(nnz, dtype=torch.int32), (k, v), arange,
                               torch.arange(nnz + 1, dtype=torch.int32), torch.ones(nnz, dtype=torch.int32))
    return k.cpu(), v.cpu()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_rounding_matches_torch(device, dtype):
    """Every fp8 value, the midpoints between neighbours (ties to even), values just off them,
    tiny subnormals: bit-identical to torch's .to(); out of range values and inf saturate to the
    largest finite value (where torch's e5m2 gives inf); NaN stays NaN."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = torch.unique(finite[torch.isfinite(finite)])  # sorted, +-0 merged
    mids = (finite[1:] + finite[:-1]) / 2
    fmax = float(finite.max())
    special = torch.tensor([0.0, -0.0, 1e-30, -1e-30, fmax * 1.03, fmax * 1.07, fmax * 1.2, -fmax * 1.2, fmax * 4,
                            1e30, -1e30, math.inf, -math.inf])
    x = torch.cat([finite, mids, mids.nextafter(torch.tensor(math.inf)), mids.nextafter(torch.tensor(-math.inf)),
                   special])
    n, dim = x.numel(), 8
    x = torch.cat([x, torch.ones((-n) % dim)]).reshape(-1, 1, dim)  # [tokens, 1 head, dim]
    k, v = _append_rows(x, dtype, device)
    got_bits = k.reshape(-1)[:n].view(torch.uint8)
    want_bits = x.reshape(-1)[:n].to(dtype).view(torch.uint8)
    # In range, torch's .to() is the rule (older torch turned e4m3 values beyond 464 into NaN and
    # torch's e5m2 overflows to inf: out of range is checked explicitly below).
    compared = x.reshape(-1)[:n].abs() <= fmax
    bad = ((got_bits != want_bits) & compared).nonzero().reshape(-1)
    assert bad.numel() == 0, (
        f"{bad.numel()} conversions differ from torch, e.g. {x.reshape(-1)[bad[0]].item()!r} -> "
        f"0x{int(got_bits[bad[0]]):02x}, torch 0x{int(want_bits[bad[0]]):02x}"
    )
    assert torch.isnan(v.float()).all()
    # Out of range (the last 9 specials, inf included): the largest finite value of the sign.
    out_of_range = k.reshape(-1)[n - 9:n].float().tolist()
    assert out_of_range == [fmax, fmax, fmax, -fmax, fmax, fmax, -fmax, fmax, -fmax]


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("device", DEVICES)
def test_fp8_saturates_from_every_source_dtype(device, dtype, src_dtype):
    """Fresh random values of every magnitude up to the source's range, inf and NaN, appended from
    each source dtype: the cache holds the reference's saturating conversion, bit for bit."""
    g = _gen(31)
    src_max = torch.finfo(src_dtype).max
    scale = torch.exp2(torch.randint(-20, int(math.log2(src_max)), (255, 1, 8), generator=g).float())
    x = torch.randn((255, 1, 8), generator=g) * scale
    x = x.clamp(-src_max, src_max)
    x = torch.cat([x, torch.tensor([math.inf, -math.inf, math.nan, src_max, -src_max, 1e4, -1e4, 6e4]).reshape(1, 1, 8)])
    x = x.to(src_dtype)
    k, _ = _append_rows(x, dtype, device)
    want = ref.to_cache_dtype(x, dtype)
    got_bits, want_bits = k.view(torch.uint8), want.view(torch.uint8)
    nan = torch.isnan(want.float())
    assert torch.isnan(k.float()[nan]).all(), "NaN must stay NaN"
    bad = ((got_bits != want_bits) & ~nan).nonzero()
    assert bad.numel() == 0, (
        f"seed {SEED}: {bad.shape[0]} conversions differ, e.g. {x[tuple(bad[0])].item()!r} -> "
        f"{k[tuple(bad[0])].float().item()!r}, want {want[tuple(bad[0])].float().item()!r}"
    )
    fmax = torch.finfo(dtype).max
    assert k.float()[-1, 0, :2].tolist() == [fmax, -fmax], "inf saturates"


# --------------------------------------------------------------------------- #
# get_batch_indices_positions / get_seq_lens
# --------------------------------------------------------------------------- #
def _i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_get_seq_lens_hand_cases(device):
    out = page.get_seq_lens(_i32([0, 2, 2, 5, 6], device), _i32([3, 0, 16, 1], device), 16)
    assert out.dtype == torch.int32 and out.device.type == device
    assert out.cpu().tolist() == [19, 0, 48, 1]
    assert page.get_seq_lens(_i32([0], device), _i32([], device), 4).numel() == 0
    assert page.get_seq_lens(_i32([0, 3], device), _i32([1], device), 1).cpu().tolist() == [3]


@pytest.mark.parametrize("device", DEVICES)
def test_get_batch_indices_positions_hand_cases(device):
    bi, pos = page.get_batch_indices_positions(_i32([0, 2, 2, 5], device), _i32([7, 1, 3], device), 5)
    assert bi.dtype == pos.dtype == torch.int32 and bi.device.type == device
    assert bi.cpu().tolist() == [0, 0, 2, 2, 2]
    assert pos.cpu().tolist() == [5, 6, 0, 1, 2]
    bi, pos = page.get_batch_indices_positions(_i32([0, 0, 0], device), _i32([4, 9], device), 0)
    assert bi.numel() == pos.numel() == 0
    bi, pos = page.get_batch_indices_positions(_i32([0, 1, 2, 3], device), _i32([1, 10, 33], device), 3)
    assert bi.cpu().tolist() == [0, 1, 2] and pos.cpu().tolist() == [0, 9, 32]


@pytest.mark.parametrize("device", DEVICES)
def test_index_helpers_match_reference_random(device):
    for salt in range(5):
        page_size = [1, 5, 16][salt % 3]
        case = Case(page_size=page_size, batch=7, salt=100 + salt)
        lens = page.get_seq_lens(case.kv_indptr.to(device), case.kv_last_page_len.to(device), page_size)
        assert torch.equal(lens.cpu(), ref.get_seq_lens(case.kv_indptr, case.kv_last_page_len, page_size))
        assert torch.equal(lens.cpu(), case.seq_lens)
        got = page.get_batch_indices_positions(case.append_indptr.to(device), lens, case.nnz)
        want = ref.get_batch_indices_positions(case.append_indptr, case.seq_lens, case.nnz)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(got, want)), f"seed {SEED}, salt {salt}"


@pytest.mark.gpu
def test_index_helpers_do_not_sync_on_cuda():
    indptr, last, append_indptr = _i32([0, 2, 2, 5], "cuda"), _i32([3, 1, 16], "cuda"), _i32([0, 2, 2, 5], "cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        lens = page.get_seq_lens(indptr, last, 16)
        bi, pos = page.get_batch_indices_positions(append_indptr, lens, 5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert lens.tolist() == [19, 0, 48] and bi.tolist() == [0, 0, 2, 2, 2] and pos.tolist() == [17, 18, 45, 46, 47]


def test_index_helpers_reject_bad_input():
    with pytest.raises(ValueError, match="nnz=4 must equal append_indptr"):
        page.get_batch_indices_positions(_i32([0, 2, 5]), _i32([3, 3]), 4)
    with pytest.raises(ValueError, match="request 1 appends 3 tokens but seq_lens"):
        page.get_batch_indices_positions(_i32([0, 2, 5]), _i32([3, 2]), 5)
    with pytest.raises(ValueError, match=r"append_indptr must never decrease: append_indptr\[2\]=2 < append_indptr"):
        page.get_batch_indices_positions(_i32([0, 3, 2]), _i32([6, 3]), 2)
    with pytest.raises(ValueError, match="1-D integer"):
        page.get_seq_lens(torch.zeros(3), _i32([1, 1]), 4)
    with pytest.raises(ValueError, match="page_size=0"):
        page.get_seq_lens(_i32([0, 1]), _i32([1]), 0)


# --------------------------------------------------------------------------- #
# Edge cases and errors
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("device", DEVICES)
def test_append_nothing_is_a_no_op(device):
    case = Case(page_size=4, salt=5).to(device)
    before = _clone_cache(case.cache)
    empty = torch.empty(0, 2, 64, dtype=case.key.dtype, device=device)
    none = torch.empty(0, dtype=torch.int32, device=device)
    page.append_paged_kv_cache(empty, empty, none, none, case.cache, case.kv_indices, case.kv_indptr,
                               case.kv_last_page_len)
    assert torch.equal(_bits(case.cache), _bits(before))


@pytest.mark.gpu
def test_append_runs_on_the_current_stream():
    """The keys are written on a side stream after a long GPU sleep, then appended there: an append
    launched on any other stream runs before they are ready and copies the stale values."""
    case = Case(page_size=16, cache_dtype=torch.bfloat16, salt=21).to("cuda")
    want = case.expected()
    bi, pos = case.indices()
    real_key, real_value = case.key.clone(), case.value.clone()
    case.key.fill_(7.0)
    case.value.fill_(7.0)
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the keys are ready
        case.key.copy_(real_key)
        case.value.copy_(real_value)
        _append(case, bi=bi, pos=pos)
    stream.synchronize()
    case.check(want, "side stream")


@pytest.mark.gpu
def test_append_does_not_sync_with_device_index_arrays():
    case = Case(page_size=16, cache_dtype=torch.float8_e4m3fn, src_dtype=torch.bfloat16, salt=23).to("cuda")
    want = case.expected()
    bi, pos = case.indices()
    _append(case, bi=bi, pos=pos)  # load the module first
    case.cache = case.cache.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _append(case, bi=bi, pos=pos)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    case.check(want, "device index arrays")


@pytest.mark.gpu
def test_append_rejects_f32_cache_on_cuda():
    case = Case(page_size=16, cache_dtype=torch.float32, salt=22).to("cuda")
    with pytest.raises(TypeError, match="float32 paged caches"):
        _append(case)


def _mutations(case):
    """(description, kwargs overrides, exception, message regex) for one bad argument each."""
    bi, pos = case.indices()
    k, v = case.key, case.value
    i64 = lambda t: t.to(torch.int64)  # noqa: E731
    bad_pos = pos.clone()
    bad_pos[-1] = int(case.kv_indptr[-1] - case.kv_indptr[-2]) * 16  # one past the last request's pages
    bad_bi = bi.clone()
    bad_bi[0] = case.kv_indptr.shape[0] - 1
    bad_pages = case.kv_indices.clone()
    bad_pages[0] = case.num_pages
    bad_indptr = case.kv_indptr.clone()
    bad_indptr[1], bad_indptr[2] = bad_indptr[2], bad_indptr[1] - 1
    return [
        ("layout", dict(kv_layout="NDH"), ValueError, "kv_layout='NDH' is not supported"),
        ("key heads", dict(append_key=k[:, :1]), ValueError, r"append_key has shape .* expected \[nnz, num_kv_heads"),
        ("key rank", dict(append_key=k[:, 0]), ValueError, "append_key must have 3 dimensions"),
        ("key dtype", dict(append_key=k.to(torch.int16)), TypeError, "append_key has dtype int16"),
        ("fp8 key into f16 cache", dict(append_key=k.to(torch.float8_e4m3fn), append_value=v.to(torch.float8_e4m3fn)),
         TypeError, "append_key has dtype float8_e4m3fn"),
        ("value dtype", dict(append_value=v.float()), TypeError, "append_key is float16 but append_value is float32"),
        ("key last dim strided", dict(append_key=torch.cat([k, k], 2)[..., ::2]), ValueError,
         "contiguous in its last dimension"),
        ("index dtype", dict(positions=pos.to(torch.int16)), TypeError,
         "positions has dtype int16; index arrays must be int32"),
        ("int64 index past int32", dict(positions=i64(pos) + 2**31), ValueError, "positions holds .* outside int32"),
        ("index rank", dict(kv_indptr=case.kv_indptr[None]), ValueError, "kv_indptr must be 1-D"),
        ("positions length", dict(positions=pos[:-1]), ValueError, "positions has .* entries; expected nnz="),
        ("last_page_len length", dict(kv_last_page_len=case.kv_last_page_len[:-1]), ValueError,
         r"kv_indptr has .* entries \(.* requests\) but kv_last_page_len has .* entries"),
        ("position beyond pages", dict(positions=bad_pos), IndexError, "beyond request .*'s pages"),
        ("negative position", dict(positions=-pos - 1), IndexError, "is negative"),
        ("batch index", dict(batch_indices=bad_bi), IndexError, r"batch_indices\[0\]=.* outside \[0, batch_size"),
        ("page index", dict(kv_indices=bad_pages), IndexError, r"kv_indices\[0\] = .* past the end of the kv cache"),
        ("indptr order", dict(kv_indptr=bad_indptr), ValueError, "kv_indptr must be non-decreasing"),
        ("last page len", dict(kv_last_page_len=case.kv_last_page_len + 16), ValueError,
         "a request with pages needs 1 <= last_page_len <= page_size"),
        ("5-D cache shape", dict(paged_kv_cache=case.cache[:, :1]), ValueError, "must be \\[pages, 2, page_size"),
        ("tuple size", dict(paged_kv_cache=(case.cache[:, 0],)), ValueError, r"must be \(k_cache, v_cache\)"),
        ("tuple dtypes", dict(paged_kv_cache=(case.cache[:, 0], case.cache[:, 1].float())), TypeError,
         "k_cache is float16 but v_cache is float32"),
        ("cache type", dict(paged_kv_cache="cache"), TypeError, "must be a 5-D tensor or a"),
        ("cache dtype", dict(paged_kv_cache=case.cache.to(torch.int16)), TypeError, "paged_kv_cache .* dtype int16"),
        ("key on another device", dict(append_key=k.to("meta")), ValueError, "tensors are on different devices"),
        ("indices on another device", dict(kv_indices=case.kv_indices.to("meta")), ValueError,
         "kv_indices is on meta but paged_kv_cache is on cpu"),
    ]


def test_int64_index_arrays_append_as_int32_ones_do():
    """FlashInfer's append converts its index arrays with .int(); engines keep positions in int64."""
    case = Case(page_size=16, salt=33)
    bi, pos = case.indices()
    want = _clone_cache(case.cache)
    page.append_paged_kv_cache(case.key, case.value, bi, pos, want, case.kv_indices, case.kv_indptr,
                               case.kv_last_page_len)
    long = lambda t: t.to(torch.int64)  # noqa: E731
    page.append_paged_kv_cache(case.key, case.value, long(bi), long(pos), case.cache, long(case.kv_indices),
                               long(case.kv_indptr), long(case.kv_last_page_len))
    assert torch.equal(_bits_cache(case.cache), _bits_cache(want))


def test_an_empty_cache_is_not_taken_for_k_and_v_sharing_memory():
    """Empty k and v tensors both have data_ptr 0: an append of nothing into them was refused as aliasing."""
    none = torch.zeros(0, dtype=torch.int32)
    caches = (torch.empty(0, 4, 2, 8), torch.empty(0, 4, 2, 8))
    page.append_paged_kv_cache(torch.empty(0, 2, 8), torch.empty(0, 2, 8), none, none, caches, none,
                               torch.zeros(1, dtype=torch.int32), none)
    with pytest.raises(IndexError, match="beyond request 0's pages"):  # a token to append: the page table's error
        one = torch.zeros(1, dtype=torch.int32)
        page.append_paged_kv_cache(torch.randn(1, 2, 8), torch.randn(1, 2, 8), one, one, caches, none,
                                   torch.zeros(2, dtype=torch.int32), one + 1)


def test_append_rejects_bad_input_before_launch(monkeypatch):
    case = Case(page_size=16, salt=31)
    before = _clone_cache(case.cache)
    bi, pos = case.indices()
    base = dict(append_key=case.key, append_value=case.value, batch_indices=bi, positions=pos,
                paged_kv_cache=case.cache, kv_indices=case.kv_indices, kv_indptr=case.kv_indptr,
                kv_last_page_len=case.kv_last_page_len, kv_layout="NHD")

    def no_launch(spec):
        raise AssertionError(f"{spec.uri} was loaded for an input that should have been rejected")

    monkeypatch.setattr(page_impl, "load", no_launch)
    for what, change, exc, message in _mutations(case):
        with pytest.raises(exc, match=message):
            page.append_paged_kv_cache(**{**base, **change})
        assert torch.equal(_bits(case.cache), _bits(before)), f"{what}: the cache changed"


def test_cpu_kernel_checks_indices_before_writing():
    """The kernel itself refuses bad indices (the Python checks bypassed) and writes nothing."""
    from jitattn.jit import KernelError

    case = Case(page_size=16, cache_dtype=torch.float32, heads=1, dim=32, salt=41)
    before = case.cache.clone()
    bi, pos = case.indices()
    pos = pos.clone()
    pos[-1] = 10**6
    module = load(VariantSpec(op="append", target="cpu", kv_dtype="f32"))
    k, v = case.cache[:, 0], case.cache[:, 1]
    params = dict(
        append_key=case.key.data_ptr(), append_value=case.value.data_ptr(), batch_indices=bi.data_ptr(),
        positions=pos.data_ptr(), k_cache=k.data_ptr(), v_cache=v.data_ptr(),
        kv_indices=case.kv_indices.data_ptr(), kv_indptr=case.kv_indptr.data_ptr(),
        nnz=case.nnz, batch_size=case.kv_indptr.shape[0] - 1, num_pages=case.num_pages, num_heads=1,
        head_dim=32, page_size=16, key_stride_n=32, key_stride_h=32, value_stride_n=32, value_stride_h=32,
        k_stride_page=k.stride(0), k_stride_n=k.stride(1), k_stride_h=k.stride(2),
        v_stride_page=v.stride(0), v_stride_n=v.stride(1), v_stride_h=v.stride(2), src_dtype=2, num_threads=2,
    )
    assert set(params) == {f.name for f in APPEND.fields}
    with pytest.raises(KernelError, match=f"token {case.nnz - 1}: position 1000000 outside request"):
        module.launch("append", None, **params)
    assert torch.equal(_bits(case.cache), _bits(before))

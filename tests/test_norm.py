"""RMSNorm and the gated activations (jitattn.ops.norm / .activation, FlashInfer's flashinfer.norm and
flashinfer.activation) against float64 references.

Inputs are fresh random data every run (the seed is in every failure message: set JITATTN_TEST_SEED to
replay one), some of them slices of a wider buffer (rows of one stride that is not the row length).
Outputs are allocated poisoned (NaN), so an element the kernel does not write fails the comparison; the
in-place forms must leave the bytes around their rows untouched. Each test runs on the cpu target and,
marked ``gpu``, on cuda (where rows of whole 16-byte units take the vector path, the others the element path).
"""

from __future__ import annotations

import os
import random

import pytest
import torch

import jitattn
import jitattn.flashinfer as fi
from jitattn.jit import KernelError

SEED = int(os.environ.get("JITATTN_TEST_SEED", random.randrange(2**31)))

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One rounding of a result of magnitude ~4 (half an ulp) and float32 sums of up to 12288 squares, relative to
# the largest reference value.
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _gen(salt: int) -> torch.Generator:
    return torch.Generator().manual_seed((SEED * 1000003 + salt) % 2**63)


def _rows(shape: tuple[int, ...], dtype, device, salt: int, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(a tensor of ``shape`` of random values, the buffer it is a slice of): with ``pad`` > 0 each row sits in
    a row of ``shape[-1] + pad`` elements whose tail holds other values."""
    g = _gen(salt)
    wide = (torch.randn(*shape[:-1], shape[-1] + pad, generator=g) * 2).to(dtype).to(device)
    return wide[..., : shape[-1]], wide


def _check(name: str, got: torch.Tensor, want: torch.Tensor, dtype) -> None:
    assert tuple(got.shape) == tuple(want.shape), f"{name}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if want.numel() == 0:
        return
    scale = max(want.abs().max().item(), 1e-6)
    err = (got.double().cpu() - want).abs().max().item() / scale
    assert not torch.isnan(got).any(), f"{name}: NaN in the output (an element not written?) (seed {SEED})"
    assert err <= TOLERANCE[dtype], f"{name}: max error {err:.3g} relative to {scale:.3g} (seed {SEED})"


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    x, w = x.double().cpu(), w.double().cpu()
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * (offset + w)


SHAPES = [(5, 64), (7, 4096), (3, 100), (2, 4, 128), (1, 12288), (2, 32768), (0, 64)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gemma", [False, True], ids=["plain", "gemma"])
def test_rmsnorm_matches_the_float64_reference(device, dtype, shape, gemma) -> None:
    salt = hash((str(dtype), shape, gemma)) % 1000
    x, _ = _rows(shape, dtype, device, salt, pad=8 if len(shape) == 2 else 0)
    w = (torch.randn(shape[-1], generator=_gen(salt + 1)) * 0.5 + (0 if gemma else 1)).to(dtype).to(device)
    out = torch.full(shape, float("nan"), dtype=dtype, device=device)
    fn = fi.gemma_rmsnorm if gemma else fi.rmsnorm
    got = fn(x, w, 1e-5, out=out)
    assert got is out
    _check("rmsnorm", out, _rms_ref(x, w, 1e-5, 1.0 if gemma else 0.0), dtype)
    fresh = fn(x, w)  # eps defaults to FlashInfer's 1e-6; a new output
    _check("rmsnorm (new output)", fresh, _rms_ref(x, w, 1e-6, 1.0 if gemma else 0.0), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_without_one_stride_go_through_a_copy_and_are_written_back(device) -> None:
    """Some heads of a wider [tokens, heads, dim] buffer (FlashInfer's per-head norm test does this): the
    leading dimensions do not collapse into one row stride; inputs are staged, outputs written back."""
    g = _gen(31)
    wide = torch.randn(5, 8, 64, generator=g).to(device)
    x = wide[:, :3]  # strides (512, 64, 1): 3 rows of 64 in each 8
    w = torch.randn(64, generator=g).to(device)
    _check("rmsnorm (strided heads)", jitattn.rmsnorm(x, w), _rms_ref(x, w, 1e-6), torch.float32)
    out_wide = torch.full((5, 8, 64), float("nan"), device=device)
    jitattn.rmsnorm(x, w, out=out_wide[:, 2:5])
    _check("rmsnorm (into strided heads)", out_wide[:, 2:5], _rms_ref(x, w, 1e-6), torch.float32)
    assert torch.isnan(out_wide[:, :2]).all() and torch.isnan(out_wide[:, 5:]).all(), "wrote outside out"
    r_wide = torch.randn(5, 8, 64, generator=g).to(device)
    x_in, r_in = x.clone(), r_wide[:, 4:7].clone()
    total = x_in.double().cpu() + r_in.double().cpu()
    jitattn.fused_add_rmsnorm(x, r_wide[:, 4:7], w)
    assert torch.equal(r_wide[:, 4:7].cpu(), (x_in + r_in).cpu())
    _check("fused_add_rmsnorm (strided heads)", x, _rms_ref(total, w, 1e-6), torch.float32)
    gate_up = torch.randn(4, 6, 2 * 32, generator=g).to(device)[:, 1:4]
    want = torch.nn.functional.silu(gate_up[..., :32].double().cpu()) * gate_up[..., 32:].double().cpu()
    _check("silu_and_mul (strided heads)", jitattn.silu_and_mul(gate_up), want, torch.float32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_rmsnorm_in_place(device, dtype) -> None:
    x, _ = _rows((6, 256), dtype, device, 11)
    x = x.contiguous()
    w = torch.randn(256, generator=_gen(12)).to(dtype).to(device)
    want = _rms_ref(x, w, 1e-6)
    assert jitattn.rmsnorm(x, w, out=x) is x
    _check("rmsnorm in place", x, want, dtype)
    # another view object of the same elements is in place too (it was refused as 'overlaps input'), as FlashInfer
    y, _ = _rows((7, 256), dtype, device, 13)
    y = y.contiguous()
    want = _rms_ref(y[:6], w, 1e-6)
    last = y[6].clone()
    jitattn.rmsnorm(y[:6], w, out=y[:6])
    _check("rmsnorm in place through another view", y[:6], want, dtype)
    assert torch.equal(y[6], last)
    with pytest.raises(ValueError, match="out overlaps input without being it"):  # a shifted view: refused
        jitattn.rmsnorm(y[:6], w, out=y[1:7])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(5, 64), (9, 4096), (3, 100), (2, 3, 128)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("gemma", [False, True], ids=["plain", "gemma"])
def test_fused_add_rmsnorm_adds_then_normalises_the_sum(device, dtype, shape, gemma) -> None:
    salt = hash((str(dtype), shape, gemma, "fused")) % 1000
    pad = 8 if len(shape) == 2 else 0
    x, x_wide = _rows(shape, dtype, device, salt, pad=pad)
    r, r_wide = _rows(shape, dtype, device, salt + 1, pad=pad)
    w = (torch.randn(shape[-1], generator=_gen(salt + 2)) * 0.5 + (0 if gemma else 1)).to(dtype).to(device)
    x_tails, r_tails = x_wide[..., shape[-1]:].clone(), r_wide[..., shape[-1]:].clone()
    total = x.double().cpu() + r.double().cpu()  # exact: two 16/32-bit values sum exactly in float64
    want_residual = (x.float() + r.float()).to(dtype).cpu()  # one rounding of the float32 sum
    fn = fi.gemma_fused_add_rmsnorm if gemma else fi.fused_add_rmsnorm
    assert fn(x, r, w, 1e-5) is None
    assert torch.equal(r.cpu(), want_residual), f"residual is not input + residual rounded once (seed {SEED})"
    w64 = w.double().cpu()
    want = total / torch.sqrt((total * total).mean(-1, keepdim=True) + 1e-5) * ((1.0 if gemma else 0.0) + w64)
    _check("fused_add_rmsnorm", x, want, dtype)
    assert torch.equal(x_wide[..., shape[-1]:], x_tails) and torch.equal(r_wide[..., shape[-1]:], r_tails), (
        "bytes outside the rows changed")


ACTS = {"silu": (fi.silu_and_mul, lambda a: a * torch.sigmoid(a)),
        "gelu": (fi.gelu_and_mul, lambda a: torch.nn.functional.gelu(a)),
        "gelu_tanh": (fi.gelu_tanh_and_mul, lambda a: torch.nn.functional.gelu(a, approximate="tanh"))}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", [(5, 128), (7, 28672), (3, 74), (2, 3, 64), (0, 64)],
                         ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("act", list(ACTS))
def test_gated_activations_match_the_float64_reference(device, dtype, shape, act) -> None:
    fn, ref = ACTS[act]
    salt = hash((str(dtype), shape, act)) % 1000
    x, _ = _rows(shape, dtype, device, salt, pad=8 if len(shape) == 2 else 0)
    d = shape[-1] // 2
    x64 = x.double().cpu()
    want = ref(x64[..., :d]) * x64[..., d:]
    out = torch.full((*shape[:-1], d), float("nan"), dtype=dtype, device=device)
    assert fn(x, out=out) is out
    _check(act, out, want, dtype)
    _check(f"{act} (new output)", fn(x), want, dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_disjoint_column_slices_of_one_buffer_are_separate_tensors(device) -> None:
    """Input, residual and out cut from disjoint columns of one buffer share no element: accepted and computed as
    separate tensors (they were refused as "sharing memory" by a check of their spans; 2026-12-06 sweep)."""
    g = _gen(77)
    buf = torch.randn(5, 3 * 96, generator=g).to(device)
    w = (torch.randn(96, generator=g) * 0.5 + 1).to(device)
    x, r, out = buf[:, :96], buf[:, 96:192], buf[:, 192:]
    want = _rms_ref(x, w, 1e-6)
    assert jitattn.rmsnorm(x, w, out=out) is out
    _check("rmsnorm into a column slice", out, want, torch.float32)
    total = x.double().cpu() + r.double().cpu()
    jitattn.fused_add_rmsnorm(x, r, w)
    _check("fused_add_rmsnorm over column slices", x, _rms_ref(total, w, 1e-6), torch.float32)
    gate = torch.randn(5, 3 * 80, generator=g).to(device)
    want = ACTS["silu"][1](gate[:, :80].double().cpu()) * gate[:, 80:160].double().cpu()
    assert jitattn.silu_and_mul(gate[:, :160], out=gate[:, 160:]) is not None
    _check("silu_and_mul into a column slice", gate[:, 160:], want, torch.float32)


def test_bad_inputs_get_clear_errors() -> None:
    x = torch.randn(4, 64)
    w = torch.randn(64)
    with pytest.raises(ValueError, match="weight has shape"):
        jitattn.rmsnorm(x, torch.randn(32))
    with pytest.raises(TypeError, match="weight is float16 but input is float32"):
        jitattn.rmsnorm(x, w.half())
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        jitattn.rmsnorm(torch.randn(64), w)
    with pytest.raises(ValueError, match="eps=-1"):
        jitattn.rmsnorm(x, w, eps=-1)
    with pytest.raises(ValueError, match="device meta is not supported"):  # not 'out overlaps input' (pointers 0)
        jitattn.rmsnorm(torch.randn(2, 8, device="meta"), torch.randn(8, device="meta"))
    with pytest.raises(TypeError, match=r"must be a Python float \(for a one-element tensor pass .item\(\)\)"):
        jitattn.rmsnorm(x, w, eps=torch.tensor(1e-6))
    with pytest.raises(TypeError, match="dtype int64"):
        jitattn.rmsnorm(torch.ones(4, 64, dtype=torch.int64), w)
    with pytest.raises(ValueError, match="out has shape"):
        jitattn.rmsnorm(x, w, out=torch.empty(4, 32))
    with pytest.raises(ValueError, match="residual and input share memory"):
        jitattn.fused_add_rmsnorm(x, x, w)
    with pytest.raises(ValueError, match="residual has shape"):
        jitattn.fused_add_rmsnorm(x, torch.randn(3, 64), w)
    for fused in (jitattn.fused_add_rmsnorm, jitattn.gemma_fused_add_rmsnorm):  # None is no plain rmsnorm
        before = x.clone()
        with pytest.raises(TypeError, match="residual must be a torch.Tensor .* got NoneType"):
            fused(x, None, w)
        assert torch.equal(x, before)
    with pytest.raises(ValueError, match=r"input has shape \(4, 0\); its last dimension \(hidden\) must be >= 1"):
        jitattn.rmsnorm(torch.randn(4, 0), torch.randn(0))
    with pytest.raises(ValueError, match="out overlaps input"):
        buf = torch.randn(5, 64)
        jitattn.rmsnorm(buf[:4], w, out=buf[1:])
    with pytest.raises(ValueError, match="last dimension must be even"):
        jitattn.silu_and_mul(torch.randn(4, 63))
    with pytest.raises(ValueError, match="out has shape"):
        jitattn.silu_and_mul(torch.randn(4, 64), out=torch.empty(4, 64))
    with pytest.raises(ValueError, match="out shares memory with input"):
        buf = torch.randn(4, 64)
        jitattn.silu_and_mul(buf, out=buf[:, :32])


@pytest.mark.gpu
def test_rmsnorm_rows_longer_than_the_cuda_limit_are_refused_with_the_limit() -> None:
    x = torch.randn(2, 40000, device="cuda")
    with pytest.raises(KernelError, match="hidden=40000 must be in"):
        jitattn.rmsnorm(x, torch.randn(40000, device="cuda"))


@pytest.mark.gpu
def test_norm_ops_are_capturable_in_a_cuda_graph() -> None:
    """The serving model's decode step replays them from a graph: the launches read only their arguments."""
    x = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    r = torch.randn(8, 4096, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(8, 2 * 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x0, r0 = x.clone(), r.clone()
    jitattn.fused_add_rmsnorm(x0, r0, w)
    act0 = jitattn.silu_and_mul(g)
    graph = torch.cuda.CUDAGraph()
    xs, rs = x.clone(), r.clone()
    with torch.cuda.graph(graph):
        jitattn.fused_add_rmsnorm(xs, rs, w)
        act = jitattn.silu_and_mul(g)
    xs.copy_(x)
    rs.copy_(r)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(xs, x0) and torch.equal(rs, r0) and torch.equal(act, act0)


@pytest.mark.gpu
def test_rmsnorm_long_rows_run_on_every_device() -> None:
    """Rows past 48 KiB of float32 need the kernel's shared-memory opt-in, an attribute set per device."""
    for index in range(torch.cuda.device_count()):
        x = torch.randn(2, 32768, device=f"cuda:{index}")
        w = torch.randn(32768, device=f"cuda:{index}")
        _check(f"rmsnorm on cuda:{index}", jitattn.rmsnorm(x, w), _rms_ref(x, w, 1e-6), torch.float32)

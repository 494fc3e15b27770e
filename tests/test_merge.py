"""merge_state / merge_state_in_place / merge_states against the float64 reference.

Each test runs on the cpu target and, marked ``gpu``, on cuda. Inputs are
fresh random values each run, with some empty (-inf) states mixed in.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

import jitattn
from jitattn import reference

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["f32", "f16", "bf16"]
# Output tolerance: the kernel rounds its fp32 result to the value dtype once.
V_TOL = {
    torch.float32: dict(atol=2e-5, rtol=2e-5),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
S_TOL = dict(atol=1e-4, rtol=1e-5)


def _gen() -> torch.Generator:
    """A generator with a fresh seed, printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"input seed: {seed}")
    return torch.Generator().manual_seed(seed)


def _values(shape, dtype, device, g) -> torch.Tensor:
    return torch.randn(shape, generator=g).to(dtype).to(device)


def _lse(shape, device, g, empty_fraction=0.15) -> torch.Tensor:
    s = torch.randn(shape, generator=g) * 4
    s[torch.rand(shape, generator=g) < empty_fraction] = -math.inf
    return s.to(device)


def _assert_state_close(v, s, v_ref, s_ref, dtype) -> None:
    assert not torch.isnan(v.float()).any() and not torch.isnan(s).any()
    torch.testing.assert_close(v.float(), v_ref, **V_TOL[dtype])
    torch.testing.assert_close(s, s_ref, **S_TOL)


def _pair(seq, heads, dim, dtype, device, strided):
    """Two states; ``strided`` gives v rows with padding and s stored head-major."""
    g = _gen()
    if strided:
        v_a = _values((seq, heads, dim + 24), dtype, device, g)[:, :, :dim]
        v_b = _values((heads, seq, dim), dtype, device, g).transpose(0, 1)
        s_a = _lse((heads, seq), device, g).t()
        s_b = _lse((seq, 2 * heads), device, g)[:, ::2]
    else:
        v_a, v_b = (_values((seq, heads, dim), dtype, device, g) for _ in range(2))
        s_a, s_b = (_lse((seq, heads), device, g) for _ in range(2))
    return v_a, s_a, v_b, s_b


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_matches_reference(device, dtype, layout):
    v_a, s_a, v_b, s_b = _pair(9, 5, 96, dtype, device, strided=(layout == "strided"))
    v, s = jitattn.merge_state(v_a, s_a, v_b, s_b)
    assert v.dtype == dtype and s.dtype == torch.float32
    assert v.shape == v_a.shape and s.shape == s_a.shape
    assert v.device == v_a.device and s.device == v_a.device
    _assert_state_close(v, s, *reference.merge_state(v_a, s_a, v_b, s_b), dtype)


@pytest.mark.parametrize("mask_kind", [None, torch.bool, torch.uint8], ids=["no-mask", "bool-mask", "uint8-mask"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_merge_state_in_place_matches_reference(device, dtype, mask_kind):
    seq = 11
    v, s, v_other, s_other = _pair(seq, 4, 80, dtype, device, strided=False)
    v_ref, s_ref = reference.merge_state(v, s, v_other, s_other)
    v_before, s_before = v.clone(), s.clone()
    mask = None
    if mask_kind is not None:
        keep = torch.arange(seq) % 3 != 1  # some rows merge, some are left alone
        mask = keep.to(mask_kind).to(device)
    jitattn.merge_state_in_place(v, s, v_other, s_other, mask=mask)
    rows = torch.ones(seq, dtype=torch.bool) if mask is None else (mask.cpu() != 0)
    rows = rows.to(device)
    _assert_state_close(v[rows], s[rows], v_ref[rows], s_ref[rows], dtype)
    if mask is not None:
        # Unmasked rows are bit-for-bit untouched.
        assert torch.equal(v[~rows], v_before[~rows])
        assert torch.equal(s[~rows], s_before[~rows])


@pytest.mark.parametrize("num_states", [1, 3, 7])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_merge_states_matches_reference(device, dtype, num_states):
    g = _gen()
    v = _values((9, num_states, 4, 72), dtype, device, g)
    s = _lse((9, num_states, 4), device, g, empty_fraction=0.3)
    out_v, out_s = jitattn.merge_states(v, s)
    assert out_v.shape == (9, 4, 72) and out_s.shape == (9, 4)
    assert out_v.dtype == dtype and out_s.dtype == torch.float32
    _assert_state_close(out_v, out_s, *reference.merge_states(v, s), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_merge_states_follows_strides_of_a_state_major_layout(device, dtype):
    g = _gen()
    # Split-KV partials are often stored [num_states, seq, heads, dim]; merging a transposed view must work.
    v = _values((5, 7, 3, 64), dtype, device, g).transpose(0, 1)
    s = _lse((3, 5, 7), device, g).permute(2, 1, 0)  # [seq, states, heads], heads not unit-stride
    assert s.shape == (7, 5, 3) and not s.is_contiguous()
    out_v, out_s = jitattn.merge_states(v, s)
    _assert_state_close(out_v, out_s, *reference.merge_states(v, s), dtype)


@pytest.mark.parametrize("device", DEVICES)
def test_lse_is_the_natural_log(device):
    g = _gen()
    v_a, v_b = (_values((2, 3, 40), torch.float32, device, g) for _ in range(2))
    s_a = torch.zeros(2, 3, device=device)  # weight e^0 = 1
    s_b = torch.full((2, 3), math.log(3.0), device=device)  # weight 3
    v, s = jitattn.merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(s, torch.full_like(s, math.log(4.0)), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(v, (v_a + 3 * v_b) / 4, atol=1e-5, rtol=1e-5)


def _all_empty_pair(dtype, device):
    g = _gen()
    v_a, v_b = (_values((4, 3, 48), dtype, device, g) for _ in range(2))  # non-zero garbage values
    s_a = torch.full((4, 3), -math.inf, device=device)
    s_b = torch.full((4, 3), -math.inf, device=device)
    return v_a, s_a, v_b, s_b


@pytest.mark.parametrize("op", ["merge_state", "merge_state_in_place", "merge_states"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("device", DEVICES)
def test_two_empty_states_give_zero_and_minus_inf_never_nan(device, dtype, op):
    v_a, s_a, v_b, s_b = _all_empty_pair(dtype, device)
    if op == "merge_state":
        v, s = jitattn.merge_state(v_a, s_a, v_b, s_b)
    elif op == "merge_state_in_place":
        jitattn.merge_state_in_place(v_a, s_a, v_b, s_b)
        v, s = v_a, s_a
    else:
        v, s = jitattn.merge_states(torch.stack([v_a, v_b], dim=1), torch.stack([s_a, s_b], dim=1))
    assert not torch.isnan(v.float()).any() and not torch.isnan(s).any()
    assert torch.equal(v.float(), torch.zeros_like(v.float()))
    assert torch.equal(s, torch.full_like(s, -math.inf))


@pytest.mark.parametrize("device", DEVICES)
def test_an_empty_state_leaves_the_other_unchanged(device):
    g = _gen()
    v_a, v_b = (_values((3, 2, 40), torch.float32, device, g) for _ in range(2))
    s_a = _lse((3, 2), device, g, empty_fraction=0.0)
    s_b = torch.full((3, 2), -math.inf, device=device)
    v, s = jitattn.merge_state(v_a, s_a, v_b, s_b)
    torch.testing.assert_close(v, v_a, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(s, s_a, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_rows_is_an_empty_result_not_an_error(device):
    v_a, s_a, v_b, s_b = _pair(0, 4, 64, torch.float16, device, strided=False)
    v, s = jitattn.merge_state(v_a, s_a, v_b, s_b)
    assert v.shape == (0, 4, 64) and s.shape == (0, 4)
    v, s = jitattn.merge_states(torch.stack([v_a, v_b], 1), torch.stack([s_a, s_b], 1))
    assert v.shape == (0, 4, 64) and s.shape == (0, 4)


# -- bad inputs -----------------------------------------------------------------

def _good():
    g = _gen()
    v_a, v_b = (torch.randn(4, 2, 32, generator=g) for _ in range(2))
    s_a, s_b = (torch.randn(4, 2, generator=g) for _ in range(2))
    return dict(v_a=v_a, s_a=s_a, v_b=v_b, s_b=s_b)


BAD_PAIRS = [
    ("s_a-float16", dict(s_a=lambda t: t["s_a"].half()), TypeError, "s_a has dtype float16"),
    ("s_b-float64", dict(s_b=lambda t: t["s_b"].double()), TypeError, "s_b has dtype float64"),
    ("v_a-int32", dict(v_a=lambda t: t["v_a"].int(), v_b=lambda t: t["v_b"].int()), TypeError,
     "v_a has dtype int32"),
    ("v_b-dtype-differs", dict(v_b=lambda t: t["v_b"].half()), TypeError, "v_b is float16 but v_a is float32"),
    ("v_b-shape", dict(v_b=lambda t: t["v_b"][:, :, :16]), ValueError, "v_b has shape"),
    ("s_a-shape", dict(s_a=lambda t: t["s_a"][:3]), ValueError, "s_a has shape"),
    ("s_b-shape", dict(s_b=lambda t: t["s_b"][:, :1]), ValueError, "s_b has shape"),
    ("v_a-rank", dict(v_a=lambda t: t["v_a"][0]), ValueError, "v_a must have 3 dimensions"),
    ("s_a-rank", dict(s_a=lambda t: t["s_a"][..., None]), ValueError, "s_a must have 2 dimensions"),
    ("v_a-last-dim-strided", dict(v_a=lambda t: torch.randn(4, 2, 64)[:, :, ::2]), ValueError, "contiguous"),
    ("v_a-not-a-tensor", dict(v_a=lambda t: t["v_a"].tolist()), TypeError, "v_a must be a torch.Tensor"),
]


@pytest.mark.parametrize("changes, error, message", [c[1:] for c in BAD_PAIRS], ids=[c[0] for c in BAD_PAIRS])
@pytest.mark.parametrize("op", ["merge_state", "merge_state_in_place"])
def test_bad_merge_state_inputs_raise_errors_naming_the_argument(op, changes, error, message):
    tensors = _good()
    args = {name: (changes[name](tensors) if name in changes else tensors[name]) for name in tensors}
    if op == "merge_state_in_place":  # its arguments are v, s, v_other, s_other
        for a, b in (("v_a", "v"), ("s_a", "s"), ("v_b", "v_other"), ("s_b", "s_other")):
            message = message.replace(a, b)
    with pytest.raises(error, match=message):
        getattr(jitattn, op)(args["v_a"], args["s_a"], args["v_b"], args["s_b"])


def test_merge_state_in_place_refuses_an_expanded_destination():
    """v is written in place: an expand()ed v (stride 0) would have its rows overwrite each other."""
    t = _good()
    v = t["v_a"][:1].expand(4, -1, -1)
    with pytest.raises(ValueError, match="share memory"):
        jitattn.merge_state_in_place(v, t["s_a"], t["v_b"], t["s_b"])


def test_merge_state_in_place_refuses_other_states_shifted_over_its_own():
    """A v_other (s_other) over v's (s's) memory a row off would be overwritten before it is read; the very same
    tensor is fine (each row reads itself, then writes it)."""
    v, s = torch.randn(5, 2, 8), torch.randn(5, 2)
    with pytest.raises(ValueError, match="v and v_other share memory but not row for row"):
        jitattn.merge_state_in_place(v[1:], s[1:], v[:-1], s[:-1].clone())
    with pytest.raises(ValueError, match="s and s_other share memory but not row for row"):
        jitattn.merge_state_in_place(v[1:], s[1:], v[:-1].clone(), s[:-1])
    expected_v, expected_s = jitattn.merge_state(v, s, v, s)
    jitattn.merge_state_in_place(v, s, v, s)
    assert torch.allclose(v, expected_v) and torch.allclose(s, expected_s)
    # two states stacked in one buffer ([n, 2, ...]): their spans interleave, their elements do not
    vv, ss = torch.randn(5, 2, 2, 8), torch.randn(5, 2, 2)
    expected_v, expected_s = jitattn.merge_state(vv[:, 0], ss[:, 0], vv[:, 1], ss[:, 1])
    jitattn.merge_state_in_place(vv[:, 0], ss[:, 0], vv[:, 1], ss[:, 1])
    assert torch.allclose(vv[:, 0], expected_v) and torch.allclose(ss[:, 0], expected_s)


@pytest.mark.parametrize("mask, error, message", [
    (torch.ones(3, dtype=torch.bool), ValueError, "mask has shape"),
    (torch.ones(4, dtype=torch.float32), TypeError, "mask has dtype float32"),
    (torch.ones(4, 1, dtype=torch.bool), ValueError, "mask must have 1 dimensions"),
], ids=["length", "dtype", "rank"])
def test_bad_mask_raises_an_error_naming_it(mask, error, message):
    t = _good()
    with pytest.raises(error, match=message):
        jitattn.merge_state_in_place(t["v_a"], t["s_a"], t["v_b"], t["s_b"], mask=mask)


@pytest.mark.parametrize("v, s, error, message", [
    (torch.randn(4, 2, 3, 32), torch.randn(4, 2, 3).half(), TypeError, "s has dtype float16"),
    (torch.randn(4, 2, 3, 32), torch.randn(4, 3, 2), ValueError, r"s has shape \(4, 3, 2\); expected \(4, 2, 3\)"),
    (torch.randn(4, 2, 32), torch.randn(4, 2), ValueError, "v must have 4 dimensions"),
    (torch.randn(4, 2, 3, 32).int(), torch.randn(4, 2, 3), TypeError, "v has dtype int32"),
], ids=["s-dtype", "s-shape", "v-rank", "v-dtype"])
def test_bad_merge_states_inputs_raise_errors_naming_the_argument(v, s, error, message):
    with pytest.raises(error, match=message):
        jitattn.merge_states(v, s)


@pytest.mark.gpu
def test_mixed_devices_raise_a_clear_error():
    t = _good()
    with pytest.raises(ValueError, match="different devices"):
        jitattn.merge_state(t["v_a"].cuda(), t["s_a"].cuda(), t["v_b"].cuda(), t["s_b"])
    with pytest.raises(ValueError, match="different devices"):
        jitattn.merge_states(torch.randn(4, 2, 3, 32, device="cuda"), torch.randn(4, 2, 3))

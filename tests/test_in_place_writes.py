"""The ops that write their arguments in place (RoPE's ``_inplace`` forms, the fused-add norms, ``rmsnorm(out=)``,
the activations' ``out=``, the KV appends, ``merge_state_in_place``, the attention wrappers' ``out`` / ``lse``): their
kernels write through pointers, so they tell autograd as torch's own in-place ops do. A tensor autograd saved for a
backward, written since, fails that backward with torch's message (it used the new values, silently); a written tensor
that requires grad is refused in grad mode, an inference tensor outside inference mode; under no_grad /
inference_mode the writes go through."""

from __future__ import annotations

import re

import pytest
import torch

import jitattn
import jitattn.flashinfer as fi

T = 6  # tokens
POS = torch.arange(1, T + 1)


def _rope(x: torch.Tensor) -> None:
    fi.apply_rope_pos_ids_inplace(x[:96].view(T, 2, 8), torch.randn(T, 1, 8), POS)


def _rope_k(x: torch.Tensor) -> None:
    fi.apply_rope_pos_ids_inplace(torch.randn(T, 2, 8), x[:96].view(T, 2, 8), POS)


def _fused_input(x: torch.Tensor) -> None:
    fi.fused_add_rmsnorm(x[:96].view(T, 16), torch.randn(T, 16), torch.rand(16) + 0.5)


def _fused_residual(x: torch.Tensor) -> None:
    fi.gemma_fused_add_rmsnorm(torch.randn(T, 16), x[:96].view(T, 16), torch.rand(16))


def _rmsnorm_out(x: torch.Tensor) -> None:
    fi.rmsnorm(torch.randn(T, 16), torch.rand(16) + 0.5, out=x[:96].view(T, 16))


def _silu_out(x: torch.Tensor) -> None:
    fi.silu_and_mul(torch.randn(T, 32), out=x[:96].view(T, 16))


def _append(x: torch.Tensor) -> None:  # x: a cache of 3 pages of 2 tokens, 1 head of 8, as [pages, 2, page, 1, 8]
    cache = x[:96].view(3, 2, 2, 1, 8)
    fi.append_paged_kv_cache(torch.randn(T, 1, 8), torch.randn(T, 1, 8), torch.zeros(T, dtype=torch.int32),
                             torch.arange(T, dtype=torch.int32), cache, torch.arange(3, dtype=torch.int32),
                             torch.tensor([0, 3], dtype=torch.int32), torch.tensor([2], dtype=torch.int32))


def _merge_v(x: torch.Tensor) -> None:
    v = x[:96].view(T, 2, 8)
    jitattn.merge_state_in_place(v, torch.randn(T, 2), torch.randn(T, 2, 8), torch.randn(T, 2))


def _merge_s_base2(x: torch.Tensor) -> None:
    fi.merge_state_in_place(torch.randn(T, 2, 8), x[:96].view(T, 16)[:, :2], torch.randn(T, 2, 8), torch.randn(T, 2))


def _ragged_wrapper():
    """A ragged prefill plan of T queries of 2 heads over 5 keys of one kv head, head_dim 8, float32."""
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(torch.tensor([0, T], dtype=torch.int32), torch.tensor([0, 5], dtype=torch.int32), 2, 1, 8,
                 q_data_type=torch.float32)
    return wrapper


def _prefill_out(x: torch.Tensor) -> None:
    _ragged_wrapper().run(torch.randn(T, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8), out=x[:96].view(T, 2, 8))


def _prefill_lse(x: torch.Tensor) -> None:  # lse [T, 2] as a strided view (row stride 16) of x
    _ragged_wrapper().run(torch.randn(T, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8),
                          lse=x[:96].view(T, 16)[:, :2], return_lse=True)


def _mla_wrapper():
    """An MLA plan of 3 queries of 2 heads over 7 tokens in pages of 4, latent 128 + rope 64; its run's arguments."""
    wrapper = jitattn.BatchMLAPagedAttentionWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    wrapper.plan(torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 2], dtype=torch.int32),
                 torch.tensor([0, 1], dtype=torch.int32), torch.tensor([7], dtype=torch.int32), 2, 128, 64, 4, False,
                 0.1, torch.float32, torch.float32)
    cache = torch.randn(2, 4, 192)
    return wrapper, (torch.randn(3, 2, 128), torch.randn(3, 2, 64), cache[..., :128], cache[..., 128:])


def _mla_out(x: torch.Tensor) -> None:  # out [3, 2, 128]: 768 of x's floats
    wrapper, args = _mla_wrapper()
    wrapper.run(*args, out=x.view(3, 2, 128))


# case: (the call writing its argument x, what its error names x)
WRITERS = {"apply_rope_pos_ids_inplace q": (_rope, "q"), "apply_rope_pos_ids_inplace k": (_rope_k, "k"),
           "fused_add_rmsnorm input": (_fused_input, "input"),
           "gemma_fused_add_rmsnorm residual": (_fused_residual, "residual"), "rmsnorm out": (_rmsnorm_out, "out"),
           "silu_and_mul out": (_silu_out, "out"), "append_paged_kv_cache": (_append, "paged_kv_cache"),
           "merge_state_in_place v": (_merge_v, "v"), "flashinfer merge_state_in_place s": (_merge_s_base2, "s"),
           "prefill run out": (_prefill_out, "out"), "prefill run lse": (_prefill_lse, "lse"),
           "mla run out": (_mla_out, "out")}


def _tensor() -> torch.Tensor:
    """Storage for every writer's argument: 768 floats (MLA's out), the first T x 16 = 96 the others' (a cache of
    3 x 2 x 2 x 8)."""
    return torch.randn(768)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_backward_that_saved_the_written_tensor_fails(writer: str) -> None:
    """(x * w).sum() saves x for w's gradient; x written in place since: torch's own error, not a gradient
    computed from the new x."""
    x, w = _tensor(), torch.randn(768, requires_grad=True)
    y = (x * w).sum()
    version = x._version
    WRITERS[writer][0](x)
    assert x._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.backward()


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_written_tensor_that_requires_grad_is_refused_in_grad_mode(writer: str) -> None:
    x = _tensor().requires_grad_()
    before = x.detach().clone()
    write, name = WRITERS[writer]
    with pytest.raises(RuntimeError, match=f"{name}.*requires grad.*writes it in place outside autograd"):
        write(x)
    assert torch.equal(x.detach(), before)  # refused before anything was written
    with torch.no_grad():
        write(x)  # the caller says no gradient flows here: written
    assert not torch.equal(x.detach(), before)


@pytest.mark.parametrize("writer", list(WRITERS))
def test_an_inference_tensor_is_written_only_in_inference_mode(writer: str) -> None:
    with torch.inference_mode():
        x = _tensor()
    before = x.clone()
    write, name = WRITERS[writer]
    with pytest.raises(RuntimeError, match=f"{name} was made under torch.inference_mode"):
        write(x)
    assert torch.equal(x, before)
    with torch.inference_mode():
        write(x)
    assert not torch.equal(x, before)


def test_flashinfer_merge_in_place_refuses_an_s_inside_v() -> None:
    """The base-2 twin converts s to a natural-log copy before the native merge, whose check of v against s then
    saw the copy: an s cut from v's memory was taken, and the merged lse written back over merged values."""
    v = torch.randn(T, 2, 8)
    with pytest.raises(ValueError, match="v and s share memory"):
        fi.merge_state_in_place(v, v[:, :, 0], torch.randn(T, 2, 8), torch.randn(T, 2))


@pytest.mark.parametrize("name", ["out", "lse"])
@pytest.mark.parametrize("value", [True, [0.0]], ids=["bool", "list"])
@pytest.mark.parametrize("wrapper_kind", ["ragged", "mla"])
def test_an_out_or_lse_that_is_not_a_tensor_is_named(wrapper_kind: str, value, name: str) -> None:
    """run(q, k, v, True) puts True in out's place: a TypeError naming it (it was an AttributeError on .shape)."""
    if wrapper_kind == "ragged":
        call = lambda **kw: _ragged_wrapper().run(torch.randn(T, 2, 8), torch.randn(5, 1, 8), torch.randn(5, 1, 8),
                                                  return_lse=True, **kw)
        where = "BatchPrefillWithRaggedKVCacheWrapper.run()"
    else:
        wrapper, args = _mla_wrapper()
        call = lambda **kw: wrapper.run(*args, return_lse=True, **kw)
        where = "BatchMLAPagedAttentionWrapper.run()"
    with pytest.raises(TypeError, match=rf"^{re.escape(where)}: {name} must be a torch.Tensor, got "
                                        rf"{type(value).__name__}"):
        call(**{name: value})

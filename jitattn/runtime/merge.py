"""Merging attention states by their log-sum-exp.

An attention *state* is the pair (v, s): v ``[seq_len, num_heads, head_dim]``
is attention output over some subset of the keys, s ``[seq_len, num_heads]``
(float32) is the **natural-log** LSE of the logits over that subset. Merging
the states of disjoint key subsets gives the state over their union. A state
with s = -inf (no keys) contributes nothing (its v is weighted by 0, so a NaN or
inf left in it still reaches the result, as in FlashInfer's merges: an empty
state's v must be finite); merging two such states gives v = 0 and s = -inf,
never NaN.
"""

from __future__ import annotations

import threading

import torch

from ..jit import load
from ..spec import Target
from .specs import merge_spec
from .checks import check_no_overlap, check_shape, check_tensor, cpu_threads, stream_handle, target_of, written_over
from .grad import check_writable, mark_written, no_backward

_VALUE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _module(value_dtype: torch.dtype, target, use_sinks: bool = False):
    return load(merge_spec(target, value_dtype, use_sinks))


def _check_pair(v_a, s_a, v_b, s_b, names: tuple[str, str, str, str] = ("v_a", "s_a", "v_b", "s_b")) -> None:
    check_tensor(names[0], v_a, ndim=3, dtypes=_VALUE_DTYPES)
    check_tensor(names[1], s_a, ndim=2, dtypes=(torch.float32,), last_dim_contiguous=False)
    check_tensor(names[2], v_b, dtypes=_VALUE_DTYPES)
    if v_b.dtype != v_a.dtype:
        raise TypeError(f"{names[2]} is {str(v_b.dtype).removeprefix('torch.')} but {names[0]} is "
                        f"{str(v_a.dtype).removeprefix('torch.')}; the two states' values must have one dtype")
    check_tensor(names[3], s_b, dtypes=(torch.float32,), last_dim_contiguous=False)
    check_shape(names[2], v_b, tuple(v_a.shape))
    check_shape(names[1], s_a, tuple(v_a.shape[:2]))
    check_shape(names[3], s_b, tuple(v_a.shape[:2]))


def _launch_pair(v_a, s_a, v_b, s_b, v_out, s_out, mask) -> None:
    target, device = target_of("merge_state", (v_a, s_a, v_b, s_b, v_out, s_out, mask))
    seq_len, num_heads, head_dim = v_a.shape
    _module(v_a.dtype, target).launch(
        "merge_state", stream_handle(device),
        v_a=v_a.data_ptr(), s_a=s_a.data_ptr(), v_b=v_b.data_ptr(), s_b=s_b.data_ptr(),
        v_out=v_out.data_ptr(), s_out=s_out.data_ptr(), mask=mask.data_ptr() if mask is not None else None,
        seq_len=seq_len, num_heads=num_heads, head_dim=head_dim,
        v_a_stride_n=v_a.stride(0), v_a_stride_h=v_a.stride(1), s_a_stride_n=s_a.stride(0), s_a_stride_h=s_a.stride(1),
        v_b_stride_n=v_b.stride(0), v_b_stride_h=v_b.stride(1), s_b_stride_n=s_b.stride(0), s_b_stride_h=s_b.stride(1),
        v_out_stride_n=v_out.stride(0), v_out_stride_h=v_out.stride(1),
        s_out_stride_n=s_out.stride(0), s_out_stride_h=s_out.stride(1),
        num_threads=cpu_threads(),
    )


def _merge_state_eager(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager implementation (see the public function of the same name)."""
    _check_pair(v_a, s_a, v_b, s_b)
    v_out = torch.empty_like(v_a, memory_format=torch.contiguous_format)
    s_out = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    _launch_pair(v_a, s_a, v_b, s_b, v_out, s_out, None)
    return v_out, s_out


def _merge_state_in_place_eager(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Eager implementation (see the public function of the same name)."""
    _check_pair(v, s, v_other, s_other, ("v", "s", "v_other", "s_other"))
    check_writable("merge_state_in_place", v=v, s=s)
    check_no_overlap("v", v)  # written in place
    check_no_overlap("s", s)
    for name, written, read in (("v", v, v_other), ("s", s, s_other)):  # the same tensor is fine: each row reads
        same = (written.data_ptr(), written.stride()) == (read.data_ptr(), read.stride())  # itself, then writes it
        if not same and written_over(written, ((name + "_other", read),)):
            raise ValueError(f"{name} and {name}_other share memory but not row for row, so a merged row would "
                             f"overwrite another row's {name}_other before it is read; pass a copy of {name}_other")
    refuse_v_over_s(v, s)
    for name, written, read in (("v", v, ("s_other", s_other)), ("s", s, ("v_other", v_other))):
        if written_over(written, (read,)):
            raise ValueError(f"{name} shares memory with {read[0]}, which the merge reads while it writes {name}; "
                             f"pass a copy of {read[0]}")
    if mask is not None:
        check_tensor("mask", mask, ndim=1, dtypes=(torch.bool, torch.uint8))
        check_shape("mask", mask, (v.shape[0],))
        mask = mask.contiguous()
    _launch_pair(v, s, v_other, s_other, v, s, mask)
    mark_written(v, s)


def refuse_v_over_s(v: torch.Tensor, s: torch.Tensor) -> None:
    """Refuse an in-place merge's ``v`` and ``s`` that share memory: one's merged rows would overwrite the other's."""
    if written_over(v, (("s", s),)):
        raise ValueError("v and s share memory, so the merged values would overwrite the merged lse (or the reverse); "
                         "pass separate tensors")


# merge_states launches prepared per input signature (shapes, strides, dtypes, device) and per thread:
# cascade run() merges once per layer, and filling the params struct from keywords costs more than the
# launch. The module is looked up every call (a dict hit), so a prepared launch never outlives it.
_prepared = threading.local()


class PreparedMerge:
    """``merge_states`` for one input signature, its params struct filled once; each call sets the pointers."""

    def __init__(self, v: torch.Tensor, s: torch.Tensor) -> None:
        check_tensor("v", v, ndim=4, dtypes=_VALUE_DTYPES)
        check_tensor("s", s, ndim=3, dtypes=(torch.float32,), last_dim_contiguous=False)
        check_shape("s", s, tuple(v.shape[:3]))
        target, self.device = target_of("merge_states", (v, s))
        seq_len, num_states, num_heads, head_dim = v.shape
        self.module = _module(v.dtype, target)
        self.params = self.module.params(
            "merge_states", v=None, s=None, v_out=None, s_out=None,
            seq_len=seq_len, num_states=num_states, num_heads=num_heads, head_dim=head_dim,
            v_stride_n=v.stride(0), v_stride_k=v.stride(1), v_stride_h=v.stride(2),
            s_stride_n=s.stride(0), s_stride_k=s.stride(1), s_stride_h=s.stride(2),
            v_out_stride_n=num_heads * head_dim, v_out_stride_h=head_dim, s_out_stride_n=num_heads, s_out_stride_h=1,
            num_threads=cpu_threads(),
        )
        self.call = self.module.bind("merge_states", self.params)
        self.out_shape, self.lse_shape, self.dtype = (seq_len, num_heads, head_dim), (seq_len, num_heads), v.dtype
        self._scratch_lse: torch.Tensor | None = None  # the merged lse no caller asked for

    def __call__(self, v: torch.Tensor, s: torch.Tensor, with_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Merge ``v``/``s`` (of the signature this was prepared for) into new tensors.

        ``with_lse=False``: the merged lse goes to a scratch buffer this object keeps (overwritten by the next
        call on the stream, like the states themselves) and None is returned for it: one allocation less."""
        v_out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        if with_lse:
            s_out = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
        else:
            if self._scratch_lse is None:
                self._scratch_lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.device)
            s_out = self._scratch_lse
        p = self.params
        p.v, p.s, p.v_out, p.s_out = v.data_ptr(), s.data_ptr(), v_out.data_ptr(), s_out.data_ptr()
        if self.device.type == "cuda":
            self.call(stream_handle(self.device))
        else:
            p.num_threads = cpu_threads()
            self.call(None)
        return v_out, s_out if with_lse else None


def _merge_states_eager(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eager implementation (see the public function of the same name)."""
    if not isinstance(v, torch.Tensor) or not isinstance(s, torch.Tensor):  # before the signature reads .shape
        check_tensor("v", v)
        check_tensor("s", s, last_dim_contiguous=False)
    signature = (v.shape, v.stride(), v.dtype, v.device, s.shape, s.stride(), s.dtype, s.device)
    cache = getattr(_prepared, "merges", None)
    if cache is None:
        cache = _prepared.merges = {}
    prepared = cache.get(signature)
    if prepared is not None and prepared.module is not _module(v.dtype, Target.CUDA if v.is_cuda else Target.CPU):
        prepared = None  # the module was reloaded (another cache root)
    if prepared is None:
        prepared = PreparedMerge(v, s)
        if len(cache) > 256:
            cache.clear()
        cache[signature] = prepared
    return prepared(v, s)


def merge_states_with_sinks(v: torch.Tensor, s: torch.Tensor, sinks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``merge_states``, then attention sinks applied once to the merged output (eager only).

    ``sinks``: float32 ``[num_heads]`` natural-log sink logits. The merged output of head h is scaled by
    ``1 / (1 + exp(sinks[h] - lse))`` (0 where no state saw a key); the LSE returned is the states'.
    The final merge of a cascade whose model has sinks (the levels merge without them).
    """
    check_tensor("v", v, ndim=4, dtypes=_VALUE_DTYPES)
    check_tensor("s", s, ndim=3, dtypes=(torch.float32,), last_dim_contiguous=False)
    check_shape("s", s, tuple(v.shape[:3]))
    target, device = target_of("merge_states", (v, s, sinks))
    from .batch import check_sinks

    check_sinks("merge_states_with_sinks", sinks, v.shape[2], v.device)
    seq_len, num_states, num_heads, head_dim = v.shape
    v_out = torch.empty((seq_len, num_heads, head_dim), dtype=v.dtype, device=v.device)
    s_out = torch.empty((seq_len, num_heads), dtype=torch.float32, device=v.device)
    _module(v.dtype, target, use_sinks=True).launch(
        "merge_states", stream_handle(device), v=v.data_ptr(), s=s.data_ptr(), v_out=v_out.data_ptr(),
        s_out=s_out.data_ptr(), seq_len=seq_len, num_states=num_states, num_heads=num_heads, head_dim=head_dim,
        v_stride_n=v.stride(0), v_stride_k=v.stride(1), v_stride_h=v.stride(2),
        s_stride_n=s.stride(0), s_stride_k=s.stride(1), s_stride_h=s.stride(2),
        v_out_stride_n=num_heads * head_dim, v_out_stride_h=head_dim, s_out_stride_n=num_heads, s_out_stride_h=1,
        num_threads=cpu_threads(), sinks=sinks.data_ptr(),
    )
    return v_out, s_out


# torch.compile: the same functions as opaque custom ops (fake implementations give shapes only).
_merge_state_op = torch.library.custom_op("jitattn::merge_state", mutates_args=())(_merge_state_eager)
_merge_states_op = torch.library.custom_op("jitattn::merge_states", mutates_args=())(_merge_states_eager)
_merge_state_in_place_op = torch.library.custom_op(
    "jitattn::merge_state_in_place", mutates_args=("v", "s"))(_merge_state_in_place_eager)


@_merge_state_op.register_fake
def _(v_a, s_a, v_b, s_b):
    return torch.empty_like(v_a, memory_format=torch.contiguous_format), s_a.new_empty(s_a.shape)


@_merge_states_op.register_fake
def _(v, s):
    return v.new_empty((v.shape[0], v.shape[2], v.shape[3])), s.new_empty((s.shape[0], s.shape[2]))


@_merge_state_in_place_op.register_fake
def _(v, s, v_other, s_other, mask=None):
    return None


@no_backward
def merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states.

    Args:
        v_a, v_b: ``[seq_len, num_heads, head_dim]``, float16/bfloat16/float32.
        s_a, s_b: ``[seq_len, num_heads]`` float32, natural-log LSE.

    Returns:
        ``(v, s)``: the merged output (v_a's dtype) and its natural-log LSE.

    LSEs from ``jitattn.flashinfer`` (FlashInfer's base 2) merge with ``jitattn.flashinfer``'s twin of this function.
    """
    if torch.compiler.is_compiling():
        return _merge_state_op(v_a, s_a, v_b, s_b)
    return _merge_state_eager(v_a, s_a, v_b, s_b)


def merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor,
    mask: torch.Tensor | None = None,
) -> None:
    """Merge ``(v_other, s_other)`` into ``(v, s)`` in place.

    ``mask`` (optional, bool ``[seq_len]``): rows where it is False are left unchanged. ``s`` and ``s_other`` are
    natural-log LSEs.

    LSEs from ``jitattn.flashinfer`` (FlashInfer's base 2) merge with ``jitattn.flashinfer``'s twin of this function.
    """
    if torch.compiler.is_compiling():
        return _merge_state_in_place_op(v, s, v_other, s_other, mask)
    return _merge_state_in_place_eager(v, s, v_other, s_other, mask)


@no_backward
def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``num_states`` attention states per row.

    Args:
        v: ``[seq_len, num_states, num_heads, head_dim]``.
        s: ``[seq_len, num_states, num_heads]`` float32, natural-log LSE.

    Returns:
        ``(v, s)`` of shapes ``[seq_len, num_heads, head_dim]`` and ``[seq_len, num_heads]``.

    LSEs from ``jitattn.flashinfer`` (FlashInfer's base 2) merge with ``jitattn.flashinfer``'s twin of this function.
    """
    if torch.compiler.is_compiling():
        return _merge_states_op(v, s)
    return _merge_states_eager(v, s)

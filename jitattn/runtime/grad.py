"""Autograd's rules for inference-only kernels: tensors written in place through pointers (refused where a backward
would miss the write, counted in their version counters as torch's own in-place ops do), and results tied to a node
whose backward says the call cannot be differentiated."""

from __future__ import annotations

import functools
import threading

import torch
from torch.autograd.graph import increment_version


def check_writable(what: str, **written) -> None:
    """Refuse tensors (None: skipped) that a kernel would write in place behind autograd's back: one that requires
    grad while grad mode is on (no backward would see the write), and an inference tensor outside inference mode
    (which torch's own in-place ops refuse)."""
    if torch.is_inference_mode_enabled():  # neither can happen there (grad mode is off): the per-layer fast path
        return
    refuse_grad_writes(what, **written)
    for name, t in written.items():
        if t is not None and t.is_inference():
            raise RuntimeError(f"{what}: {name} was made under torch.inference_mode(), and torch lets nothing update "
                               f"such a tensor in place outside it; call this under torch.inference_mode() too, or "
                               f"pass {name}.clone()")


def refuse_grad_writes(what: str, **written) -> None:
    """``check_writable``'s grad rule alone, traceable by Dynamo: under torch.compile a custom op writes copies of
    the caller's tensors, where the rule inside it cannot see that they require grad."""
    if torch.is_grad_enabled() or getattr(_RECORDING, "active", False):  # (no_backward turns grad mode off)
        for name, t in written.items():
            if t is not None and t.requires_grad:
                raise RuntimeError(f"{what}: {name} requires grad, and this call writes it in place outside autograd "
                                   f"(it has no backward); call it under torch.no_grad() or torch.inference_mode(), "
                                   f"or pass {name}.detach()")


def mark_written(*tensors) -> None:
    """Count a kernel's in-place write (through the tensors' pointers) in their version counters, as torch's own
    in-place ops do: a backward that saved their earlier values then fails with torch's message instead of using
    the new ones. None: skipped."""
    increment_version([t for t in tensors if t is not None])


def claim_outputs(wrapper: str, out, lse) -> None:
    """A caller's ``out`` / ``lse`` buffers (None: not given) before ``wrapper``'s run() writes them: tensors,
    writable here (``check_writable``) and counted as written (``mark_written``), as the in-place ops' arguments.
    Under inference mode the type check alone (nothing there records a backward). run() calls this every time: the
    common case is kept to a few attribute reads and one call (the message is built only to raise)."""
    if out is None and lse is None:
        return
    for name, t in (("out", out), ("lse", lse)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{wrapper}.run(): {name} must be a torch.Tensor, got {type(t).__name__}")
    if torch.is_inference_mode_enabled():
        return
    written = (lse,) if out is None else (out,) if lse is None else (out, lse)
    for t in written:
        if t.requires_grad or t.is_inference():
            check_writable(f"{wrapper}.run()", out=out, lse=lse)  # (every tensor in one call)
            break
    increment_version(written)


def needs_grad(*values) -> bool:
    """Whether one of ``values`` (tensors, tuples or lists of them, anything else) requires grad: with grad mode
    on, autograd would record a call on them. Cheap (a loop of attribute reads: run() calls it in grad mode)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            if value.requires_grad:
                return True
        elif isinstance(value, (tuple, list)) and any(isinstance(t, torch.Tensor) and t.requires_grad for t in value):
            return True
    return False


_RECORDING = threading.local()  # .active: a call runs inside _NoBackward (its caller in grad mode)


class _NoBackward(torch.autograd.Function):
    """Runs a kernel call inside autograd's record of it: its outputs then hang off a node whose backward says the
    call cannot be differentiated, instead of being tensors without a grad_fn (whose backward fails with torch's
    generic message, far from the call)."""

    @staticmethod
    def forward(ctx, what: str, call, *inputs):  # inputs: only to tie the outputs to them
        ctx.what = what
        _RECORDING.active = True  # the caller's grad mode, for check_writable (autograd turns it off in here)
        try:
            return call()
        finally:
            _RECORDING.active = False

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.what} is inference-only: jitattn's kernels have no backward. Train with an "
                           "attention that has one (torch's scaled_dot_product_attention), or run this under "
                           "torch.no_grad() / torch.inference_mode()")


def inference_only(what: str, call, inputs) -> object:
    """``call()``, whose results (tensors, or a tuple of them) autograd ties to those of ``inputs`` that require
    grad, with a backward that raises a clear error naming ``what``. For callers that found ``needs_grad`` true in
    grad mode; with nothing requiring grad it is just ``call()``."""
    needing = [t for v in inputs for t in (v if isinstance(v, (tuple, list)) else (v,))
               if isinstance(t, torch.Tensor) and t.requires_grad]
    return _NoBackward.apply(what, call, *needing) if needing else call()


def no_backward(fn):
    """Decorator of a public op or ``run()``: in grad mode, with an argument that requires grad (a tensor, or one in
    a tuple or list argument), its results through ``inference_only``, named by the function's qualified name."""
    what = fn.__qualname__

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.is_grad_enabled() and needs_grad(*args, *kwargs.values()):
            if torch.compiler.is_compiling():  # (Dynamo would trace the backward that raises, at every call)
                raise RuntimeError(f"{what} is inference-only (jitattn's kernels have no backward), and an argument "
                                   "requires grad: under torch.compile call it under torch.no_grad() or "
                                   "torch.inference_mode(), or with tensors that do not require grad")
            return inference_only(what, lambda: fn(*args, **kwargs), (*args, *kwargs.values()))
        return fn(*args, **kwargs)
    return call

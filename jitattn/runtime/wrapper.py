"""What every batch wrapper (decode, paged prefill, ragged prefill) shares.

Construction (target from the workspace, layout, backend, CUDA-graph buffers),
workspace replacement, the eager/compiled run dispatch, the run-time options
FlashInfer's ``run()`` takes (``q_scale``, ``window_left``, positional custom
variant arguments) and its older ``forward`` spellings. Each wrapper adds its
own ``plan()`` and ``run()``.
"""

from __future__ import annotations

import functools
import struct

import torch

from ..spec import Target
from .batch import AttentionPlan, run_plan, run_plan_or_compiled
from .checks import FP8_DTYPES, not_planned, target_of
from .grad import inference_only, needs_grad
from .compiled import register_wrapper
from .fp8_prefill import device_scales
from .options import (FLAG_ARGUMENTS, check_flag, check_flags, fp8_scale, parse_kv_layout, refuse_unsupported,
                      resolve_flag, resolve_window_left)

# The index arrays a captured launch reads, which CUDA-graph mode needs in fixed caller buffers.
_GRAPH_ROLES = ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len")


def workspace_target(workspace: torch.Tensor, wrapper: str) -> tuple[Target, torch.device]:
    if not isinstance(workspace, torch.Tensor):
        raise TypeError(f"{wrapper}: float_workspace_buffer must be a torch.Tensor (e.g. torch.empty(128 << 20, dtype=torch.uint8))")
    if not workspace.is_contiguous():  # the kernels write its bytes from data_ptr on, gaps included
        raise ValueError(f"{wrapper}: float_workspace_buffer (strides {tuple(workspace.stride())}) is not contiguous: "
                         "the kernels would write into the memory between its elements; pass a tensor of its own")
    return target_of(wrapper, (workspace,))


class NotCopyable:
    """A wrapper's copy or pickle is refused: it holds its plan's device buffers, loaded kernels and (under
    torch.compile) a registration by which compiled code finds it, so a copy would share them and re-planning one
    would change the other."""

    def _refuse_copy(self, *args):
        raise TypeError(f"{type(self).__name__} cannot be copied or pickled: its plan's buffers and kernels belong to "
                        "it. Make a new wrapper and plan() it (wrappers may share one workspace when they do not run "
                        "concurrently)")

    __copy__ = __deepcopy__ = __reduce_ex__ = __reduce__ = _refuse_copy


class BatchWrapperBase(NotCopyable):
    _NAME = ""

    def __init__(
        self, float_workspace_buffer: torch.Tensor, kv_layout: str, use_cuda_graph: bool, backend: str,
        buffers: dict[str, torch.Tensor | None], buffer_args: dict[str, str], jit_args=None, jit_kwargs=None,
    ) -> None:
        """``buffers``: the caller's fixed index buffers by role; ``buffer_args``: the argument naming each."""
        refuse_unsupported(f"{self._NAME}()", "custom kernels are given as plan(..., variant=jitattn.AttentionVariant(...))",
                           jit_args=jit_args, jit_kwargs=jit_kwargs)
        self._target, self._device = workspace_target(float_workspace_buffer, self._NAME)
        self._workspace = float_workspace_buffer
        self._kv_layout = parse_kv_layout(kv_layout)
        if backend not in ("auto", "fa2", "fa3"):
            raise ValueError(f"backend={backend!r} is not supported; use 'auto' (or 'fa2'/'fa3', which pick the same "
                             "kernels)")
        self._use_cuda_graph = resolve_flag(use_cuda_graph, "use_cuda_graph")  # a string such as "False" is truthy
        missing = [buffer_args[role] for role in _GRAPH_ROLES if role in buffer_args and buffers.get(role) is None]
        if self._use_cuda_graph and missing:
            raise ValueError(f"use_cuda_graph=True needs the fixed index buffers {', '.join(missing)} "
                             "(sized for the largest batch)")
        self._buffers = buffers
        self._uses_sinks = False  # a run() passed sinks: later plans prepare the sink launch up front
        self._plan: AttentionPlan | None = None
        self._plan_call: dict = {}  # the keyword arguments of the last plan(), for forward()'s re-plan
        self._op_key = register_wrapper(self)

    @property
    def _plan(self) -> AttentionPlan | None:
        return self._current_plan

    @_plan.setter
    def _plan(self, plan: AttentionPlan | None) -> None:
        # Once run() has seen sinks, every new plan loads its sink launch here, in plan(): a run()
        # being captured into a CUDA graph then only reads the prepared struct.
        if plan is not None and self._uses_sinks and plan.spec.variant is None:  # a variant takes no sinks
            plan.sink_launch_ready()
        self._current_plan = plan

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    # What a wrapper that composes others (the cascade) reads of them: the last plan, where it runs, and the
    # planned launch with the run-time arguments only.
    @property
    def current_plan(self) -> AttentionPlan | None:
        """The last ``plan()``'s plan (None before one succeeded)."""
        return self._current_plan

    @property
    def target(self):
        """The target of the workspace's device (``Target.CUDA`` or ``Target.CPU``)."""
        return self._target

    @property
    def kv_layout(self):
        """The KV layout (``KVLayout``) the wrapper was made for."""
        return self._kv_layout

    def run_planned(self, q, kv, *, k_scale: float, v_scale: float, out, lse, return_lse: bool,
                    fixed_outputs: bool = False):
        """The current plan's launch with resolved scales (``run()`` without its option handling): out, or
        (out, lse). ``fixed_outputs``: ``out`` / ``lse`` are buffers the caller keeps for this plan."""
        return run_plan(self._plan, self._NAME, self._workspace, q, kv, k_scale=k_scale, v_scale=v_scale, out=out,
                        lse=lse, return_lse=return_lse, fixed_outputs=fixed_outputs)

    # FlashInfer's private plan attributes that serving backends read back (vLLM asserts them before
    # every run()): the planned values as FlashInfer keeps them (soft cap None -> 0.0, the rest raw).
    @property
    def _window_left(self) -> int:
        return self._plan_call.get("window_left", -1)

    @property
    def _logits_soft_cap(self) -> float:
        cap = self._plan_call.get("logits_soft_cap")
        return 0.0 if cap is None else cap

    @property
    def _sm_scale(self) -> float | None:
        return self._plan_call.get("sm_scale")

    @property
    def _causal(self) -> bool:
        return self._plan_call.get("causal", False)

    @property
    def _pos_encoding_mode(self) -> str:
        return self._plan_call.get("pos_encoding_mode", "NONE")

    @property
    def _rope_scale(self) -> float | None:
        return self._plan_call.get("rope_scale")

    @property
    def _rope_theta(self) -> float | None:
        return self._plan_call.get("rope_theta")

    def drop_plan(self) -> None:
        """Leave the wrapper without a plan (what a ``plan()`` that raised leaves): ``run()`` then says so."""
        self._plan, self._plan_call = None, {}

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor, int_workspace_buffer=None) -> None:
        """Use another float workspace (on the same device); the int workspace is not needed (plan metadata
        lives in the wrapper's own buffers)."""
        workspace_target(float_workspace_buffer, self._NAME)  # a tensor
        target_of(self._NAME, (float_workspace_buffer, self._workspace))
        self._workspace = float_workspace_buffer

    def end_forward(self) -> None:
        """No-op kept for older FlashInfer call sites."""

    def _forward(self, options: dict, run_args: tuple, run_kwargs: dict):
        """FlashInfer's older ``forward``: its plan-time options replace the planned ones.

        When they differ from what ``plan()`` was given, the batch is planned again with them
        (the kernel may change: RoPE, a window or a soft cap are compiled in), so an option is
        never accepted and ignored.
        """
        if self._plan is None:
            raise not_planned(self._NAME, "forward", "plan() (or begin_forward())")
        head_dim = self._plan.head_dim_qk
        changed = {name: value for name, value in options.items()
                   if _as_planned(name, self._plan_call.get(name), head_dim) != _as_planned(name, value, head_dim)}
        if changed and self._plan_call.get("fast_decode_plan"):  # its arrays are not kept: no re-plan
            raise ValueError(
                f"{self._NAME}.forward({', '.join(f'{k}={v!r}' for k, v in changed.items())}) differs from the last "
                "fast_decode_plan(); pass these options to fast_decode_plan and call run()"
            )
        if changed:
            planned = dict(self._plan_call)
            try:
                self.plan(**{**planned, **changed})
            except Exception:  # refused options leave the batch planned as it was (a refused plan() leaves none)
                try:
                    self.plan(**planned)
                except Exception:
                    pass
                raise
        return self.run(*run_args, **run_kwargs)

    def _run(self, q, kv, k_scale, v_scale, out, lse, return_lse, variant_args, variant_positional=(),
             q_scale=None, window_left=None, sinks=None, enable_pdl=None):
        """``kv``: the paged cache as given (paged plans) or the ``(k, v)`` pair (ragged); ``sinks``: float32
        ``[num_qo_heads]`` attention sinks (None: none); ``enable_pdl`` only checked (speed only, ignored)."""
        if torch.is_grad_enabled() and needs_grad(q, kv, sinks):  # re-entered under autograd's record, grad mode off
            return inference_only(f"{self._NAME}.run", lambda: self._run(
                q, kv, k_scale, v_scale, out, lse, return_lse, variant_args, variant_positional, q_scale, window_left,
                sinks, enable_pdl), (q, kv, sinks))
        check_flag(enable_pdl, "enable_pdl")
        plan = self._plan
        if return_lse is not False and return_lse is not True:  # the hot path passes a bool: two identity tests
            return_lse = resolve_flag(return_lse, "return_lse")
        if sinks is not None:
            self._uses_sinks = True
        if (window_left is not None and plan is not None  # rare: run() takes it for FlashInfer's signature
                and resolve_window_left(window_left) != plan.scalars.window_left):
            raise ValueError(
                f"{self._NAME}.run(window_left={window_left}) differs from the planned window_left="
                f"{plan.scalars.window_left}; the window is part of the plan: pass it to plan()"
            )
        if variant_positional:
            variant_args = _positional_variant_args(self._NAME, plan, variant_positional, variant_args)
        head_scales = None
        if plan is not None and plan.q_dtype in FP8_DTYPES:  # an fp8 query's scales may be device tensors
            (q_scale, k_scale, v_scale), head_scales = device_scales(
                q_scale, k_scale, v_scale, plan.num_qo_heads, plan.num_kv_heads, q.device)
        k_scale = 1.0 if k_scale is None else fp8_scale(k_scale, "k_scale")
        v_scale = 1.0 if v_scale is None else fp8_scale(v_scale, "v_scale")
        q_scale = 1.0 if q_scale is None else fp8_scale(q_scale, "q_scale")
        if head_scales is not None:
            if torch.compiler.is_compiling():
                raise NotImplementedError(f"{self._NAME}.run() with scale tensors is not supported under torch.compile"
                                          " yet; pass Python floats or call it outside the compiled region")
            return run_plan(plan, self._NAME, self._workspace, q, kv, k_scale=k_scale, v_scale=v_scale, out=out,
                            lse=lse, return_lse=return_lse, variant_args=variant_args, q_scale=q_scale, sinks=sinks,
                            head_scales=head_scales)
        if torch.compiler.is_compiling():
            return run_plan_or_compiled(
                self._op_key, plan, self._NAME, self._workspace, q, kv, k_scale=k_scale, v_scale=v_scale, out=out,
                lse=lse, return_lse=return_lse, variant_args=variant_args, q_scale=q_scale, sinks=sinks,
            )
        return run_plan(plan, self._NAME, self._workspace, q, kv, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse,
                        return_lse=return_lse, variant_args=variant_args, q_scale=q_scale, sinks=sinks)

    def _run_eager(self, q, k, v, *, k_scale, v_scale, out, lse, return_lse, q_scale=1.0):
        return run_plan(self._plan, self._NAME, self._workspace, q, (k, v), k_scale=k_scale, v_scale=v_scale,
                        out=out, lse=lse, return_lse=return_lse, q_scale=q_scale)


def drops_plan_on_failure(plan):
    """For a ``plan()`` that records its arguments first thing (``plan_arguments``): when it raises, the wrapper is
    left without a plan (and without recorded options), as every wrapper is after a refused plan: running the last
    batch's plan on this batch's tensors would be silently wrong, and ``forward()`` must not take the failed call's
    options as planned."""
    @functools.wraps(plan)
    def planned(self, *args, **kwargs):
        try:
            return plan(self, *args, **kwargs)
        except BaseException:
            self.drop_plan()
            raise
    return host_side(planned)


def host_side(function):
    """``function`` run eagerly under torch.compile, a graph break. A plan computes on the host from index arrays and
    binds the kernels' argument structs to their addresses, which a trace would turn into fake tensors (an empty
    array's placeholder address lost, a launch refused); what runs each step is the run() custom op. The POD
    wrappers' run() composes its parts' launches in Python (and plans the prefill part), which no graph holds
    either."""
    return torch.compiler.disable(function)


def returning_lse(run):
    """FlashInfer's ``run_return_lse`` (a ``functools.partialmethod`` there) as a plain method, which Dynamo traces
    (a partialmethod's ``__get__`` it does not: under ``fullgraph=True`` the call failed): ``run`` with
    ``return_lse=True``, a keyword the call gives winning as with a partialmethod."""

    @functools.wraps(run)
    def run_return_lse(self, *args, **kwargs):
        return run(self, *args, **{"return_lse": True, **kwargs})
    return run_return_lse


def plan_arguments(plan_locals: dict) -> dict:
    """A ``plan()``'s arguments from the ``locals()`` it takes first thing (``forward()`` re-plans with them)."""
    call = dict(plan_locals)
    del call["self"]
    call.pop("__class__", None)  # present when the method uses super()
    check_flags(**{name: call[name] for name in FLAG_ARGUMENTS if name in call})
    return call


# FlashInfer's defaults of the options forward() may repeat (None means the default).
_OPTION_DEFAULTS = {"logits_soft_cap": 0.0, "window_left": -1, "rope_scale": 1.0, "rope_theta": 1e4}


def _as_planned(name: str, value, head_dim: int):
    """An option as the kernel sees it: None resolved to FlashInfer's default, floats rounded to float32.

    ``forward(sm_scale=head_dim ** -0.5, logits_soft_cap=0.0)`` after a plan without them (SGLang's
    call) is the same plan, although ``head_dim ** -0.5 != 1 / sqrt(head_dim)`` in float64 for some head dims.
    """
    if value is None:
        value = head_dim ** -0.5 if name == "sm_scale" else _OPTION_DEFAULTS.get(name)
    if isinstance(value, float):
        return struct.unpack("f", struct.pack("f", value))[0]
    return value


def _positional_variant_args(wrapper: str, plan: AttentionPlan | None, values: tuple, named: dict) -> dict:
    """FlashInfer passes a custom variant's extra tensors positionally after the KV: map them to names."""
    variant = plan.spec.variant if plan is not None else None
    if variant is None:
        raise TypeError(f"{wrapper}.run() got {len(values)} extra positional argument(s); they are the parameters "
                        "of a custom variant, and this plan has none (plan(..., variant=...))")
    names = [p.name for p in variant.params]
    if len(values) > len(names):
        raise TypeError(f"{wrapper}.run() got {len(values)} positional variant arguments; variant {variant.name!r} "
                        f"declares {len(names)} ({', '.join(names) or 'none'})")
    both = sorted(set(names[: len(values)]) & set(named))
    if both:
        raise TypeError(f"{wrapper}.run() got variant argument(s) {both} both by position and by name")
    return {**dict(zip(names, values)), **named}

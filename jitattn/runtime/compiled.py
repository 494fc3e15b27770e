"""torch.library custom ops, so models calling jitattn compile with torch.compile.

Under compilation a wrapper's ``run()`` becomes one opaque op call,
``jitattn::wrapper_run``, keyed by a per-wrapper integer that never changes:
the current plan is looked up when the op executes, so a new ``plan()``
(different lengths, same shapes) never triggers a recompile. A prefill plan
that applies RoPE before its kernel rotates its operands in a second op,
``jitattn::wrapper_rope_first``, before it; a paged plan whose kernel reads the
cache's rows gathered (the fp8 upcast, RoPE first) gathers them in a third,
``jitattn::wrapper_kv_rows``, whose row count is the plan's (a size the graph
does not specialise on). ``BatchMLAPagedAttentionWrapper.run()`` is one op,
``jitattn::mla_run`` (its launch checks the latent caches' addresses), and
``MultiLevelCascadeAttentionWrapper.run()`` one, ``jitattn::cascade_run`` (every
level and the merge: the plan's state buffers stay out of the graph). The fake
implementations give output shapes and dtypes without running anything.
"""

from __future__ import annotations

import itertools
import weakref
import torch

from ..spec import KVLayout
from .checks import check_tensor
from .grad import refuse_grad_writes
from .kv import split_paged_kv_cache
from .options import fp8_scale

# The ops whose launch is a plan made outside the graph (or, in compiled_ops, that may copy host index arrays to the
# device): under torch.compile's CUDA graphs (mode="reduce-overhead", as transformers' generate compiles a static
# cache's forward) Inductor runs them between its graphs, not inside one whose replays would launch the captured plan
# (a wrapper without use_cuda_graph=True refuses the capture).
OUTSIDE_CUDA_GRAPHS = tuple(t for t in (getattr(torch.Tag, "cudagraph_unsafe", None),) if t is not None)

_wrappers: dict[int, weakref.ReferenceType] = {}
_keys = itertools.count(1)


def register_wrapper(wrapper: object) -> int:
    """A stable key for ``wrapper`` (dropped when the wrapper is garbage collected)."""
    key = next(_keys)
    _wrappers[key] = weakref.ref(wrapper, lambda _ref, key=key: _wrappers.pop(key, None))
    return key


def _wrapper_of(key: int):
    """The wrapper ``key`` names (``register_wrapper``), when an op of a compiled graph runs."""
    wrapper = _wrappers[key]()
    if wrapper is None:
        raise RuntimeError("jitattn: the wrapper this compiled graph calls no longer exists")
    return wrapper


@torch.library.custom_op("jitattn::wrapper_run", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def wrapper_run(
    key: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim_vo: int, out_dtype: torch.dtype,
    k_scale: float, v_scale: float, q_scale: float, q_repeat: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_repeat``: output rows per q row (a plan whose rows share queries, e.g. a split cascade level)."""
    wrapper = _wrapper_of(key)
    return wrapper._run_eager(q, k, v, k_scale=k_scale, v_scale=v_scale, q_scale=q_scale, out=None, lse=None,
                              return_lse=True)


@wrapper_run.register_fake
def _wrapper_run_fake(key, q, k, v, head_dim_vo, out_dtype, k_scale, v_scale, q_scale, q_repeat):
    out = q.new_empty((q.shape[0] * q_repeat, q.shape[1], head_dim_vo), dtype=out_dtype)
    lse = q.new_empty((q.shape[0] * q_repeat, q.shape[1]), dtype=torch.float32)
    return out, lse


def run_compiled(
    key: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, head_dim_vo: int, out_dtype: torch.dtype,
    k_scale: float, v_scale: float, out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool,
    q_scale: float = 1.0, q_repeat: int = 1,
):
    """The compiled path of a wrapper's run(): one custom op, results copied into out/lse if given."""
    check_buffers("run()", out, lse, (q.shape[0] * q_repeat, q.shape[1], head_dim_vo), out_dtype)
    result, result_lse = torch.ops.jitattn.wrapper_run(key, q, k, v, head_dim_vo, out_dtype, k_scale, v_scale,
                                                       q_scale, q_repeat)
    return _returned(result, result_lse, out, lse, return_lse)


def check_buffers(where: str, out: torch.Tensor | None, lse: torch.Tensor | None, shape: tuple, dtype) -> None:
    """The caller's out / lse against the op's result, at trace time: eager's checks of their shapes and dtypes,
    and of a grad-requiring buffer (the op's result is copied into them; their addresses are not traceable)."""
    refuse_grad_writes(where, out=out, lse=lse)
    for name, t, want, dtypes in (("out", out, shape, (dtype,)), ("lse", lse, shape[:2], (torch.float32,))):
        if t is not None:
            check_tensor(name, t, ndim=len(want), dtypes=dtypes, last_dim_contiguous=name == "out")
            if tuple(t.shape) != want:
                raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")


def _scales(k_scale, v_scale) -> tuple[float, float]:
    """A run's ``k_scale`` / ``v_scale`` as the floats an op takes (None: 1; a tensor is refused under compile)."""
    return tuple(1.0 if x is None else fp8_scale(x, name) for x, name in ((k_scale, "k_scale"), (v_scale, "v_scale")))


def _returned(result: torch.Tensor, result_lse: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None,
              return_lse: bool):
    """An op's (out, lse) as run() returns them: copied into the caller's out / lse when given."""
    if out is not None:
        out.copy_(result)
        result = out
    if lse is not None:
        lse.copy_(result_lse)
        result_lse = lse
    return (result, result_lse) if return_lse else result


@torch.library.custom_op("jitattn::wrapper_rope_first", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def wrapper_rope_first(key: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The current plan's operands of a prefill wrapper that applies RoPE first (``rope_operands``)."""
    wrapper = _wrapper_of(key)
    rotated = wrapper.rope_operands(q, k, v)
    return tuple(x.clone() if x is y else x for x, y in zip(rotated, (q, k, v)))  # an op's outputs never alias


@wrapper_rope_first.register_fake
def _wrapper_rope_first_fake(key, q, k, v):
    from .rope_first import OPERAND_DTYPE

    return tuple(x.new_empty(x.shape, dtype=OPERAND_DTYPE) for x in (q, k, v))


def rope_first_operands(key: int, rotation, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rotation(q, k, v)`` (a ``RopeFirst``) eagerly; under torch.compile the custom op that finds it at run time."""
    if torch.compiler.is_compiling():
        return torch.ops.jitattn.wrapper_rope_first(key, q, k, v)
    return rotation(q, k, v)


@torch.library.custom_op("jitattn::wrapper_kv_rows", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def wrapper_kv_rows(key: int, k: torch.Tensor, v: torch.Tensor, heads_dim: int, out_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The current plan's ragged k / v rows of the paged caches ``k`` / ``v`` (``kv_rows``); ``heads_dim``: the
    caches' heads dimension (2 in NHD, 1 in HND); ``out_dtype``: the rows' (the plan's)."""
    wrapper = _wrapper_of(key)
    rows = wrapper.kv_rows((k, v))
    return tuple(x.clone() if x is y else x for x, y in zip(rows, (k, v)))  # an op's outputs never alias


@wrapper_kv_rows.register_fake
def _wrapper_kv_rows_fake(key, k, v, heads_dim, out_dtype):
    tokens = torch.library.get_ctx().new_dynamic_size()  # the plan's, known when the op runs
    return tuple(x.new_empty((tokens, x.shape[heads_dim], x.shape[-1]), dtype=out_dtype) for x in (k, v))


def gathered_kv_rows(key: int, gather, paged_kv_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """``gather(paged_kv_cache)`` (a ``KVUpcast``) eagerly; under torch.compile the custom op that finds it at run
    time (its checks of the cache against the plan run there, not as guards of the graph)."""
    if not torch.compiler.is_compiling():
        return gather(paged_kv_cache)
    k, v = split_paged_kv_cache(paged_kv_cache, gather.kv_layout)
    heads_dim = 2 if gather.kv_layout is KVLayout.NHD else 1
    return torch.ops.jitattn.wrapper_kv_rows(key, k, v, heads_dim, gather.out_dtype)


@torch.library.custom_op("jitattn::mla_run", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def mla_run(key: int, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor,
            k_scale: float, v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The current plan of an MLA wrapper run over ``ckv`` / ``kpe``: (out, natural-log lse)."""
    wrapper = _wrapper_of(key)
    return wrapper.run_natural_lse(q_nope, q_pe, ckv, kpe, return_lse=True, k_scale=k_scale, v_scale=v_scale)


@mla_run.register_fake
def _mla_run_fake(key, q_nope, q_pe, ckv, kpe, k_scale, v_scale):
    return q_nope.new_empty(q_nope.shape[:2] + (ckv.shape[-1],)), q_nope.new_empty(q_nope.shape[:2],
                                                                                   dtype=torch.float32)


def mla_run_compiled(key: int, q_nope: torch.Tensor, q_pe: torch.Tensor, ckv: torch.Tensor, kpe: torch.Tensor, *,
                     out: torch.Tensor | None, lse: torch.Tensor | None, return_lse: bool, k_scale, v_scale):
    """The compiled path of ``BatchMLAPagedAttentionWrapper.run()``: one custom op, results copied into out / lse."""
    k_scale, v_scale = _scales(k_scale, v_scale)
    check_buffers("BatchMLAPagedAttentionWrapper.run()", out, lse, (*q_nope.shape[:2], ckv.shape[-1]), q_nope.dtype)
    result, result_lse = torch.ops.jitattn.mla_run(key, q_nope, q_pe, ckv, kpe, k_scale, v_scale)
    return _returned(result, result_lse, out, lse, return_lse)


@torch.library.custom_op("jitattn::cascade_run", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def cascade_run(key: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The current plan of a cascade wrapper over the paged cache ``(k, v)``: (out, natural-log lse). One op for
    every level and the merge: traced, the plan's state buffers (their chunk counts) would be guarded inputs."""
    wrapper = _wrapper_of(key)
    return wrapper.run_natural_lse(q, (k, v), k_scale=k_scale, v_scale=v_scale, return_lse=True)


@cascade_run.register_fake
def _cascade_run_fake(key, q, k, v, k_scale, v_scale):
    return q.new_empty(q.shape), q.new_empty(q.shape[:2], dtype=torch.float32)


def cascade_run_compiled(key: int, q: torch.Tensor, paged_kv_cache, kv_layout, k_scale, v_scale, return_lse: bool):
    """The compiled path of ``MultiLevelCascadeAttentionWrapper.run()`` without sinks or variant parameters."""
    k, v = split_paged_kv_cache(paged_kv_cache, KVLayout.parse(kv_layout, "kv_layout"))
    out, lse = torch.ops.jitattn.cascade_run(key, q, k, v, *_scales(k_scale, v_scale))
    return (out, lse) if return_lse else out


@torch.library.custom_op("jitattn::batch_attention_run", mutates_args=(), tags=OUTSIDE_CUDA_GRAPHS)
def batch_attention_run(key: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: float, v_scale: float,
                        head_dim_vo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The current plan of a ``BatchAttention`` over the paged cache ``(k, v)``: (out, natural-log lse). One op for
    its parts (prefill and decode, side by side), which compose in Python."""
    return _wrapper_of(key).run_natural_lse(q, (k, v), k_scale=k_scale, v_scale=v_scale)


@batch_attention_run.register_fake
def _batch_attention_run_fake(key, q, k, v, k_scale, v_scale, head_dim_vo):
    return q.new_empty((*q.shape[:2], head_dim_vo)), q.new_empty(q.shape[:2], dtype=torch.float32)


def batch_attention_run_compiled(key: int, q: torch.Tensor, kv_cache, kv_layout, out, lse, k_scale, v_scale,
                                 head_dim_vo: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled path of ``BatchAttention.run()``: one custom op, results copied into out / lse if given."""
    k, v = split_paged_kv_cache(kv_cache, KVLayout.parse(kv_layout, "kv_layout"))
    check_buffers("BatchAttention.run()", out, lse, (*q.shape[:2], head_dim_vo), q.dtype)
    result, result_lse = torch.ops.jitattn.batch_attention_run(key, q, k, v, *_scales(k_scale, v_scale), head_dim_vo)
    return _returned(result, result_lse, out, lse, True)

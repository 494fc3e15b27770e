"""The specs each wrapper requests, computed by one function per op.

The CLI's ``warm`` uses the same functions, so a pre-warmed cache holds
exactly what the wrappers will ask for. On the cpu target only the dtypes
are compiled in (everything else is a run-time argument, which keeps the
number of builds small); on cuda every axis of ``SPECIALIZED_AXES``.
"""

from __future__ import annotations

import functools

import torch

from .. import hardware
from ..variant import AttentionVariant
from ..spec import DType, KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target, VariantSpec
from .checks import FP8_DTYPES
from .options import resolve_flag


@functools.lru_cache(maxsize=512)  # plan() asks for the same spec every step; validation is not free
def attention_spec(
    op: Op, target: Target, *, q_dtype: torch.dtype, kv_dtype: torch.dtype, o_dtype: torch.dtype,
    head_dim_qk: int, head_dim_vo: int, num_qo_heads: int, num_kv_heads: int,
    pos_encoding: PosEncoding, use_sliding_window: bool, use_logits_soft_cap: bool,
    mask_mode: MaskMode, kv_layout: KVLayout, kv_storage: KVStorage, variant: AttentionVariant | None = None,
) -> VariantSpec:
    """The spec of a decode or prefill kernel for these shapes and options (and custom variant, if any).

    Cached (a plan per step asks for the same few specs; building one validates it, ~25 us)."""
    if variant is not None and not isinstance(variant, AttentionVariant):
        raise TypeError(f"variant must be a jitattn.AttentionVariant or None; got {type(variant).__name__}")
    return _attention_spec(op, target, q_dtype, kv_dtype, o_dtype, head_dim_qk, head_dim_vo, num_qo_heads,
                           num_kv_heads, pos_encoding, bool(use_sliding_window), bool(use_logits_soft_cap), mask_mode,
                           kv_layout, kv_storage, variant)


@functools.lru_cache(maxsize=512)
def _attention_spec(
    op: Op, target: Target, q_dtype: torch.dtype, kv_dtype: torch.dtype, o_dtype: torch.dtype, head_dim_qk: int,
    head_dim_vo: int, num_qo_heads: int, num_kv_heads: int, pos_encoding: PosEncoding, use_sliding_window: bool,
    use_logits_soft_cap: bool, mask_mode: MaskMode, kv_layout: KVLayout, kv_storage: KVStorage,
    variant: AttentionVariant | None,
) -> VariantSpec:
    if variant is not None and not isinstance(variant, AttentionVariant):
        raise TypeError(f"variant must be a jitattn.AttentionVariant or None; got {type(variant).__name__}")
    if num_kv_heads < 1 or num_qo_heads < 1 or num_qo_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_qo_heads={num_qo_heads} must be a positive multiple of num_kv_heads={num_kv_heads} "
            "(MHA: equal, GQA: a multiple, MQA: num_kv_heads=1)"
        )
    if target is Target.CPU:
        from ..spec import check_head_dims

        check_head_dims(head_dim_qk, head_dim_vo)  # validated even where it is a run-time value
        return VariantSpec(op=op, target=target, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype, variant=variant)
    return VariantSpec(
        op=op, target=target, q_dtype=q_dtype, kv_dtype=kv_dtype, o_dtype=o_dtype,
        head_dim_qk=head_dim_qk, head_dim_vo=head_dim_vo, group_size=num_qo_heads // num_kv_heads,
        pos_encoding=pos_encoding, use_sliding_window=use_sliding_window, use_logits_soft_cap=use_logits_soft_cap,
        mask_mode=mask_mode if op is Op.PREFILL else None, kv_layout=kv_layout,
        kv_storage=kv_storage, variant=variant,
    )


@functools.cache
def merge_spec(target: Target, dtype: torch.dtype, use_sinks: bool = False) -> VariantSpec:
    """The merge kernels' spec (cached: building a spec validates it, ~25 us, and merges run per layer).

    ``use_sinks``: the build whose ``merge_states`` applies attention sinks (a cascade's final merge)."""
    return VariantSpec(op=Op.MERGE, target=target, o_dtype=dtype, use_sinks=use_sinks)


@functools.cache
def append_spec(target: Target, kv_dtype: torch.dtype) -> VariantSpec:
    """The append kernel's spec (cached, as ``merge_spec``)."""
    return VariantSpec(op=Op.APPEND, target=target, kv_dtype=kv_dtype)


@functools.cache
def dtype_spec(op: Op, target: Target, dtype: torch.dtype) -> VariantSpec:
    """The spec of an op whose one compile-time axis is its tensors' dtype: ``Op.ROPE`` (q and k), ``Op.NORM``,
    ``Op.ACT`` (cached, as ``merge_spec``)."""
    return VariantSpec(op=op, target=target, q_dtype=dtype)


@functools.cache
def rope_spec(target: Target, dtype: torch.dtype, out_dtype: torch.dtype | None = None) -> VariantSpec:
    """The RoPE kernel's spec for q/k of ``dtype``, rotated into ``out_dtype`` (None: ``dtype``; else the other
    16-bit dtype; cached, as ``merge_spec``)."""
    if out_dtype is None or out_dtype == dtype:
        return dtype_spec(Op.ROPE, target, dtype)
    return VariantSpec(op=Op.ROPE, target=target, q_dtype=dtype, o_dtype=out_dtype)


def model_specs(
    target: Target, *, num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
    kv_dtype: torch.dtype, sliding_window: bool = False, full_attention_too: bool = True,
    logits_soft_cap: bool = False, kv_layout: KVLayout = KVLayout.NHD, attention_sinks: bool = False,
) -> list[VariantSpec]:
    """Every spec a model's decode, prefill (paged and ragged), cascade, merge, append and RoPE paths request,
    and the RMSNorm and gated activation (``jitattn.rmsnorm``, ``silu_and_mul``...) a serving loop runs around them.

    ``sliding_window`` adds the windowed variants; ``full_attention_too``
    keeps the unwindowed ones (models that alternate layers need both).
    ``attention_sinks`` (gpt-oss) adds the sink build of each attention and merge spec (``plan()``
    loads the plain one, the first ``run(sinks=...)`` its sink twin: both are needed).
    """
    sliding_window, full_attention_too, logits_soft_cap, attention_sinks = (
        resolve_flag(value, name) for name, value in (
            ("sliding_window", sliding_window), ("full_attention_too", full_attention_too),
            ("logits_soft_cap", logits_soft_cap), ("attention_sinks", attention_sinks)))
    windows = [True] if sliding_window and not full_attention_too else ([False, True] if sliding_window else [False])
    common = dict(
        q_dtype=dtype, kv_dtype=kv_dtype, o_dtype=dtype, head_dim_qk=head_dim, head_dim_vo=head_dim,
        num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, pos_encoding=PosEncoding.NONE,
        use_logits_soft_cap=logits_soft_cap, kv_layout=kv_layout,
    )
    specs: list[VariantSpec] = []
    for window in windows:
        specs.append(attention_spec(Op.DECODE, target, use_sliding_window=window, mask_mode=MaskMode.NONE,
                                    kv_storage=KVStorage.PAGED, **common))
        for storage in (KVStorage.PAGED, KVStorage.RAGGED):
            # causal for prefill/append, none for the shared-prefix levels of cascade
            for mask in (MaskMode.CAUSAL, MaskMode.NONE):
                specs.append(attention_spec(Op.PREFILL, target, use_sliding_window=window, mask_mode=mask,
                                            kv_storage=storage, **common))
    specs.append(merge_spec(target, dtype))
    if attention_sinks:
        specs += [spec.replace(use_sinks=True) for spec in specs]
    specs.append(append_spec(target, kv_dtype))
    # the RoPE ops a serving loop applies to q and k around attention, its RMSNorm and gated MLP activation
    specs += [dtype_spec(op, target, dtype) for op in (Op.ROPE, Op.NORM, Op.ACT)]
    return list(dict.fromkeys(specs))


def mla_model_specs(
    target: Target, *, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, qk_nope_head_dim: int,
    v_head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
) -> list[VariantSpec]:
    """Every spec a DeepSeek-style MLA model's attention paths request.

    - ``BatchMLAPagedAttentionWrapper`` (absorbed: decode, speculative decode, chunked prefill): the paged
      prefill kernel with head dims ``kv_lora_rank + qk_rope_head_dim`` / ``kv_lora_rank``, one latent kv
      head, the latent cache in ``kv_dtype``, without and with the causal mask;
    - non-absorbed prefill through the ragged wrapper: head dims ``qk_nope_head_dim + qk_rope_head_dim`` /
      ``v_head_dim``, ``num_kv_heads == num_heads``, k/v in ``dtype`` (the up-projection's output), causal
      for the new tokens and without a mask for earlier chunks, whose states are merged;
    - the merge (``dtype``) and ``append_paged_mla_kv_cache`` (``kv_dtype``);
    - on a 9.0a-only arch list with a 16-bit or fp8 latent cache of ckv 512 / kpe 64: the dedicated MLA kernel
      (``mla_kernel_spec``), which the MLA wrapper plans there instead of the paged prefill kernels.
    """
    common = dict(q_dtype=dtype, o_dtype=dtype, pos_encoding=PosEncoding.NONE, use_sliding_window=False,
                  use_logits_soft_cap=False, kv_layout=KVLayout.NHD)
    specs: list[VariantSpec] = []
    latent = f"kv_lora_rank={kv_lora_rank} with qk_rope_head_dim={qk_rope_head_dim}"
    for mask in (MaskMode.NONE, MaskMode.CAUSAL):
        specs.append(_named(latent, lambda: attention_spec(
            Op.PREFILL, target, kv_dtype=kv_dtype, head_dim_qk=kv_lora_rank + qk_rope_head_dim,
            head_dim_vo=kv_lora_rank, num_qo_heads=num_heads, num_kv_heads=1, mask_mode=mask,
            kv_storage=KVStorage.PAGED, **common)))
    for mask in (MaskMode.CAUSAL, MaskMode.NONE):
        specs.append(_named(f"qk_nope_head_dim={qk_nope_head_dim} + qk_rope_head_dim={qk_rope_head_dim} with "
                            f"v_head_dim={v_head_dim}", lambda: attention_spec(
            Op.PREFILL, target, kv_dtype=dtype, head_dim_qk=qk_nope_head_dim + qk_rope_head_dim,
            head_dim_vo=v_head_dim, num_qo_heads=num_heads, num_kv_heads=num_heads, mask_mode=mask,
            kv_storage=KVStorage.RAGGED, **common)))
    specs.append(merge_spec(target, dtype))
    specs.append(append_spec(target, kv_dtype))
    if (target is Target.CUDA and hardware.hopper_only(hardware.known_arch_list()) and dtype in (torch.float16, torch.bfloat16)
            and (kv_dtype == dtype or kv_dtype in FP8_DTYPES)
            and (kv_lora_rank, qk_rope_head_dim) == (MLA_CKV_DIM, MLA_KPE_DIM)):
        specs.append(mla_kernel_spec(dtype, kv_dtype))  # what the MLA wrapper plans on an H100/H200
    return list(dict.fromkeys(specs))


def _named(dims: str, make):
    """``make()``, its ValueError led by the model's own dimensions (the spec's head dims are derived from them)."""
    try:
        return make()
    except ValueError as exc:
        raise ValueError(f"an MLA model of {dims}: {exc}") from None


MLA_CKV_DIM, MLA_KPE_DIM = 512, 64  # the dedicated MLA kernel's latent widths (jitattn.kernels.mla)


@functools.lru_cache(maxsize=16)
def mla_kernel_spec(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> VariantSpec:
    """The spec of the dedicated sm90 MLA kernel: queries / output of ``dtype`` (f16/bf16), a latent cache of
    ``kv_dtype`` (default ``dtype``; or fp8 e4m3 / e5m2)."""
    d = DType.parse(dtype, "q_data_type")
    kv = DType.parse(kv_dtype if kv_dtype is not None else dtype, "kv_data_type")
    return VariantSpec(op=Op.MLA, target=Target.CUDA, q_dtype=d, kv_dtype=kv, o_dtype=d,
                       head_dim_qk=MLA_CKV_DIM + MLA_KPE_DIM, head_dim_vo=MLA_CKV_DIM)


"""The variant spec: the single source of truth for one compiled kernel module.

A ``VariantSpec`` names everything a kernel is specialised on. Fields left at
``None`` are *not* specialised: the kernel takes that axis as a run-time
argument. Which axes each (op, target) pair specialises on is fixed in
``SPECIALIZED_AXES``; validation rejects a spec that sets any other axis, so
the number of distinct binaries (and cold builds) stays bounded.

URI grammar (documented in README.md; ``uri`` is derived, never stored)::

    uri   := op ["_" storage] "_" target "_" dtype ["_kv" kvdtype] ["_o" odtype]
             ["_hd" qk ["x" vo]] ["_g" group] ["_" pos] ["_swa"] ["_softcap"]
             ["_" mask] ["_" layout] ["_sink"] ["_v" name "-" hash8]
    op      := decode | prefill | merge | append | mla | rope | norm | act
    storage := paged | ragged
    target  := cuda | cpu
    dtype   := the q dtype (the o dtype when the op has no q; rope, norm, act: the tensors'): f32 | f16 | bf16
    kvdtype := present when it differs from dtype: f16 | bf16 | f32 | e4m3 | e5m2
    odtype  := present when it differs from dtype (rope: the other 16-bit dtype, e.g. rope_cuda_bf16_of16)
    pos     := rope | alibi            (absent: none)
    mask    := causal | custom         (absent: none)
    layout  := nhd | hnd
    sink    := present when the kernel applies per-head attention sinks (``use_sinks``)
    name, hash8 := a custom variant's name and the first 8 hex digits of the sha256
               of its canonical form (jitattn.variant); "-" becomes "_" in the kernel name

The profiler-visible kernel name is ``"jitattn_" + uri`` with the target token
removed, e.g. ``jitattn_decode_paged_bf16_hd128_g4_nhd``.
"""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from typing import Any

import torch

from .variant import AttentionVariant


class _Choice(str, enum.Enum):
    """A string enum whose ``parse`` accepts the value or a known alias."""

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {}

    @classmethod
    def parse(cls, value: Any, field: str):
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            key = value.strip().lower()
            key = cls._aliases().get(key, key)
            for member in cls:
                if member.value == key:
                    return member
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"{field}={value!r} is not supported; use one of {allowed}")


class Op(_Choice):
    DECODE = "decode"
    PREFILL = "prefill"
    MERGE = "merge"
    APPEND = "append"
    MLA = "mla"  # the dedicated latent-attention kernel (cuda, sm_90a); MLA also runs on the prefill kernels
    ROPE = "rope"  # FlashInfer's standalone rotary-embedding functions (q and k rotated in one launch)
    NORM = "norm"  # RMSNorm of rows, the residual add fused in (FlashInfer's flashinfer.norm functions)
    ACT = "act"  # act(a row's first half) * its second half (flashinfer.activation's gated activations)


class Target(_Choice):
    CUDA = "cuda"
    CPU = "cpu"


class DType(_Choice):
    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    E4M3 = "e4m3"
    E5M2 = "e5m2"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"float32": "f32", "float": "f32", "fp32": "f32", "float16": "f16", "half": "f16", "fp16": "f16",
                "bfloat16": "bf16", "float8_e4m3fn": "e4m3", "fp8_e4m3": "e4m3", "e4m3fn": "e4m3",
                "float8_e5m2": "e5m2", "fp8_e5m2": "e5m2"}

    @classmethod
    def parse(cls, value: Any, field: str) -> "DType":
        if isinstance(value, torch.dtype):
            value = str(value).removeprefix("torch.")
        return super().parse(value, field)

    @property
    def torch_dtype(self) -> torch.dtype:
        return _TORCH_DTYPES[self]

    @property
    def itemsize(self) -> int:
        return {"f32": 4, "f16": 2, "bf16": 2, "e4m3": 1, "e5m2": 1}[self.value]

    @property
    def is_fp8(self) -> bool:
        return self in (DType.E4M3, DType.E5M2)


_TORCH_DTYPES = {
    DType.F32: torch.float32, DType.F16: torch.float16, DType.BF16: torch.bfloat16,
    DType.E4M3: torch.float8_e4m3fn, DType.E5M2: torch.float8_e5m2,
}


class PosEncoding(_Choice):
    NONE = "none"
    ROPE_LLAMA = "rope"
    ALIBI = "alibi"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        # FlashInfer's spellings: "NONE", "ROPE_LLAMA", "ALIBI".
        return {"rope_llama": "rope"}


class MaskMode(_Choice):
    NONE = "none"
    CAUSAL = "causal"
    CUSTOM = "custom"


class KVLayout(_Choice):
    NHD = "nhd"
    HND = "hnd"


class KVStorage(_Choice):
    PAGED = "paged"
    RAGGED = "ragged"


class IndexDType(_Choice):
    I32 = "i32"

    @classmethod
    def _aliases(cls) -> dict[str, str]:
        return {"int32": "i32"}


# Axes each (op, target) kernel family compiles in. Every other axis must be
# left None: the kernel reads it at run time.
_ATTENTION_CUDA = frozenset({
    "q_dtype", "kv_dtype", "o_dtype", "head_dim_qk", "head_dim_vo", "group_size",
    "pos_encoding", "use_sliding_window", "use_logits_soft_cap", "kv_layout", "kv_storage",
})
SPECIALIZED_AXES: dict[tuple[Op, Target], frozenset[str]] = {
    (Op.MERGE, Target.CUDA): frozenset({"o_dtype"}),
    (Op.MERGE, Target.CPU): frozenset({"o_dtype"}),
    (Op.APPEND, Target.CUDA): frozenset({"kv_dtype"}),
    (Op.APPEND, Target.CPU): frozenset({"kv_dtype"}),
    (Op.DECODE, Target.CUDA): _ATTENTION_CUDA,
    (Op.DECODE, Target.CPU): frozenset({"q_dtype", "kv_dtype", "o_dtype"}),
    (Op.PREFILL, Target.CUDA): _ATTENTION_CUDA | {"mask_mode"},
    (Op.PREFILL, Target.CPU): frozenset({"q_dtype", "kv_dtype", "o_dtype"}),
    (Op.MLA, Target.CUDA): frozenset({"q_dtype", "kv_dtype", "o_dtype", "head_dim_qk", "head_dim_vo"}),
    **{(op, t): frozenset({"q_dtype"}) for op in (Op.ROPE, Op.NORM, Op.ACT) for t in Target},  # the tensors' dtype
}

SUPPORTED_HEAD_DIMS: tuple[int, ...] = tuple(range(8, 257, 8))
# (head_dim_qk, head_dim_vo) pairs beyond the symmetric ones.
ASYMMETRIC_HEAD_DIMS: tuple[tuple[int, int], ...] = ((192, 128), (576, 512))

_ENUM_FIELDS: dict[str, type[_Choice]] = {
    "op": Op, "target": Target, "q_dtype": DType, "kv_dtype": DType, "o_dtype": DType,
    "pos_encoding": PosEncoding, "mask_mode": MaskMode, "kv_layout": KVLayout,
    "kv_storage": KVStorage, "idtype": IndexDType,
}


@dataclass(frozen=True)
class VariantSpec:
    """One kernel variant. Construct with enums or their string spellings.

    Fields left ``None`` are run-time arguments of the kernel (see
    ``SPECIALIZED_AXES``). Raises ``ValueError`` naming the field, the
    supported values and the fix when the combination is invalid.
    """

    op: Op
    target: Target
    q_dtype: DType | None = None
    kv_dtype: DType | None = None
    o_dtype: DType | None = None
    head_dim_qk: int | None = None
    head_dim_vo: int | None = None
    group_size: int | None = None
    pos_encoding: PosEncoding | None = None
    use_sliding_window: bool | None = None
    use_logits_soft_cap: bool | None = None
    mask_mode: MaskMode | None = None
    kv_layout: KVLayout | None = None
    kv_storage: KVStorage | None = None
    idtype: IndexDType = IndexDType.I32
    variant: AttentionVariant | None = None  # custom snippets (decode/prefill); see jitattn.variant
    # Attention sinks (decode/prefill/merge, every target): the final output of query head h is scaled by
    # e^lse / (e^lse + e^sinks[h]); a float32 [num_qo_heads] pointer in the params. Off: the spec, its
    # sources and its cache key are exactly those of a spec without the field.
    use_sinks: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.variant, dict):
            object.__setattr__(self, "variant", AttentionVariant.from_dict(self.variant))
        if self.variant is not None and not isinstance(self.variant, AttentionVariant):
            raise ValueError(f"variant={self.variant!r} must be a jitattn.AttentionVariant, a dict of one, or None")
        if self.idtype is None:  # the default, as the uri prints it (None was a second cache entry under one uri)
            object.__setattr__(self, "idtype", IndexDType.I32)
        for name, enum_type in _ENUM_FIELDS.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, enum_type.parse(value, name))
        for name in ("head_dim_qk", "head_dim_vo", "group_size"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name}={value!r} must be an int")
        for name in ("use_sliding_window", "use_logits_soft_cap"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise ValueError(f"{name}={value!r} must be True, False or None")
        if not isinstance(self.use_sinks, bool):
            raise ValueError(f"use_sinks={self.use_sinks!r} must be True or False")
        self._validate()

    # -- validation ---------------------------------------------------------

    def _validate(self) -> None:
        axes = spec_axes(self.op, self.target)
        for field in dataclasses.fields(self):
            name = field.name
            if name in ("op", "target", "idtype", "variant", "use_sinks"):
                continue
            value = getattr(self, name)
            if name in axes and value is None:
                raise ValueError(
                    f"{name} is required for op={self.op.value!r} on target={self.target.value!r} "
                    f"(that kernel is compiled for one value of it); set {name}"
                )
            optional = self.op is Op.ROPE and name == "o_dtype"  # rope's outputs: q_dtype, or the other 16-bit one
            if name not in axes and value is not None and not optional:
                raise ValueError(
                    f"{name}={_show(value)} is not a compile-time axis of op={self.op.value!r} on "
                    f"target={self.target.value!r}; leave it None (the kernel takes it at run time). "
                    f"Compile-time axes there: {', '.join(sorted(axes))}"
                )
        if self.q_dtype is not None and self.q_dtype.is_fp8 and not (
                self.op is Op.PREFILL and self.target is Target.CUDA and self.kv_dtype is self.q_dtype):
            raise ValueError(f"q_dtype={self.q_dtype.value!r}: fp8 queries are only for op 'prefill' on target 'cuda' "
                             "with kv_dtype the same fp8 dtype (the sm90 tier); use f16 or bf16 (fp8 kv_dtype is fine)")
        if self.o_dtype is not None and self.o_dtype.is_fp8:
            raise ValueError(f"o_dtype={self.o_dtype.value!r}: fp8 output is not supported; use f16, bf16 or f32")
        if self.op is Op.ROPE and self.o_dtype is not None and {self.o_dtype, self.q_dtype} != {DType.F16, DType.BF16}:
            raise ValueError(f"o_dtype={self.o_dtype.value!r} for op 'rope' with q_dtype={self.q_dtype.value!r}: "
                             "outputs of the other 16-bit dtype only (f16 <-> bf16); leave it None for q_dtype's")
        if self.target is Target.CUDA and self.op not in (Op.ROPE, Op.NORM, Op.ACT):  # these take f32 on both
            for name in ("q_dtype", "kv_dtype"):
                value = getattr(self, name)
                if value is DType.F32:
                    raise ValueError(
                        f"{name}='f32' is not supported on target 'cuda'; use f16 or bf16 "
                        "(f32 inputs run on the cpu target)"
                    )
        if (
            self.q_dtype is not None and self.kv_dtype is not None and not self.kv_dtype.is_fp8
            and self.kv_dtype is not self.q_dtype
        ):
            raise ValueError(
                f"kv_dtype={self.kv_dtype.value!r} differs from q_dtype={self.q_dtype.value!r}; "
                "a 16/32-bit kv cache must have the query's dtype (only fp8 kv may differ)"
            )
        if self.head_dim_qk is not None or self.head_dim_vo is not None:
            check_head_dims(self.head_dim_qk, self.head_dim_vo)
        if self.variant is not None and self.op not in (Op.DECODE, Op.PREFILL):
            raise ValueError(
                f"variant is for attention kernels (op 'decode' or 'prefill'); op={self.op.value!r} takes none"
            )
        if self.use_sinks and self.op not in (Op.DECODE, Op.PREFILL, Op.MERGE):
            raise ValueError(
                f"use_sinks is for attention and merge kernels (op 'decode', 'prefill' or 'merge'); "
                f"op={self.op.value!r} takes none"
            )
        if self.use_sinks and self.variant is not None:
            raise ValueError(
                "use_sinks with a custom variant is not supported; a variant can add the sink itself "
                "(a tensor parameter and its own normalisation), or drop the variant"
            )
        if self.group_size is not None and self.group_size < 1:
            raise ValueError(f"group_size={self.group_size} must be >= 1 (num_qo_heads // num_kv_heads)")

    # -- derived names ------------------------------------------------------

    @property
    def uri(self) -> str:
        """Readable identity, by the grammar in this module's docstring."""
        return "_".join(self._name_tokens(with_target=True))

    @property
    def kernel_name(self) -> str:
        """The name kernels carry in profiler timelines."""
        return "jitattn_" + "_".join(self._name_tokens(with_target=False))

    def _name_tokens(self, with_target: bool) -> list[str]:
        tokens = [self.op.value]
        if self.kv_storage is not None:
            tokens.append(self.kv_storage.value)
        if with_target:
            tokens.append(self.target.value)
        base = self.q_dtype or self.o_dtype or self.kv_dtype
        if base is not None:
            tokens.append(base.value)
        if self.kv_dtype is not None and self.kv_dtype is not base:
            tokens.append("kv" + self.kv_dtype.value)
        if self.o_dtype is not None and self.o_dtype is not base:
            tokens.append("o" + self.o_dtype.value)
        if self.head_dim_qk is not None:
            hd = f"hd{self.head_dim_qk}"
            if self.head_dim_vo is not None and self.head_dim_vo != self.head_dim_qk:
                hd += f"x{self.head_dim_vo}"
            tokens.append(hd)
        if self.group_size is not None:
            tokens.append(f"g{self.group_size}")
        if self.pos_encoding not in (None, PosEncoding.NONE):
            tokens.append(self.pos_encoding.value)
        if self.use_sliding_window:
            tokens.append("swa")
        if self.use_logits_soft_cap:
            tokens.append("softcap")
        if self.mask_mode not in (None, MaskMode.NONE):
            tokens.append(self.mask_mode.value)
        if self.kv_layout is not None:
            tokens.append(self.kv_layout.value)
        if self.use_sinks:
            tokens.append("sink")
        if self.variant is not None:  # "v<name>-<hash8>"; a C identifier in the kernel name
            tokens.append(self.variant.token if with_target else self.variant.token.replace("-", "_"))
        return tokens

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form (enums as their values); part of the cache key.

        ``variant`` and ``use_sinks`` appear only when set, so specs without them keep their keys.
        """
        data = {f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
                if f.name not in ("variant", "use_sinks")}
        if self.variant is not None:
            data["variant"] = self.variant.to_dict()
        if self.use_sinks:
            data["use_sinks"] = True
        return data

    def canonical_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VariantSpec":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown spec field(s) {sorted(unknown)}; known fields: {sorted(known)}")
        missing = [name for name in ("op", "target") if name not in data]
        if missing:
            raise ValueError(f"a spec needs {' and '.join(missing)} (e.g. op=decode, target=cuda)")
        return cls(**data)

    def replace(self, **changes: Any) -> "VariantSpec":
        return dataclasses.replace(self, **changes)


def spec_axes(op: Op, target: Target) -> frozenset[str]:
    axes = SPECIALIZED_AXES.get((op, target))
    if axes is None:
        targets = [t.value for (o, t) in SPECIALIZED_AXES if o is op]
        raise ValueError(f"op={op.value!r} has no kernel for target={target.value!r} (targets: {', '.join(targets)}); "
                         "on the cpu, MLA runs through BatchMLAPagedAttentionWrapper on the prefill kernels")
    return axes


def check_head_dims(head_dim_qk: int | None, head_dim_vo: int | None) -> None:
    """Raise ValueError unless (head_dim_qk, head_dim_vo) is a supported shape."""
    if head_dim_qk is None or head_dim_vo is None:
        raise ValueError("head_dim_qk and head_dim_vo are set together (head_dim_vo = head_dim_qk when symmetric)")
    if head_dim_qk == head_dim_vo and head_dim_qk in SUPPORTED_HEAD_DIMS:
        return
    if (head_dim_qk, head_dim_vo) in ASYMMETRIC_HEAD_DIMS:
        return
    paddable = head_dim_qk == head_dim_vo and 0 < head_dim_qk < max(SUPPORTED_HEAD_DIMS)
    raise ValueError(
        f"head_dim_qk={head_dim_qk}, head_dim_vo={head_dim_vo} is not supported; supported: every multiple "
        f"of 8 from 8 to 256 (equal qk and vo), or (qk, vo) in {list(ASYMMETRIC_HEAD_DIMS)}. "
        + ("Pad the head dimension to the next multiple of 8 (zero columns in q, k and v change nothing)"
           if paddable else "No kernel serves this shape")
    )


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _show(value: Any) -> str:
    return repr(_plain(value))

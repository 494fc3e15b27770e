"""Custom attention variants: user C++ snippets and extra parameters, part of the spec.

An ``AttentionVariant`` is an optional field of ``VariantSpec`` (decode and
prefill ops). It is hashed into the cache key by content (``to_dict``), so an
edited snippet can never load a stale binary, and shown in the uri as
``v<name>-<hash8>``.

Snippets are plain C++ expressions (one expression, no statements), the same
text for the cpu target and every cuda tier. Each is rendered into its own small
inline function (``#line`` names the snippet, so a compile error points into
it). Variables every snippet sees (all ``int64_t``)::

    request   index of the request in the batch
    qo_len    number of queries of the request
    kv_len    number of keys of the request
    qo_head   query head          (query_transform, logits_*, output_transform)
    kv_head   kv head             (key_transform, logits_*)
    q_idx     query index in the request, 0..qo_len-1   (not in key_transform);
              the query sits at position kv_len - qo_len + q_idx
    kv_idx    key index (= position) in the request, 0..kv_len-1
              (key_transform, logits_*)
    dim       element of the head dimension (query/key/output transforms)

and one value of type ``float`` named after the hook's input: ``q``
(query_transform), ``k`` (key_transform), ``logits`` (logits_transform and
logits_mask), ``out`` (output_transform). Transforms return a float;
``logits_mask`` returns a bool (``false`` hides the key).

Extra parameters (``VariantParam``) are visible by name: a scalar as its C type
(``float``/``int32_t``/``int64_t``); a tensor (contiguous, on the launch
device) as a ``const T*`` indexed row-major (``name[i]``, ``name[i * name_size1 + j]``)
with its sizes as ``int64_t name_size0, name_size1, ...``. The float math of
<cmath> (``expf``, ``logf``, ``tanhf``, ``sqrtf``, ``fabsf``, ``fminf``, ``fmaxf``)
is available on every target.

Semantics (the order inside the kernel; ``jitattn.reference.variant_attention``
is the same in torch):

1. ``q``/``k`` rows are converted to float (and rotated by RoPE), then
   ``query_transform`` / ``key_transform`` map each element.
2. ``logits = sm_scale * q.k`` (+ ALiBi, soft cap), then the built-in masks
   (causal, window, custom); a key they hide stays hidden.
3. ``logits_mask`` may hide more keys; ``logits_transform`` maps each visible logit.
4. ``use_softmax=True``: ``out = sum_j softmax(logits)_j v_j`` over visible keys
   (LSE in natural log, as without a variant). ``use_softmax=False``:
   ``out = sum_j logits_j * v_j`` over visible keys, no normalisation; the LSE
   output is not meaningful and is written as NaN (a cascade merge therefore
   refuses such a variant).
5. ``output_transform`` maps each element of the output row (after
   normalisation and ``v_scale``), before the cast to the output dtype.
"""

from __future__ import annotations

import hashlib
import json
import keyword
import re
from dataclasses import dataclass, field
from typing import Any

HOOKS: tuple[str, ...] = ("query_transform", "key_transform", "logits_transform", "logits_mask", "output_transform")

# The hook's own input value and the index variables it sees, in the C function's argument order.
HOOK_SIGNATURES: dict[str, tuple[str, str, tuple[str, ...]]] = {
    # hook: (return type, input value, index variables)
    "query_transform": ("float", "q", ("dim", "request", "q_idx", "qo_len", "kv_len", "qo_head")),
    "key_transform": ("float", "k", ("dim", "request", "kv_idx", "qo_len", "kv_len", "kv_head")),
    "logits_transform": ("float", "logits",
                         ("request", "q_idx", "kv_idx", "qo_len", "kv_len", "qo_head", "kv_head")),
    "logits_mask": ("bool", "logits", ("request", "q_idx", "kv_idx", "qo_len", "kv_len", "qo_head", "kv_head")),
    "output_transform": ("float", "out", ("dim", "request", "q_idx", "qo_len", "kv_len", "qo_head")),
}

# dtype -> (C element type, torch dtype name). 16-bit floats are not offered:
# their C types differ between targets, and a snippet must read the same everywhere.
TENSOR_DTYPES: dict[str, tuple[str, str]] = {
    "f32": ("float", "float32"), "i32": ("int32_t", "int32"), "i64": ("int64_t", "int64"),
    "u8": ("uint8_t", "uint8"), "bool": ("bool", "bool"),
}
SCALAR_DTYPES: dict[str, tuple[str, str]] = {"f32": ("float", "f32"), "i32": ("int32_t", "i32"),
                                              "i64": ("int64_t", "i64")}
MAX_RANK = 4

_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,23}$")
_INDEX_VARIABLES = frozenset({"request", "qo_len", "kv_len", "qo_head", "kv_head", "q_idx", "kv_idx", "dim"})
# Characters a snippet may not hold: a NUL, and the line breaks other than "\n" and "\r\n".
_NOT_SOURCE = frozenset("\x00\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029")
# Names a parameter may not take: the snippets' variables, the run() arguments
# of every wrapper (parameters are passed to run() by keyword), and C/C++ words.
RESERVED_NAMES = frozenset(
    _INDEX_VARIABLES | {"q", "k", "v", "logits", "out", "o", "lse", "vp", "p", "params"}
    | {"paged_kv_cache", "k_scale", "v_scale", "return_lse", "self", "kwargs"}
    # the keyword arguments of every wrapper's run() and forward(): a parameter so named could not be passed
    | {"q_scale", "window_left", "sinks", "enable_pdl", "args", "variant_args", "sm_scale", "logits_soft_cap",
       "rope_scale", "rope_theta", "causal", "pos_encoding_mode", "use_fp16_qk_reduction", "q_len_per_req"}
    | {"float", "double", "int", "bool", "char", "short", "long", "unsigned", "signed", "void", "auto", "const",
       "return", "if", "else", "for", "while", "do", "true", "false", "nullptr", "new", "delete", "class",
       "struct", "union", "enum", "template", "typename", "namespace", "using", "static", "inline", "operator",
       "this", "sizeof", "switch", "case", "default", "break", "continue", "goto", "volatile", "register",
       "extern", "friend", "virtual", "public", "private", "protected", "typedef", "mutable", "explicit",
       "and", "or", "not", "xor", "INFINITY", "NAN"}
    # the rest of C++'s keywords and alternative tokens, macros and names of the headers snippets see
    | {"alignas", "alignof", "asm", "bitand", "bitor", "catch", "char8_t", "char16_t", "char32_t", "compl", "concept",
       "const_cast", "consteval", "constexpr", "constinit", "co_await", "co_return", "co_yield", "decltype",
       "dynamic_cast", "export", "noexcept", "not_eq", "and_eq", "or_eq", "xor_eq", "reinterpret_cast", "requires",
       "static_assert", "static_cast", "thread_local", "throw", "try", "typeid", "wchar_t", "NULL", "std",
       "M_E", "M_PI", "M_PI_2", "M_PI_4", "M_LN2", "M_LN10", "M_LOG2E", "M_LOG10E", "M_SQRT2", "M_SQRT1_2",
       "HUGE_VAL", "HUGE_VALF", "FLT_MAX", "FLT_MIN", "VariantParams", "assert", "isnan", "isinf", "isfinite",
       "signbit", "int8_t", "int16_t", "int32_t", "int64_t", "uint8_t", "uint16_t", "uint32_t", "uint64_t", "size_t"}
    # (a math function's name shadows the function where the parameter is bound: cos / sin tables are fine)
)


@dataclass(frozen=True)
class VariantParam:
    """One extra parameter of a variant, passed to ``run(..., name=value)``.

    ``rank`` 0 is a scalar (dtype f32, i32 or i64; a Python number); rank 1..4
    a tensor (dtype f32, i32, i64, u8 or bool; contiguous, on the launch
    device). ``optional`` parameters may be omitted at run time: a tensor is then
    a null pointer with sizes 0, a scalar 0.
    """

    name: str
    dtype: str
    rank: int = 0
    optional: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _IDENT.fullmatch(self.name):
            raise ValueError(
                f"variant parameter name {self.name!r} must be a C identifier: a letter, then letters, "
                "digits or '_', at most 32 characters"
            )
        if (self.name in RESERVED_NAMES or keyword.iskeyword(self.name)
                or self.name.lower().startswith(("jitattn", "variant_"))):
            raise ValueError(
                f"variant parameter name {self.name!r} is reserved (a snippet variable, a run() argument or a "
                "C++ word); rename it"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank <= MAX_RANK:
            raise ValueError(f"variant parameter {self.name!r}: rank={self.rank!r} must be an int in 0..{MAX_RANK} "
                             "(0 = scalar)")
        allowed = SCALAR_DTYPES if self.rank == 0 else TENSOR_DTYPES
        if self.dtype not in allowed:
            kind = "a scalar" if self.rank == 0 else "a tensor"
            raise ValueError(
                f"variant parameter {self.name!r}: dtype={self.dtype!r} is not supported for {kind}; use one of "
                f"{', '.join(allowed)} (16-bit floats are not offered: their C types differ between targets)"
            )
        if not isinstance(self.optional, bool):
            raise ValueError(f"variant parameter {self.name!r}: optional={self.optional!r} must be True or False")

    @property
    def c_type(self) -> str:
        return (SCALAR_DTYPES if self.rank == 0 else TENSOR_DTYPES)[self.dtype][0]

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "rank": self.rank, "optional": self.optional}


@dataclass(frozen=True)
class AttentionVariant:
    """A user-defined attention variant (see this module's docstring for the snippet interface).

    ``params`` accepts ``VariantParam`` objects or dicts with the same keys.
    """

    name: str
    query_transform: str | None = None
    key_transform: str | None = None
    logits_transform: str | None = None
    logits_mask: str | None = None
    output_transform: str | None = None
    use_softmax: bool = True
    params: tuple[VariantParam, ...] = field(default=())

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not _NAME.fullmatch(self.name):
            raise ValueError(
                f"variant name {self.name!r} must be a letter, then letters, digits or '_', at most 24 "
                "characters (it becomes part of the uri and the kernel name)"
            )
        if not isinstance(self.use_softmax, bool):
            raise ValueError(f"variant {self.name!r}: use_softmax={self.use_softmax!r} must be True or False")
        for hook in HOOKS:
            text = getattr(self, hook)
            if text is None:
                continue
            if not isinstance(text, str) or not text.strip():
                raise ValueError(
                    f"variant {self.name!r}: {hook} must be a non-empty C++ expression or None (leave it out to "
                    "keep the default)"
                )
            # %: is the digraph of #; _Pragma the preprocessor's operator (its pragma would reach the kernel's code)
            if ";" in text or "#" in text or "%:" in text or "_Pragma" in text:
                raise ValueError(
                    f"variant {self.name!r}: {hook} must be one C++ expression (no ';' and no preprocessor "
                    f"lines or _Pragma); got {text!r}. Use the ternary operator for choices"
                )
            odd = sorted({c for c in text if c in _NOT_SOURCE})
            if odd:  # (Python's splitlines breaks lines at them where the compiler does not; a NUL is dropped)
                raise ValueError(f"variant {self.name!r}: {hook} holds {', '.join(map(repr, odd))}: a NUL or a line "
                                 "break other than '\\n', where the compiler's line numbers and the report's would "
                                 "disagree; remove it")
            if any(line.rstrip(" \t").endswith("\\") for line in text.splitlines()):
                raise ValueError(f"variant {self.name!r}: {hook} has a line ending in a backslash, which joins the "
                                 f"next line (after the last, the generated code's) to it; got {text!r}. Remove it")
            # a one-line snippet's rest dropped (a multi-line snippet's comment ends at its line's end)
            if "//" in text and "\n" not in text.strip():
                raise ValueError(f"variant {self.name!r}: {hook} has '//', which starts a C++ comment that drops the "
                                 f"rest of the line; got {text!r}. Snippets are C++: floor division of floats is "
                                 "floorf(a / b); a comment is /* ... */ (or // at the end of a line of a multi-line "
                                 "snippet)")
        if self.use_softmax and all(getattr(self, hook) is None for hook in HOOKS):
            raise ValueError(
                f"variant {self.name!r} changes nothing: give at least one snippet ({', '.join(HOOKS)}) or "
                "use_softmax=False"
            )
        given = self.params
        if not isinstance(given, (VariantParam, dict, str, bytes, set, frozenset)):  # (a set's order is the hash's)
            try:
                given = tuple(given)
            except TypeError:
                pass
        if not isinstance(given, tuple) or not all(isinstance(p, (VariantParam, dict)) for p in given):
            raise TypeError(f"variant {self.name!r}: params must be a tuple of VariantParam (or dicts of its fields); "
                            f"got {self.params!r}")
        params = tuple(p if isinstance(p, VariantParam) else VariantParam(**p) for p in given)
        object.__setattr__(self, "params", params)
        seen: set[str] = set()
        for param in params:
            if param.name in seen:
                raise ValueError(f"variant {self.name!r}: parameter {param.name!r} is declared twice")
            seen.add(param.name)
        for param in params:
            for d in range(param.rank):
                if f"{param.name}_size{d}" in seen:
                    raise ValueError(f"variant {self.name!r}: parameter {param.name}_size{d} collides with the "
                                     f"size variable of tensor {param.name!r}; rename it")

    # -- identity -------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Canonical JSON-able form; part of the spec's cache key."""
        data: dict[str, Any] = {"name": self.name, "use_softmax": self.use_softmax,
                                "params": [p.to_dict() for p in self.params]}
        for hook in HOOKS:
            if getattr(self, hook) is not None:
                data[hook] = getattr(self, hook)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AttentionVariant":
        known = {"name", "use_softmax", "params", *HOOKS}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown variant field(s) {sorted(unknown)}; known fields: {sorted(known)}")
        values = dict(data)
        values["params"] = tuple(VariantParam(**p) if isinstance(p, dict) else p for p in values.get("params", ()))
        return cls(**values)

    @property
    def digest(self) -> str:
        """sha256 of the canonical form (hex)."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()

    @property
    def token(self) -> str:
        """The uri token: ``v<name>-<hash8>``."""
        return f"v{self.name}-{self.digest[:8]}"

    # -- properties the planners use ------------------------------------------

    @property
    def splittable(self) -> bool:
        """Whether split-KV partial states can be merged by LSE (softmax, no output transform)."""
        return self.use_softmax and self.output_transform is None

    @property
    def hooks(self) -> tuple[str, ...]:
        return tuple(h for h in HOOKS if getattr(self, h) is not None)

    @property
    def position_names(self) -> tuple[str, ...]:
        """The index variables its snippets read that say where a query or key sits in its request (``request``,
        ``q_idx``, ``kv_idx``, ``qo_len``, ``kv_len``): a cascade level gives them relative to its own node."""
        words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", " ".join(getattr(self, h) for h in self.hooks)))
        return tuple(n for n in ("request", "q_idx", "kv_idx", "qo_len", "kv_len") if n in words)

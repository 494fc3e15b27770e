"""A spec's text forms, as the CLI and error messages give them: its uri (``decode_paged_cuda_bf16_hd128_g4_nhd``),
``key=value`` pairs (``op=merge,target=cpu,o_dtype=bf16``) or ``@path/to/spec.json``."""

from __future__ import annotations

import errno
import json
import os
import re
import stat
from typing import Any

from .env import OFF_WORDS, ON_WORDS
from .spec import DType, MaskMode, Op, PosEncoding, Target, VariantSpec, spec_axes

_ATTENTION_DEFAULTS: dict[str, Any] = {
    "pos_encoding": PosEncoding.NONE, "use_sliding_window": False, "use_logits_soft_cap": False,
    "mask_mode": MaskMode.NONE,
}


def parse_spec_text(text: str) -> VariantSpec:
    """A spec from its text form: a uri (``decode_paged_cuda_bf16_hd128_g4_nhd``) or
    ``key=value`` pairs separated by commas (``op=merge,target=cpu,o_dtype=bf16``), or
    ``@path/to/spec.json`` (the spec's ``to_dict()``; the only form that carries a custom variant).

    In the uri form, boolean and enum axes a kernel specialises on default to
    off/none when their token is absent, as the grammar prints them.
    """
    text = text.strip()
    if text.startswith("@"):
        return _spec_from_file(text[1:])
    if "=" in text:
        return VariantSpec.from_dict(_key_values(text))
    return _parse_uri(text)


def _key_values(text: str) -> dict[str, Any]:
    """``key=value,...`` as spec fields: integers and on / off words parsed, a key given twice or a value that is
    not of its kind an error (a misspelt ``use_sinks=ture`` must not build the kernel without sinks)."""
    values: dict[str, Any] = {}
    for pair in text.split(","):
        key, _, raw = pair.partition("=")
        key, raw = key.strip(), raw.strip()
        if not key:
            raise ValueError(f"{text!r} has an empty key=value pair (two commas in a row, a trailing comma or '=' "
                             "without a key); give key=value pairs separated by single commas")
        if key in values:
            raise ValueError(f"{key} is given twice; give each key once")
        if key in ("head_dim_qk", "head_dim_vo", "group_size"):
            try:
                values[key] = int(raw)
            except ValueError:
                raise ValueError(f"{key}={raw!r} is not an integer") from None
        elif key in ("use_sliding_window", "use_logits_soft_cap", "use_sinks"):
            if raw.lower() not in ON_WORDS + OFF_WORDS:
                raise ValueError(f"{key}={raw!r} is neither on nor off; give 1 or 0 (true / false)")
            values[key] = raw.lower() in ON_WORDS
        else:
            values[key] = raw
    return values


def read_json_file(path, limit: int = 16 << 20):
    """The JSON value in the small regular file ``path`` (a link to one is followed). A FIFO or a device there would
    block the read for good or never end (/dev/zero): the file is opened without blocking and read only when it is
    regular and at most ``limit`` bytes (OSError otherwise; UnicodeDecodeError / ValueError for its text)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"{info.st_size} bytes, more than the {limit} a JSON file here may have")
        return json.loads(f.read(limit + 1).decode("utf-8"))


def _spec_from_file(path: str) -> VariantSpec:
    """``@path``: a JSON file holding one spec's fields (``VariantSpec.to_dict``), a variant included."""
    try:
        data = read_json_file(path)
    except OSError as exc:
        raise ValueError(f"cannot read spec file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"spec file {path!r} is not UTF-8 text: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"spec file {path!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"spec file {path!r} must hold one JSON object (the spec's fields)")
    return VariantSpec.from_dict(data)


def _parse_uri(uri: str) -> VariantSpec:
    if "-" in uri:
        raise ValueError(
            f"uri {uri!r} names a custom variant, whose snippets a uri cannot carry; give the spec as a "
            "JSON file instead: --spec @path/to/spec.json (VariantSpec.to_dict() written with json.dump)"
        )
    tokens = uri.split("_")
    values: dict[str, Any] = {"op": Op.parse(tokens.pop(0), "op")}
    if tokens and tokens[0] in ("paged", "ragged"):
        values["kv_storage"] = tokens.pop(0)
    values["target"] = Target.parse(tokens.pop(0) if tokens else "", "target")
    base = DType.parse(tokens.pop(0), "dtype") if tokens else None
    given: dict[str, str] = {}  # field -> the token that set it
    for token in tokens:
        for field, value in _uri_token(uri, token).items():
            if field in given:  # "_g4_g8" must not quietly mean g8
                raise ValueError(f"uri {uri!r}: {token!r} sets {field} again (after {given[field]!r}); give each "
                                 "axis once")
            given[field] = token
            values[field] = value
    axes = spec_axes(values["op"], values["target"])
    if base is not None:
        for name in ("q_dtype", "kv_dtype", "o_dtype"):
            if name in axes:
                values.setdefault(name, base)
    for name, default in _ATTENTION_DEFAULTS.items():
        if name in axes:
            values.setdefault(name, default)
    return VariantSpec(**values)


_NUMBER = r"(?:0|[1-9][0-9]*)"  # ASCII digits, no leading zero: the form the uri prints (hd0128 is not hd128's uri)
_FLAG_TOKENS = {"rope": ("pos_encoding", "rope"), "alibi": ("pos_encoding", "alibi"),
                "swa": ("use_sliding_window", True), "softcap": ("use_logits_soft_cap", True),
                "causal": ("mask_mode", "causal"), "custom": ("mask_mode", "custom"), "nhd": ("kv_layout", "nhd"),
                "hnd": ("kv_layout", "hnd"), "sink": ("use_sinks", True)}  # token -> (field, value)
_DTYPE_NAMES = frozenset(d.value for d in DType)


def _uri_token(uri: str, token: str) -> dict[str, Any]:
    """The spec fields one uri token after the dtype sets."""
    if token.startswith("kv") and token != "kv":
        return {"kv_dtype": DType.parse(token[2:], "kv_dtype")}
    if token.startswith("o") and token[1:] in _DTYPE_NAMES:
        return {"o_dtype": DType.parse(token[1:], "o_dtype")}
    if token.startswith("hd"):
        dims = re.fullmatch(rf"hd({_NUMBER})(?:x({_NUMBER}))?", token)
        if dims is None:
            raise ValueError(f"uri {uri!r}: {token!r} is not a head dim token; write hd<qk> or hd<qk>x<vo> in "
                             "decimal digits (hd128, hd192x128)")
        return {"head_dim_qk": int(dims[1]), "head_dim_vo": int(dims[2] or dims[1])}
    if re.fullmatch(rf"g{_NUMBER}", token):
        return {"group_size": int(token[1:])}
    if token in _FLAG_TOKENS:
        return dict([_FLAG_TOKENS[token]])
    raise ValueError(f"uri {uri!r}: unknown token {token!r} (see the grammar in jitattn.spec)")

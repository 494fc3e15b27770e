"""Which specs a command is about: presets, HF configs and spec texts, for a target and arch list."""

from __future__ import annotations

import argparse
import contextlib
import os
from typing import Iterator


class UsageError(Exception):
    """Bad arguments or inputs: exit code 2."""


def add_selection_args(parser: argparse.ArgumentParser, *, default_dtype: str = "bfloat16") -> None:
    group = parser.add_argument_group("what to build (repeatable; combined)")
    group.add_argument("--preset", action="append", metavar="NAME",
                       help="model preset (see `jitattn-cache presets`): llama-3-8b, mistral-7b, gemma-2-9b, "
                            "deepseek-v3, ...")
    group.add_argument("--config", action="append", metavar="CONFIG_JSON",
                       help="path to a Hugging Face config.json on disk")
    group.add_argument("--spec", action="append", metavar="TEXT",
                       help="one spec: a uri (merge_cuda_bf16), key=value,... (op=merge,target=cpu,o_dtype=bf16), "
                            "@spec.json or inline JSON (VariantSpec.to_dict(); carries a custom variant)")
    opts = parser.add_argument_group("how (for --preset / --config)")
    opts.add_argument("--target", choices=["cuda", "cpu"],
                      help="default: cuda when a GPU is visible or --arch is given, else cpu")
    opts.add_argument("--arch", metavar="ARCHS",
                      help="CUDA archs in the JITATTN_CUDA_ARCH_LIST format, e.g. '9.0a' or '8.0;9.0a' "
                           "(build on a machine without that GPU)")
    opts.add_argument("--dtype", default=default_dtype, help=f"q/o dtype (default {default_dtype})")
    opts.add_argument("--kv-dtype", help="kv cache dtype (default: --dtype; e.g. float8_e4m3fn)")
    opts.add_argument("--tp", type=int, default=1, help="tensor-parallel degree: heads per rank (default 1)")


def has_selection(args: argparse.Namespace) -> bool:
    return bool(args.preset or args.config or args.spec)


@contextlib.contextmanager
def arch_env(arch: str | None) -> Iterator[None]:
    """Set JITATTN_CUDA_ARCH_LIST to ``arch`` for the duration (the key and flags read it at use)."""
    if not arch:
        yield
        return
    saved = os.environ.get("JITATTN_CUDA_ARCH_LIST")
    os.environ["JITATTN_CUDA_ARCH_LIST"] = arch
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("JITATTN_CUDA_ARCH_LIST", None)
        else:
            os.environ["JITATTN_CUDA_ARCH_LIST"] = saved


def gpu_visible() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def default_target(arch: str | None) -> str:
    return "cuda" if arch or gpu_visible() else "cpu"


def check_arch(arch: str | None, needed: bool) -> tuple[str, ...]:
    """Validate --arch (inside ``arch_env``); when cuda specs are ``needed``, the arch list must resolve."""
    from jitattn.jit.admin import ToolchainError, cuda_arch_list

    if not arch and not needed:
        return ()
    try:
        return cuda_arch_list()
    except ToolchainError as exc:
        where = f"--arch {arch!r}" if arch else "cuda specs need an arch list (pass --arch, e.g. --arch 9.0a)"
        raise UsageError(f"{where}: {exc}") from None


def _spec_from_text(text: str):
    """``--spec`` text: inline JSON (``{...}``, what the library prints for custom variants) or
    anything ``parse_spec_text`` reads (a uri, ``key=value,...``, ``@spec.json``)."""
    import json

    from jitattn.spec import VariantSpec
    from jitattn.spec_text import parse_spec_text

    if text.lstrip()[:1] in ("{", "[", '"'):  # JSON (a uri never starts so)
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("must be one JSON object (the spec's fields)")
        return VariantSpec.from_dict(data)
    return parse_spec_text(text)


def resolve_specs(args: argparse.Namespace) -> list:
    """The unique specs ``args`` select, in order; UsageError for anything unparseable.

    Call inside ``arch_env(args.arch)``.
    """
    import torch

    from jitattn import mla_model_specs, model_specs
    from jitattn.spec import DType, Target

    from .presets import PRESETS, MLAShape, from_hf_config

    args.target = args.target or default_target(args.arch)
    target = Target.parse(args.target, "--target")
    shapes = []
    for name in args.preset or []:
        if name not in PRESETS:
            raise UsageError(f"unknown preset {name!r}; available: {', '.join(PRESETS)} "
                             "(or use --config path/to/config.json)")
        shapes.append((f"preset {name}", PRESETS[name]))
    for path in args.config or []:
        try:
            shapes.append((f"config {path}", from_hf_config(path)))
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    try:
        dtype = DType.parse(args.dtype, "--dtype").torch_dtype
        kv_dtype = DType.parse(args.kv_dtype, "--kv-dtype").torch_dtype if args.kv_dtype else dtype
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if shapes and target is Target.CUDA and dtype == torch.float32:
        raise UsageError("--dtype float32 is supported on the cpu target only; use bfloat16 or float16")
    specs = []
    for what, shape in shapes:
        try:
            shape = shape.with_tensor_parallel(args.tp)
            if isinstance(shape, MLAShape):
                specs += mla_model_specs(
                    target, num_heads=shape.num_heads, kv_lora_rank=shape.kv_lora_rank,
                    qk_rope_head_dim=shape.qk_rope_head_dim, qk_nope_head_dim=shape.qk_nope_head_dim,
                    v_head_dim=shape.v_head_dim, dtype=dtype, kv_dtype=kv_dtype,
                )
                continue
            specs += model_specs(
                target, num_qo_heads=shape.num_qo_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                dtype=dtype, kv_dtype=kv_dtype, sliding_window=shape.sliding_window,
                full_attention_too=shape.full_attention_too, logits_soft_cap=shape.logits_soft_cap,
                attention_sinks=shape.attention_sinks,
            )
        except ValueError as exc:
            raise UsageError(f"{what}: {exc}") from None
    for text in args.spec or []:
        try:
            specs.append(_spec_from_text(text))
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise UsageError(f"--spec {text!r}: {exc}") from None
    if not specs:
        raise UsageError("nothing selected: give --preset NAME, --config config.json or --spec TEXT")
    specs = list(dict.fromkeys(specs))
    check_arch(args.arch, needed=any(s.target is Target.CUDA for s in specs))
    return specs

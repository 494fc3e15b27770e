"""Model attention shapes: built-in presets and Hugging Face config.json files.

A ``ModelShape`` is what ``jitattn.runtime.specs.model_specs`` needs to list
every kernel a model's decode, prefill (paged and ragged), cascade, merge and
append paths request; an ``MLAShape`` (DeepSeek-style latent attention) is what
``jitattn.runtime.specs.mla_model_specs`` needs. ``warm`` and ``export`` expand
shapes with them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from jitattn.spec_text import read_json_file


@dataclass(frozen=True)
class ModelShape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: bool = False
    full_attention_too: bool = True  # some layers without the window
    logits_soft_cap: bool = False
    attention_sinks: bool = False  # gpt-oss: per-head sink logits (the sink builds too)

    def with_tensor_parallel(self, tp: int) -> "ModelShape":
        """The shape one rank of a ``tp``-way tensor-parallel model sees.

        Query heads are split evenly; kv heads are split when ``tp`` divides
        them, and replicated (one per rank) when they divide ``tp`` (vLLM's and
        SGLang's rule).
        """
        if tp < 1:
            raise ValueError(f"--tp {tp} must be at least 1")
        if self.num_qo_heads % tp != 0:
            raise ValueError(f"--tp {tp} must divide num_attention_heads={self.num_qo_heads}")
        if self.num_kv_heads % tp == 0:
            kv = self.num_kv_heads // tp
        elif tp % self.num_kv_heads == 0:
            kv = 1  # each rank holds one replicated kv head
        else:
            raise ValueError(
                f"--tp {tp} must divide num_key_value_heads={self.num_kv_heads} or be a multiple of it"
            )
        return replace(self, num_qo_heads=self.num_qo_heads // tp, num_kv_heads=kv)

    def describe(self) -> str:
        parts = [f"{self.num_qo_heads} q heads", f"{self.num_kv_heads} kv heads", f"head_dim {self.head_dim}"]
        if self.sliding_window:
            parts.append("sliding window" + (" + global layers" if self.full_attention_too else ""))
        if self.logits_soft_cap:
            parts.append("logits soft cap")
        if self.attention_sinks:
            parts.append("attention sinks")
        return ", ".join(parts)


@dataclass(frozen=True)
class MLAShape:
    """DeepSeek-style multi-head latent attention (the names of its Hugging Face config)."""

    num_heads: int
    kv_lora_rank: int  # the compressed latent (ckv) width
    qk_rope_head_dim: int  # the rope part (kpe)
    qk_nope_head_dim: int
    v_head_dim: int

    def with_tensor_parallel(self, tp: int) -> "MLAShape":
        """One rank of a ``tp``-way tensor-parallel model: the query heads split, the one latent head replicated."""
        if tp < 1:
            raise ValueError(f"--tp {tp} must be at least 1")
        if self.num_heads % tp != 0:
            raise ValueError(f"--tp {tp} must divide num_attention_heads={self.num_heads}")
        return replace(self, num_heads=self.num_heads // tp)

    def describe(self) -> str:
        return (f"MLA: {self.num_heads} heads, kv_lora_rank {self.kv_lora_rank}, qk_rope {self.qk_rope_head_dim}, "
                f"qk_nope {self.qk_nope_head_dim}, v_head_dim {self.v_head_dim}")


PRESETS: dict[str, ModelShape | MLAShape] = {
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(64, 8, 128),
    "mistral-7b": ModelShape(32, 8, 128, sliding_window=True, full_attention_too=False),
    "qwen2.5-7b": ModelShape(28, 4, 128),
    "gemma-2-9b": ModelShape(16, 8, 256, sliding_window=True, full_attention_too=True, logits_soft_cap=True),
    "phi-3-mini": ModelShape(32, 32, 96),
    "deepseek-v3": MLAShape(128, 512, 64, 128, 128),
    "deepseek-v2-lite": MLAShape(16, 512, 64, 128, 128),
}

_MLA_FIELDS = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def _positive_int(config: dict, name: str, path: str | Path) -> int:
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{path}: {name}={value!r} must be a positive integer")
    return value


def from_hf_config(path: str | Path) -> ModelShape | MLAShape:
    """Read the attention shape from a Hugging Face ``config.json`` on disk.

    A config with ``kv_lora_rank`` (DeepSeek-V2/V3 style) is MLA: num_attention_heads,
    kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim and v_head_dim give an ``MLAShape``.
    Otherwise it uses num_attention_heads, num_key_value_heads (default: MHA), head_dim
    (else hidden_size / num_attention_heads), sliding_window (with
    use_sliding_window, and gemma-style alternation via layer_types,
    sliding_window_pattern or model_type gemma*) and attn_logit_softcapping; model_type gpt_oss has
    attention sinks.
    RoPE settings need nothing compiled: jitattn's model specs take positions
    as applied by the serving stack, and rope scalars are run-time arguments.
    """
    try:
        config = read_json_file(path)
    except FileNotFoundError:
        raise ValueError(f"model config {path} does not exist") from None
    except OSError as exc:
        raise ValueError(f"cannot read model config {path}: {exc.strerror or exc}") from None
    except ValueError as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a JSON object; expected a Hugging Face config.json")
    config = config.get("text_config") or config  # multimodal configs nest the language model
    if "num_attention_heads" not in config:
        raise ValueError(f"{path}: no num_attention_heads; is this a transformer config.json?")
    heads = _positive_int(config, "num_attention_heads", path)
    if config.get("kv_lora_rank") is not None:
        missing = [name for name in _MLA_FIELDS if config.get(name) is None]
        if missing:
            raise ValueError(f"{path}: an MLA config (kv_lora_rank is set) needs {', '.join(missing)} too")
        return MLAShape(heads, *(_positive_int(config, name, path) for name in _MLA_FIELDS))
    kv_heads = _positive_int(config, "num_key_value_heads", path) \
        if config.get("num_key_value_heads") is not None else heads
    if config.get("head_dim") is not None:
        head_dim = _positive_int(config, "head_dim", path)
    elif config.get("hidden_size"):
        hidden = _positive_int(config, "hidden_size", path)
        if hidden % heads:
            raise ValueError(f"{path}: hidden_size={hidden} is not a multiple of num_attention_heads={heads}")
        head_dim = hidden // heads
    else:
        raise ValueError(f"{path}: neither head_dim nor hidden_size is set")
    if heads % kv_heads:
        raise ValueError(f"{path}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
    window = config.get("sliding_window")
    if window is not None and window is not False:  # null / false: no window; else its length in tokens
        _positive_int(config, "sliding_window", path)
    uses_window = bool(window) and bool(config.get("use_sliding_window", True))
    cap = config.get("attn_logit_softcapping")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 0 <= cap < math.inf):
        raise ValueError(f"{path}: attn_logit_softcapping={cap!r} is not a soft cap (a positive number, or null / 0 "
                         "for none)")
    layer_types = [str(t) for t in config.get("layer_types") or []]
    if layer_types and "sliding_attention" not in layer_types:
        uses_window = False  # every layer is global
    # Gemma-2 style models alternate windowed and global layers.
    alternating = uses_window and (
        bool(config.get("sliding_window_pattern")) or str(config.get("model_type", "")).startswith("gemma")
        or any(t != "sliding_attention" for t in layer_types)
    )
    return ModelShape(
        num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, sliding_window=uses_window,
        full_attention_too=(not uses_window) or alternating,
        logits_soft_cap=bool(cap),
        attention_sinks=str(config.get("model_type", "")) == "gpt_oss",
    )

"""Model configurations of the serving engine's Llama-architecture decoder."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from ..spec import SUPPORTED_HEAD_DIMS
from ..spec_text import read_json_file


@dataclass(frozen=True)
class ModelConfig:
    """The shapes of a Llama-architecture decoder (Hugging Face ``LlamaConfig`` names where they exist)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float = 500000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name}={value!r} must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                             f"num_key_value_heads={self.num_key_value_heads} (GQA)")
        if self.head_dim not in SUPPORTED_HEAD_DIMS:
            raise ValueError(f"head_dim={self.head_dim} is not a head dim the attention kernels take (multiples of 8 "
                             f"from {SUPPORTED_HEAD_DIMS[0]} to {SUPPORTED_HEAD_DIMS[-1]})")
        for name, positive in (("rope_theta", True), ("rms_norm_eps", False)):
            value = getattr(self, name)
            number = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
            if not number or value < 0 or positive and value == 0:
                bound = "> 0" if positive else ">= 0"
                raise ValueError(f"ModelConfig.{name}={value!r} must be a finite number {bound}")

    @property
    def group_size(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def with_layers(self, num_hidden_layers: int) -> "ModelConfig":
        return replace(self, num_hidden_layers=num_hidden_layers)

    def to_hf_dict(self) -> dict:
        """A Hugging Face ``config.json`` of this model (``jitattn-cache warm --config`` reads it)."""
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **asdict(self)}

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_hf_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_hf_config(cls, path: str | Path) -> "ModelConfig":
        """Read a Hugging Face Llama ``config.json`` (a file or the directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            data = read_json_file(path)
        except FileNotFoundError:
            raise ValueError(f"{path} does not exist; expected a Hugging Face config.json") from None
        except OSError as exc:
            raise ValueError(f"cannot read {path}: {exc.strerror or exc}; expected a Hugging Face config.json") \
                from None
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path} is not UTF-8 text ({exc.reason}); expected a Hugging Face config.json") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc}); expected a Hugging Face config.json") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path} holds a JSON {type(data).__name__}; expected a Hugging Face config.json object")
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if k not in data]
        if missing:
            raise ValueError(f"{path}: missing {', '.join(missing)}; is this a Llama config.json?")
        # What this small engine computes is a Llama block: refuse what would silently differ from it.
        model_type = data.get("model_type", "llama")
        if model_type not in ("llama", "mistral"):
            raise ValueError(f"{path}: model_type {model_type!r}; this engine runs Llama-architecture models "
                             "(llama, mistral) only")
        for flag in ("attention_bias", "mlp_bias"):
            if data.get(flag):
                raise ValueError(f"{path}: {flag}=true is not supported (the engine's projections have no bias)")
        if data.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{path}: hidden_act {data['hidden_act']!r}; the engine's MLP is SwiGLU (silu)")
        if model_type == "mistral" and data.get("sliding_window"):
            raise ValueError(f"{path}: sliding_window={data['sliding_window']} is not supported by this engine")
        try:
            return cls(**_hf_fields(data))
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None


def _given(*values):
    """The first of ``values`` that is not None (a field given as null reads as not given, as transformers reads
    it)."""
    return next(v for v in values if v is not None)


def _hf_fields(data: dict) -> dict:
    """``ModelConfig``'s fields from a Hugging Face config's (``None`` where transformers derives a default); what
    they cannot be is a ValueError (``ModelConfig`` checks the rest)."""
    heads, hidden = data["num_attention_heads"], data["hidden_size"]
    rope = data.get("rope_parameters") or data.get("rope_scaling") or {}  # transformers 5 / 4 spellings
    if not isinstance(rope, dict):
        raise ValueError(f"rope_scaling={rope!r} must be an object (its rope_type and parameters)")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported by this small engine (plain RoPE only)")
    head_dim = data.get("head_dim")
    if head_dim is None and all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in (heads, hidden)):
        if hidden % heads:
            raise ValueError(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} and no head_dim "
                             "is given; give head_dim")
        head_dim = hidden // heads
    kv_heads = data.get("num_key_value_heads")
    fields = dict(vocab_size=data["vocab_size"], hidden_size=hidden, intermediate_size=data["intermediate_size"],
                  num_hidden_layers=data["num_hidden_layers"], num_attention_heads=heads,
                  num_key_value_heads=heads if kv_heads is None else kv_heads, head_dim=head_dim,
                  rope_theta=_given(rope.get("rope_theta"), data.get("rope_theta"), 10000.0),
                  rms_norm_eps=data.get("rms_norm_eps", 1e-6),  # (null: refused, the norm has no eps then)
                  tie_word_embeddings=_given(data.get("tie_word_embeddings"), False))
    for name in ("rope_theta", "rms_norm_eps"):
        if isinstance(fields[name], int) and not isinstance(fields[name], bool):
            fields[name] = float(fields[name])
    if not isinstance(fields["tie_word_embeddings"], bool):
        raise ValueError(f"tie_word_embeddings={fields['tie_word_embeddings']!r} must be true or false")
    return fields


PRESETS: dict[str, ModelConfig] = {
    # Runs on the cpu target in seconds; 4 q heads over 2 kv heads so that TP 2 and TP 4 both split it.
    "tiny": ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "small": ModelConfig(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, num_key_value_heads=4, head_dim=64),
    # Llama-3-8B's shapes (random weights unless a checkpoint is given).
    "llama-3-8b-shapes": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                     head_dim=128, rope_theta=500000.0),
}


def preset(name: str) -> ModelConfig:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(PRESETS)} or give a checkpoint directory")
    return PRESETS[name]

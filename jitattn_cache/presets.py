"""Model attention shapes: built-in presets and Hugging Face config.json files."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path


@dataclass(frozen=True)
class ModelShape:
    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: bool = False
    full_attention_too: bool = True  # some layers without the window
    logits_soft_cap: bool = False

    def with_tensor_parallel(self, tp: int) -> "ModelShape":
        if tp < 1 or self.num_qo_heads % tp != 0:
            raise ValueError(f"--tp {tp} must divide num_attention_heads={self.num_qo_heads}")
        kv = self.num_kv_heads // tp if self.num_kv_heads % tp == 0 else 1  # kv heads replicate when tp > kv heads
        return replace(self, num_qo_heads=self.num_qo_heads // tp, num_kv_heads=max(1, kv))


PRESETS: dict[str, ModelShape] = {
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(64, 8, 128),
    "mistral-7b": ModelShape(32, 8, 128, sliding_window=True, full_attention_too=False),
    "qwen2.5-7b": ModelShape(28, 4, 128),
    "gemma-2-9b": ModelShape(16, 8, 256, sliding_window=True, full_attention_too=True, logits_soft_cap=True),
    "phi-3-mini": ModelShape(32, 32, 96),
}


def from_hf_config(path: str | Path) -> ModelShape:
    """Read the attention shape from a Hugging Face ``config.json`` on disk."""
    try:
        config = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"cannot read model config {path}: {exc}") from None
    config = config.get("text_config", config)  # multimodal configs nest the language model
    try:
        heads = int(config["num_attention_heads"])
    except KeyError:
        raise ValueError(f"{path}: no num_attention_heads; is this a transformer config.json?") from None
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
    window = config.get("sliding_window")
    uses_window = bool(window) and config.get("use_sliding_window", True)
    # Gemma-2 style models alternate windowed and global layers.
    alternating = uses_window and (
        "sliding_window_pattern" in config or config.get("model_type", "").startswith("gemma")
        or bool(config.get("layer_types"))
    )
    return ModelShape(
        num_qo_heads=heads, num_kv_heads=kv_heads, head_dim=int(head_dim), sliding_window=uses_window,
        full_attention_too=(not uses_window) or alternating,
        logits_soft_cap=bool(config.get("attn_logit_softcapping")),
    )

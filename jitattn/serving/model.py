"""A Llama-architecture decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention is a callback.

The model knows nothing about caches: ``forward(input_ids, positions, attention)`` computes
q/k/v per layer, applies RoPE (jitattn's op), and calls ``attention(layer, q, k, v)`` for the output
of that layer's attention (``[tokens, heads, head_dim]``). The serving engine passes a callback
that appends k/v to its paged pool and runs a planned jitattn wrapper; the reference passes one
that keeps plain per-request tensors and uses torch attention. Weights use Hugging Face Llama
names and come from a seed (random) or a checkpoint directory; a tensor-parallel rank keeps
only its shard (see :mod:`jitattn.serving.parallel`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

import jitattn

from .config import ModelConfig
from .parallel import TPGroup, column_range, head_shard

AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def hf_weight_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every weight of the model by its Hugging Face Llama name, with its full (unsharded) shape."""
    h, d = config.hidden_size, config.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (config.num_attention_heads * d, h),
            p + "self_attn.k_proj.weight": (config.num_key_value_heads * d, h),
            p + "self_attn.v_proj.weight": (config.num_key_value_heads * d, h),
            p + "self_attn.o_proj.weight": (h, config.num_attention_heads * d),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
        })
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


def random_weights(config: ModelConfig, seed: int = 0, device: str | torch.device = "cpu",
                   dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights, scaled so activations stay O(1) at any depth.

    Drawn in float32 on ``device`` (the same values on every rank for one seed and device type; draw
    Llama-3-8B-sized weights on the GPU: the host takes minutes), then cast to ``dtype``.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a ModelConfig (e.g. preset('tiny')), got {type(config).__name__}")
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, shape in hf_weight_shapes(config).items():
        w = torch.randn(shape, generator=gen, device=device)
        if name.endswith("norm.weight"):
            w = 1.0 + 0.1 * w
        elif name != "model.embed_tokens.weight":
            w = w * shape[1] ** -0.5
        weights[name] = w.to(dtype)
    return weights


def load_checkpoint(directory: str | Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """(config, weights) of a Hugging Face Llama checkpoint directory.

    Reads ``config.json`` and every ``*.safetensors`` file (needs the ``safetensors`` package), else
    ``pytorch_model*.bin``. Only the Llama names of :func:`hf_weight_shapes` are kept.
    """
    directory = Path(directory)
    config = ModelConfig.from_hf_config(directory)
    weights: dict[str, torch.Tensor] = {}
    tensors = sorted(directory.glob("*.safetensors"))
    if tensors:
        try:
            from safetensors.torch import load_file
        except ImportError:
            raise ImportError(f"{directory} holds .safetensors files; install the safetensors package "
                              "(python3 -m pip install safetensors)") from None
        for path in tensors:
            weights.update(load_file(str(path)))
    else:
        bins = sorted(directory.glob("pytorch_model*.bin"))
        if not bins:
            raise ValueError(f"{directory} has neither *.safetensors nor pytorch_model*.bin files")
        for path in bins:
            loaded = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(loaded, dict):
                raise ValueError(f"{path} holds a {type(loaded).__name__}; expected a state dict (name -> tensor)")
            weights.update(loaded)
    expected = check_weights(config, weights, str(directory))
    # Weights the Llama block has no use for (biases, another architecture's parts) would be dropped
    # silently and change the tokens: refuse them (a tied lm_head copy and rotary buffers are fine).
    unused = [n for n in weights if n not in expected and not n.endswith("rotary_emb.inv_freq")
              and not (n == "lm_head.weight" and config.tie_word_embeddings)]
    if unused:
        raise ValueError(f"{directory}: {len(unused)} weights this Llama engine does not use, e.g. {unused[0]}; "
                         "is this a Llama checkpoint (no biases)?")
    return config, {n: weights[n] for n in expected}


def check_weights(config: ModelConfig, weights, where: str) -> dict[str, tuple[int, ...]]:
    """Raise unless ``weights`` holds every tensor of ``config`` at its shape; returns the shapes by name."""
    if not isinstance(weights, dict):
        raise TypeError(f"{where}: weights must be a dict of name -> tensor, got {type(weights).__name__}")
    expected = hf_weight_shapes(config)
    missing = [n for n in expected if n not in weights]
    if missing:
        raise ValueError(f"{where}: {len(missing)} weights missing, e.g. {missing[0]}")
    for name, shape in expected.items():
        t = weights[name]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = f"of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            raise ValueError(f"{where}: {name} is {got}; the config says a tensor of shape {shape}")
    return expected


def save_checkpoint(config: ModelConfig, weights: dict[str, torch.Tensor], directory: str | Path) -> None:
    """Write ``config.json`` and ``pytorch_model.bin`` (Hugging Face Llama names)."""
    directory = Path(directory)
    check_weights(config, weights, "save_checkpoint")  # before writing anything: no half-written checkpoint
    config.save(directory)
    torch.save({n: t.contiguous() for n, t in weights.items()}, directory / "pytorch_model.bin")


def check_placement(dtype, device) -> torch.device:
    """The model's device, once ``dtype`` is one the kernels take and ``device`` one this machine has."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"dtype={dtype!r} is not one the kernels take; use torch.float16, torch.bfloat16 or "
                        "torch.float32")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"device={device!r} is not a device ({e}); use 'cpu' or 'cuda'") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={str(device)!r}, but this machine has no CUDA device; use device='cpu'")
    return device


def _finite(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` is finite (e4m3 has no isfinite kernel: checked in float16, which holds it)."""
    try:
        return bool(t.isfinite().all())
    except (NotImplementedError, RuntimeError):
        return bool(t.to(torch.float16).isfinite().all())


class LlamaModel:
    """One tensor-parallel rank's shard of a Llama decoder (the whole model when tp is 1)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", group: TPGroup | None = None) -> None:
        if not isinstance(config, ModelConfig):
            raise TypeError(f"config must be a ModelConfig (e.g. preset('tiny')), got {type(config).__name__}")
        device = check_placement(dtype, device)
        names = check_weights(config, weights, "LlamaModel")
        # a NaN or inf weight gives every request garbage tokens (argmax of NaN logits) without an error
        bad = next((n for n in names if weights[n].is_floating_point() and not _finite(weights[n])), None)
        if bad is not None:
            raise ValueError(f"LlamaModel: weight {bad} holds NaN or inf values; check the checkpoint (or its dtype "
                             "conversion)")
        self.config = config
        self.group = group or TPGroup()
        self.dtype, self.device = dtype, device
        shard = head_shard(config.num_attention_heads, config.num_key_value_heads, self.group.rank, self.group.size)
        self.num_q_heads, self.num_kv_heads = shard.num_q, shard.num_kv
        d = config.head_dim
        q_rows = slice(shard.q_start * d, (shard.q_start + shard.num_q) * d)
        kv_rows = slice(shard.kv_start * d, (shard.kv_start + shard.num_kv) * d)
        mlp_lo, mlp_hi = column_range(config.intermediate_size, self.group.rank, self.group.size)

        def put(t: torch.Tensor) -> torch.Tensor:
            return t.to(device=self.device, dtype=dtype).contiguous()

        self.embed = put(weights["model.embed_tokens.weight"])
        self.norm = put(weights["model.norm.weight"])
        self.lm_head = self.embed if config.tie_word_embeddings else put(weights["lm_head.weight"])
        self.layers = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            w = lambda name: weights[p + name]  # noqa: E731
            self.layers.append(dict(
                input_norm=put(w("input_layernorm.weight")), post_norm=put(w("post_attention_layernorm.weight")),
                # q, k and v of this rank's heads as one fused projection
                qkv=put(torch.cat([w("self_attn.q_proj.weight")[q_rows], w("self_attn.k_proj.weight")[kv_rows],
                                   w("self_attn.v_proj.weight")[kv_rows]])),
                o=put(w("self_attn.o_proj.weight")[:, q_rows]),
                gate_up=put(torch.cat([w("mlp.gate_proj.weight")[mlp_lo:mlp_hi], w("mlp.up_proj.weight")[mlp_lo:mlp_hi]])),
                down=put(w("mlp.down_proj.weight")[:, mlp_lo:mlp_hi]),
            ))

    @property
    def weight_bytes(self) -> int:
        """Bytes of this rank's weights a decode step reads (the embedding rows it gathers aside): the layers,
        the final norm and the LM head."""
        tensors = [t for layer in self.layers for t in layer.values()] + [self.norm, self.lm_head]
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, **kwargs) -> "LlamaModel":
        """A model with :func:`random_weights` drawn on its device (the same on every rank for one seed)."""
        device, dtype = kwargs.get("device", "cpu"), kwargs.get("dtype", torch.float32)
        check_placement(dtype, device)  # before drawing weights there
        return cls(config, random_weights(config, seed, device=device, dtype=dtype), **kwargs)

    @classmethod
    def from_checkpoint(cls, directory: str | Path, **kwargs) -> "LlamaModel":
        config, weights = load_checkpoint(directory)
        return cls(config, weights, **kwargs)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionFn) -> torch.Tensor:
        """Hidden states ``[tokens, hidden]`` after the final norm; ``attention(layer, q, k, v)`` gives each
        layer's attention output ``[tokens, num_q_heads, head_dim]`` (RoPE already applied to q and k).

        The residual stream ``x`` takes each block's output through ``fused_add_rmsnorm`` (``x += delta``, then
        ``delta`` becomes the next norm of ``x``: one launch for the add and the norm, computed from the float32
        sum), and the MLP's gate through ``silu_and_mul``: jitattn's kernels on both targets."""
        c = self.config
        d, hq, hkv, eps = c.head_dim, self.num_q_heads, self.num_kv_heads, c.rms_norm_eps
        x = self.embed[input_ids]  # the residual stream (a new tensor: the gather copies)
        tokens = input_ids.shape[0]
        delta = None  # the last block's output, not yet added into x
        for i, layer in enumerate(self.layers):
            if delta is None:
                h = jitattn.rmsnorm(x, layer["input_norm"], eps)
            else:  # x += delta; delta = the norm of x
                jitattn.fused_add_rmsnorm(delta, x, layer["input_norm"], eps)
                h = delta
            qkv = (h @ layer["qkv"].t()).view(tokens, hq + 2 * hkv, d)
            q, k, v = qkv[:, :hq], qkv[:, hq: hq + hkv], qkv[:, hq + hkv:]
            # Hugging Face Llama's rotary embedding (non-interleaved halves), q and k in place: one launch
            jitattn.apply_rope_pos_ids_inplace(q, k, positions, rope_theta=c.rope_theta)
            o = attention(i, q, k, v).reshape(tokens, hq * d)
            delta = self.group.all_reduce(o @ layer["o"].t())
            jitattn.fused_add_rmsnorm(delta, x, layer["post_norm"], eps)
            delta = self.group.all_reduce(jitattn.silu_and_mul(delta @ layer["gate_up"].t()) @ layer["down"].t())
        if delta is None:
            return jitattn.rmsnorm(x, self.norm, eps)
        jitattn.fused_add_rmsnorm(delta, x, self.norm, eps)
        return delta

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[tokens, vocab]`` (the lm head is replicated on every rank)."""
        return (hidden @ self.lm_head.t()).float()

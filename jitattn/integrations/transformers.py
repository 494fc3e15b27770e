"""jitattn as a Hugging Face transformers attention backend.

Importing this module registers ``"jitattn"`` with transformers' ``AttentionInterface`` (the
attention function) and ``AttentionMaskInterface`` (the mask builder), so that::

    import jitattn.integrations.transformers  # noqa: F401  (registers "jitattn")
    model = AutoModelForCausalLM.from_config(config, attn_implementation="jitattn")

runs every attention layer, in ``forward`` and ``generate``, on jitattn's ragged prefill kernel.
The mask registration matters: transformers builds no mask at all for an implementation it does
not know, which would silently drop causal masking, sliding windows and padding. The mask
builder is transformers' boolean ``sdpa_mask``; when it skips the mask (a plain causal pattern
with no padding) the kernel's own causal mask is used, and otherwise the boolean mask goes to
the kernel as a custom mask (sliding windows and padding included). ``scaling`` and Gemma-2's
``softcap`` map to ``sm_scale`` and ``logits_soft_cap``; GQA needs no key repetition.

Each layer's call plans and runs one ragged batch (every sequence of the batch a request). The
integration registers on import; :func:`register` is idempotent and may be called again.
"""

from __future__ import annotations

import threading

import torch

import jitattn
from jitattn.spec import check_head_dims

NAME = "jitattn"
_WORKSPACE_BYTES = 16 << 20
_local = threading.local()  # a wrapper per thread and device: a layer's plan and run must not interleave with another's


def _wrapper(device: torch.device) -> jitattn.BatchPrefillWithRaggedKVCacheWrapper:
    wrappers = _local.__dict__.setdefault("wrappers", {})
    if device not in wrappers:
        workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        wrappers[device] = jitattn.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    return wrappers[device]


def jitattn_attention_forward(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
    softcap: float | None = None, is_causal: bool | None = None, **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: q ``[B, H, T, D]``, k/v ``[B, H_kv, S, D]`` -> (``[B, T, H, D_v]``, None).

    ``attention_mask`` is the boolean ``[B, 1, T, S]`` mask of :func:`jitattn_mask` (True: attend)
    or None for a plain causal pattern. Attention weights are never materialised (None).
    """
    if dropout and module.training:
        raise ValueError("jitattn attention has no dropout; use attn_implementation='eager' for training with dropout")
    for name in ("position_bias", "indices", "block_indices"):  # a bias; a sparse model's top-k keys (flash_mla's)
        if kwargs.get(name) is not None:  # attention without them would be dense: wrong, silently
            raise ValueError(f"jitattn attention does not take {name}= (this model's attention needs it); use "
                             "attn_implementation='sdpa' or 'eager'")
    if kwargs.get("output_attentions"):  # the model would return no weights, silently
        raise ValueError("jitattn attention never materialises the attention weights, so output_attentions=True "
                         "cannot be served; use attn_implementation='eager' to get them")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
        raise RuntimeError("the jitattn backend is inference-only (its kernels have no backward); run under "
                           "torch.no_grad()/torch.inference_mode(), or use attn_implementation='eager' to train")
    sinks = kwargs.get("s_aux")  # gpt-oss attention sinks: one logit per query head, after the scaling
    if sinks is not None:
        sinks = sinks.detach().to(device=query.device, dtype=torch.float32).contiguous()
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    custom_mask = None
    if attention_mask is None:
        causal = causal and q_len > 1  # a single query sees every key (bottom-right alignment)
        if causal and kv_len > q_len:
            # transformers skips the mask for a prefill into an empty static cache: upper-left causal, i.e.
            # only the first q_len keys exist yet (sdpa slices the same way)
            key, value, kv_len = key[:, :, :q_len], value[:, :, :q_len], q_len
    else:
        if attention_mask.dtype != torch.bool and attention_mask.dim() == 4 and attention_mask.shape[1] > 1:
            raise ValueError("the jitattn backend takes boolean masks, one for every head; got a float mask per head "
                             f"(shape {tuple(attention_mask.shape)}: a bias such as ALiBi folded into the mask, as "
                             "Falcon with alibi=True builds it), which it cannot apply; use attn_implementation='sdpa'")
        if attention_mask.dtype != torch.bool:
            raise TypeError(f"the jitattn backend takes boolean masks (True: attend); got a {attention_mask.dtype} "
                            "mask (an additive one, such as a 4-D float attention_mask passed to the model, or the "
                            "mask of another attention implementation). Pass the 2-D padding mask (1: a token) and "
                            "let the model build its mask, or a boolean 4-D one (additive == 0); build the model "
                            f"with attn_implementation='{NAME}' after importing jitattn.integrations.transformers")
        if attention_mask.dim() != 4 or attention_mask.shape[1] != 1:
            what = "a mask per head" if attention_mask.dim() == 4 else f"a {attention_mask.dim()}-D mask"
            raise ValueError(f"the jitattn backend takes one mask for every head ([B, 1, T, S]); got shape "
                             f"{tuple(attention_mask.shape)} ({what}); use attn_implementation='sdpa'")
        mask_b, _, mask_t, mask_s = attention_mask.shape
        if any(n not in (1, want) for n, want in ((mask_b, batch), (mask_t, q_len), (mask_s, kv_len))):
            raise ValueError(f"the attention mask has shape {tuple(attention_mask.shape)}, but these {batch} "
                             f"sequences of {q_len} queries over {kv_len} keys take [{batch}, 1, {q_len}, {kv_len}] "
                             "(or 1 in a dimension to broadcast it)")
        custom_mask = attention_mask.expand(batch, 1, q_len, kv_len)[:, 0].reshape(-1).cpu()
        causal = False  # the mask holds the causal pattern
    dtype = _autocast_dtype(query.device.type) if len({query.dtype, key.dtype, value.dtype}) > 1 else None
    if dtype is not None:  # under autocast (RoPE's float32 q and k beside a low-precision v): its dtype, as sdpa runs
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    # (the kernels read rows of head_dim contiguous elements: a model's strided last dimension is copied)
    q = query.transpose(1, 2).reshape(batch * q_len, heads, head_dim).contiguous()
    k = key.transpose(1, 2).reshape(batch * kv_len, kv_heads, head_dim).contiguous()
    v = value.transpose(1, 2).reshape(batch * kv_len, kv_heads, value.shape[-1]).contiguous()
    try:
        check_head_dims(head_dim, value.shape[-1])
    except ValueError as exc:
        raise ValueError(f"{exc}; use attn_implementation='sdpa' for this model") from None
    wrapper = _wrapper(query.device)
    wrapper.plan(torch.arange(batch + 1, dtype=torch.int32) * q_len, torch.arange(batch + 1, dtype=torch.int32) * kv_len,
                 heads, kv_heads, head_dim, head_dim_vo=value.shape[-1], custom_mask=custom_mask, causal=causal,
                 sm_scale=scaling, logits_soft_cap=softcap or None, q_data_type=query.dtype, kv_data_type=key.dtype)
    out = wrapper.run(q, k, v, sinks=sinks)
    return out.view(batch, q_len, heads, value.shape[-1]), None


def _autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast runs ``device_type``'s ops in, None when it is off (or this torch cannot say: before 2.4)."""
    try:
        return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None
    except (TypeError, AttributeError):
        return None


def jitattn_mask(*args, **kwargs) -> torch.Tensor | None:
    """transformers' mask-builder contract: the boolean mask of ``sdpa_mask`` (None when plain causal suffices)."""
    from transformers.masking_utils import sdpa_mask

    kwargs.pop("dtype", None)  # eager's additive masks want it; boolean masks do not
    return sdpa_mask(*args, **kwargs)


def register() -> None:
    """Register ``"jitattn"`` with ``AttentionInterface`` and ``AttentionMaskInterface`` (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as exc:
        raise ImportError(f"jitattn.integrations.transformers needs transformers 5.x ({exc}); install it with "
                          "python3 -m pip install 'jitattn[transformers]'") from None

    AttentionInterface.register(NAME, jitattn_attention_forward)
    AttentionMaskInterface.register(NAME, jitattn_mask)


register()

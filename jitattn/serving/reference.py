"""The plain per-request reference: same model and weights, torch attention, no paging, no sharing."""

from __future__ import annotations

import torch

from .model import LlamaModel
from .request import request_tokens


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal (bottom-right) GQA attention in float32: q ``[n, Hq, D]`` over k/v ``[kv_len, Hkv, D]``."""
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.float(), k.float().repeat_interleave(group, 1), v.float().repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", qf, kf) * q.shape[-1] ** -0.5
    n, kv_len = q.shape[0], k.shape[0]
    visible = torch.arange(kv_len, device=q.device)[None, :] <= torch.arange(kv_len - n, kv_len, device=q.device)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), vf).to(q.dtype)


@torch.no_grad()
def reference_generate(model: LlamaModel, prompt: list[int], max_new_tokens: int,
                       forced_tokens: list[int] | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """(greedy tokens, float32 logits of each) for one request, one token per forward after the prompt.

    ``forced_tokens``: teacher forcing, fed instead of the greedy choices (the returned tokens are
    still the greedy ones, so they can be compared); as in ``Engine.add_request``, ``max_new_tokens - 1`` of them
    (the last output is never fed), and the tokens are checked as it checks them.
    """
    prompt, max_new_tokens, forced_tokens, _ = request_tokens(prompt, max_new_tokens, forced_tokens, None,
                                                              model.config.vocab_size, max_seq_len=1 << 62)
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * model.config.num_hidden_layers

    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if caches[layer] is not None:
            k, v = torch.cat([caches[layer][0], k]), torch.cat([caches[layer][1], v])
        caches[layer] = (k, v)
        return torch_attention(q, k, v)

    device = model.device
    tokens, logits_out = [], []
    ids = torch.tensor(prompt, dtype=torch.long, device=device)
    positions = torch.arange(len(prompt), device=device)
    for step in range(max_new_tokens):
        logits = model.logits(model.forward(ids, positions, attention)[-1:])[0]
        tokens.append(int(logits.argmax()))
        logits_out.append(logits.cpu())
        if step + 1 == max_new_tokens:
            break
        fed = forced_tokens[step] if forced_tokens is not None else tokens[-1]
        ids = torch.tensor([fed], dtype=torch.long, device=device)
        positions = torch.tensor([len(prompt) + step], device=device)
    return tokens, logits_out

"""Custom attention variants: sigmoid attention without softmax, and a document-boundary mask.

Each variant is a few C++ expressions (the same text on the cpu target and every cuda
tier) plus typed extra parameters passed to ``run()`` by keyword. Both are checked
against a plain torch computation here. Runs on the GPU when one is visible, else on
the cpu target:

    python3 examples/custom_variant.py
"""

from __future__ import annotations

import torch

import jitattn
from jitattn import AttentionVariant, VariantParam

# out = sum_j sigmoid(logit_j + bias) * v_j: no softmax, no normalisation.
SIGMOID = AttentionVariant(
    "sigmoid",
    logits_transform="1.0f / (1.0f + expf(-(logits + bias)))",
    use_softmax=False,
    params=(VariantParam("bias", "f32"),),
)

# Sequence packing: a query sees only keys of its own document. doc_ids holds the
# document of every token of the packed batch; doc_start[r] is request r's first token.
DOC_MASK = AttentionVariant(
    "docmask",
    logits_mask="doc_ids[doc_start[request] + kv_len - qo_len + q_idx] == doc_ids[doc_start[request] + kv_idx]",
    params=(VariantParam("doc_ids", "i32", rank=1), VariantParam("doc_start", "i64", rank=1)),
)


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 8, 2, 64
    lens = [37, 90]  # two packed prompts (self-attention: qo_len == kv_len)
    indptr = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    q = torch.randn(sum(lens), heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(sum(lens), kv_heads, head_dim, dtype=dtype, device=device)
    v = torch.randn(sum(lens), kv_heads, head_dim, dtype=dtype, device=device)
    doc_ids = torch.cat([torch.arange(n) // 16 for n in lens]).to(torch.int32)  # documents of 16 tokens
    doc_start = torch.tensor([0, lens[0]], dtype=torch.int64)

    workspace = torch.empty(16 << 20, dtype=torch.uint8, device=device)
    wrapper = jitattn.BatchPrefillWithRaggedKVCacheWrapper(workspace)
    scale = head_dim ** -0.5

    # 1. Sigmoid attention (causal).
    wrapper.plan(indptr, indptr, heads, kv_heads, head_dim, causal=True, q_data_type=dtype, variant=SIGMOID)
    out = wrapper.run(q, k, v, bias=-2.0)
    expected = []
    for r, n in enumerate(lens):
        s = slice(int(indptr[r]), int(indptr[r + 1]))
        qr, kr, vr = (x[s].double().cpu() for x in (q, k, v))
        kr, vr = kr.repeat_interleave(heads // kv_heads, 1), vr.repeat_interleave(heads // kv_heads, 1)
        w = torch.sigmoid(torch.einsum("qhd,khd->hqk", qr, kr) * scale - 2.0)
        w = w * torch.ones(n, n).tril().double()
        expected.append(torch.einsum("hqk,khd->qhd", w, vr))
    sigmoid_error = (out.double().cpu() - torch.cat(expected)).abs().max().item()

    # 2. Causal attention within each document.
    wrapper.plan(indptr, indptr, heads, kv_heads, head_dim, causal=True, q_data_type=dtype, variant=DOC_MASK)
    out = wrapper.run(q, k, v, doc_ids=doc_ids.to(device), doc_start=doc_start.to(device))
    expected = []
    for r, n in enumerate(lens):
        s = slice(int(indptr[r]), int(indptr[r + 1]))
        qr, kr, vr = (x[s].double().cpu() for x in (q, k, v))
        kr, vr = kr.repeat_interleave(heads // kv_heads, 1), vr.repeat_interleave(heads // kv_heads, 1)
        ids = doc_ids[s]
        allowed = torch.ones(n, n, dtype=torch.bool).tril() & (ids[:, None] == ids[None, :])
        logits = (torch.einsum("qhd,khd->hqk", qr, kr) * scale).masked_fill(~allowed, float("-inf"))
        expected.append(torch.einsum("hqk,khd->qhd", logits.softmax(-1), vr))
    doc_error = (out.double().cpu() - torch.cat(expected)).abs().max().item()

    tol = 5e-2 if dtype == torch.bfloat16 else 1e-4
    print(f"device={device} sigmoid attention max abs error {sigmoid_error:.2e}; "
          f"document mask max abs error {doc_error:.2e}")
    assert sigmoid_error < tol * 10 and doc_error < tol, "mismatch against the torch reference"


if __name__ == "__main__":
    main()

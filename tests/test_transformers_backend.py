"""jitattn as a transformers attention backend: greedy generation identical to eager (float32, cpu target).

Skipped when transformers is not installed (``pip install -e .[transformers]``).
"""

from __future__ import annotations

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import jitattn.integrations.transformers  # noqa: E402,F401  (registers "jitattn")
from jitattn.integrations.transformers import NAME  # noqa: E402

# Tiny random configs, one per attention feature the backend must carry.
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2),
    "mistral-sliding-window": lambda: transformers.MistralConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=7),
    "gemma2-softcap": lambda: transformers.Gemma2Config(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, sliding_window=7, attn_logit_softcapping=5.0,
        final_logit_softcapping=30.0, query_pre_attn_scalar=24),
    "qwen2-gqa7": lambda: transformers.Qwen2Config(
        vocab_size=128, hidden_size=14 * 64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=14,
        num_key_value_heads=2),
    "phi3-hd96": lambda: transformers.Phi3Config(
        vocab_size=128, hidden_size=2 * 96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2),
    # The tiny head dims of transformers' own test models (hidden 32 over 4 heads is 8; over 2, 16).
    "llama-hd8": lambda: transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2),
    "mistral-hd16-window": lambda: transformers.MistralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=37, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=5),
    "qwen2-hd24": lambda: transformers.Qwen2Config(
        vocab_size=128, hidden_size=48, intermediate_size=37, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1),
}


def _model(name: str, implementation: str):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[name](), attn_implementation=implementation,
                                                          dtype=torch.float32)
    with torch.no_grad():  # random init is tiny; larger weights make the attention patterns sharp
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    return model.eval()


@pytest.fixture(scope="module", params=list(CONFIGS))
def models(request):
    return request.param, _model(request.param, "eager"), _model(request.param, NAME)


def _generate(model, ids, mask=None, new_tokens=8):
    return model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens,
                          pad_token_id=0)


def test_greedy_generation_is_identical_to_eager(models) -> None:
    name, eager, ours = models
    assert ours.config._attn_implementation == NAME
    ids = torch.randint(3, 128, (2, 20), generator=torch.Generator().manual_seed(1))  # longer than the windows
    expected = _generate(eager, ids)
    assert torch.equal(_generate(ours, ids), expected)


def test_left_padded_batch_matches_eager(models) -> None:
    name, eager, ours = models
    ids = torch.randint(3, 128, (3, 16), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0  # left padding: the backend must get (and apply) the padding mask
    mask[2, :9] = 0
    ids = ids.masked_fill(mask == 0, 0)
    assert torch.equal(_generate(ours, ids, mask, 8), _generate(eager, ids, mask, 8))


def test_forward_logits_match_eager(models) -> None:
    name, eager, ours = models
    ids = torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids).logits, eager(ids).logits, rtol=1e-4, atol=1e-4)


def test_unregistered_mask_would_drop_the_window() -> None:
    """Why the mask registration matters: without it a windowed model's logits change."""
    from transformers.masking_utils import AttentionMaskInterface

    eager, ours = _model("mistral-sliding-window", "eager"), _model("mistral-sliding-window", NAME)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(4))
    saved = AttentionMaskInterface._global_mapping.pop(NAME)
    try:
        with torch.no_grad():
            dropped = ours(ids).logits
    finally:
        AttentionMaskInterface._global_mapping[NAME] = saved
    with torch.no_grad():
        expected = eager(ids).logits
        torch.testing.assert_close(ours(ids).logits, expected, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(dropped, expected, rtol=1e-3, atol=1e-3)


def test_serving_engine_loads_a_transformers_llama_checkpoint(tmp_path) -> None:
    """The engine's Llama decoder, loaded from ``save_pretrained`` output, generates what transformers does."""
    from jitattn.serving import Engine, LlamaModel, preset

    tiny = preset("tiny")
    config = transformers.LlamaConfig(
        vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers, num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads, head_dim=tiny.head_dim, rms_norm_eps=tiny.rms_norm_eps,
        rope_theta=tiny.rope_theta)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, p.shape[-1] ** -0.5) if p.dim() == 2 else p.uniform_(0.9, 1.1)
    hf.save_pretrained(tmp_path)
    prompts = torch.randint(0, tiny.vocab_size, (3, 21), generator=torch.Generator().manual_seed(6))
    expected = hf.generate(prompts, max_new_tokens=6, do_sample=False, min_new_tokens=6)[:, 21:].tolist()
    engine = Engine(LlamaModel.from_checkpoint(tmp_path), num_pages=32, page_size=8)
    requests = [engine.add_request(p, 6) for p in prompts.tolist()]
    engine.run()
    assert [r.output for r in requests] == expected


def test_gpt_oss_attention_sinks_match_eager() -> None:
    """gpt-oss passes its sinks as ``s_aux``: they must reach the kernels (windowed and full layers)."""
    config = transformers.GptOssConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=4,
                                       num_experts_per_tok=2, sliding_window=8,
                                       layer_types=["sliding_attention", "full_attention"])
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    logits = {}
    for implementation in ("eager", NAME):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                              dtype=torch.float32).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("sinks"):
                    param.normal_(0, 2.0)  # large enough that dropping them moves the logits by ~0.3
            logits[implementation] = model(ids).logits
    torch.testing.assert_close(logits[NAME], logits["eager"], rtol=1e-4, atol=1e-4)


def test_training_with_gradients_is_refused() -> None:
    model = _model("llama", NAME)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="inference-only"):
        model(ids, labels=ids).loss.backward()


def test_what_the_backend_cannot_serve_is_refused_with_what_to_use() -> None:
    """output_attentions=True returned an empty tuple silently; an additive (float) 4-D mask was blamed on how the
    model was built."""
    model = _model("llama", NAME)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with pytest.raises(ValueError, match="output_attentions=True cannot be served; use attn_implementation="):
            model(ids, output_attentions=True)
        additive = torch.zeros(1, 1, 8, 8).masked_fill(torch.ones(8, 8, dtype=torch.bool).triu(1), float("-inf"))
        with pytest.raises(TypeError, match=r"an additive one, such as a 4-D float attention_mask .*\(additive == 0\)"):
            model(ids, attention_mask=additive)
        per_head = torch.ones(8, 8, dtype=torch.bool).tril().expand(1, 2, 8, 8).clone()  # one mask per head
        per_head[:, 1, 5:, :5] = False
        with pytest.raises(ValueError, match=r"one mask for every head \(\[B, 1, T, S\]\); got shape \(1, 2, 8, 8\)"):
            model(ids, attention_mask=per_head)


@pytest.mark.parametrize("name", ["indices", "block_indices"])
def test_a_sparse_models_selected_keys_are_refused_not_dropped(name) -> None:
    """DeepSeek-V3.2-style models pass the indexer's top-k keys as indices= (block_indices= in MiniMax-M3) to any
    implementation but eager and sdpa: run densely without them the logits were wrong, silently."""
    module = torch.nn.Module().eval()
    q, k, v = (torch.randn(1, 2, 6, 16) for _ in range(3))
    with torch.no_grad(), pytest.raises(ValueError, match=rf"does not take {name}=.*attn_implementation='sdpa'"):
        jitattn.integrations.transformers.jitattn_attention_forward(module, q, k, v, None,
                                                                   **{name: torch.zeros(1, 6, 4, dtype=torch.int64)})


@pytest.mark.parametrize("dims, advice", [((512, 512), "No kernel serves this shape"), ((20, 20), "Pad the head"),
                                          ((32, 16), "No kernel serves this shape")])
def test_a_head_dim_without_a_kernel_names_sdpa(dims, advice) -> None:
    module = torch.nn.Module().eval()
    q, k, v = torch.randn(1, 2, 4, dims[0]), torch.randn(1, 2, 4, dims[0]), torch.randn(1, 2, 4, dims[1])
    with torch.no_grad(), pytest.raises(ValueError, match=rf"{advice}.*; use attn_implementation='sdpa'"):
        jitattn.integrations.transformers.jitattn_attention_forward(module, q, k, v, None)


def test_a_three_dimensional_mask_is_named_as_such_and_a_strided_query_runs() -> None:
    module = torch.nn.Module().eval()
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 5, 32, generator=gen) for _ in range(3))
    forward = jitattn.integrations.transformers.jitattn_attention_forward
    with torch.no_grad(), pytest.raises(ValueError, match=r"got shape \(1, 5, 5\) \(a 3-D mask\)"):
        forward(module, q, k, v, torch.ones(1, 5, 5, dtype=torch.bool))
    strided = torch.randn(1, 2, 5, 64, generator=gen)[..., ::2]  # a query whose last dimension is strided
    with torch.no_grad():
        got, _ = forward(module, strided, k, v, None, is_causal=True)
        expected = torch.nn.functional.scaled_dot_product_attention(strided, k, v, is_causal=True)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("shape", [(1, 1, 5, 7), (1, 1, 4, 5), (3, 1, 5, 5)], ids=["keys", "queries", "batch"])
def test_a_mask_of_other_lengths_says_what_it_must_be(shape) -> None:
    """A boolean [B, 1, T, S] mask whose lengths are not the call's (nor 1) was torch's expand error."""
    module = torch.nn.Module().eval()
    q, k, v = (torch.randn(1, 2, 5, 32) for _ in range(3))
    forward = jitattn.integrations.transformers.jitattn_attention_forward
    with torch.no_grad(), pytest.raises(ValueError, match=rf"mask has shape {re.escape(str(shape))}, but these 1 "
                                                          r"sequences of 5 queries over 5 keys take \[1, 1, 5, 5\]"):
        forward(module, q, k, v, torch.ones(shape, dtype=torch.bool))
    with torch.no_grad():  # a broadcast mask dimension of 1 is the call's
        got, _ = forward(module, q, k, v, torch.ones(1, 1, 1, 5, dtype=torch.bool))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got, expected.transpose(1, 2), atol=1e-4, rtol=1e-4)


def test_autocast_runs_and_alibi_in_the_mask_is_refused() -> None:
    """Under torch.autocast RoPE gives float32 q and k beside a bf16 v: the backend refused the mixed dtypes; it now
    runs them in the autocast dtype, as sdpa does. Falcon with alibi=True folds ALiBi into a per-head float mask:
    refused with that reason (it was told to build the model with the name it was built with)."""
    model, sdpa = _model("llama", NAME), _model("llama", "sdpa")
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, expected = model(ids).logits, sdpa(ids).logits
    assert got.dtype == expected.dtype
    torch.testing.assert_close(got.float(), expected.float(), atol=3e-2, rtol=3e-2)
    falcon = transformers.AutoModelForCausalLM.from_config(
        transformers.FalconConfig(vocab_size=128, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                  alibi=True), attn_implementation=NAME).eval()
    with torch.no_grad(), pytest.raises(ValueError, match="ALiBi folded into the mask.*attn_implementation='sdpa'"):
        falcon(ids)


def test_each_thread_plans_on_its_own_wrapper() -> None:
    """A model used from two threads: a layer's plan and run on one shared wrapper interleaved with another thread's
    (wrong outputs with different padding, a shape error with different lengths)."""
    import threading

    from jitattn.integrations.transformers import _wrapper

    seen = []
    thread = threading.Thread(target=lambda: seen.append(_wrapper(torch.device("cpu"))))
    thread.start()
    thread.join()
    assert seen[0] is not _wrapper(torch.device("cpu")) and _wrapper(torch.device("cpu")) is _wrapper(
        torch.device("cpu"))


def test_serving_engine_refuses_checkpoints_it_would_compute_wrong(tmp_path) -> None:
    from jitattn.serving import LlamaModel, preset

    tiny = preset("tiny")
    shapes = dict(vocab_size=tiny.vocab_size, hidden_size=tiny.hidden_size, intermediate_size=tiny.intermediate_size,
                  num_hidden_layers=tiny.num_hidden_layers, num_attention_heads=tiny.num_attention_heads,
                  num_key_value_heads=tiny.num_key_value_heads, head_dim=tiny.head_dim)
    cases = {"attention_bias": transformers.LlamaConfig(attention_bias=True, **shapes),
             "mlp_bias": transformers.LlamaConfig(mlp_bias=True, **shapes),
             "model_type": transformers.Qwen2Config(**shapes)}
    for match, config in cases.items():
        directory = tmp_path / match
        transformers.AutoModelForCausalLM.from_config(config).save_pretrained(directory)
        with pytest.raises(ValueError, match=match):
            LlamaModel.from_checkpoint(directory)


# --- on the GPU ---------------------------------------------------------------------------------

def _gpu_specs():
    from jitattn.runtime.specs import attention_spec
    from jitattn.spec import KVLayout, KVStorage, MaskMode, Op, PosEncoding, Target

    return [attention_spec(Op.PREFILL, Target.CUDA, q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16,
                           o_dtype=torch.bfloat16, head_dim_qk=128, head_dim_vo=128, num_qo_heads=16, num_kv_heads=4,
                           pos_encoding=PosEncoding.NONE, use_sliding_window=False, use_logits_soft_cap=False,
                           mask_mode=mask, kv_layout=KVLayout.NHD, kv_storage=KVStorage.RAGGED)
            for mask in (MaskMode.CAUSAL, MaskMode.NONE)]


GPU_SPECS = _gpu_specs()  # causal prefill (the prompt), no mask (each generated token)


@pytest.mark.gpu
def test_bf16_llama_logits_and_generation_on_the_gpu() -> None:
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=2048, intermediate_size=4096, num_hidden_layers=4,
                                      num_attention_heads=16, num_key_value_heads=4)
    models = {}
    for implementation in ("eager", NAME):
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                              dtype=torch.float32)
        with torch.no_grad():  # sharper logits than the default init: fewer near-ties for bf16 to flip
            for p in model.parameters():
                if p.dim() == 2:
                    p.normal_(0, p.shape[1] ** -0.5)
        models[implementation] = model.to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (4, 300), generator=torch.Generator().manual_seed(7)).cuda()
    with torch.no_grad():
        expected, got = models["eager"](ids).logits.float(), models[NAME](ids).logits.float()
    relative = float((got - expected).norm() / expected.norm())
    print(f"\nbf16 llama logits vs eager: relative error {relative:.2e}")
    assert relative < 2e-2
    out = {name: m.generate(ids[:, :64], max_new_tokens=16, do_sample=False, min_new_tokens=16)[:, 64:]
           for name, m in models.items()}
    agree = float((out[NAME] == out["eager"]).float().mean())
    print(f"bf16 greedy tokens agreeing with eager: {agree:.0%}")
    assert agree > 0.75, f"only {agree:.0%} of the bf16 greedy tokens agree with eager"


@pytest.mark.gpu
def test_static_cache_generation_compiled_by_transformers_on_the_gpu() -> None:
    """A static cache on a GPU makes generate() compile the forward (mode="reduce-overhead": CUDA graphs): the
    backend's plan is a graph break and its launch runs between the graphs."""
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=2048, intermediate_size=4096, num_hidden_layers=2,
                                      num_attention_heads=16, num_key_value_heads=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=NAME, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (2, 48), generator=torch.Generator().manual_seed(8)).cuda()
    with torch.no_grad():
        dynamic = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)[:, 48:]
        static = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                cache_implementation="static")[:, 48:]
    agree = float((static == dynamic).float().mean())
    print(f"\nstatic-cache (compiled) greedy tokens agreeing with the dynamic cache's: {agree:.0%}")
    assert agree > 0.75

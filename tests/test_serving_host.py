"""The serving engine's host-side parts alone: a Hugging Face config read into ``ModelConfig``, the radix tree's
eviction order, the batch buckets of an engine of any limit, prompts given as numpy arrays."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from jitattn.serving import Engine, KVPool, LlamaModel, ModelConfig, RadixCache, preset
from jitattn.serving.graphs import bucket_of, bucket_sizes

BASE = dict(model_type="llama", vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2)


def _read(tmp_path, **changes) -> ModelConfig:
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **changes}))
    return ModelConfig.from_hf_config(tmp_path)


def test_a_config_that_is_not_a_regular_file_is_refused(tmp_path) -> None:
    """A FIFO named config.json blocked the read for good (a device such as /dev/zero never ended)."""
    import os

    os.mkfifo(tmp_path / "config.json")
    with pytest.raises(ValueError, match="config.json: not a regular file; expected a Hugging Face config.json"):
        ModelConfig.from_hf_config(tmp_path)


@pytest.mark.parametrize("changes,match", [
    (dict(num_attention_heads=0), "num_attention_heads=0 must be a positive int"),
    (dict(num_attention_heads="4"), "num_attention_heads='4' must be a positive int"),
    (dict(num_key_value_heads=0), "num_key_value_heads=0 must be a positive int"),
    (dict(head_dim=0), "head_dim=0 must be a positive int"),
    (dict(rope_scaling="linear"), "rope_scaling='linear' must be an object"),
    (dict(rms_norm_eps=None), "rms_norm_eps=None must be a finite number >= 0"),
    (dict(rope_theta="abc"), "rope_theta='abc' must be a finite number > 0"),
    (dict(tie_word_embeddings="false"), "tie_word_embeddings='false' must be true or false"),
    (dict(hidden_size=130), "hidden_size=130 is not a multiple of num_attention_heads=4 and no head_dim"),
], ids=["heads_0", "heads_str", "kv_heads_0", "head_dim_0", "rope_scaling_str", "eps_null", "theta_str",
        "tie_str", "hidden_not_multiple"])
def test_a_config_field_it_cannot_be_is_named_with_the_file(tmp_path, changes, match) -> None:
    """Such fields crashed (ZeroDivisionError, AttributeError, TypeError) or were silently changed: 0 kv heads read
    as plain MHA, a head_dim of 0 derived from the hidden size, "false" read as True."""
    with pytest.raises(ValueError, match=f"config.json: .*{match}"):
        _read(tmp_path, **changes)


def test_fields_transformers_derives_are_derived(tmp_path) -> None:
    config = _read(tmp_path, num_key_value_heads=None, head_dim=None, rope_theta=10000, rms_norm_eps=0,
                   rope_scaling=None, tie_word_embeddings=None)
    assert (config.num_key_value_heads, config.head_dim, config.rope_theta, config.rms_norm_eps) == (4, 32, 1e4, 0.0)
    assert type(config.rope_theta) is float and type(config.rms_norm_eps) is float
    assert config.tie_word_embeddings is False
    assert _read(tmp_path, head_dim=64).head_dim == 64
    assert _read(tmp_path, rope_scaling={"rope_type": "default", "rope_theta": None}, rope_theta=5e5).rope_theta == 5e5


def _tree(seed: int, page_size: int = 2) -> tuple[KVPool, RadixCache, list[int]]:
    """A radix tree of random prompts over a small alphabet (shared prefixes, forks at every depth), each prompt
    inserted by a request that then ended (the tree alone holds its pages), then some looked up again; the last
    prompt's pages held by a running request."""
    rng = random.Random(seed)
    pool = KVPool(1, 400, page_size, 1, 8, torch.float32, "cpu")
    radix = RadixCache(pool)
    prompts = [[rng.randrange(3) for _ in range(page_size * rng.randint(1, 6))] for _ in range(40)]
    for prompt in prompts:
        pages = pool.alloc(len(prompt) // page_size)
        radix.insert(prompt, pages)
        pool.decref(pages)
    for prompt in rng.sample(prompts, 10):
        radix.match(prompt)
    pool.incref(radix.match(prompts[-1]))
    return pool, radix, prompts[-1]


def _lru_order(radix: RadixCache) -> list[int]:
    """The pages ``evict`` frees, in order, by the rule: the least recently used leaf that no request holds."""
    order = []
    while True:
        leaves = [n for n in radix._leaves() if all(radix.pool.refcount(p) == 1 for p in n.pages)]
        if not leaves:
            return order
        victim = min(leaves, key=lambda n: n.last_used)
        del victim.parent.children[victim.key[: radix.page_size]]
        radix.pool.decref(victim.pages)
        order += victim.pages


@pytest.mark.parametrize("seed", range(6))
def test_eviction_frees_idle_leaves_in_lru_order(seed) -> None:
    """One walk of the tree and a heap (a walk per victim made evicting k of n leaves cost k * n) free what the
    rule frees, in its order, and never a page a request holds."""
    expected = _lru_order(_tree(seed)[1])
    for want in (1, 5, 10 ** 6):
        pool, radix, held = _tree(seed)
        freed_order = []
        decref = pool.decref
        pool.decref = lambda pages: freed_order.extend(pages) or decref(pages)
        freed = radix.evict(want)
        assert freed_order == expected[:freed] and freed >= min(want, len(expected))
    assert radix.num_cached_pages == len(radix.match(held)) > 0  # what the request holds stays


def test_buckets_are_computed_for_an_engine_of_any_batch_limit() -> None:
    """The bucket list was built (one entry per 8 rows) by every engine and searched at every step: a limit of 10**8
    took 2 s and 1.5 GB, sys.maxsize never returned."""
    for limit in (1, 3, 5, 8, 9, 64, 100):
        sizes = bucket_sizes(limit)
        assert [bucket_of(n, limit) for n in range(1, limit + 1)] == [min(b for b in sizes if b >= n)
                                                                     for n in range(1, limit + 1)]
    engine = Engine(LlamaModel.random(preset("tiny"), seed=0), num_pages=16, page_size=4, max_batch_size=2 ** 62)
    assert (engine.graphs.bucket(3), engine.graphs.bucket(9)) == (4, 16)


@pytest.mark.parametrize("prompt", [np.array([3, 4], dtype=object), np.array(["a"]), np.array([1.5])],
                         ids=["object", "str", "float"])
def test_a_numpy_prompt_of_no_integer_dtype_is_named(prompt) -> None:
    engine = Engine(LlamaModel.random(preset("tiny"), seed=0), num_pages=16, page_size=4)
    with pytest.raises(TypeError, match="prompt as a tensor or array must be 1-D with an integer dtype"):
        engine.add_request(prompt, 2)

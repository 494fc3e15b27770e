"""A small continuous-batching serving engine on jitattn's paged wrappers.

- :mod:`.kv_pool`: pages of KV memory per layer, reference-counted;
- :mod:`.radix`: a radix tree over token prefixes sharing pages copy-free, LRU eviction;
- :mod:`.attention`: one plan per step (chunked prefill, flat or cascade decode), one callback per layer;
- :mod:`.graphs`: CUDA-graph capture of the decode step per batch-size bucket;
- :mod:`.engine`: the scheduler (admission, chunked prefill, batched decode);
- :mod:`.model`: a Llama-architecture decoder (random or checkpoint weights, tensor-parallel shards);
- :mod:`.reference`: the per-request torch reference the engine is tested against.
"""

from .config import PRESETS, ModelConfig, preset
from .engine import Engine
from .kv_pool import KVPool, pages_in_budget
from .model import LlamaModel, load_checkpoint, random_weights, save_checkpoint
from .parallel import TPGroup, head_shard
from .radix import RadixCache
from .reference import reference_generate, torch_attention
from .request import EngineStats, Request

__all__ = [
    "PRESETS", "Engine", "EngineStats", "KVPool", "LlamaModel", "ModelConfig", "RadixCache", "Request", "TPGroup", "pages_in_budget",
    "head_shard", "load_checkpoint", "preset", "random_weights", "reference_generate", "save_checkpoint",
    "torch_attention",
]

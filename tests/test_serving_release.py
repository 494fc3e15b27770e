"""An engine that goes out of scope frees its KV pool at once: nothing in it refers back to it, so its
memory does not wait for Python's cycle collector (a second engine sized from the free GPU memory,
as examples/serve.py sizes one, would otherwise find the first one's pool still held)."""

from __future__ import annotations

import gc
import weakref

import torch

from jitattn.serving import Engine, LlamaModel, preset


def test_an_engine_is_freed_by_reference_counting_alone_after_it_served():
    model = LlamaModel.random(preset("tiny"), seed=0, dtype=torch.float32, device="cpu")
    engine = Engine(model, num_pages=32, page_size=16, max_batch_size=4, cascade=True)
    for i in range(3):
        engine.add_request([1 + i, 2, 3, 4, 5] * 8, 3)
    engine.run()
    ref = weakref.ref(engine)
    gc.disable()
    try:
        del engine
        assert ref() is None, "the engine is in a reference cycle: its KV pool waits for the cycle collector"
    finally:
        gc.enable()

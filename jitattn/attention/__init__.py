"""Python front-ends of the attention kernels (wrappers and functions).

``jitattn.attention.BatchAttentionWithAttentionSinkWrapper`` is where FlashInfer keeps that
wrapper (``flashinfer.attention``); it lives in ``jitattn.attention_sink`` and is looked up
lazily here, so importing this package does not import the API layer above it.
"""


def __getattr__(name: str):
    if name == "BatchAttentionWithAttentionSinkWrapper":
        from ..attention_sink import BatchAttentionWithAttentionSinkWrapper

        return BatchAttentionWithAttentionSinkWrapper
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

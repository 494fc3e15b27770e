"""Python front-ends of the attention kernels (wrappers and functions).

``jitattn.attention.BatchAttentionWithAttentionSinkWrapper`` and ``jitattn.attention.BatchAttention`` are
where FlashInfer keeps those wrappers (``flashinfer.attention``); they live in ``jitattn.attention_sink``
and ``jitattn.batch_attention`` and are looked up lazily here, so importing this package does not import
the API layer above it.
"""


def __getattr__(name: str):
    if name == "BatchAttentionWithAttentionSinkWrapper":
        from ..attention_sink import BatchAttentionWithAttentionSinkWrapper

        return BatchAttentionWithAttentionSinkWrapper
    if name == "BatchAttention":
        from ..batch_attention import BatchAttention

        return BatchAttention
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

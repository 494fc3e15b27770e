"""The public ops: FlashInfer 0.5.3's wrappers and functions, one module per op.

``jitattn`` re-exports every name; ``jitattn.decode``, ``jitattn.prefill``, ... are these modules
(the package face registers them under their short paths). ``attention`` is FlashInfer's
``flashinfer.attention`` module layout (the sink wrapper and ``BatchAttention``).
"""

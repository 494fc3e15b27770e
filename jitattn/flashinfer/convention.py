"""FlashInfer's log-sum-exp convention, base 2, over jitattn's natural-log operations.

jitattn's own API returns and takes the natural-log LSE everywhere. Code written for FlashInfer
expects base 2: ``log2(sum_j 2^(s_j * log2(e)))``, i.e. the natural-log LSE times ``log2(e)``. The
namespace ``jitattn.flashinfer`` converts at its edges: an LSE a call writes (returned, or into the
caller's ``lse`` buffer) is scaled to base 2 in place after the native call, on the same stream
(so it is captured into CUDA graphs with the call), and an LSE a merge takes is scaled to natural
log before it. The conversion is one multiply by ``log2(e)`` (or ``ln(2)``): -inf stays -inf, NaN
stays NaN.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch

LOG2E = 1.0 / math.log(2.0)
LN2 = math.log(2.0)


def lse_to_base2(result, lse: torch.Tensor | None = None):
    """``result`` of a native call, its LSE scaled to base 2 in place.

    The LSE the call wrote is the second element of a returned ``(out, lse)`` pair, else the caller's
    ``lse`` buffer (native wrappers write it even when ``return_lse`` is False, as FlashInfer's do).
    """
    if isinstance(result, tuple):
        result[1].mul_(LOG2E)
    elif lse is not None:
        lse.mul_(LOG2E)
    return result


def returns_base2(function):
    """``function`` (a native op or wrapper method whose ``lse`` buffer, if any, is keyword-only) returning
    a base-2 LSE; the signature (``inspect.signature``) stays the native one."""

    @functools.wraps(function)
    def base2(*args, **kwargs):
        return lse_to_base2(function(*args, **kwargs), kwargs.get("lse"))

    return base2


def returns_base2_bound(function):
    """``returns_base2`` for a function whose ``lse`` buffer may also come positionally (FlashInfer's
    block-sparse and POD wrappers take it so): the call's arguments are bound to find it."""
    signature = inspect.signature(function)

    @functools.wraps(function)
    def base2(*args, **kwargs):
        try:
            lse = signature.bind(*args, **kwargs).arguments.get("lse")
        except TypeError:  # arguments that do not fit: the call itself raises Python's error, which names it
            return function(*args, **kwargs)
        return lse_to_base2(function(*args, **kwargs), lse)

    return base2


def lse_to_natural(name: str, lse) -> torch.Tensor:
    """A new tensor: the caller's base-2 ``lse`` in natural log (what the native merges take)."""
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"{name} must be a float32 torch.Tensor of base-2 log-sum-exp values; got "
                        f"{type(lse).__name__}")
    return lse * LN2

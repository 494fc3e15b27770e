"""``flashinfer.pod`` with FlashInfer's base-2 LSE (see :mod:`jitattn.flashinfer`)."""

from __future__ import annotations

import functools

from ..ops import pod as native
from .convention import LOG2E

__all__ = ["BatchPODWithPagedKVCacheWrapper", "PODWithPagedKVCacheWrapper"]


def _pod_returns_base2(run):
    """A POD ``run`` whose LSEs (``((out_p, out_d), (lse_p, lse_d))`` when asked for) are scaled to base 2."""

    @functools.wraps(run)
    def base2(*args, **kwargs):
        result = run(*args, **kwargs)
        if isinstance(result[0], tuple):
            for lse in result[1]:
                if lse is not None:
                    lse.mul_(LOG2E)
        return result

    return base2


class PODWithPagedKVCacheWrapper(native.PODWithPagedKVCacheWrapper):
    __doc__ = native.PODWithPagedKVCacheWrapper.__doc__
    run = _pod_returns_base2(native.PODWithPagedKVCacheWrapper.run)


class BatchPODWithPagedKVCacheWrapper(native.BatchPODWithPagedKVCacheWrapper):
    __doc__ = native.BatchPODWithPagedKVCacheWrapper.__doc__
    run = _pod_returns_base2(native.BatchPODWithPagedKVCacheWrapper.run)

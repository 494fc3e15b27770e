"""What every case module of the benchmark shares: element sizes, the cpu target's scale, the pairs a mask keeps."""

from __future__ import annotations

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "e4m3": 1, "e5m2": 1}
CPU_SCALE = 16  # tokens / CPU_SCALE on the cpu target


def div_at_least(n: int, by: int, minimum: int = 1) -> int:
    """``n // by``, but at least ``minimum`` (a small case keeps one of everything)."""
    return max(minimum, n // by)


def visible_keys(qo_len: int, kv_len: int, causal: bool, window_left: int = -1) -> int:
    """Unmasked (query, key) pairs of one request (bottom-right causal, window ``[p - w, p]``).

    Query i sits at position ``p = kv_len - qo_len + i``; causal keeps keys ``j <= p``, a window
    ``w >= 0`` keeps ``j >= p - w`` (as in ``jitattn.reference``; a non-causal window bounds
    the left side only).
    """
    total = 0
    hi_all = kv_len - 1
    for i in range(qo_len):
        p = kv_len - qo_len + i
        hi = min(p, hi_all) if causal else hi_all
        lo = max(0, p - window_left) if window_left >= 0 else 0
        total += max(0, hi - lo + 1)
    return total


def visible_keys_fast(qo_len: int, kv_len: int, causal: bool, window_left: int) -> int:
    """``visible_keys`` in closed form for the common cases (long prefills)."""
    if window_left < 0 and not causal:
        return qo_len * kv_len
    if window_left < 0 and causal and kv_len >= qo_len:
        return qo_len * (kv_len - qo_len) + qo_len * (qo_len + 1) // 2
    return visible_keys(qo_len, kv_len, causal, window_left)

"""What every case module of the benchmark shares: element sizes and the cpu target's scale."""

from __future__ import annotations

DTYPE_BYTES = {"f32": 4, "f16": 2, "bf16": 2, "e4m3": 1, "e5m2": 1}
CPU_SCALE = 16  # tokens / CPU_SCALE on the cpu target


def div_at_least(n: int, by: int, minimum: int = 1) -> int:
    """``n // by``, but at least ``minimum`` (a small case keeps one of everything)."""
    return max(minimum, n // by)

"""The decode kernel's shared-memory row layout (no GPU: the values rendered into the kernel)."""

from __future__ import annotations

import pytest

from jitattn.kernels.decode import TUNING, cuda_layout
from jitattn.spec import VariantSpec


def _spec(hd: int, kv: str = "bf16", group: int = 1) -> VariantSpec:
    return VariantSpec(op="decode", target="cuda", q_dtype="bf16", kv_dtype=kv, o_dtype="bf16", head_dim_qk=hd,
                       head_dim_vo=hd, group_size=group, kv_layout="nhd", kv_storage="paged", pos_encoding="none",
                       use_sliding_window=False, use_logits_soft_cap=False)


@pytest.mark.parametrize("group", [1, 4])
def test_rows_ending_mid_line_take_whole_line_slots_with_room_for_the_shift(group):
    """192-byte rows (d96, 16 bits) on tensor cores: a slot of the row plus half a line, every piece index after
    the 4-piece shift and the swizzle (which permutes within a line's 8) inside the slot."""
    hd = 96
    lay = cuda_layout(_spec(hd, group=group))
    row = hd * 2
    assert lay["kRowShift"] == 1 and lay["kSwizzle"] == 1 and lay["kSmemAlign"] == 128
    assert lay["kKPitch"] == lay["kVPitch"] == row + 64 and lay["kKPitch"] % 128 == 0
    last_piece = row // 16 - 1 + 4
    assert (last_piece | 7) * 16 + 16 <= lay["kKPitch"]


@pytest.mark.parametrize("hd,kv", [(128, "bf16"), (64, "bf16"), (96, "e4m3"), (80, "bf16")])
def test_other_rows_keep_their_layout(hd, kv):
    lay = cuda_layout(_spec(hd, kv))
    assert lay["kRowShift"] == 0
    row = hd * (1 if kv == "e4m3" else 2)
    if row % 128 == 0:
        assert lay["kSwizzle"] == 1 and lay["kKPitch"] == row
    else:  # the padded pitch: an odd number of 16-byte units
        assert lay["kSwizzle"] == 0 and (lay["kKPitch"] // 16) % 2 == 1


def test_row_shift_off_gives_the_padded_pitch():
    lay = cuda_layout(_spec(96), {**TUNING, "row_shift": 0})
    assert lay["kRowShift"] == 0 and lay["kSwizzle"] == 0 and (lay["kKPitch"] // 16) % 2 == 1

"""The decode kernel's shared-memory row layout (no GPU: the values rendered into the kernel)."""

from __future__ import annotations

import pytest
import torch

from jitattn.jit import has_short_items_layout, render
from jitattn.kernels.decode import LAYOUT_CONSTANTS, TUNING, cuda_layout, short_items_layout
from jitattn.kv_split import (
    SHORT_ITEMS_MAX_TOKENS, SHORT_ITEMS_MIN_BLOCKS_PER_SM, SHORT_ITEMS_ONE_WAVE_MIN_BLOCKS, decode_kv_split,
    short_items_split, unsplit,
)
from jitattn.page_table import check_paged_index
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


@pytest.mark.parametrize("hd,group", [(128, 1), (128, 4), (64, 8), (128, 8)])
def test_the_short_items_layout_differs_only_in_its_layout_constants(hd, group):
    """16-bit KV at head dims 64 / 128: a second layout of more resident blocks and less shared memory (its
    pipeline and merge staging: fewer stages, or at head dim 64 shorter ones), every other constant (pitches,
    threads) the default's."""
    spec = _spec(hd, group=group)
    default, short = cuda_layout(spec), short_items_layout(spec)
    assert short is not None
    knob = "mma_blocks_per_sm_short_small_rows" if hd == 64 else "mma_blocks_per_sm_short"
    assert short["kMinBlocks"] == TUNING[knob] > default["kMinBlocks"]
    assert short["kPipeBytes"] < default["kPipeBytes"] and short["kStages"] >= 2
    assert short["kStages"] < default["kStages"] or short["kTileTokens"] < default["kTileTokens"]
    assert short["kSmemBytes"] * short["kMinBlocks"] <= TUNING["smem_per_sm"]
    assert {k for k in default if default[k] != short[k]} <= set(LAYOUT_CONSTANTS)
    assert short["kQOffset"] == (short["kStages"] - 1) * short["kKStageBytes"]


@pytest.mark.parametrize("case", ["hd96", "hd256", "fp8", "rope", "group16"])
def test_specs_outside_the_short_items_set_have_one_layout(case):
    spec = {"hd96": _spec(96), "hd256": _spec(256), "fp8": _spec(128, kv="e4m3"), "group16": _spec(128, group=16),
            "rope": VariantSpec(op="decode", target="cuda", q_dtype="bf16", kv_dtype="bf16", o_dtype="bf16",
                                head_dim_qk=128, head_dim_vo=128, group_size=4, kv_layout="nhd", kv_storage="paged",
                                pos_encoding="rope", use_sliding_window=False, use_logits_soft_cap=False)}[case]
    assert short_items_layout(spec) is None
    assert not has_short_items_layout(spec)


def test_the_short_items_layout_of_small_rows_may_take_shorter_tiles(monkeypatch):
    """16-bit KV at head dim 64 (a token's K + V rows 256 bytes): the short-items layout's own blocks and steps per
    stage (``mma_*_short_small_rows``), so four blocks of 64-token stages sit beside the default's two of 128; the
    kernel takes every tile constant from its layout (each struct holds its own)."""
    monkeypatch.setitem(TUNING, "mma_blocks_per_sm_short_small_rows", 4)
    monkeypatch.setitem(TUNING, "mma_steps_short_small_rows", 1)
    short_items_layout.cache_clear()
    try:
        spec = _spec(64, group=8)
        default, short = cuda_layout(spec), short_items_layout(spec)
        assert short is not None and short["kMinBlocks"] == 4 and default["kMinBlocks"] == 2
        assert (short["kTileTokens"], default["kTileTokens"]) == (64, 128) and short["kSteps"] == 1
        assert short["kSmemBytes"] * 4 <= TUNING["smem_per_sm"] and short["kStages"] >= 2
        assert {k for k in default if default[k] != short[k]} <= set(LAYOUT_CONSTANTS)
        source = render(spec)["kernel.cu"]
        for name, lay in (("DefaultLayout", default), ("ShortItemsLayout", short)):
            struct = source.split(f"struct {name} {{")[1].split("};")[0]
            assert f"kTileTokens = {lay['kTileTokens']};" in struct and f"kSteps = {lay['kSteps']};" in struct
        assert "constexpr int kTileTokens" not in source.split("struct DefaultLayout")[0]
        # head dim 128 keeps its short layout (the small-rows knobs do not reach it)
        assert short_items_layout(_spec(128, group=4))["kMinBlocks"] == TUNING["mma_blocks_per_sm_short"]
    finally:
        short_items_layout.cache_clear()


def test_the_short_items_layout_is_rendered_beside_the_default():
    source = render(_spec(128, group=4))["kernel.cu"]
    assert "struct DefaultLayout {" in source and "struct ShortItemsLayout {" in source
    assert "constexpr bool kHasShortItems = true;" in source
    one = render(_spec(96))["kernel.cu"]
    assert "struct ShortItemsLayout" not in one and "constexpr bool kHasShortItems = false;" in one


def _index(lens: list[int], shared_pages: int = 0, page: int = 16):
    """A page table of requests of ``lens`` tokens, their first ``shared_pages`` pages the same for all."""
    indptr, indices, last, nxt = [0], [], [], shared_pages
    for n in lens:
        pages = -(-n // page)
        own = max(0, pages - shared_pages)
        indices += list(range(min(pages, shared_pages))) + list(range(nxt, nxt + own))
        nxt += own
        indptr.append(len(indices))
        last.append((n - 1) % page + 1)
    i32 = dict(dtype=torch.int32)
    return check_paged_index(torch.tensor(indptr, **i32), torch.tensor(indices, **i32), torch.tensor(last, **i32), page)


@pytest.mark.parametrize("batch,heads,length,shared,split_chunk,expected", [
    (128, 8, 300, 0, 0, True),      # 1024 blocks over 132 SMs: 7.8 a SM, short requests
    (100, 8, 1024, 0, 0, True),     # 800 blocks, just above 6 a SM; 1024 tokens is still short
    (64, 8, 300, 0, 0, False),      # 512: 3.9 a SM (1.3 waves of three blocks)
    (256, 8, 4096, 0, 0, False),    # long requests of their own pages (read from DRAM)
    (128, 8, 8448, 8192, 0, True),  # long requests over shared pages (re-read from L2)
    (128, 8, 300, 0, 256, False),   # split plans keep the default layout
])
def test_many_unsplit_blocks_of_short_or_shared_requests_take_the_short_items_layout(batch, heads, length, shared,
                                                                                      split_chunk, expected):
    index = _index([length] * batch, shared // 16)
    kw = dict(num_kv_heads=heads, num_sms=132, page_size=16)
    split = decode_kv_split(index.kv_len_array, **kw, fixed_split_size=split_chunk // 16 if split_chunk else None)
    assert bool(split.kv_chunk_size) == bool(split_chunk)
    marked = short_items_split(split, index, heads, 132)
    assert marked.short_items is expected
    assert marked.kv_chunk_size == split.kv_chunk_size and marked.split_indptr == split.split_indptr
    assert (SHORT_ITEMS_MIN_BLOCKS_PER_SM, SHORT_ITEMS_MAX_TOKENS) == (6, 1024)


@pytest.mark.parametrize("batch,blocks_per_sm,window_left,expected", [
    (64, (2, 4), 127, True),     # 512 blocks: one wave of four (528), not of two (264): gpt-oss's window 128
    (64, (2, 3), 127, False),    # ... a layout of three blocks would take 1.3 waves
    (66, (2, 4), 127, True),     # 528: exactly one wave of four
    (67, (2, 4), 127, False),    # 536: more than one wave of four, under 6 a SM
    (33, (2, 4), 127, False),    # 264: one wave of the default layout already
    (34, (2, 4), 127, True),     # 272
    (64, (2, 4), -1, False),     # long requests of their own pages
    (64, (0, 0), 127, False),    # the layouts not given: the 6-a-SM rule alone
])
def test_a_short_items_layout_of_four_blocks_takes_the_batches_its_one_wave_holds(batch, blocks_per_sm, window_left,
                                                                                  expected):
    """Fewer than SHORT_ITEMS_MIN_BLOCKS_PER_SM blocks a SM take the short-items layout when it has at least
    SHORT_ITEMS_ONE_WAVE_MIN_BLOCKS resident blocks and its one wave holds every block where the default's does not."""
    index = _index([8192] * batch)
    assert short_items_split(unsplit(batch), index, 8, 132, window_left, blocks_per_sm).short_items is expected
    assert SHORT_ITEMS_ONE_WAVE_MIN_BLOCKS == 4


@pytest.mark.parametrize("window_left,expected", [(-1, False), (127, True), (1023, True), (1024, False)])
def test_a_sliding_window_makes_long_requests_short(window_left, expected):
    """A request under a window reads at most window_left + 1 of its tokens: long requests of their own pages take
    the short-items layout when that is at most SHORT_ITEMS_MAX_TOKENS (and the batch has the blocks)."""
    index = _index([8192] * 128)
    split = decode_kv_split(index.kv_len_array, num_kv_heads=8, num_sms=132, page_size=16)
    assert not split.kv_chunk_size
    assert short_items_split(split, index, 8, 132, window_left).short_items is expected

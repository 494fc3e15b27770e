"""The host-side planner (pure functions): page-table checks, split-KV schedule, mask packing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from jitattn import reference
from jitattn.page_table import check_page_table, check_paged_index
from jitattn.kv_split import decode_kv_split, max_decode_chunks, split_workspace_bytes, window_lens
from jitattn.masks import segment_packbits


def _i32(values):
    return torch.tensor(values, dtype=torch.int32)


def test_kv_lens_from_page_table() -> None:
    index = check_paged_index(_i32([0, 2, 2, 5]), _i32([4, 1, 0, 2, 3]), _i32([3, 0, 16]), 16)
    assert index.kv_lens == (19, 0, 48)
    assert index.max_page_index == 4
    assert index.batch_size == 3


def test_empty_batch_and_empty_requests() -> None:
    index = check_paged_index(_i32([0]), _i32([]), _i32([]), 16)
    assert index.kv_lens == () and index.max_page_index == -1


@pytest.mark.parametrize("indptr,indices,last,match", [
    ([0, 2], [1], [3], "exceeds"),
    ([0, 1], [-1], [3], "negative"),
    ([0, 1], [0], [0], "out of range"),
    ([0, 1], [0], [3, 3], "expected batch_size"),
    ([0, 2**31 - 1, -2**31, -2**31 + 3], [0], [1, 1, 1], "non-decreasing"),  # an int32 step would wrap around
])
def test_bad_page_tables(indptr, indices, last, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_paged_index(_i32(indptr), _i32(indices), _i32(last), 16)


@pytest.mark.parametrize("indices,last,match", [
    ([0, 2**32 + 1], [3, 5], "does not fit an int32"),  # as uint32 halves: 1 and 1
    ([0, -2**33], [3, 5], "does not fit an int32"),
    ([0, 1], [3, 2**32 + 1], "does not fit an int32"),  # last - 1 = 2**32: uint32 halves 0 and 1
    ([0, 11], [3, 5], "past the end"),
    ([0, -1], [3, 5], "negative"),
    ([0, 1], [3, 17], "out of range"),
])
def test_int64_tables_get_the_same_checks(indices, last, match) -> None:
    """check_page_table's one-pass unsigned bounds assume int32: an int64 array is checked as int32 when
    its values fit one (a value that does not is refused); the public callers convert to int32 first."""
    with pytest.raises((ValueError, IndexError), match=match):
        check_page_table(_i32([0, 1, 2]), torch.tensor(indices), torch.tensor(last), 16, num_pages=10)


def test_float_page_tables_are_refused() -> None:
    with pytest.raises(TypeError, match="must be int32"):
        check_page_table(_i32([0, 1, 2]), torch.tensor([0.0, 5.7]), _i32([3, 5]), 16)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_window_lens_are_the_tokens_a_window_reads(dtype) -> None:
    lens = np.array([0, 5, 128, 129, 5000], dtype=dtype)
    assert window_lens(lens, -1) is lens
    assert window_lens(lens, 127).tolist() == [0, 5, 128, 128, 128]
    assert window_lens(lens, 0).tolist() == [0, 1, 1, 1, 1]
    assert window_lens(lens, 2**31 - 1).tolist() == lens.tolist()  # the widest window, int32 lengths too
    assert window_lens(lens, 2**63 - 1).tolist() == lens.tolist()  # no overflow past it either


def test_no_split_when_the_batch_fills_the_gpu() -> None:
    plan = decode_kv_split((2048,) * 64, num_kv_heads=8, num_sms=132, page_size=16)
    assert plan.kv_chunk_size == 0 and plan.num_chunks == 64


def test_no_split_when_the_longest_request_is_near_the_balanced_chunk() -> None:
    # 32 x 4096 x 8 heads over 2 x 132 blocks: balanced chunk 3984, so a split would add 112-token tails
    assert decode_kv_split((4096,) * 32, num_kv_heads=8, num_sms=132, page_size=16).kv_chunk_size == 0
    # a third of that batch is split: 32 x 4096 over 3 x 132 blocks gives 2656-token chunks
    assert decode_kv_split((4096,) * 32, num_kv_heads=8, num_sms=132, page_size=16,
                             blocks_per_sm=3).kv_chunk_size == 2656


def test_single_long_request_is_split_to_fill_the_gpu() -> None:
    plan = decode_kv_split((32768,), num_kv_heads=8, num_sms=132, page_size=16)
    assert plan.kv_chunk_size > 0 and plan.kv_chunk_size % 16 == 0
    assert 0.9 * 132 <= plan.num_chunks * 8 <= 132, "one block per SM, in one wave"
    assert plan.split_indptr == (0, math.ceil(32768 / plan.kv_chunk_size))


def test_few_requests_take_one_block_per_sm_in_one_wave() -> None:
    kw = dict(num_kv_heads=8, num_sms=132, page_size=16)
    for lens, chunk in [((32768,) * 4, 8192), ((8192, 8192), 1024), ((16384,) * 8, 8192), ((32768, 0, 0), 2352)]:
        plan = decode_kv_split(lens, **kw)
        assert plan.kv_chunk_size == chunk and plan.num_chunks * 8 <= 132, (lens, plan)
    # 16 x 4096: one block per request head already fills the SMs: no split
    assert decode_kv_split((4096,) * 16, **kw).kv_chunk_size == 0
    # more request heads than SMs: balanced over the resident blocks as before
    assert decode_kv_split((32768,) + (512,) * 63, **kw).num_chunks * 8 > 132


@pytest.mark.parametrize("lens", [(32768,) + (512,) * 15, (32768,) * 2 + (4096,) * 14, (8192,) * 8 + (256,) * 8])
def test_few_requests_of_skewed_lengths_still_cut_the_long_ones(lens) -> None:
    """One wave of one block per SM would leave the long requests whole here: the resident-blocks rule."""
    plan = decode_kv_split(lens, num_kv_heads=8, num_sms=132, page_size=16)
    longest = max(lens)
    chunks = [b - a for a, b in zip(plan.split_indptr, plan.split_indptr[1:])]
    assert 0 < plan.kv_chunk_size <= longest // 3 and chunks[0] >= 4, (lens, plan)
    balanced = math.ceil(sum(lens) * 8 / (2 * 132))  # the resident-blocks rule: 2 blocks on each of 132 SMs
    assert plan.kv_chunk_size == math.ceil(balanced / 16) * 16


def test_one_wave_search_is_fast_on_page_size_one() -> None:
    plan = decode_kv_split((1 << 20,) + (256,) * 32, num_kv_heads=4, num_sms=132, page_size=1)
    assert plan.split_indptr[1] - plan.split_indptr[0] > 16  # the 1M-token request is cut


def test_skewed_batch_cuts_the_long_request_most() -> None:
    lens = (32768,) + (512,) * 63
    plan = decode_kv_split(lens, num_kv_heads=8, num_sms=132, page_size=16)
    chunks = [b - a for a, b in zip(plan.split_indptr, plan.split_indptr[1:])]
    assert chunks[0] >= 8, "the 32k request must be spread over many SMs"
    assert max(chunks[1:]) == 1, "short requests stay whole"
    assert plan.kv_chunk_size <= 4 * 512


def test_fixed_split_size_is_in_pages_and_independent_of_the_batch() -> None:
    alone = decode_kv_split((1000,), num_kv_heads=8, num_sms=132, page_size=16, fixed_split_size=8)
    crowd = decode_kv_split((1000,) + (7,) * 200, num_kv_heads=8, num_sms=132, page_size=16, fixed_split_size=8)
    assert alone.kv_chunk_size == crowd.kv_chunk_size == 128
    assert alone.split_indptr[1] == crowd.split_indptr[1] == 8


def test_disable_split_kv() -> None:
    plan = decode_kv_split((32768,), num_kv_heads=8, num_sms=132, page_size=16, disable_split_kv=True)
    assert plan.kv_chunk_size == 0 and plan.split_indptr == (0, 1)


def test_workspace_formula() -> None:
    assert split_workspace_bytes(10, 32, 128) == 10 * 32 * 129 * 4


def test_segment_packbits_matches_reference_packing() -> None:
    gen = torch.Generator().manual_seed(0)
    qo, kv = [3, 0, 2], [5, 4, 7]
    flat = torch.rand(sum(q * k for q, k in zip(qo, kv)), generator=gen) > 0.5
    packed, indptr = segment_packbits(flat, qo, kv)
    assert indptr.tolist() == [0, 2, 2, 4]
    segments = torch.split(flat, [q * k for q, k in zip(qo, kv)])
    expected = torch.cat([reference.pack_custom_mask(s) for s in segments if s.numel()])
    assert torch.equal(packed, expected)


@pytest.mark.parametrize("lens", [(32768,), (32768,) + (512,) * 63, (100,) * 7, (5000, 3, 70000), (1,)])
@pytest.mark.parametrize("fixed", [None, 4])
def test_max_decode_chunks_bounds_every_plan(lens, fixed) -> None:
    kw = dict(num_kv_heads=8, num_sms=132, page_size=16)
    plan = decode_kv_split(lens, fixed_split_size=fixed, **kw)
    assert plan.num_chunks <= max_decode_chunks(len(lens), sum(lens), fixed_split_size=fixed, **kw)


def test_split_level_page_table_is_chunk_major_on_page_boundaries() -> None:
    from jitattn.kv_split import cascade_level_chunks, split_level_page_table

    index = check_paged_index(_i32([0, 5, 7]), _i32([10, 11, 12, 13, 14, 20, 21]), _i32([3, 16]), 16)
    qo, chunked = split_level_page_table(_i32([0, 2, 3]), index, 3)
    kv, indices, last = chunked.indptr, chunked.indices, chunked.last_page_len
    assert qo.tolist() == [0, 2, 3, 5, 6, 8, 9]  # chunk c's queries are rows c * 3 + ...
    assert kv.tolist() == [0, 2, 3, 5, 6, 7, 7]
    assert indices.tolist() == [10, 11, 20, 12, 13, 21, 14]
    assert last.tolist() == [16, 16, 16, 16, 3, 0]  # node 1's third chunk is empty
    assert cascade_level_chunks((32768,), num_kv_heads=8, num_sms=132, page_size=16) == 33
    # 128 queries of a 4-head group in 128-row tiles: 4 blocks per KV head already; 8 chunks fill the 264
    # slots of two blocks per SM in one wave (9 would leave a second wave of 24 blocks), 4 the sm90 tier's 132
    assert cascade_level_chunks((8192,), num_kv_heads=8, num_sms=132, page_size=16, query_tiles=4) == 8
    assert cascade_level_chunks((8192,), num_kv_heads=8, num_sms=132, page_size=16, query_tiles=4,
                                blocks_per_sm=1) == 4
    assert cascade_level_chunks((32768,), num_kv_heads=8, num_sms=132, page_size=16, blocks_per_sm=1) == 16
    assert cascade_level_chunks((100,) * 64, num_kv_heads=8, num_sms=132, page_size=16) == 1
    assert cascade_level_chunks((67, 32), num_kv_heads=8, num_sms=132, page_size=16, fixed_split_size=2) == 3


def test_cascade_chunks_are_whole_kv_blocks() -> None:
    from jitattn.kv_split import CHUNK_ALIGN_TOKENS, cascade_chunk_pages

    assert CHUNK_ALIGN_TOKENS == 128
    assert cascade_chunk_pages(2048, 33, 16) == (32, 64)  # 63-page chunks -> 64 (8 KV blocks of 128 tokens)
    assert cascade_chunk_pages(512, 9, 16) == (8, 64)
    assert cascade_chunk_pages(500, 9, 16) == (9, 56)    # 56 pages: already 7 blocks; the last chunk shorter
    assert cascade_chunk_pages(12, 3, 16) == (2, 8)
    assert cascade_chunk_pages(8, 3, 16) == (1, 8)       # one block's worth: no split left
    assert cascade_chunk_pages(100, 7, 48) == (7, 15)    # 48 does not divide 128: no rounding
    assert cascade_chunk_pages(300, 7, 1) == (3, 128)
    gen = torch.Generator().manual_seed(3)
    for _ in range(500):  # every page covered, never more chunks than asked, whole blocks when pages divide 128
        longest, wanted = (int(x) for x in torch.randint(1, 5000, (2,), generator=gen))
        page = [1, 2, 8, 16, 48, 64, 128, 256][int(torch.randint(0, 8, (1,), generator=gen))]
        chunks, per = cascade_chunk_pages(longest, wanted, page)
        assert 1 <= chunks <= max(1, wanted) and chunks * per >= longest > (chunks - 1) * per
        assert CHUNK_ALIGN_TOKENS % page or (per * page) % CHUNK_ALIGN_TOKENS == 0


def test_concat_level_tables_puts_the_levels_one_after_another() -> None:
    from jitattn.kv_split import concat_level_tables, split_level_page_table

    shared = check_paged_index(_i32([0, 3]), _i32([7, 8, 9]), _i32([4]), 16)
    qo_shared, shared_chunks = split_level_page_table(_i32([0, 3]), shared, 2)  # 2 chunks, 3 queries
    unique = check_paged_index(_i32([0, 1, 1, 3]), _i32([1, 2, 3, 42]), _i32([5, 0, 16]), 16)  # 42: a stale tail
    qo, table = concat_level_tables([(qo_shared, shared_chunks), (_i32([0, 1, 2, 3]), unique)])
    assert qo.tolist() == [0, 3, 6, 7, 8, 9]  # the unique level's rows follow the two chunks' (rows % 3 = queries)
    assert table.indptr.tolist() == [0, 2, 3, 4, 4, 6]
    assert table.indices.tolist() == [7, 8, 9, 1, 2, 3]  # only the used part of each level's indices
    assert table.last_page_len.tolist() == [16, 4, 5, 0, 16]
    assert table.kv_lens == shared_chunks.kv_lens + unique.kv_lens == (32, 4, 5, 0, 32)
    assert table.max_page_index == 9


def test_index_arrays_come_to_the_host_through_one_joined_copy() -> None:
    from jitattn.page_table import joined_to_host, to_host_int32_many

    tensors = [torch.tensor(x, dtype=torch.int32) for x in ([0, 2, 3], [], [5, 1, 4], [7, 16])]
    assert [h.tolist() for h in joined_to_host(tensors)] == [t.tolist() for t in tensors]
    host = to_host_int32_many(("a", "b", "c"), (tensors[0], tensors[2], tensors[3]))
    assert [h.tolist() for h in host] == [[0, 2, 3], [5, 1, 4], [7, 16]]
    with pytest.raises(TypeError, match="b has dtype torch.int64"):
        to_host_int32_many(("a", "b", "c"), (tensors[0], tensors[2].long(), tensors[3]))


def test_graph_level_chunks_follow_the_batch_shape_only() -> None:
    from jitattn.kv_split import graph_level_chunks

    # 64 queries of 4 heads in 128-row tiles: 2 tiles x 8 kv heads = 16 blocks; one wave of 2 per SM of 132
    # -> 16 chunks (8 at one block per SM)
    assert graph_level_chunks(64, group=4, tile_rows=128, num_kv_heads=8, num_sms=132) == 16
    assert graph_level_chunks(64, group=4, tile_rows=128, num_kv_heads=8, num_sms=132, blocks_per_sm=1) == 8
    assert graph_level_chunks(2048, group=4, tile_rows=128, num_kv_heads=8, num_sms=132) == 1, "the tiles fill it"
    assert graph_level_chunks(1, group=1, tile_rows=128, num_kv_heads=1, num_sms=1000) == 32, "capped"
    assert graph_level_chunks(0, group=4, tile_rows=128, num_kv_heads=8, num_sms=132) == 32, "one tile at least"

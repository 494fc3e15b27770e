"""Shared builders for the API tests: random paged caches, page tables, tolerances."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from jitattn.spec import KVLayout


@dataclass
class PagedBatch:
    cache: torch.Tensor | tuple[torch.Tensor, torch.Tensor]
    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    kv_last_page_len: torch.Tensor
    kv_lens: list[int]


def random_paged_batch(
    kv_lens: list[int], num_kv_heads: int, head_dim: int, page_size: int, dtype: torch.dtype,
    layout: str = "NHD", kv_format: str = "5d", device: str = "cpu", spare_pages: int = 3,
    generator: torch.Generator | None = None, head_dim_vo: int | None = None,
) -> PagedBatch:
    """A random KV pool with pages handed out in random order (never zeros)."""
    pages_per = [(n + page_size - 1) // page_size for n in kv_lens]
    total = sum(pages_per)
    pool = total + spare_pages
    order = torch.randperm(pool, generator=generator)[:total].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages_per).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page_size + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
    layout = KVLayout.parse(layout, "layout")
    head_dim_vo = head_dim if head_dim_vo is None else head_dim_vo

    def rand(shape):
        x = torch.randn(shape, generator=generator)
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            x = x * 2
        return x.to(dtype).to(device)

    if kv_format == "tuple3":
        assert page_size == 1
        k = rand((pool, num_kv_heads, head_dim))
        v = rand((pool, num_kv_heads, head_dim_vo))
        cache = (k, v)
    elif kv_format == "5d":
        assert head_dim == head_dim_vo
        shape = (pool, 2, page_size, num_kv_heads, head_dim) if layout is KVLayout.NHD else (
            pool, 2, num_kv_heads, page_size, head_dim)
        cache = rand(shape)
    else:  # tuple4
        def shape(d):
            return (pool, page_size, num_kv_heads, d) if layout is KVLayout.NHD else (pool, num_kv_heads, page_size, d)
        cache = (rand(shape(head_dim)), rand(shape(head_dim_vo)))
    return PagedBatch(cache, indptr, order, last, list(kv_lens))


def cascade_level(nodes_kv_lens: list[int], page_pool: list[int],
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Page table (indptr, indices, last_page_len) of one cascade level: each node takes fresh pages from
    ``page_pool`` (popped from its end)."""
    indptr, indices, last = [0], [], []
    for n in nodes_kv_lens:
        pages = (n + page_size - 1) // page_size
        indices += [page_pool.pop() for _ in range(pages)]
        indptr.append(len(indices))
        last.append((n - 1) % page_size + 1 if n else 0)
    return (torch.tensor(indptr, dtype=torch.int32), torch.tensor(indices, dtype=torch.int32),
            torch.tensor(last, dtype=torch.int32))


def tolerance(dtype: torch.dtype) -> float:
    """Absolute tolerance for outputs of magnitude ~1 stored in ``dtype``."""
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]


# The cuda prefill wrappers rotate q and k into f16 copies before the kernel when a plan has RoPE (RoPE first,
# jitattn/runtime/rope_first.py): each score carries the copies' rounding, up to 2^-10 of sum |q_i k_i| x scale,
# which reaches a few 1e-3 of the LSE at fp8 cases' k_scale (H200: 0.0028 at one seed).
ROPE_FIRST_LSE_ATOL = 5e-3


def stable_seed(*parts) -> int:
    """A generator seed from a test's parameters, the same in every process (``hash`` of a str is not)."""
    return zlib.crc32(repr(parts).encode())


def assert_close_lse(actual: torch.Tensor, expected: torch.Tensor, atol: float = 2e-3) -> None:
    actual, expected = actual.float().cpu(), expected.float().cpu()
    assert not torch.isnan(actual).any(), "lse has NaN (unwritten or invalid)"
    both_inf = torch.isinf(actual) & torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected)), "lse -inf pattern differs"
    torch.testing.assert_close(actual[~both_inf], expected[~both_inf], atol=atol, rtol=1e-4)


def assert_close_out(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    actual = actual.float().cpu()
    assert not torch.isnan(actual).any(), "output has NaN (unwritten or invalid)"
    torch.testing.assert_close(actual, expected.float().cpu(), atol=tolerance(dtype), rtol=tolerance(dtype))


def devices():
    import pytest

    return ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

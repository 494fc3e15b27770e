"""Two parts of one mixed batch side by side on a GPU: a chunk's prefill and a batch of decodes.

The prefill part is compute-bound and the sm90 prefill tier is persistent (one block per SM, each owning its
SM's shared memory), so a decode launched after it on another stream waits for SMs until the prefill ends:
run back to back, the two parts cost the sum of their times. ``side_by_side`` caps the prefill's grid at
``prefill_sms`` blocks and launches the two parts on two side streams at once, the prefill's of higher
priority; the decode's blocks take the other SMs, then the prefill's as its blocks finish. The decode part is
bandwidth-bound and reaches most of the read stream on part of the SMs, so both parts end near the longer
one's time alone.

The cap gives the prefill the share of the SMs that makes it end with the decode: its time alone over the
decode's, both estimated from FLOPs and bytes at the rates below (H200, measured by the ``ops`` suite's POD
case); the kernels' results do not depend on it.
"""

from __future__ import annotations

import math
import threading
from typing import Callable, TypeVar

import numpy as np
import torch

from ..hardware import num_sms
from ..kv_split import window_lens
from .batch import AttentionPlan

A = TypeVar("A")
B = TypeVar("B")

# Rates of the estimate (H200, the ops suite's POD case: a 2048-token causal chunk, 32 / 8 heads at head dim
# 128 in 127 us; 64 decodes over 4096 tokens in 251 us).
PREFILL_FLOPS_PER_S = 270e12
DECODE_BYTES_PER_S = 4.28e12
MIN_PREFILL_SMS = 8  # the prefill part never starves: at least this many blocks


def prefill_sms(prefill_flops: float, decode_bytes: float, sms: int) -> int:
    """Blocks for the prefill part's persistent grid beside a decode part (``sms``: every SM): its estimated
    time alone over the decode part's, as a share of the SMs, rounded up; every SM when the prefill is the
    longer part (the decode then fills the SMs its blocks leave)."""
    prefill_s = prefill_flops / PREFILL_FLOPS_PER_S
    decode_s = decode_bytes / DECODE_BYTES_PER_S
    if decode_s <= 0 or prefill_s >= decode_s:
        return sms
    return max(min(MIN_PREFILL_SMS, sms), min(sms, math.ceil(sms * prefill_s / decode_s)))


def prefill_flops(qo_lens, kv_lens, num_qo_heads: int, head_dim_qk: int, head_dim_vo: int, causal: bool,
                  window_left: int = -1) -> float:
    """FLOPs of a prefill batch: 2 per multiply-add of q.k and of p.v over the visible pairs (bottom-right
    causal: query i of a request with q queries and k keys is at position k - q + i and sees the keys up to it;
    a window of ``window_left`` >= 0 hides the keys before position - window_left, causal or not)."""
    q = np.asarray(qo_lens, dtype=np.int64).reshape(-1)
    k = np.asarray(kv_lens, dtype=np.int64).reshape(-1)
    if q.shape != k.shape:
        raise ValueError(f"qo_lens has {q.size} requests but kv_lens has {k.size}")
    if window_left < 0:
        if causal:  # k >= q: q (k - q + 1) + q (q - 1) / 2; else the last k queries see 1..k keys
            pairs = np.where(k >= q, q * (k - q + 1) + q * (q - 1) // 2, k * (k + 1) // 2)
        else:
            pairs = q * k
        return 2.0 * float(pairs.sum()) * num_qo_heads * (head_dim_qk + head_dim_vo)
    # one entry per query: its position, then its keys [max(0, pos - window_left), min(k, pos + 1)) (causal) or up to k
    pos = np.arange(int(q.sum()), dtype=np.int64) - np.repeat(np.cumsum(q) - q, q) + np.repeat(k - q, q)
    keys = np.repeat(k, q)
    hi = np.minimum(keys, pos + 1) if causal else keys
    visible = np.maximum(0, hi - np.maximum(0, pos - window_left))
    return 2.0 * float(visible.sum()) * num_qo_heads * (head_dim_qk + head_dim_vo)


def decode_bytes(kv_lens, num_kv_heads: int, head_dim_qk: int, head_dim_vo: int, kv_element_bytes: int,
                 window_left: int = -1) -> float:
    """Bytes a decode batch reads: each request's K and V once (under a window of ``window_left`` >= 0, the
    window's keys)."""
    tokens = float(window_lens(np.asarray(kv_lens, dtype=np.int64).reshape(-1), window_left).sum())
    return tokens * num_kv_heads * (head_dim_qk + head_dim_vo) * kv_element_bytes


def prefill_blocks(prefill: AttentionPlan, qo_lens, decode: AttentionPlan) -> int:
    """The grid cap of the paged ``prefill`` plan (requests of ``qo_lens`` queries) beside the ``decode`` plan:
    ``prefill_sms`` of their FLOPs and bytes on the prefill's device; 0 (no cap) on the cpu."""
    device = prefill.qo_indptr.device
    if device.type != "cuda":
        return 0
    flops = prefill_flops(qo_lens, prefill.index.kv_lens, prefill.num_qo_heads, prefill.head_dim_qk,
                          prefill.head_dim_vo, prefill.scalars.causal, prefill.scalars.window_left)
    read = decode_bytes(decode.index.kv_lens, decode.num_kv_heads, decode.head_dim_qk, decode.head_dim_vo,
                        decode.kv_dtype.itemsize, decode.scalars.window_left)
    index = device.index if device.index is not None else torch.cuda.current_device()
    return prefill_sms(flops, read, num_sms(index))


# Per device: (a high-priority stream for the first part, a default-priority stream for the second).
_SIDE_STREAMS: dict[int, tuple[torch.cuda.Stream, torch.cuda.Stream]] = {}
_LOCK = threading.Lock()


def _side_streams(device_index: int) -> tuple[torch.cuda.Stream, torch.cuda.Stream]:
    with _LOCK:
        streams = _SIDE_STREAMS.get(device_index)
        if streams is None:
            low, high = torch.cuda.Stream.priority_range()  # e.g. (0, -5): a lower number is a higher priority
            streams = _SIDE_STREAMS[device_index] = (torch.cuda.Stream(device_index, priority=high),
                                                     torch.cuda.Stream(device_index, priority=low))
        return streams


def side_by_side(first: Callable[[], A], second: Callable[[], B], device: torch.device) -> tuple[A, B]:
    """``first()`` and ``second()`` on two side streams of ``device``, both starting after the work enqueued
    before this call; the current stream waits for both before its later work (also while a CUDA graph is
    captured: the side streams join the capture). On the cpu the two run in order.

    ``first`` (the persistent prefill) runs on a high-priority stream, so that its blocks are placed before the
    second part's whenever both wait for SMs. Both parts wait on the same event, so both become ready together;
    without the priority the block scheduler placed the decode's blocks first when they were ready first (the
    decode behind earlier work on its own stream, the prefill behind a cross-stream event, as in back-to-back
    calls): the decode took every SM and the prefill, which needs a whole SM's shared memory, ran after it.
    H200, the ops suite's POD case, plain back-to-back launches: 377 us with the prefill on the current stream,
    330 us now (the parts alone 371); timed with L2 evicted and the launches queued: 297 and 306 us.

    The side streams are used only inside this call, and always after waiting for the current stream: memory
    the caller frees after the call is reused on them only behind the caller's earlier work (no
    ``record_stream``)."""
    if device.type != "cuda":
        return first(), second()
    main = torch.cuda.current_stream(device)
    high, low = _side_streams(device.index if device.index is not None else torch.cuda.current_device())
    high.wait_stream(main)
    low.wait_stream(main)
    with torch.cuda.stream(high):
        a = first()
    with torch.cuda.stream(low):
        b = second()
    main.wait_stream(high)
    main.wait_stream(low)
    return a, b

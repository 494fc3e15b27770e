"""RoPE applied before a prefill kernel instead of inside it: q and k rotated once per run into f16 copies.

A prefill kernel that rotates inside turns each key block again for every query tile that reads it (about 64
times per key at causal b x 4096 with the GQA group packed), and on the sm90 tier the rotation would sit between
the TMA loads and the wgmma that reads shared memory directly. Rotating the batch's q and k once costs one read
and one write of each, and then the plain kernel (no RoPE) runs on the rotated rows (docs/kernels/sm90_prefill.md,
"RoPE before the kernel").

Precision: the rotation is computed in float32 from angles computed in float64 (``cos_sin_table``) and rounded to
f16 (a relative error of 2^-11 per element, as the decode kernel's tf32 path): a bf16 q and k are rotated straight
into f16 rows (the rope kernel's bf16-to-f16 build), v converted (exact for bf16 values of magnitude in [2^-14,
65504]; larger ones overflow to inf), so the kernel's operands are f16 whatever the input; the output keeps the
plan's dtype.

``JITATTN_PREFILL_ROPE_FIRST`` decides when a prefill plan takes this route (``env.prefill_rope_first``).
"""

from __future__ import annotations

import numpy as np
import torch

from .batch import upload_int32
from .rope import Angles, Positions, rotate

OPERAND_DTYPE = torch.float16


def cos_sin_table(rows: int, shift: int, head_dim: int, rope_scale: float, rope_theta: float,
                  device: torch.device) -> torch.Tensor:
    """float32 ``[rows, head_dim]``: row r holds the cos (first half) and sin (second half) of each pair's angle at
    position ``r - shift``, ``(r - shift) / rope_scale * rope_theta^(-2i / head_dim)``, computed in float64."""
    i = torch.arange(head_dim // 2, dtype=torch.float64, device=device)
    freq = float(rope_theta) ** (-2.0 * i / head_dim) / float(rope_scale)
    pos = torch.arange(rows, dtype=torch.float64, device=device) - shift
    angle = pos[:, None] * freq[None, :]
    return torch.cat([torch.cos(angle), torch.sin(angle)], dim=1).to(torch.float32)


class RopeFirst:
    """The rotation of one plan: ``rope_first(q, k, v) -> (q, k, v)`` in f16, q's row i of a request with qo_len q
    and kv_len k at position ``k - q + i``, k's row j at ``j`` (the kernels' ``ROPE_LLAMA`` positions).

    ``qo_indptr`` / ``kv_indptr``: the plan's (host); k and v arrive as ragged ``[kv tokens, kv heads, dim]`` (the
    paged wrapper gathers its pages first)."""

    def __init__(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, *, head_dim: int, rope_scale: float,
                 rope_theta: float, device: torch.device, previous: RopeFirst | None = None) -> None:
        qo = qo_indptr.numpy().astype(np.int64)
        kv = kv_indptr.numpy().astype(np.int64)
        delta = np.diff(kv) - np.diff(qo)  # a request's first query position (negative when qo_len > kv_len)
        shift = int(max(0, -int(delta.min()))) if delta.size else 0
        rows = shift + (int(np.diff(kv).max()) if kv.size > 1 else 0) + 1
        self.key = (device, head_dim, float(rope_scale), float(rope_theta), shift)
        if previous is not None and previous.key == self.key and previous.table.shape[0] >= rows:
            self.table = previous.table  # the last plan's angles cover these positions
        else:
            self.table = cos_sin_table(1 << (rows - 1).bit_length(), shift, head_dim, rope_scale, rope_theta, device)
        self.q_tokens, self.k_tokens = int(qo[-1]), int(kv[-1])  # the rows of the requests (others are not read)
        arrays = {"qo_indptr": qo, "q_offsets": delta + shift, "kv_indptr": kv,
                  "k_offsets": np.full(kv.size - 1, shift)}
        qo_d, q_off, kv_d, k_off = upload_int32(  # one host-to-device copy
            [(name, torch.from_numpy(a.astype(np.int32)), None) for name, a in arrays.items()], device)
        self.q_positions = Positions(indptr=qo_d, offsets=q_off)
        self.k_positions = Positions(indptr=kv_d, offsets=k_off)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return (self._rotated(q, self.q_tokens, self.q_positions), self._rotated(k, self.k_tokens, self.k_positions),
                v.to(OPERAND_DTYPE))

    def _rotated(self, x: torch.Tensor, tokens: int, positions: Positions) -> torch.Tensor:
        """``x`` (``[tokens, heads, dim]``) turned into a new f16 tensor (its first ``tokens`` rows; others are not
        read)."""
        if x.dtype in (torch.float16, torch.bfloat16):  # one pass: 16-bit rows rotated straight into f16
            out = torch.empty(x.shape, dtype=OPERAND_DTYPE, device=x.device)
            src = x[:tokens]
        else:  # fp8 (a ragged fp8 k): converted first (exact), then turned in place
            out = x.to(OPERAND_DTYPE, memory_format=torch.contiguous_format)
            src = out[:tokens]
        dst = out[:tokens]
        # the rotation kernel takes q and k rows of one token count: the other operand is an empty view
        rotate(src, src[:, :0], dst, dst[:, :0], positions, None, False, Angles(cos_sin_cache=self.table))
        return out

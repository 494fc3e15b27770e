"""fp8 prefill (q, k and v all fp8, FlashInfer's ``single_prefill_with_kv_cache`` with ``scale_q`` / ``scale_k`` /
``scale_v``): its operands, for the fp8 kernel or converted for the 16-bit one.

FlashInfer runs an fp8 query on its Hopper (FA3) backend only, with per-head scales (float32 tensors of
``[num_qo_heads]`` for q, ``[num_kv_heads]`` for k and v) and the output in ``o_dtype`` (default: q's fp8 dtype).
On an H100 / H200 the sm90 prefill tier's fp8 kernel takes the call when it runs its options (``ops/prefill_fp8.py``
decides: head_dim 128, no custom mask or RoPE); it reads scale tensors (per head, or one value) on the device
(``device_scales``), and its output is rounded to an fp8 ``o_dtype`` as below. Everywhere else the operands are
converted to 16 bits and the 16-bit kernel runs:

- Per-tensor scales (None, a float, a one-element host tensor): q, k, v are converted exactly (every e4m3 / e5m2
  value is a bf16 and an f16 value) and the kernel applies the scales (``scale_q * scale_k`` to the scores,
  ``scale_v`` to the output), so the result is the 16-bit kernel's attention of the dequantized values.
- Scales as tensors of one value per head (or a one-element tensor on the GPU), never read on the host: each
  operand is multiplied by its scales in float32 and rounded to bf16 (relative error 2^-9, within fp8's own
  2^-4). Their values are not checked (that would need a device sync): a NaN or negative scale gives what it
  implies.
- An fp8 ``o_dtype`` (FlashInfer's default for an fp8 query): the 16-bit output rounded to it, saturating at the
  dtype's largest finite value (e5m2 has infinities; e4m3fn has none).

The conversion costs one read of the fp8 operands and one write and read of 16-bit ones on top of the 16-bit
kernel (docs/kernels/sm90_prefill.md, "fp8 prefill").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec import KVLayout
from .checks import FP8_DTYPES, check_tensor, target_of
from .options import fp8_scale

_SIXTEEN_BIT = (torch.float16, torch.bfloat16)


def is_fp8(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.dtype in FP8_DTYPES


@dataclass(frozen=True)
class Fp8Prefill:
    """The operands of one fp8 prefill call (converted to 16 bits, or as given when ``fp8``), the scales the
    kernel applies and the output's dtypes."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scales: tuple  # scale_q, scale_k, scale_v for the kernel (floats; as given for the fp8 kernel)
    kernel_o_dtype: torch.dtype  # what the kernel writes
    out_dtype: torch.dtype  # what the caller gets
    fp8: bool  # the operands are the fp8 ones (for the fp8 kernel), not converted

    def output(self, result):
        """The kernel's ``result`` (out, or (out, lse)) with out in the caller's dtype."""
        if self.out_dtype == self.kernel_o_dtype:
            return result
        out, lse = result if isinstance(result, tuple) else (result, None)
        limit = torch.finfo(self.out_dtype).max
        out = out.clamp(-limit, limit).to(self.out_dtype)
        return out if lse is None else (out, lse)


def _device_scale(value, name: str, heads: int) -> torch.Tensor | None:
    """``value`` as float32 scales to multiply in (one per head, or one for all) when it is a tensor that is not a
    one-element host tensor, else None (a per-tensor scale the kernel applies)."""
    if not isinstance(value, torch.Tensor) or value.numel() == 1 and value.device.type == "cpu":
        return None
    if not value.is_floating_point() or value.dim() > 1 or value.numel() not in (1, heads):
        raise ValueError(f"{name} (shape {tuple(value.shape)}, {str(value.dtype).removeprefix('torch.')}) must be a "
                         f"float, a one-element tensor, or a float tensor of one scale per head ([{heads}])")
    return value.to(torch.float32).reshape(-1)


def device_scales(scale_q, scale_k, scale_v, num_qo_heads: int, num_kv_heads: int, device: torch.device
                  ) -> tuple[tuple, torch.Tensor | None]:
    """An fp8 query kernel's scales: ``((scale_q, scale_k, scale_v), head_scales)``, the scalars as given but 1 for
    each given as a device tensor (one value, or one per head), and those in one float32 device tensor (q's heads,
    then k's, then v's: ``kernels.attention``'s ``head_scales``), None when there are none. Never read on the
    host."""
    heads = (num_qo_heads, num_kv_heads, num_kv_heads)
    given = ((scale_q, "scale_q"), (scale_k, "scale_k"), (scale_v, "scale_v"))
    on_device = [_device_scale(s, n, h) for (s, n), h in zip(given, heads)]
    if all(s is None for s in on_device):
        return (scale_q, scale_k, scale_v), None
    parts = [torch.ones(h, dtype=torch.float32, device=device) if s is None else s.to(device).expand(h)
             for s, h in zip(on_device, heads)]
    scalars = tuple(1.0 if d is not None else s for d, (s, _) in zip(on_device, given))
    return scalars, torch.cat(parts)


def prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale_q, scale_k, scale_v, o_dtype: torch.dtype | None,
            kv_layout: KVLayout, keep_fp8: bool = False) -> Fp8Prefill:
    """The operands of an fp8 query's prefill (q ``[qo_len, H_qo, D]``, k / v ``[kv_len, H_kv, D]`` (NHD) or
    ``[H_kv, kv_len, D]`` (HND)): as given when ``keep_fp8`` (the fp8 kernel takes them), else converted to 16
    bits."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=3)
    target_of("single_prefill_with_kv_cache", (q, k, v))
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q is {str(q.dtype).removeprefix('torch.')}, k {str(k.dtype).removeprefix('torch.')} and v "
                        f"{str(v.dtype).removeprefix('torch.')}: an fp8 query needs k and v of its fp8 dtype (for fp8 "
                        "KV alone, pass a 16-bit query)")
    out_dtype = q.dtype if o_dtype is None else o_dtype
    if out_dtype not in (*_SIXTEEN_BIT, torch.float32, *FP8_DTYPES):
        raise TypeError(f"o_dtype={o_dtype}: an fp8 prefill writes float16, bfloat16, float32 or an fp8 dtype")
    heads_dim = (1, 1 if kv_layout is KVLayout.NHD else 0, 1 if kv_layout is KVLayout.NHD else 0)
    operands = (q, k, v)
    given = ((scale_q, "scale_q"), (scale_k, "scale_k"), (scale_v, "scale_v"))
    on_device = [_device_scale(s, n, x.shape[d]) for (s, n), x, d in zip(given, operands, heads_dim)]
    if keep_fp8:  # the fp8 kernel; it applies the scales (tensors ones through head_scales: device_scales)
        dtype, scales, converted = torch.bfloat16, (scale_q, scale_k, scale_v), operands
    elif all(s is None for s in on_device):  # exact conversions; the kernel applies the scales
        dtype = out_dtype if out_dtype in _SIXTEEN_BIT else torch.bfloat16
        scales = tuple(fp8_scale(s, n) for s, n in given)
        converted = tuple(x.to(dtype) for x in operands)
    else:  # scales multiplied in (float32, then bf16: the range of any fp8 value times a scale)
        dtype, scales, converted = torch.bfloat16, (1.0, 1.0, 1.0), []
        for x, (s, n), d, dev in zip(operands, given, heads_dim, on_device):
            if dev is None:
                converted.append((x.to(torch.float32) * fp8_scale(s, n)).to(dtype))
            else:
                shape = [1, 1, 1]
                shape[d] = dev.numel()
                converted.append((x.to(torch.float32) * dev.to(x.device).view(shape)).to(dtype))
    kernel_o_dtype = out_dtype if out_dtype in (*_SIXTEEN_BIT, torch.float32) else dtype
    return Fp8Prefill(*converted, scales, kernel_o_dtype, out_dtype, fp8=converted is operands)

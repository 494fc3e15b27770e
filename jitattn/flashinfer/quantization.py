"""``flashinfer.quantization``: ``packbits`` / ``segment_packbits``, the bit packing users call to build a
``packed_custom_mask`` (FlashInfer's prefill packs with ``bitorder="little"``). Torch operations on the tensors'
device, as ``numpy.packbits``: a nonzero element is a 1 bit, each byte's first element its highest bit ("big") or
its lowest ("little"), a partial last byte padded with 0 bits."""

from __future__ import annotations

import torch

__all__ = ["packbits", "segment_packbits"]


def _bits(x: torch.Tensor, what: str, bitorder: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{what}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 1:
        raise ValueError(f"{what}: x must be 1-D, got shape {tuple(x.shape)}")
    if bitorder not in ("big", "little"):
        raise ValueError(f"{what}: bitorder={bitorder!r} must be 'big' or 'little'")
    return (x != 0).to(torch.uint8)


def _weights(bitorder: str, device: torch.device) -> torch.Tensor:
    order = range(7, -1, -1) if bitorder == "big" else range(8)
    return torch.tensor([1 << i for i in order], dtype=torch.uint8, device=device)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """The 1-D binary array ``x`` packed into uint8 ``[(len(x) + 7) // 8]`` (``numpy.packbits``'s semantics)."""
    bits = _bits(x, "packbits", bitorder)
    padded = torch.zeros((bits.numel() + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
    padded[: bits.numel()] = bits
    return (padded.view(-1, 8) * _weights(bitorder, bits.device)).sum(dim=1, dtype=torch.uint8)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big") -> tuple[torch.Tensor, torch.Tensor]:
    """Each segment ``x[indptr[i]:indptr[i + 1]]`` packed as ``packbits`` packs, each from a byte of its own:
    (uint8 ``[new_indptr[-1]]``, int32 ``new_indptr`` with ``new_indptr[i + 1] - new_indptr[i] = (len_i + 7) // 8``).
    Reads the segment sizes on the host (a synchronisation when ``indptr`` is on a GPU)."""
    bits = _bits(x, "segment_packbits", bitorder)
    if (not isinstance(indptr, torch.Tensor) or indptr.dim() != 1 or indptr.numel() < 1 or indptr.is_floating_point()
            or indptr.is_complex() or indptr.dtype == torch.bool):
        raise ValueError("segment_packbits: indptr must be a 1-D integer tensor of batch_size + 1 entries")
    starts = indptr.to(device="cpu", dtype=torch.int64)
    lens = starts[1:] - starts[:-1]
    if starts[0] != 0 or (lens < 0).any() or int(starts[-1]) != bits.numel():
        raise ValueError(f"segment_packbits: indptr must start at 0, never decrease and end at len(x) = {bits.numel()}"
                         f"; got {starts.tolist()[:8]}{' ...' if starts.numel() > 8 else ''}")
    new_indptr = torch.zeros_like(starts)
    new_indptr[1:] = torch.cumsum((lens + 7) // 8, 0)
    # element j of segment s goes to slot 8 new_indptr[s] + (j - indptr[s]) of the segments padded to whole bytes,
    # which then pack as packbits packs (a scatter and a sum, not an index_add_ per bit)
    shift = (new_indptr[:-1] * 8 - starts[:-1]).to(bits.device)
    slot = torch.arange(bits.numel(), device=bits.device) + torch.repeat_interleave(
        shift, lens.to(bits.device), output_size=bits.numel())  # its size given: no wait for the GPU
    padded = torch.zeros(int(new_indptr[-1]) * 8, dtype=torch.uint8, device=bits.device)
    padded[slot] = bits
    out = (padded.view(-1, 8) * _weights(bitorder, bits.device)).sum(dim=1, dtype=torch.uint8)
    return out, new_indptr.to(device=indptr.device, dtype=torch.int32)

"""FlashInfer's flattened boolean custom masks and their bit-packed form."""

from __future__ import annotations


import torch
from torch import Tensor


def unpack_custom_mask(packed: Tensor, total_bits: int) -> Tensor:
    """Unpack a little-endian bit-packed uint8 mask into a flat bool tensor.

    Bit ``i`` of the flat mask is ``(packed[i // 8] >> (i % 8)) & 1``
    (``numpy.packbits(..., bitorder="little")`` layout, as in FlashInfer).

    Returns:
        bool tensor ``[total_bits]`` on ``packed``'s device.
    """
    total_bits = int(total_bits)
    flat = packed.reshape(-1)
    if total_bits < 0 or flat.numel() * 8 < total_bits:
        raise ValueError(f"{flat.numel()} bytes cannot hold {total_bits} bits")
    idx = torch.arange(total_bits, dtype=torch.int64, device=packed.device)
    byte = flat.to(torch.int64)[idx // 8]
    return ((byte >> (idx % 8)) & 1).to(torch.bool)


def pack_custom_mask(mask_bool_flat: Tensor) -> Tensor:
    """Inverse of :func:`unpack_custom_mask`: pack a bool mask little-endian.

    The mask is flattened (row-major); the result has ``ceil(n / 8)`` bytes and
    any padding bits of the last byte are 0.

    Returns:
        uint8 tensor on the mask's device.
    """
    bits = mask_bool_flat.reshape(-1).to(torch.bool).to(torch.int64)
    n = bits.numel()
    nbytes = (n + 7) // 8
    padded = torch.zeros(nbytes * 8, dtype=torch.int64, device=bits.device)
    padded[:n] = bits
    weights = (2 ** torch.arange(8, dtype=torch.int64, device=bits.device))
    return (padded.reshape(nbytes, 8) * weights).sum(dim=1).to(torch.uint8)

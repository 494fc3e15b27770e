"""Custom masks on the host: FlashInfer's flattened boolean masks bit-packed per request, and
multi-item scoring turned into the equivalent mask."""

from __future__ import annotations


import torch


def packed_mask_indptr(qo_lens: list[int], kv_lens: list[int]) -> torch.Tensor:
    """Byte offset of each request's bit-packed qo_len x kv_len mask (each starts on a byte)."""
    sizes = [(q * k + 7) // 8 for q, k in zip(qo_lens, kv_lens)]
    out = [0]
    for size in sizes:
        out.append(out[-1] + size)
    return torch.tensor(out, dtype=torch.int32)


def host_mask(name: str, mask: torch.Tensor) -> torch.Tensor:
    """``mask`` (an argument called ``name``) copied to the host, where masks are packed; a meta tensor has no values
    to copy."""
    if mask.device.type == "meta":
        raise ValueError(f"{name} is a meta tensor (a shape without values); pass the mask itself")
    return mask.detach().to("cpu")


def segment_packbits(custom_mask: torch.Tensor, qo_lens: list[int], kv_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack FlashInfer's flattened boolean mask per request, bit i of a request at byte i//8, bit i%8.

    Returns (packed uint8, mask_indptr int32 in bytes).
    """
    if not isinstance(custom_mask, torch.Tensor):
        raise TypeError(f"custom_mask must be a bool torch.Tensor, got {type(custom_mask).__name__}")
    one = len(qo_lens) == 1 and (qo_lens[0], kv_lens[0])
    if custom_mask.dim() != 1 and not (one and tuple(custom_mask.shape) == one):  # a transposed mask would be misread
        raise ValueError(f"custom_mask has shape {tuple(custom_mask.shape)}; pass it flattened (1-D: each request's "
                         "[qo_len, kv_len] mask row-major, the requests concatenated)"
                         + (f", or [qo_len, kv_len] = {one} for this one request" if one else ""))
    mask = host_mask("custom_mask", custom_mask).reshape(-1)
    if mask.dtype != torch.bool:
        raise TypeError(f"custom_mask has dtype {mask.dtype}; pass a bool mask (or packed_custom_mask as uint8)")
    expected = sum(q * k for q, k in zip(qo_lens, kv_lens))
    if mask.numel() != expected:
        raise ValueError(
            f"custom_mask has {mask.numel()} elements; the requests' qo_len*kv_len sum to {expected} "
            "(flattened row-major per request, concatenated)"
        )
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8)
    chunks, offset = [], 0
    for q, k in zip(qo_lens, kv_lens):
        bits = mask[offset: offset + q * k]
        offset += q * k
        padded = torch.zeros((bits.numel() + 7) // 8 * 8, dtype=torch.uint8)
        padded[: bits.numel()] = bits.to(torch.uint8)
        chunks.append((padded.view(-1, 8) * weights).sum(dim=1, dtype=torch.uint8) if padded.numel() else padded)
    packed = torch.cat(chunks) if chunks else torch.zeros(0, dtype=torch.uint8)
    return packed, packed_mask_indptr(qo_lens, kv_lens)


def multi_item_mask(
    qo_lens: list[int], kv_lens: list[int], prefix_len: torch.Tensor, token_pos_in_items: torch.Tensor,
    token_pos_in_items_len: int,
) -> torch.Tensor:
    """FlashInfer's multi-item scoring as a flattened bool custom mask (True = attend).

    A request's sequence is a shared prefix of ``prefix_len[r]`` tokens followed by items,
    each item a delimiter and its tokens; ``token_pos_in_items`` gives every token after the
    prefix its position in its item (0 for a delimiter), request r's values starting at
    ``r * token_pos_in_items_len`` (FlashInfer's zero-padded rows; entries past the tensor's end,
    which FlashInfer's own tests leave off the last request's row, are that padding: 0). The query
    at sequence position p (bottom-right aligned)
    sees key j when ``j <= p`` and: p is in the prefix, or j is in the prefix, or j lies in
    p's own item (``p - pos < j``). A delimiter after the prefix so sees only the prefix, and
    no item sees an earlier one.
    """
    for name, t in (("prefix_len_ptr", prefix_len), ("token_pos_in_items_ptr", token_pos_in_items)):
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            got = str(t.dtype).removeprefix("torch.") if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(f"{name} must be an integer tensor, got {got}")
    prefix = prefix_len.detach().to("cpu").to(torch.int64).reshape(-1)
    positions = token_pos_in_items.detach().to("cpu").to(torch.int64).reshape(-1)
    if prefix.numel() and int(prefix.min()) < 0:
        raise ValueError(f"prefix_len_ptr has a negative length ({int(prefix.min())})")
    if positions.numel() and int(positions.min()) < 0:
        raise ValueError(f"token_pos_in_items_ptr has a negative position ({int(positions.min())})")
    if prefix.numel() != len(qo_lens):
        raise ValueError(f"prefix_len_ptr has {prefix.numel()} entries; expected one per request ({len(qo_lens)})")
    stride = int(token_pos_in_items_len)
    if len(qo_lens) > 1 and stride <= 0:
        raise ValueError("token_pos_in_items_len must give each request's (zero-padded) length of "
                         "token_pos_in_items_ptr when the batch has more than one request")
    masks = []
    padded = torch.cat([positions, torch.zeros(1, dtype=torch.int64)])  # index numel: the implied zero padding
    for r, (q, k) in enumerate(zip(qo_lens, kv_lens)):
        p_len = int(prefix[r])
        pos_q = torch.arange(q, dtype=torch.int64) + (k - q)  # sequence position of each query
        j = torch.arange(k, dtype=torch.int64)
        after_prefix = torch.clamp(pos_q - p_len, min=0)
        if stride > 0 and (pos_q >= p_len).any() and int(after_prefix.max()) >= stride:
            raise ValueError(
                f"request {r} has {int(after_prefix.max()) + 1} tokens after its prefix, but token_pos_in_items_len "
                f"is {stride}: each request's row of token_pos_in_items_ptr must hold all of them (pass the longest)"
            )
        offset = torch.clamp(after_prefix + r * stride, max=positions.numel())
        in_item = torch.where(pos_q >= p_len, padded[offset], 0)
        causal = j[None, :] <= pos_q[:, None]
        same_item = (pos_q[:, None] - in_item[:, None]) < j[None, :]
        visible = causal & ((pos_q[:, None] < p_len) | (j[None, :] < p_len) | same_item)
        masks.append(visible.reshape(-1))
    return torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)

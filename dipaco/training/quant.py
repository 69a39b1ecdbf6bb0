"""Quantized transport of outer gradients: blockwise symmetric integers with one bf16 scale per block.

A flat fp32 vector is cut into blocks of ``block`` values; each block stores ``scale ≈ absmax / qmax``
(bf16, rounded up by < 1.1% so no value clips; bf16 rather than fp16 so tiny gradients do not
underflow) and ``q = round(x / scale)`` in [−qmax, qmax] (4 bits: qmax 7, two values per byte;
8 bits: qmax 127). Round-trip error per value is at most ``scale / 2`` ≤ 1.011 · absmax(block) / (2·qmax),
i.e. ≈ absmax / 14 in 4 bits. ``bits = 16`` sends bf16, ``bits = 32`` sends fp32 unchanged.
Blocks are independent: quantizing a slice that starts and ends on block boundaries (the vector's end counts
as one) gives exactly the bytes of those blocks in the whole vector (the reduce-scatter relies on it).
Dequantized values are fp32; sums are taken in fp32. Rounding is deterministic, so every receiver
of the same bytes reconstructs the same values (shared modules stay bit-identical on all holders).
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (4, 8, 16, 32)


def payload_bytes(numel: int, bits: int, block: int) -> int:
    """Bytes one quantized vector of ``numel`` values occupies on the wire."""
    if bits == 32:
        return 4 * numel
    if bits == 16:
        return 2 * numel
    blocks = -(-numel // block)
    return blocks * block * bits // 8 + 2 * blocks


def quantize(x: torch.Tensor, bits: int, block: int) -> torch.Tensor:
    """fp32 vector -> uint8 payload (values, then bf16 scales) of ``payload_bytes`` bytes."""
    x = x.detach().reshape(-1).float()
    if bits == 32:
        return x.clone().view(torch.uint8)
    if bits == 16:
        return x.to(torch.bfloat16).view(torch.uint8)
    qmax = (1 << (bits - 1)) - 1
    blocks = -(-x.numel() // block)
    padded = torch.zeros(blocks * block, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    padded = padded.view(blocks, block)
    scale = (padded.abs().amax(dim=1) / qmax * (1 + 2 ** -7)).to(torch.bfloat16)  # >= absmax / qmax
    safe = torch.where(scale > 0, scale.float(), torch.ones_like(scale, dtype=torch.float32))
    q = torch.clamp(torch.round(padded / safe[:, None]), -qmax, qmax).to(torch.int16)
    if bits == 4:
        u = (q + 8).to(torch.uint8).view(-1)
        values = u[0::2] | (u[1::2] << 4)
    else:
        values = q.to(torch.int8).view(torch.uint8).view(-1)
    return torch.cat([values, scale.view(torch.uint8)])


def dequantize(payload: torch.Tensor, numel: int, bits: int, block: int) -> torch.Tensor:
    """uint8 payload -> fp32 vector of ``numel`` values."""
    if bits == 32:
        return payload.view(torch.float32)[:numel].clone()
    if bits == 16:
        return payload.view(torch.bfloat16)[:numel].float()
    blocks = -(-numel // block)
    nvalues = blocks * block * bits // 8
    # clone: a payload sliced out of a received buffer may start at an odd byte, and a bf16 view needs an even one
    values, scale = payload[:nvalues], payload[nvalues:].clone().view(torch.bfloat16).float()
    if bits == 4:
        q = torch.empty(blocks * block, dtype=torch.float32, device=payload.device)
        q[0::2] = (values & 0xF).float() - 8
        q[1::2] = (values >> 4).float() - 8
    else:
        q = values.view(torch.int8).float()
    return (q.view(blocks, block) * scale[:, None]).reshape(-1)[:numel]

"""Dense little-endian bit packing into int32 words, as GPTQ (v1) and compressed-tensors use it.

Value e of a row occupies bits [e*b, (e+1)*b) of the row's bitstream; word w holds bits [32w, 32w+32),
lowest bits first. For b in {2, 4, 8} this is "word r ORs q[r*(32/b)+j] << (b*j)"; for b = 3 values
straddle words exactly as AutoGPTQ's 3-bit packer does.
"""

from __future__ import annotations

import math

import torch

_MASK32 = 0xFFFFFFFF
SCALE_DTYPE = torch.float16  # how every format stores scales and biases


def stored_bias(tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """A linear's stored bias as float32, or None."""
    bias = tensors.get("bias")
    return None if bias is None else bias.float()


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """Reinterpret unsigned 32-bit values held in int64 as int32 bit patterns."""
    words = words & _MASK32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int32(values: torch.Tensor, bits: int, dim: int = -1) -> torch.Tensor:
    """Pack unsigned `bits`-bit integers along `dim` of a 2-D tensor into int32 words."""
    values = values.to(torch.int64)
    if dim in (0, -2):
        return pack_int32(values.t(), bits).t().contiguous()
    if values.numel() and (values.min() < 0 or values.max() >= 2**bits):
        raise ValueError(f"values outside [0, {2**bits - 1}] cannot be packed in {bits} bits")
    rows, cols = values.shape
    num_words = math.ceil(cols * bits / 32)
    pos = torch.arange(cols) * bits
    word, offset = pos // 32, pos % 32
    out = torch.zeros(rows, num_words + 1, dtype=torch.int64)
    out.scatter_add_(1, word.expand(rows, cols), values << offset)  # bit ranges are disjoint: add == or
    spill = (offset + bits > 32)
    if spill.any():
        high = torch.where(spill, values >> (32 - offset), torch.zeros_like(values))
        out.scatter_add_(1, (word + 1).expand(rows, cols), high)
    return _to_int32(out[:, :num_words])


def unpack_int32(packed: torch.Tensor, bits: int, num_values: int, dim: int = -1) -> torch.Tensor:
    """Inverse of pack_int32: [rows, num_values] (or transposed for dim 0) unsigned values as int64."""
    if dim in (0, -2):
        return unpack_int32(packed.t(), bits, num_values).t().contiguous()
    words = packed.to(torch.int64) & _MASK32
    words = torch.cat([words, torch.zeros(words.shape[0], 1, dtype=torch.int64)], dim=1)
    pos = torch.arange(num_values) * bits
    word, offset = pos // 32, pos % 32
    low = words[:, word] >> offset
    high = words[:, word + 1] << (32 - offset)
    spill = (offset + bits > 32)
    return torch.where(spill, low | high, low) & (2**bits - 1)


def interleave_awq(values: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM packing of 4-bit values [R, C] along C: word c ORs v[:, 8c + ORDER[i]] << 4i."""
    rows, cols = values.shape
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    grouped = values.to(torch.int64).view(rows, cols // 8, 8)[:, :, order]
    shifts = torch.arange(8) * 4
    return _to_int32((grouped << shifts).sum(-1))


def deinterleave_awq(packed: torch.Tensor, num_values: int) -> torch.Tensor:
    rows = packed.shape[0]
    words = packed.to(torch.int64) & _MASK32
    shifts = torch.arange(8) * 4
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [R, C/8, 8] in packed order
    order = torch.tensor([0, 2, 4, 6, 1, 3, 5, 7])
    out = torch.empty_like(nibbles)
    out[:, :, order] = nibbles
    return out.view(rows, num_values)

"""Weight-only quantized matmuls: y = x @ dequant(W)^T with W stored as integer codes.

The reference dequantizes in fp32 and multiplies; the CPU fast paths are aten's packed kernels:
- int4 (any code width <= 4 bits): `_weight_int4pack_mm_for_cpu`, which computes per group
  w = (q - 8) * scale + offset, so our w = (q - z) * s becomes offset = (8 - z) * s;
- int8 per output channel: `_weight_int8pack_mm` (signed codes, one scale per row), with a rank-1
  correction for asymmetric zero points.

Shapes: x [M, K]; codes q [N, K] unsigned; scales [N, G]; zeros [N, G]; y [M, N].
"""

from __future__ import annotations

import torch

from llmopt.core.contract.fp4 import pack_nibbles, unpack_nibbles  # noqa: F401  (the int4 layouts' nibble copy)

INT4_GROUP_SIZES = (32, 64, 128, 256)  # what the aten int4 kernel accepts


def reference_quant_matmul(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                           g_idx: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (scales * (q - zeros))^T with column k in group g_idx[k]; fp32 maths, x's dtype out."""
    g = g_idx.long()
    w = scales.float()[:, g] * (q.float() - zeros.float()[:, g])  # [N, K]
    return (x.float() @ w.t()).to(x.dtype)


def int4_group_size(in_features: int, group_size: int) -> int | None:
    """The aten group size that expresses `group_size` (-1 = per channel), or None if none does.

    Larger groups are split into equal kernel groups that repeat the scale."""
    width = in_features if group_size == -1 else group_size
    for size in reversed(INT4_GROUP_SIZES):
        if width % size == 0:
            return size
    return None


def can_pack_int4(out_features: int, in_features: int, bits: int, group_size: int) -> bool:
    return (bits <= 4 and out_features % 16 == 0 and in_features % 2 == 0
            and int4_group_size(in_features, group_size) is not None)


def pack_int4(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Codes [N, K], scales/zeros [N, G] -> (packed weight, scales_and_offsets [G', N, 2], kernel group size)."""
    n, k = q.shape
    kernel_group = int4_group_size(k, group_size)
    repeat = (k if group_size == -1 else group_size) // kernel_group
    scales = scales.float().repeat_interleave(repeat, dim=1)  # [N, G']
    offsets = (8 - zeros.float().repeat_interleave(repeat, dim=1)) * scales
    packed = pack_int4_codes(q)
    scales_and_offsets = torch.stack([scales, offsets], dim=-1).transpose(0, 1).contiguous().to(dtype)
    return packed, scales_and_offsets, kernel_group


def pack_int4_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] (< 16) -> aten's packed int4 layout for `_weight_int4pack_mm_for_cpu`."""
    return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_and_offsets: torch.Tensor,
                kernel_group: int) -> torch.Tensor:
    """x [M, K] (dtype of scales_and_offsets) -> [M, N]."""
    return torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, kernel_group, scales_and_offsets)


def int4_dequantize(nibbles: torch.Tensor, scales_and_offsets: torch.Tensor, kernel_group: int) -> torch.Tensor:
    """The dense weight [N, K] in the dtype of scales_and_offsets, w = (q - 8) * scale + offset per kernel
    group: the same arithmetic as `_weight_int4pack_mm_for_cpu`."""
    n = nibbles.shape[0]
    dtype = scales_and_offsets.dtype
    q = unpack_nibbles(nibbles).reshape(n, -1, kernel_group).to(dtype)  # [N, G', g]
    scales = scales_and_offsets[..., 0].t().unsqueeze(-1)  # [N, G', 1]
    offsets = scales_and_offsets[..., 1].t().unsqueeze(-1)
    return torch.addcmul(offsets, q - 8, scales).reshape(n, -1)


def pack_int4_panels(nibbles: torch.Tensor, scales_and_offsets: torch.Tensor, kernel_group: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The int4 weight in panels of 16 outputs for `int4_matmul_panels` (csrc/int4_cpu.cpp): codes [N/16, K, 8]
    (per column k, output i of the panel in the low nibble of byte i, output 8 + i in the high one) and per group
    the panel's scales and biases (offset - 8 * scale, so w = q * scale + bias) as fp32 [N/16, K/group, 2, 16]."""
    q = unpack_nibbles(nibbles)  # [N, K]
    n, k = q.shape
    panels = q.reshape(n // 16, 16, k).to(torch.uint8)
    codes = (panels[:, :8] | (panels[:, 8:] << 4)).transpose(1, 2).contiguous()  # [P, K, 8]
    scales, offsets = scales_and_offsets[..., 0].float(), scales_and_offsets[..., 1].float()  # [G, N]
    per_panel = torch.stack([scales, offsets - 8 * scales], dim=1)  # [G, 2, N]
    return codes, per_panel.reshape(k // kernel_group, 2, n // 16, 16).permute(2, 0, 1, 3).contiguous()


def pack_int4_q8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int, kernel_group: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [N, K] (< 16), scales / zeros [N, G] -> the layout of `int4_matmul_q8` (csrc/int4_q8_cpu.cpp): codes
    [N/16, K/8, 64] (chunk c of panel p: bytes 4j..4j+3 are output 16p + j's columns 8c..8c+3 in the low nibbles
    and 8c+4..8c+7 in the high ones) and per kernel group the panel's scales and biases (w = q * scale + bias,
    bias = -zero * scale) as float16 [N/16, K/kernel_group, 2, 16]."""
    n, k = q.shape
    columns = q.to(torch.uint8).reshape(n // 16, 16, k // 8, 2, 4)  # [P, j, c, half, b]: column 8c + 4 half + b
    codes = (columns[..., 0, :] | (columns[..., 1, :] << 4)).permute(0, 2, 1, 3).reshape(n // 16, k // 8, 64)
    repeat = (k if group_size == -1 else group_size) // kernel_group
    scale = scales.float().repeat_interleave(repeat, dim=1)  # [N, G']
    bias = -zeros.float().repeat_interleave(repeat, dim=1) * scale
    scales_biases = torch.stack([scale, bias], dim=1).reshape(n // 16, 16, 2, -1).permute(0, 3, 2, 1)
    return codes.contiguous(), scales_biases.to(torch.float16).contiguous()


def fits_float16(*tensors: torch.Tensor) -> bool:
    """Whether every value is finite in float16 (int4_matmul_q8's scales and biases are stored in it)."""
    return all(bool(t.float().abs().max() <= torch.finfo(torch.float16).max) for t in tensors if t.numel())


def pack_int8(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-channel 8-bit codes [N, K], scales/zeros [N, 1] -> (signed codes, scales [N], correction [N] or None).

    w = s (q - z) = s (q - 128) + s (128 - z): the second term times sum(x) is the correction."""
    signed = (q.to(torch.int16) - 128).to(torch.int8).contiguous()
    scale, shift = int8_scale_shift(scales, zeros)
    return signed, scale.to(dtype), shift.to(dtype) if shift is not None else None


def pack_int8_panels(signed: torch.Tensor) -> torch.Tensor:
    """Signed codes [N, K] (N a multiple of 16) -> [N/16, K, 16] for `int8_matmul_panels`: per column k, the 16
    codes of a panel's outputs side by side."""
    n, k = signed.shape
    return signed.reshape(n // 16, 16, k).transpose(1, 2).contiguous()


def pack_int8_q8(signed: torch.Tensor) -> torch.Tensor:
    """Signed codes [N, K] (N a multiple of 16, K of 4) -> the layout of `int8_matmul_q8` (csrc/int8_q8_cpu.cpp):
    [N/16, K/4, 64] (chunk c of panel p: bytes 4j..4j+3 are output 16p + j's columns 4c..4c+3)."""
    n, k = signed.shape
    return signed.reshape(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).reshape(n // 16, k // 4, 64).contiguous()


def int8_scale_shift(scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-channel scales / zeros [N, 1] -> float32 scale [N] and shift [N] (None when every zero point is 128):
    w = scale * (q - zero) = scale * signed + shift, signed = q - 128."""
    scale = scales.float()[:, 0].contiguous()
    shift = (128 - zeros.float()[:, 0]) * scale
    return scale, shift.contiguous() if bool(shift.abs().max() > 0) else None


def int8_zeros_symmetric(zeros: torch.Tensor) -> bool:
    """Whether 8-bit codes' zero points are all 128 (symmetric weights: the only ones `int8_matmul_q8`'s grouped
    scales take; no kernel takes a per-group shift)."""
    return bool((zeros == 128).all())


def int8_group_scales(scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor | None:
    """Grouped symmetric 8-bit scales [N, G] (every zero point 128) -> float32 [G, N], group-major as
    `int8_matmul_q8` reads grouped scales; None for zero points off 128 (int8_zeros_symmetric)."""
    return scales.float().t().contiguous() if int8_zeros_symmetric(zeros) else None


def int8_matmul(x: torch.Tensor, signed: torch.Tensor, scale: torch.Tensor,
                correction: torch.Tensor | None) -> torch.Tensor:
    y = torch.ops.aten._weight_int8pack_mm(x, signed, scale)
    if correction is not None:
        y = y + x.sum(dim=-1, keepdim=True) * correction
    return y

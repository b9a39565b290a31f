"""FP4 (E2M1) values and the block scales of NVFP4 and MXFP4, as compressed-tensors and the OCP MX spec define
them: pure tensor functions shared by the quantizers, the formats and the runtime's reference path.

An E2M1 code is 4 bits: bit 3 the sign, bits 0-2 the magnitude's index into (0, 0.5, 1, 1.5, 2, 3, 4, 6). Two
codes share a byte, the even column in the low nibble (compressed-tensors' `weight_packed`, [N, K/2] uint8).
Block scales: NVFP4 keeps one E4M3 scale per 16 values and one FP32 global scale per tensor (w = v * s / g);
MXFP4 one E8M0 scale (a power of two, stored as its biased exponent e: 2^(e - 127)) per 32 values (w = v * s).
"""

from __future__ import annotations

import torch

E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding |x| to the nearest magnitude, ties to the even mantissa: the thresholds between neighbours and
# whether a value exactly on one rounds up (0.75 -> 1.0, 1.75 -> 2.0, 3.5 -> 4.0) or down (0.25 -> 0, 1.25 -> 1.0,
# 2.5 -> 2.0, 5.0 -> 4.0): compressed-tensors' cast_to_fp4.
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))
E8M0_BIAS = 127
FP8_SCALE_EPS = 0.125  # what an all-zero NVFP4 block's scale becomes (compressed-tensors' eps for E4M3)


def e2m1_table(dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """[16] the value of each code (codes 8-15: the negatives, code 8 = -0)."""
    magnitudes = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32)
    return torch.cat([magnitudes, -magnitudes]).to(dtype=dtype, device=device)


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """uint8 codes of x rounded to the nearest E2M1 value (saturating at +-6, ties to even); a negative x that
    rounds to zero keeps its sign bit, as compressed-tensors packs it."""
    a = x.abs().float()
    index = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for threshold, tie_up in _THRESHOLDS:
        index += (a >= threshold) if tie_up else (a > threshold)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


def e2m1_values(codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return e2m1_table(dtype, codes.device)[codes.long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (K even) -> [N, K/2] uint8, column 2j in the low nibble of byte j (E2M1 codes as
    compressed-tensors stores them; the runtime's int4 layout for dequantizing whole weights)."""
    codes = codes.to(torch.uint8)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_nibbles: [N, K/2] uint8 -> codes [N, K] uint8."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def nvfp4_scales(amax: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """NVFP4's stored block scales (float32, E4M3-representable) for blocks whose range is +-amax: amax / 6 (in
    amax's dtype) x global, rounded to E4M3 (saturating at 448); an all-zero block gets 0.125 (compressed-tensors'
    formula)."""
    scales = (global_scale * (amax / 6.0)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return torch.where(scales == 0, torch.full_like(scales, FP8_SCALE_EPS), scales)


def nvfp4_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale [1] float32 for a tensor whose largest magnitude is amax: 448 x 6 / amax, so the
    largest block's scale lands on E4M3's largest value (compressed-tensors' generate_gparam)."""
    amax = amax.float().clamp(min=torch.finfo(torch.float32).tiny)
    return torch.nan_to_num(448.0 * 6.0 / amax, nan=1.0, posinf=1.0, neginf=1.0).reshape(1)


def fake_quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor, block: int = 16) -> torch.Tensor:
    """x [..., K] through NVFP4 and back (float32): blocks of `block` along the last dimension, scales from
    each block's amax (dynamic) under a given global scale (NVFP4 inputs; compressed-tensors' fake quantization,
    which takes amax / 6 in x's own dtype: a bf16 input's scales round through bf16 first)."""
    spans = x.reshape(*x.shape[:-1], x.shape[-1] // block, block)
    effective = nvfp4_scales(spans.abs().amax(dim=-1, keepdim=True), global_scale) / global_scale
    codes = e2m1_codes((spans.float() / effective).clamp_(-6.0, 6.0))
    return (e2m1_values(codes) * effective).reshape(x.shape)


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Powers of two -> their biased exponents, uint8."""
    return (torch.floor(torch.log2(scale.float())) + E8M0_BIAS).clamp(0, 255).to(torch.uint8)


def e8m0_decode(exponents: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents -> float32 2^(e - 127)."""
    return torch.exp2(exponents.to(torch.float32) - E8M0_BIAS)


def block_scale_table(scheme_scale_format: str, global_scale: torch.Tensor | None) -> torch.Tensor:
    """[256] float32: the effective scale (block scale / global scale) of each stored scale byte, for kernels
    that read the one-byte scales: E4M3 bit patterns (NVFP4) or E8M0 exponents (MXFP4)."""
    codes = torch.arange(256, dtype=torch.uint8)
    if scheme_scale_format == "e4m3":
        values = codes.view(torch.float8_e4m3fn).float()
        values = torch.where(torch.isfinite(values), values, torch.zeros_like(values))  # 0x7f / 0xff are NaN
        return values / global_scale.float().reshape(()) if global_scale is not None else values
    return e8m0_decode(codes)


def scale_bytes(scales: torch.Tensor, scale_format: str) -> torch.Tensor:
    """Block scales [N, G] float32 (E4M3-representable or powers of two) -> their stored bytes, uint8."""
    if scale_format == "e4m3":
        return scales.to(torch.float8_e4m3fn).view(torch.uint8)
    return e8m0_encode(scales)


def fp4_kernel_operands(qweight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the FP4 kernels read of an NVFP4 / MXFP4 QuantizedWeight: (codes two a byte [N, K/2] uint8, the
    block scales' stored bytes [N, G] uint8, block_scale_table [256] float32)."""
    scale_format = qweight.scheme.scale_format
    return (pack_nibbles(qweight.q), scale_bytes(qweight.scales, scale_format).contiguous(),
            block_scale_table(scale_format, qweight.global_scale))

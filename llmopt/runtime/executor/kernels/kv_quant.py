"""The 8-bit KV cache's numbers, as pure tensor functions: every store kernel (compiled CPU, Triton) writes the
codes and scales these write, and every attention kernel reads values equal to `dequantize_kv`'s.

Each cached key or value vector — one token, one KV head, head_dim values — is stored as head_dim 8-bit codes
and one fp32 scale (symmetric, dynamic: scale = amax / code_max, as llama.cpp's q8_0 does per 32 values and
KIVI does per token for values). The scale is per token and head rather than per tensor because a scale fixed
in advance must cover the rare outlier channels of the keys and rounds every other value coarsely; a scale per
vector costs 4 bytes per head_dim codes (68 bytes for 64 values against 256 in fp32: 3.76x as many tokens).

- int8: codes = round_half_even(x / scale) in [-127, 127], scale = amax / 127;
- fp8: codes = E4M3 (float8_e4m3fn, round to nearest even) of x / scale, scale = amax / 448 (E4M3's largest
  finite value), so every vector uses E4M3's full range.

A vector of zeros gets scale 0 and codes 0 (dequantized: zeros).
"""

from __future__ import annotations

import torch

from llmopt.core.contract.activations import exact_quotient

E4M3_MAX = 448.0
INT8_MAX = 127.0
# --kv-cache-dtype name -> the dtype its codes are stored in
KV_CODE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
CODE_MAX = {torch.int8: INT8_MAX, torch.float8_e4m3fn: E4M3_MAX}


def kv_scales(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """x [..., head_dim] -> the fp32 scale of each vector [...]: amax / the code's largest value."""
    return exact_quotient(x.abs().amax(dim=-1).float(), CODE_MAX[code_dtype])  # (as the CPU divides, on CUDA too)


def quantize_kv(x: torch.Tensor, code_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, kv_heads, head_dim] -> (codes [T, kv_heads, head_dim] in code_dtype, scales [T, kv_heads] fp32)."""
    scales = kv_scales(x, code_dtype)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales))[..., None]
    limit = CODE_MAX[code_dtype]
    scaled = (x.float() / safe).clamp(-limit, limit)
    codes = scaled.round().to(torch.int8) if code_dtype == torch.int8 else scaled.to(code_dtype)
    return codes, scales.contiguous()


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """codes [..., head_dim], scales [...] -> values in dtype (the product taken in fp32)."""
    return (codes.float() * scales[..., None]).to(dtype)


def fake_quantize_kv(x: torch.Tensor, code_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache gives it back: quantized and dequantized, in x's dtype."""
    return dequantize_kv(*quantize_kv(x, code_dtype), x.dtype)

"""Float-grid weight quantization shared by RTN and GPTQ: FP8 (E4M3 values, one scale per row or group) and FP4
(E2M1 values in blocks: NVFP4's E4M3 block scales under a global scale, MXFP4's power-of-two scales), with
compressed-tensors' formulas; the value encodings themselves are core.contract.fp4's. Pure tensor functions over
W [N out, K in]."""

from __future__ import annotations

import torch

from llmopt.core.contract import QuantScheme, QuantizedWeight, default_g_idx
from llmopt.core.contract.fp4 import (
    E8M0_BIAS, e2m1_codes, e2m1_values, e8m0_decode, nvfp4_global_scale, nvfp4_scales,
)
from llmopt.core.contract.scheme import FLOAT4_MAX


def quantize_float_rtn(w: torch.Tensor, scheme: QuantScheme, bias: torch.Tensor | None = None,
                       mse: bool = False) -> QuantizedWeight:
    """FP8 (E4M3) weights of `w` [N, K]: per (row, group) scale = amax / 448 (mse: the searched range), values
    w / scale rounded to the nearest E4M3 (compressed-tensors' float-quantized). q holds the values' bytes; zeros
    are unused (0)."""
    n, k = w.shape
    width = scheme.group_width(k)
    groups = w.float().reshape(n, k // width, width)
    scales = float_mse_scales(w, scheme, None) if mse else _stored_scales(groups.abs().amax(dim=-1), scheme, None)
    values = (groups / scales[..., None]).clamp_(-scheme.float_max, scheme.float_max).to(torch.float8_e4m3fn)
    return QuantizedWeight(values.reshape(n, k).view(torch.uint8), scales,
                           torch.zeros_like(scales, dtype=torch.int32), default_g_idx(k, scheme), scheme, bias)

def fp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale [1] float32 for weights `w` (any shape): core.contract.fp4.nvfp4_global_scale of
    their amax. Linears that a runtime fuses (q/k/v, gate/up) share one: pass their weights concatenated."""
    return nvfp4_global_scale(w.float().abs().amax())

def _round_to_power_of_2(x: torch.Tensor) -> torch.Tensor:
    """x float32 >= 0 -> the power of two below it, or above it when its mantissa is 1.75 or more (the bits of
    a float32 plus a quarter of the mantissa's range, masked to sign and exponent: the MX spec's reference)."""
    bits = x.float().view(torch.int32)
    return ((bits + (1 << 21)) & (0x1FF << 23)).view(torch.float32)

def fp4_block_scales(w: torch.Tensor, scheme: QuantScheme, global_scale: torch.Tensor | None,
                     mse: bool = False) -> torch.Tensor:
    """Block scales [N, G] float32 of `w` [N, K] for an FP4 scheme, as compressed-tensors' observers compute
    them: NVFP4 amax / 6 * global, rounded to E4M3 (0 -> 0.125); MXFP4 2^(exponent of amax rounded to a power
    of two - 2), so the block's largest value lands within E2M1's +-6 (saturating when its mantissa is 1.5-1.75).
    mse: the scale of a shrunk range where that lowers the block's error (float_mse_scales)."""
    n, k = w.shape
    if mse:
        return float_mse_scales(w, scheme, global_scale)
    amax = w.float().reshape(n, k // scheme.group_size, scheme.group_size).abs().amax(dim=-1)  # [N, G]
    return _stored_scales(amax, scheme, global_scale)

def _stored_scales(amax: torch.Tensor, scheme: QuantScheme, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The stored scale of blocks whose range is +-amax: FP8 amax / 448 (1 for zero blocks); NVFP4 and MXFP4 as
    fp4_block_scales says."""
    if scheme.scale_format is None:
        scales = amax / scheme.float_max
        return torch.where(scales > 0, scales, torch.ones_like(scales))
    if scheme.scale_format == "e4m3":
        return nvfp4_scales(amax, global_scale)
    exponent = torch.floor(torch.log2(_round_to_power_of_2(amax))) - 2 + E8M0_BIAS  # -inf for all-zero blocks
    return e8m0_decode(exponent.clamp(0, 255).to(torch.uint8))

def float_mse_scales(w: torch.Tensor, scheme: QuantScheme, global_scale: torch.Tensor | None, grid: int = 40,
                     max_shrink: float = 0.4, norm: float = 2.4) -> torch.Tensor:
    """Stored scales [N, G] of a float scheme minimising each block's sum |w - Q(w)|^norm over the ranges
    amax x (1, 1 - 1/grid, ...) as each format stores them (GPTQ's mse search on the float grid; llm-compressor's
    mse observer). w: [N, K]."""
    n, k = w.shape
    width = scheme.group_width(k)
    blocks = w.float().reshape(n, k // width, width)  # [N, G, W]
    amax = blocks.abs().amax(dim=-1)
    best_err, best = None, None
    for i in range(int(max_shrink * grid) + 1):
        scales = _stored_scales(amax * (1 - i / grid), scheme, global_scale)  # [N, G]
        effective = scales if global_scale is None else scales / global_scale
        _, dq = quantize_float_column(blocks, effective.unsqueeze(-1), scheme)
        err = (dq - blocks).abs_().pow_(norm).sum(-1)
        if best is None:
            best_err, best = err, scales
        else:
            better = err < best_err
            best_err, best = torch.where(better, err, best_err), torch.where(better, scales, best)
    return best

def fp4_codes(w: torch.Tensor, scales: torch.Tensor, global_scale: torch.Tensor | None) -> torch.Tensor:
    """E2M1 codes [N, K] of `w` [N, K] under block scales [N, K] (already expanded per column): w / (s / g)
    clamped to +-6 and rounded to the nearest value (compressed-tensors' _quantize)."""
    effective = scales if global_scale is None else scales / global_scale
    return e2m1_codes((w.float() / effective).clamp_(-FLOAT4_MAX, FLOAT4_MAX))

def quantize_fp4_rtn(w: torch.Tensor, scheme: QuantScheme, bias: torch.Tensor | None = None,
                     global_scale: torch.Tensor | None = None, mse: bool = False) -> QuantizedWeight:
    """NVFP4 or MXFP4 weights of `w` [N, K] (global_scale: NVFP4's, shared with the linears fused with this one;
    default: this weight's own)."""
    n, k = w.shape
    if scheme.scale_format == "e4m3" and global_scale is None:
        global_scale = fp4_global_scale(w)
    if scheme.scale_format != "e4m3":
        global_scale = None
    scales = fp4_block_scales(w, scheme, global_scale, mse)
    g_idx = default_g_idx(k, scheme)
    codes = fp4_codes(w, scales[:, g_idx.long()], global_scale)
    return QuantizedWeight(codes, scales, torch.zeros_like(scales, dtype=torch.int32), g_idx, scheme, bias,
                           global_scale=global_scale)

def float_block_scales(w: torch.Tensor, scheme: QuantScheme, mse: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored scales [N, G] float32, NVFP4's global scale or None) of `w` [N, K] for a float scheme: the
    ranges GPTQ keeps fixed while it rounds column by column (FP8: amax / 448 per group; mse: searched)."""
    global_scale = fp4_global_scale(w) if scheme.scale_format == "e4m3" else None
    if mse:
        return float_mse_scales(w, scheme, global_scale), global_scale
    if scheme.scale_format is not None:
        return fp4_block_scales(w, scheme, global_scale), global_scale
    return quantize_float_rtn(w, scheme).scales, None

def quantize_float_column(w: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, dequantized float32) of values `w` [R] under effective scales [R] on a float grid: E4M3
    (codes: the values' bytes) or E2M1 (codes: core.contract.fp4)."""
    scaled = (w.float() / scale).clamp_(-scheme.float_max, scheme.float_max)
    if scheme.bits == 4:
        codes = e2m1_codes(scaled)
        return codes, e2m1_values(codes) * scale
    values = scaled.to(torch.float8_e4m3fn)
    return values.view(torch.uint8), values.float() * scale

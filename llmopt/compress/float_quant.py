"""Float-grid weight quantization shared by RTN and GPTQ: FP8 (E4M3 values, one scale per row or group) and FP4
(E2M1 values in blocks: NVFP4's E4M3 block scales under a global scale, MXFP4's power-of-two scales), with
compressed-tensors' formulas; the value encodings themselves are core.contract.fp4's. Pure tensor functions over
W [N out, K in]."""

from __future__ import annotations

import torch

from llmopt.core.contract import QuantizedWeight, QuantScheme, default_g_idx
from llmopt.core.contract.activations import exact_quotient
from llmopt.core.contract.fp4 import E8M0_BIAS, e2m1_codes, e2m1_values, e8m0_decode, nvfp4_global_scale, nvfp4_scales


def fp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """NVFP4's per-tensor scale [1] float32 for weights `w` (any shape): core.contract.fp4.nvfp4_global_scale of
    their amax. Linears that a runtime fuses (q/k/v, gate/up) share one: pass their weights concatenated."""
    return nvfp4_global_scale(w.float().abs().amax())


def _round_to_power_of_2(x: torch.Tensor) -> torch.Tensor:
    """x float32 >= 0 -> the power of two below it, or above it when its mantissa is 1.75 or more (the bits of
    a float32 plus a quarter of the mantissa's range, masked to sign and exponent: the MX spec's reference)."""
    bits = x.float().view(torch.int32)
    return ((bits + (1 << 21)) & (0x1FF << 23)).view(torch.float32)


def _stored_scales(amax: torch.Tensor, scheme: QuantScheme, global_scale: torch.Tensor | None) -> torch.Tensor:
    """The stored scale of blocks whose range is +-amax, as compressed-tensors' observers compute it: FP8
    amax / 448 (1 for zero blocks); NVFP4 amax / 6 x global, rounded to E4M3 (0 -> 0.125); MXFP4 2^(exponent of
    amax rounded to a power of two - 2), so the block's largest value lands within E2M1's +-6 (saturating when
    its mantissa is 1.5-1.75)."""
    if scheme.scale_format is None:
        scales = exact_quotient(amax, scheme.float_max)
        return torch.where(scales > 0, scales, torch.ones_like(scales))
    if scheme.scale_format == "e4m3":
        return nvfp4_scales(amax, global_scale)
    exponent = torch.floor(torch.log2(_round_to_power_of_2(amax))) - 2 + E8M0_BIAS  # -inf for all-zero blocks
    return e8m0_decode(exponent.clamp(0, 255).to(torch.uint8))


def quantize_float_column(w: torch.Tensor, scale: torch.Tensor, scheme: QuantScheme
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8, dequantized float32) of values `w` under effective scales broadcastable to them, on a float
    grid: E4M3 (codes: the values' bytes) or E2M1 (codes: core.contract.fp4); w / scale clamped to the grid's
    largest value and rounded to the nearest (compressed-tensors' _quantize)."""
    scaled = (w.float() / scale).clamp_(-scheme.float_max, scheme.float_max)
    if scheme.bits == 4:
        codes = e2m1_codes(scaled)
        return codes, e2m1_values(codes) * scale
    values = scaled.to(torch.float8_e4m3fn)
    return values.view(torch.uint8), values.float() * scale


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


def float_block_scales(w: torch.Tensor, scheme: QuantScheme, mse: bool = False,
                       global_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(stored scales [N, G] float32, NVFP4's global scale or None) of `w` [N, K] for a float scheme: from each
    block's amax, or searched (mse). global_scale: NVFP4's, shared with the linears fused with this one (default:
    this weight's own). The ranges GPTQ keeps fixed while it rounds column by column."""
    if scheme.scale_format != "e4m3":
        global_scale = None
    elif global_scale is None:
        global_scale = fp4_global_scale(w)
    if mse:
        return float_mse_scales(w, scheme, global_scale), global_scale
    n, k = w.shape
    width = scheme.group_width(k)
    amax = w.float().reshape(n, k // width, width).abs().amax(dim=-1)  # [N, G]
    return _stored_scales(amax, scheme, global_scale), global_scale


def quantize_float_rtn(w: torch.Tensor, scheme: QuantScheme, bias: torch.Tensor | None = None, mse: bool = False,
                       global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """FP8 / NVFP4 / MXFP4 weights of `w` [N, K], rounded to the nearest grid value (compressed-tensors'
    float-quantized and nvfp4- / mxfp4-pack-quantized). q holds the E4M3 values' bytes or the E2M1 codes; zeros
    are unused (0)."""
    k = w.shape[1]
    scales, global_scale = float_block_scales(w, scheme, mse, global_scale)
    g_idx = default_g_idx(k, scheme)
    effective = scales if global_scale is None else scales / global_scale
    codes, _ = quantize_float_column(w, effective[:, g_idx.long()], scheme)
    return QuantizedWeight(codes, scales, torch.zeros_like(scales, dtype=torch.int32), g_idx, scheme, bias,
                           global_scale=global_scale)

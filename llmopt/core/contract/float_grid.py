"""The float grids, shared by RTN and GPTQ: FP8 (E4M3 values, one scale per row or group) and FP4 (E2M1 values in
blocks: NVFP4's E4M3 block scales under a global scale, MXFP4's power-of-two scales), with compressed-tensors'
formulas; the value encodings themselves are core.contract.fp4's. Pure tensor functions over W [N out, K in], and
the grid that serves `QuantScheme.type` "float" through them."""

from __future__ import annotations

import torch

from llmopt.core.contract.activations import exact_quotient
from llmopt.core.contract.fp4 import E8M0_BIAS, e2m1_codes, e2m1_values, e8m0_decode, nvfp4_global_scale, nvfp4_scales
from llmopt.core.contract.grid import GridRanges, WeightGrid, register_weight_grid
from llmopt.core.contract.scheme import FLOAT_BITS, FP4_BLOCKS, QuantScheme
from llmopt.core.errors import ConfigError


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


@register_weight_grid
class FloatGrid(WeightGrid):
    """FP8 (E4M3) and FP4 (E2M1) values under block scales; codes: the E4M3 values' bytes or the E2M1 codes;
    no zero point (zeros 0). The ranges come from the weight before rounding, also in GPTQ."""

    name = "float"

    def check(self, scheme, in_features, name):
        if scheme.bits not in FLOAT_BITS:
            raise ConfigError(f"{scheme.bits}-bit float schemes are not supported: FP8 (E4M3) and FP4 (E2M1) only")
        if scheme.scale_format is None:
            return
        block = FP4_BLOCKS.get(scheme.strategy)
        if block != scheme.group_size:
            raise ConfigError(f"FP4 with strategy {scheme.strategy} and blocks of {scheme.group_size} is not a format: "
                              "NVFP4 is tensor_group with blocks of 16, MXFP4 group with blocks of 32")
        if in_features % block:
            raise ConfigError(f"{scheme.fp4_name}'s blocks of {block} do not divide {name}'s in_features "
                              f"({in_features}): leave it dense (--ignore) or use an int scheme")

    def ranges(self, w, scheme, mse=False, global_scale=None):
        scales, global_scale = float_block_scales(w, scheme, mse, global_scale)
        return GridRanges(scales, torch.zeros_like(scales), global_scale)

    def round(self, values, scale, zero, scheme):
        return quantize_float_column(values, scale, scheme)[0]

    def decode(self, codes, zeros, scheme):
        if scheme.bits == 4:
            return e2m1_values(codes)
        return codes.to(torch.uint8).view(torch.float8_e4m3fn).float()

    def zero_code(self, zeros):
        return torch.zeros_like(zeros, dtype=torch.uint8)  # +0.0 in E4M3 and E2M1

    def stored_zeros(self, zeros, scheme):
        return zeros.to(torch.int32)

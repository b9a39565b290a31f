"""Integer weight quantization maths shared by RTN, GPTQ and AWQ: pure tensor functions over the convention
of llmopt.core.contract (groups of input columns, scale and unsigned zero point per row and group)."""

from __future__ import annotations

import torch

from llmopt.core.contract import QuantScheme, QuantizedWeight, default_g_idx
from llmopt.core.contract.fp4 import (
    E8M0_BIAS, e2m1_codes, e2m1_values, e8m0_decode, nvfp4_global_scale, nvfp4_scales,
)
from llmopt.core.contract.scheme import FLOAT4_MAX


def compute_qparams(
    w: torch.Tensor, scheme: QuantScheme, clip_ratio: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and unsigned zero point per row of `w` [R, Gw] (one group per row), min/max based.

    clip_ratio ([R] or scalar) shrinks the range toward zero, as found by the MSE/AWQ clip searches.
    """
    w = w.float()
    return qparams_from_range(w.amin(dim=1) * clip_ratio, w.amax(dim=1) * clip_ratio, scheme)


def qparams_from_range(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and unsigned zero point [R] for rows whose values span [wmin, wmax] [R] (0 is kept in range)."""
    wmin, wmax = wmin.clamp(max=0), wmax.clamp(min=0)
    if scheme.sym:
        amax = torch.maximum(wmin.abs(), wmax)
        # Symmetric range [-amax, amax] over 2^b - 1 steps with z = 2^(b-1): the positive side gets
        # one step fewer; the usual GPTQ choice scale = 2 * amax / maxq keeps every code reachable.
        scale = 2 * amax / scheme.maxq
        zero = torch.full_like(scale, 2 ** (scheme.bits - 1))
    else:
        scale = (wmax - wmin) / scheme.maxq
        zero = None
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if zero is None:
        # z >= 1: GPTQ v1 stores z - 1, which must not underflow (only all-non-negative groups are affected).
        zero = torch.round(-wmin / scale).clamp(1, scheme.maxq)
    return scale, zero


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    """Codes clamp(round(w / s) + z) for `w` [..., C] with scale/zero broadcastable to it."""
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int) -> torch.Tensor:
    return scale * (quantize_codes(w, scale, zero, maxq) - zero)


def mse_qparams(
    w: torch.Tensor, scheme: QuantScheme, grid: int = 40, max_shrink: float = 0.6, norm: float = 2.4
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row qparams minimising sum |w - Q(w)|^norm over clip ratios 1, 1 - 1/grid, ... (GPTQ's `mse` search).

    w: [R, Gw]. Returns scale [R], zero [R]. (Rows in chunks, the error computed in place in one buffer: 3x
    faster than one temporary per op, and the same result.)
    """
    w = w.float()
    scales, zeros = [], []
    for rows in w.split(16384):
        wmin, wmax = rows.amin(dim=1), rows.amax(dim=1)
        error = torch.empty_like(rows)
        best = None  # (err, scale, zero)
        for i in range(int(max_shrink * grid) + 1):
            ratio = 1 - i / grid
            scale, zero = qparams_from_range(wmin * ratio, wmax * ratio, scheme)
            s, z = scale[:, None], zero[:, None]
            # |fake_quantize(rows) - rows|^norm, in place
            torch.div(rows, s, out=error).round_().add_(z).clamp_(0, scheme.maxq).sub_(z).mul_(s)
            err = error.sub_(rows).abs_().pow_(norm).sum(1)
            if best is None:
                best = (err, scale, zero)
            else:
                better = err < best[0]
                best = tuple(torch.where(better, new, old) for new, old in zip((err, scale, zero), best))
        scales.append(best[1])
        zeros.append(best[2])
    return torch.cat(scales), torch.cat(zeros)


def group_qparams(w: torch.Tensor, scheme: QuantScheme, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scales and zeros [N, G] for every (row, group) of `w` [N, K]."""
    n, k = w.shape
    width = scheme.group_width(k)
    flat = w.reshape(n * (k // width), width)
    scale, zero = mse_qparams(flat, scheme) if mse else compute_qparams(flat, scheme)
    return scale.view(n, -1), zero.view(n, -1)


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


def quantize_rtn(w: torch.Tensor, scheme: QuantScheme, mse: bool = False, bias: torch.Tensor | None = None,
                 global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of `w` [N, K] (global_scale: NVFP4's shared one, see quantize_fp4_rtn)."""
    n, k = w.shape
    scheme.check(k)
    if scheme.scale_format is not None:
        return quantize_fp4_rtn(w, scheme, bias, global_scale, mse)
    if scheme.type == "float":
        return quantize_float_rtn(w, scheme, bias, mse)
    scales, zeros = group_qparams(w, scheme, mse)
    g_idx = default_g_idx(k, scheme)
    codes = quantize_codes(w.float(), scales[:, g_idx.long()], zeros[:, g_idx.long()], scheme.maxq)
    return QuantizedWeight(codes.to(torch.uint8), scales.float(), zeros.to(torch.int32), g_idx, scheme, bias)


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

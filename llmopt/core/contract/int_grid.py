"""The integer grid: codes 0 .. 2^b - 1 standing for s * (q - z), a scale and a zero point per row and group of
input columns (llmopt.core.contract.weight's convention). Pure tensor functions shared by RTN, GPTQ and AWQ, and
the grid that serves `QuantScheme.type` "int" through them."""

from __future__ import annotations

import torch

from llmopt.core.contract.grid import GridRanges, WeightGrid, register_weight_grid
from llmopt.core.contract.scheme import SUPPORTED_BITS, QuantScheme
from llmopt.core.errors import ConfigError


def compute_qparams(
    w: torch.Tensor, scheme: QuantScheme, clip_ratio: torch.Tensor | float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and unsigned zero point per row of `w` [R, Gw] (one group per row), min/max based.

    clip_ratio ([R] or scalar) shrinks the range toward zero, as found by the MSE/AWQ clip searches.
    """
    w = w.float()
    return qparams_from_range(w.amin(dim=1) * clip_ratio, w.amax(dim=1) * clip_ratio, scheme)


def qparams_from_range(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and unsigned zero point [R] for rows whose values span [wmin, wmax] [R] (0 is kept in range, but for
    a float zero point: see float_zero_qparams)."""
    if scheme.float_zero_point:
        return float_zero_qparams(wmin, wmax, scheme)
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


def float_zero_qparams(wmin: torch.Tensor, wmax: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and real zero point [R] spanning exactly [wmin, wmax] (GGUF Q4_1's choice: the minimum is code 0, the
    maximum code 2^b - 1, 0 need not be in range). Scale and minimum m are rounded to fp16 first, as every format
    stores them (GGUF keeps m itself): z = -m / s then gives back m = -s z to well under fp16's precision."""
    scale = ((wmax - wmin) / scheme.maxq).to(torch.float16).float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    minimum = wmin.to(torch.float16).float()
    return scale, -minimum / scale


def quantize_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int,
                   float_zero: bool = False) -> torch.Tensor:
    """Codes clamp(round(w / s) + z) for `w` [..., C] with scale/zero broadcastable to it; float_zero: a real z,
    clamp(round(w / s + z))."""
    if float_zero:
        return torch.clamp(torch.round(w / scale + zero), 0, maxq)
    return torch.clamp(torch.round(w / scale) + zero, 0, maxq)


def fake_quantize(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: int,
                  float_zero: bool = False) -> torch.Tensor:
    return scale * (quantize_codes(w, scale, zero, maxq, float_zero) - zero)


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
            # an integer zero point's range holds 0 and shrinks toward it; a float one's toward its middle
            centre = (wmin + wmax) / 2 if scheme.float_zero_point else 0.0
            scale, zero = qparams_from_range(centre + (wmin - centre) * ratio, centre + (wmax - centre) * ratio,
                                             scheme)
            s, z = scale[:, None], zero[:, None]
            # |fake_quantize(rows) - rows|^norm, in place
            if scheme.float_zero_point:
                torch.div(rows, s, out=error).add_(z).round_().clamp_(0, scheme.maxq).sub_(z).mul_(s)
            else:
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


@register_weight_grid
class IntGrid(WeightGrid):
    """Integer codes with a scale and an integer (or real: a float zero point scheme) zero point per group."""

    name = "int"
    methods = ("rtn", "gptq", "awq")
    adaptive_groups = True

    def check(self, scheme, in_features, name):
        if scheme.bits not in SUPPORTED_BITS:
            raise ConfigError(f"--bits {scheme.bits} is not supported: choose one of {SUPPORTED_BITS}")

    def ranges(self, w, scheme, mse=False, global_scale=None):
        return GridRanges(*group_qparams(w, scheme, mse))

    def group_ranges(self, rows, scheme, mse=False):
        return mse_qparams(rows, scheme) if mse else compute_qparams(rows, scheme)

    def round(self, values, scale, zero, scheme):
        return quantize_codes(values, scale, zero, scheme.maxq, scheme.float_zero_point)

    def decode(self, codes, zeros, scheme):
        return codes.float() - zeros.float()

    def zero_code(self, zeros):
        return zeros

    def stored_zeros(self, zeros, scheme):
        """int32 codes, or float32 for a float zero point."""
        return zeros.float() if scheme.float_zero_point else zeros.to(torch.int32)

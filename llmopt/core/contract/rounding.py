"""Round-to-nearest onto any weight grid (core.contract.grid): the ranges the grid fixes, each value rounded to
the nearest code. RTN's quantizer, the runtime's quantized head, and the tests' reference."""

from __future__ import annotations

import torch

from llmopt.core.contract.grid import weight_grid
from llmopt.core.contract.scheme import QuantScheme
from llmopt.core.contract.weight import QuantizedWeight, default_g_idx


def quantize_rtn(w: torch.Tensor, scheme: QuantScheme, mse: bool = False, bias: torch.Tensor | None = None,
                 global_scale: torch.Tensor | None = None) -> QuantizedWeight:
    """Round-to-nearest quantization of `w` [N, K] (global_scale: NVFP4's shared one, see
    float_grid.float_block_scales)."""
    k = w.shape[1]
    scheme.check(k)
    grid = weight_grid(scheme.type)
    ranges = grid.ranges(w, scheme, mse, global_scale)
    g_idx = default_g_idx(k, scheme)
    columns = g_idx.long()
    codes = grid.round(w.float(), ranges.effective_scales[:, columns], ranges.zeros[:, columns], scheme)
    return QuantizedWeight(codes.to(torch.uint8), ranges.scales.float(), grid.stored_zeros(ranges.zeros, scheme),
                           g_idx, scheme, bias, global_scale=ranges.global_scale)

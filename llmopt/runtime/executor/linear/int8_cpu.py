"""int8 weights, one scale per output channel, on CPU: aten's int8 weight-only kernel."""

from __future__ import annotations

import torch

from llmopt.runtime.executor.kernels.quant_matmul import int8_matmul, pack_int8
from llmopt.runtime.executor.linear.base import LinearMethod, new_stacked, register_linear_method


@register_linear_method
class Int8PackedLinear(LinearMethod):
    name, priority = "int8-cpu", 10

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        signed, scale, correction = pack_int8(qweight.q, qweight.scales, qweight.zeros, dtype)
        self.register_buffer("signed", signed)
        self.register_buffer("scale", scale)
        self.register_buffer("correction", correction)

    @classmethod
    def accepts(cls, qweight, scheme, device):
        k = qweight.shape[1]
        w = qweight.scheme
        # aten's int8 kernel reads K in vectors of 16 (it crashes on other widths); inputs stay in the compute dtype
        return (device.type == "cpu" and scheme.input_activations is None and qweight.has_trivial_g_idx
                and w.type == "int" and w.bits == 8 and w.group_size in (-1, k) and k % 16 == 0)

    @classmethod
    def stack(cls, parts: list[Int8PackedLinear]) -> Int8PackedLinear:
        """One layer computing cat([part(x) for part in parts], -1) in one kernel call (exact: each output column
        is computed on its own)."""
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        fused.register_buffer("signed", torch.cat([p.signed for p in parts]))
        fused.register_buffer("scale", torch.cat([p.scale for p in parts]))
        corrections = [p.correction if p.correction is not None else torch.zeros_like(p.scale) for p in parts]
        has_correction = any(p.correction is not None for p in parts)
        fused.register_buffer("correction", torch.cat(corrections) if has_correction else None)
        return fused

    @staticmethod
    def can_stack(parts) -> bool:
        first = parts[0]
        return all(type(p) is Int8PackedLinear and p.in_features == first.in_features and p.dtype == first.dtype
                   for p in parts)

    def _matmul(self, x2d):
        return int8_matmul(x2d, self.signed, self.scale, self.correction)

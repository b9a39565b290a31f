"""Quantization-aware distillation of an int-quantized student: the integer codes stay fixed, the group scales and
zero points train (EfficientQAT's second phase). Each forward rebuilds the weight s * (q - z) from them; the
zero point is rounded with a straight-through estimator, so what trains is exactly what the format stores (a float
zero point trains as it is)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.core.contract import QuantizedWeight


def round_ste(x: torch.Tensor) -> torch.Tensor:
    """round(x) forward, identity backward."""
    return x + (torch.round(x) - x).detach()


class FakeQuantLinear(nn.Module):
    """A linear whose weight [N, K] is scales[:, g] * (q - z[:, g]) with q fixed (uint8 buffer), scales [N, G]
    trainable, and zero points [N, G] trainable for asymmetric schemes (fixed at 2^(b-1) for symmetric ones)."""

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.scheme = qweight.scheme
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("q", qweight.q.clone())
        self.register_buffer("g_idx", qweight.g_idx.clone())
        self.scales = nn.Parameter(qweight.scales.float().clone())
        zeros = qweight.zeros.float().clone()
        if qweight.scheme.sym:
            self.register_buffer("zeros", zeros)
        else:
            self.zeros = nn.Parameter(zeros)
        self.bias = None if qweight.bias is None else nn.Parameter(qweight.bias.to(dtype).clone(),
                                                                   requires_grad=False)
        self.compute_dtype = dtype

    def weight_now(self) -> torch.Tensor:
        """[N, K] the weight the current scales and (rounded, clamped) zero points give."""
        g = self.g_idx.long()
        zeros = self.zeros if self.scheme.float_zero_point else round_ste(self.zeros).clamp(0, self.scheme.maxq)
        return self.scales[:, g] * (self.q.float() - zeros[:, g])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight_now().to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def to_quantized(self) -> QuantizedWeight:
        """The trained layer as the contract's QuantizedWeight (same codes, new scales and zero points)."""
        zeros = self.zeros.detach().float().clone()
        if not self.scheme.float_zero_point:
            zeros = torch.round(zeros).clamp(0, self.scheme.maxq).to(torch.int32)
        bias = None if self.bias is None else self.bias.detach().float()
        return QuantizedWeight(self.q.clone(), self.scales.detach().float().clamp_min(1e-10).clone(), zeros,
                               self.g_idx.clone(), self.scheme, bias)

"""FP8 (E4M3) weights, one scale per output channel (or group), on any device: the weight stays in 1-byte E4M3 and
is widened to the compute dtype for each product (no full-precision copy kept: half of bf16's resident bytes);
W8A8-FP8 checkpoints also get their inputs quantized to E4M3 per token, as the checkpoint says
(core.contract.activations). There is no FP8 matrix unit on CPUs: this method saves memory, not time."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.core.contract import fake_quantize_activations
from llmopt.runtime.executor.linear.base import LinearMethod, register_linear_method


@register_linear_method
class Float8WeightLinear(LinearMethod):
    name = "fp8-weight"
    compiled = False  # torch ops: the E4M3 weight widened for each product

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        self.register_buffer("weight_fp8", qweight.q.view(torch.float8_e4m3fn).to(device))  # [N, K]
        self.register_buffer("scale", qweight.scales[:, qweight.g_idx.long()].to(dtype).to(device)
                             if qweight.scales.shape[1] > 1 else qweight.scales.to(dtype).to(device))  # [N, K|1]
        self.input_scheme = qweight.input_activations

    @classmethod
    def accepts(cls, qweight, scheme, device):
        acts = scheme.input_activations
        return qweight.scheme.type == "float" and (acts is None or acts.type == "float")

    def _matmul(self, x2d):
        if self.input_scheme is not None:
            x2d = fake_quantize_activations(x2d, self.input_scheme)
        return F.linear(x2d, self.weight_fp8.to(self.dtype) * self.scale)

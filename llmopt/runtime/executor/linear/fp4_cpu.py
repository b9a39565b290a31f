"""FP4 (E2M1) weights on CPU, NVFP4 or MXFP4: the codes stay packed two per byte and the block scales one byte
each (0.5625 bytes per weight, under a third of bf16's), decoded in registers by the compiled kernels
(kernels/csrc/fp4_cpu.cpp): straight from the codes for few rows (decode), into a reused buffer before the dense
GEMM for more (prefill). Without the compiled kernels each product decodes the weight with torch. There is no FP4
arithmetic on CPUs: this method saves memory and bandwidth, the products run in the compute dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.core.contract.activations import fake_quantize_activations
from llmopt.core.contract.fp4 import e2m1_table, fp4_kernel_operands, unpack_nibbles
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.linear.base import LinearMethod, dequantize_buffer, new_stacked, register_linear_method


@register_linear_method
class Fp4WeightLinear(LinearMethod):
    name, device_type = "fp4-cpu", "cpu"
    dequantize_min_rows = 16  # from here the weight is decoded whole and the dense GEMM runs (as int4-cpu)

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        self.group = qweight.scheme.group_size
        nibbles, scale_bytes, scale_table = fp4_kernel_operands(qweight)
        self.register_buffer("nibbles", nibbles)  # [N, K/2]
        self.register_buffer("scale_bytes", scale_bytes)  # [N, G]
        self.register_buffer("scale_table", scale_table)  # [256]
        # NVFP4 inputs (nvfp4-a4): fake-quantized with their calibrated global scale (no FP4 arithmetic on CPUs)
        self.input_scheme, self.input_global_scale = qweight.input_activations, qweight.input_global_scale

    @classmethod
    def accepts(cls, qweight, scheme, device):
        w, acts = qweight.scheme, scheme.input_activations
        nvfp4_inputs = acts is not None and acts.scale_format == "e4m3" and qweight.input_global_scale is not None
        return ((acts is None or nvfp4_inputs) and w.scale_format is not None
                and qweight.has_trivial_g_idx)

    @staticmethod
    def can_stack(parts) -> bool:
        """q/k/v or gate/up stack when they read their scale bytes through one table: MXFP4 always, NVFP4 when
        they share a global scale (as llmopt and llm-compressor write them)."""
        first = parts[0]
        return all(type(p) is Fp4WeightLinear and p.in_features == first.in_features and p.dtype == first.dtype
                   and p.group == first.group and torch.equal(p.scale_table, first.scale_table)
                   and p.input_scheme == first.input_scheme and _same(p.input_global_scale, first.input_global_scale)
                   for p in parts)

    @classmethod
    def stack(cls, parts: list[Fp4WeightLinear]) -> Fp4WeightLinear:
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        fused.group = parts[0].group
        fused.register_buffer("nibbles", torch.cat([p.nibbles for p in parts]))
        fused.register_buffer("scale_bytes", torch.cat([p.scale_bytes for p in parts]))
        fused.register_buffer("scale_table", parts[0].scale_table)
        fused.input_scheme, fused.input_global_scale = parts[0].input_scheme, parts[0].input_global_scale
        return fused

    def dequantize(self) -> torch.Tensor:
        """[N, K] the weight in the compute dtype, torch only (the reference the kernels are tested against)."""
        values = e2m1_table()[unpack_nibbles(self.nibbles).long()]  # [N, K] fp32
        scales = self.scale_table[self.scale_bytes.long()].repeat_interleave(self.group, dim=1)
        return (values * scales).to(self.dtype)

    def _matmul(self, x2d):
        if self.input_scheme is not None:
            x2d = fake_quantize_activations(x2d, self.input_scheme, self.input_global_scale)
        ops = cpu_ops()
        if ops is None:
            return F.linear(x2d, self.dequantize())
        if x2d.shape[0] < self.dequantize_min_rows:
            return ops.fp4_matmul_rows(x2d, self.nibbles, self.scale_bytes, self.scale_table, self.group)
        weight = dequantize_buffer(self.out_features * self.in_features, self.dtype)
        weight = weight.view(self.out_features, self.in_features)
        ops.fp4_dequantize_out(self.nibbles, self.scale_bytes, self.scale_table, self.group, weight)
        return F.linear(x2d, weight)


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))

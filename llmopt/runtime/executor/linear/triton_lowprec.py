"""CUDA: low-precision checkpoints on the Triton kernels of kernels/triton_lowprec.py.
- `w8a8-triton`: W8A8 int8 or FP8 — each token's inputs quantized (core.contract.activations' formulas, per token),
  the 8-bit product on the tensor cores (int32 or fp32 sums), scaled back by the token's and the channel's scales;
- `float-weight-triton`: FP8 / NVFP4 / MXFP4 weights with inputs in the compute dtype, decoded in registers (the
  weight stays 1 or 0.5625 bytes per value in memory)."""

from __future__ import annotations

import torch

from llmopt.core.contract import FP8_TOKEN_ACTIVATIONS, INT8_TOKEN_ACTIVATIONS, quantize_activations
from llmopt.core.contract.activations import quantize_activations_fp8
from llmopt.core.contract.fp4 import fp4_kernel_operands
from llmopt.runtime.executor.linear.base import LinearMethod, fp8_tensor_cores, register_linear_method, triton_installed


@register_linear_method
class TritonW8A8Linear(LinearMethod):
    name, device_type = "w8a8-triton", "cuda"
    quantized_inputs = True
    available = staticmethod(triton_installed)

    def __init__(self, qweight, dtype, device):
        super().__init__(qweight, dtype, device)
        self.input_scheme = qweight.input_activations
        if qweight.scheme.type == "float":
            weight = qweight.q.view(torch.float8_e4m3fn)  # [N, K] E4M3
        else:
            weight = qweight.signed_codes()  # [N, K]
        self.register_buffer("weight", weight.contiguous().to(device))
        self.register_buffer("weight_scale", qweight.scales.reshape(-1).float().to(device))  # [N]

    @classmethod
    def accepts(cls, qweight, scheme, device):
        w, acts = qweight.scheme, scheme.input_activations
        int8 = acts == INT8_TOKEN_ACTIVATIONS and w.type == "int" and w.bits == 8 and w.sym
        fp8 = acts == FP8_TOKEN_ACTIVATIONS and w.type == "float" and w.bits == 8 and fp8_tensor_cores(device)
        return ((int8 or fp8) and w.strategy == "channel" and qweight.has_trivial_g_idx)

    def _matmul(self, x2d):
        from llmopt.runtime.executor.kernels.triton_lowprec import scaled_matmul

        quantize = quantize_activations_fp8 if self.weight.dtype == torch.float8_e4m3fn else quantize_activations
        codes, scale = quantize(x2d, self.input_scheme)  # [M, 1, K], [M, 1, 1]
        return scaled_matmul(codes.reshape(x2d.shape), self.weight, scale.reshape(-1), self.weight_scale, self.dtype)


@register_linear_method
class TritonFloatWeightLinear(LinearMethod):
    name, device_type = "float-weight-triton", "cuda"
    available = staticmethod(triton_installed)

    def __init__(self, qweight, dtype, device):
        super().__init__(qweight, dtype, device)
        scheme = qweight.scheme
        self.group = scheme.group_width(self.in_features)
        if scheme.scale_format is not None:  # FP4: codes two a byte, scale bytes through their table
            for name, tensor in zip(("weight", "scales", "scale_table"), fp4_kernel_operands(qweight)):
                self.register_buffer(name, tensor.to(device))
        else:
            self.register_buffer("weight", qweight.q.view(torch.float8_e4m3fn).contiguous().to(device))
            self.register_buffer("scales", qweight.scales.float().contiguous().to(device))
            self.scale_table = None

    @classmethod
    def accepts(cls, qweight, scheme, device):
        w = qweight.scheme
        fp4 = w.scale_format is not None  # (FP8 values are converted by the GPU's FP8 unit: 8.9 and later)
        return (scheme.input_activations is None and w.type == "float" and qweight.has_trivial_g_idx
                and qweight.shape[1] % 16 == 0 and (fp4 or fp8_tensor_cores(device)))

    def _matmul(self, x2d):
        from llmopt.runtime.executor.kernels.triton_lowprec import float_weight_matmul

        return float_weight_matmul(x2d, self.weight, self.scales, self.group, self.scale_table)

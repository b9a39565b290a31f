"""CUDA: codes of <= 4 bits dequantized in registers by the Triton W4A16 kernel."""

from __future__ import annotations

from llmopt.runtime.executor.linear.base import LinearMethod, register_linear_method, triton_installed


@register_linear_method
class TritonW4A16Linear(LinearMethod):
    name, device_type = "w4a16-triton", "cuda"
    available = staticmethod(triton_installed)

    def __init__(self, qweight, dtype, device):
        super().__init__(qweight, dtype, device)
        from llmopt.runtime.executor.kernels.triton_w4a16 import pack_w4a16

        self.group_size = qweight.scheme.group_width(self.in_features)
        qw, scales, zeros = pack_w4a16(qweight.q.to(device), qweight.scales.to(device), qweight.zeros.to(device),
                                       dtype)
        self.register_buffer("qweight", qw)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    @classmethod
    def accepts(cls, qweight, scheme, device):
        w = qweight.scheme
        return (scheme.input_activations is None and qweight.has_trivial_g_idx
                and w.type == "int" and w.bits <= 4 and qweight.shape[1] % 8 == 0)

    def _matmul(self, x2d):
        from llmopt.runtime.executor.kernels.triton_w4a16 import w4a16_matmul

        return w4a16_matmul(x2d, self.qweight, self.scales, self.zeros, self.group_size)

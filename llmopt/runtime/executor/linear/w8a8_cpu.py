"""W8A8 int8 on CPU: per-channel symmetric int8 weights, inputs quantized per token at run time (symmetric int8,
core.contract.activations' formula) and multiplied in integers, the int32 sums scaled back by the token's and the
channel's scales: up to GEMV_MAX_ROWS rows (decode) by the compiled int8 GEMV (kernels/csrc/int8_cpu.cpp: the
weight read once for every row, VNNI dot products where the CPU has them), more rows by an integer GEMM between the
compiled quantization and epilogue: on CPUs with AMX-INT8 oneDNN's on a weight prepacked once at load
(`onednn.qlinear_pointwise`, its output float(sum) * channel scale, then the token's scale), elsewhere
`torch._int_mm` (oneDNN's s8s8s32 GEMM packing the weight per call) where it returns exact sums (`int_mm_exact`),
else a float64 matmul of the codes (exact too: every partial sum is an integer below 2**53).

y[m, n] = (sum_k xq[m, k] * wq[n, k]) * sx[m] * sw[n]   (+ bias)"""

from __future__ import annotations

import torch

from functools import cache

from llmopt.core.contract import INT8_TOKEN_ACTIVATIONS, quantize_activations
from llmopt.core.hardware import usable_features
from llmopt.runtime.executor.kernels.cpu_ops import GEMV_MAX_ROWS, cpu_ops
from llmopt.runtime.executor.linear.base import LinearMethod, new_stacked, register_linear_method


@cache
def onednn_int8_gemm() -> bool:
    """Whether more than GEMV_MAX_ROWS rows go to oneDNN's prepacked int8 GEMM: where the CPU has AMX-INT8 tiles
    (measured ~1.4x `torch._int_mm` at 1,024 rows on SmolLM2's shapes, docs/results/lowprec.md) and torch has
    the op."""
    return "amx_int8" in usable_features() and hasattr(torch.ops.onednn, "qlinear_pointwise")


@cache
def int_mm_exact() -> bool:
    """Whether `torch._int_mm` returns exact int32 sums on this machine, checked once on inputs at both ends of
    int8's range. Under `ONEDNN_MAX_CPU_ISA=AVX2` on an AVX-512-VNNI CPU (the AVX2 simulation) torch 2.13's
    oneDNN shifted the inputs to u8 and summed byte products pairwise in saturating int16 (vpmaddubsw): sums off
    by up to ~1e5 at 576 columns. The kernels' tests that compare against it pass on real AVX2-only and VNNI
    CPUs."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(-128, 128, (32, 256), generator=g, dtype=torch.int8)
    w = torch.randint(-128, 128, (256, 32), generator=g, dtype=torch.int8)
    a[0], w[:, 0] = -128, -128  # the largest pair products, 2 x 16384
    a[1], w[:, 1] = 127, -128
    return torch.equal(torch._int_mm(a, w), exact_int_matmul(a, w))


def exact_int_matmul(codes: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """[M, K] int8 @ [K, N] int8 -> [M, N] int32 in float64 (|sums| <= K * 2**14: exact for any K below 2**39)."""
    return torch.matmul(codes.double(), weight_t.double()).to(torch.int32)


def integer_matmul(codes: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """codes [M, K] int8 @ weight_t [K, N] int8 -> [M, N] int32, exact: `torch._int_mm` where it is exact here."""
    return torch._int_mm(codes, weight_t) if int_mm_exact() else exact_int_matmul(codes, weight_t)


@register_linear_method
class Int8W8A8Linear(LinearMethod):
    name, device_type = "w8a8-int8-cpu", "cpu"
    quantized_inputs = True

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        codes = qweight.signed_codes()  # [N, K]
        self.register_buffer("weight", codes.contiguous().to(device))  # [N, K]; its .t() is _int_mm's operand
        self.register_buffer("weight_sum", codes.sum(dim=1, dtype=torch.int32).to(device))  # [N]: the GEMV's
        self.register_buffer("weight_scale", qweight.scales.reshape(-1).float().to(device))  # [N]
        self.input_scheme = qweight.input_activations
        self._prepack()

    def _prepack(self) -> None:
        """The weight in oneDNN's blocked layout for its AMX-INT8 GEMM (None where it is not used)."""
        use = onednn_int8_gemm()  # (a CPU method: device_type)
        self.packed = torch.ops.onednn.qlinear_prepack(self.weight, None) if use else None
        self.zero_points = torch.zeros(self.out_features, dtype=torch.long) if use else None

    @classmethod
    def accepts(cls, qweight, scheme, device):
        w, acts = qweight.scheme, scheme.input_activations
        return (acts == INT8_TOKEN_ACTIVATIONS and w.type == "int" and w.bits == 8
                and w.sym and w.strategy == "channel" and qweight.has_trivial_g_idx)

    @staticmethod
    def can_stack(parts) -> bool:
        first = parts[0]
        return all(type(p) is Int8W8A8Linear and p.in_features == first.in_features and p.dtype == first.dtype
                   for p in parts)

    @classmethod
    def stack(cls, parts: list[Int8W8A8Linear]) -> Int8W8A8Linear:
        """q/k/v or gate/up as one integer GEMM (exact: each output column is computed on its own, and the inputs'
        per-token scales do not depend on the weights)."""
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        fused.register_buffer("weight", torch.cat([p.weight for p in parts]))
        fused.register_buffer("weight_sum", torch.cat([p.weight_sum for p in parts]))
        fused.register_buffer("weight_scale", torch.cat([p.weight_scale for p in parts]))
        fused.input_scheme = parts[0].input_scheme
        fused._prepack()
        return fused

    def _matmul(self, x2d):
        ops = cpu_ops()
        if ops is not None and x2d.shape[0] <= GEMV_MAX_ROWS:  # decode: one pass over the weight
            return ops.int8_gemv_rows(x2d, self.weight, self.weight_scale, self.weight_sum, self.dtype)
        if ops is not None and self.packed is not None:  # AMX-INT8 on the prepacked weight, the same numbers
            codes, scale = ops.quantize_rows_int8(x2d)  # [M, K] int8, [M] float32
            y = torch.ops.onednn.qlinear_pointwise(codes, 1.0, 0, self.packed, self.weight_scale, self.zero_points,
                                                   None, 1.0, 0, torch.float32, "none", [], "")  # [M, N] sum * sw
            y = y.mul_(scale.unsqueeze(1))
            return y if y.dtype == self.dtype else y.to(self.dtype)
        if ops is not None:  # the compiled halves (kernels/csrc/int8_cpu.cpp): one pass each, same numbers
            codes, scale = ops.quantize_rows_int8(x2d)  # [M, K] int8, [M] float32
            return ops.scale_int32_rows(integer_matmul(codes, self.weight.t()), scale, self.weight_scale, self.dtype)
        codes, scale = quantize_activations(x2d, self.input_scheme)  # [M, 1, K] int8, [M, 1, 1]
        acc = integer_matmul(codes.reshape(x2d.shape), self.weight.t())  # [M, N] int32
        # int32 x float -> float in one pass, then the tokens' scales in place
        y = torch.mul(acc, self.weight_scale).mul_(scale.reshape(-1, 1))
        return y if y.dtype == self.dtype else y.to(self.dtype)

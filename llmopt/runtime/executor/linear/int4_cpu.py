"""Codes of <= 4 bits on CPU: aten's int4 layout for bf16 decode, the compiled kernels (kernels/csrc/int4_cpu.cpp)
for fp32 / fp16 rows and for dequantizing whole weights before a dense GEMM at prefill sizes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.kernels.quant_matmul import (
    can_pack_int4, int4_dequantize, int4_group_size, int4_matmul, pack_int4, pack_int4_codes, pack_nibbles,
    unpack_nibbles,
)
from llmopt.runtime.executor.linear.base import LinearMethod, dequantize_buffer, new_stacked, register_linear_method


@register_linear_method
class Int4PackedLinear(LinearMethod):
    """aten's int4 kernel for few rows (decode: it reads 4-bit weights, the memory-bound case); for more rows
    (prefill, decode batches of 16+) the weight is dequantized whole and multiplied by the dense GEMM, which on
    CPUs with bf16 matrix units is several times faster than the int4 kernel there (docs/results/runtime.md).
    The plain nibble copy for that costs another half byte per weight."""

    name, priority = "int4-cpu", 10
    # two copies of the codes, one read per step (aten's layout for bf16 decode, nibbles otherwise; the same
    # size): eval.speed.model_cost counts one
    prefill_only_buffers = ("nibbles",)
    dequantize_min_rows = 256  # the measured crossover on SmolLM2's shapes, bf16, 2 cores (benchmarks/int4_matmul.py)
    # the same with the compiled dequantization (kernels/csrc/int4_cpu.cpp, ~30x faster than the torch one)
    compiled_dequantize_min_rows = 16

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        packed, scales_and_offsets, self.kernel_group = pack_int4(
            qweight.q, qweight.scales, qweight.zeros, qweight.scheme.group_size, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_offsets", scales_and_offsets)
        self.register_buffer("nibbles", pack_nibbles(qweight.q))

    @classmethod
    def accepts(cls, qweight, scheme, device):
        n, k = qweight.shape
        w = qweight.scheme
        return (device.type == "cpu" and scheme.input_activations is None and qweight.has_trivial_g_idx
                and w.type == "int" and can_pack_int4(n, k, w.bits, w.group_size))

    @classmethod
    def stack(cls, parts: list[Int4PackedLinear]) -> Int4PackedLinear:
        """One layer computing cat([part(x) for part in parts], -1) in one kernel call (q/k/v, gate/up): the
        parts' rows stacked. Exact: the kernel computes each output column on its own. Needs the same
        in_features, kernel group and dtype (`can_stack`)."""
        nibbles = torch.cat([p.nibbles for p in parts])  # [sum N, K/2]
        fused = new_stacked(cls, parts[0], nibbles.shape[0], parts)
        fused.kernel_group = parts[0].kernel_group
        fused.register_buffer("packed", pack_int4_codes(unpack_nibbles(nibbles)))
        fused.register_buffer("scales_and_offsets", torch.cat([p.scales_and_offsets for p in parts], dim=1))
        fused.register_buffer("nibbles", nibbles)
        return fused

    @classmethod
    def can_stack(cls, parts) -> bool:
        first = parts[0]
        return all(type(p) is cls and p.in_features == first.in_features and p.dtype == first.dtype
                   and p.kernel_group == first.kernel_group for p in parts)

    def _few_rows(self, ops, x2d):
        """fp32 / fp16 rows straight from the codes (aten's kernel serves bf16 well, fp32 ~20x slower)."""
        return ops.int4_matmul_rows(x2d, self.nibbles, self.scales_and_offsets, self.kernel_group)

    def _matmul(self, x2d):
        rows = x2d.shape[0]
        ops = cpu_ops() if x2d.device.type == "cpu" else None
        if ops is not None and rows < self.compiled_dequantize_min_rows and x2d.dtype != torch.bfloat16:
            return self._few_rows(ops, x2d)
        if ops is not None and rows >= self.compiled_dequantize_min_rows:
            # one compiled pass into a reused buffer, then the dense GEMM
            weight = dequantize_buffer(self.out_features * self.in_features, self.scales_and_offsets.dtype)
            weight = weight.view(self.out_features, self.in_features)
            ops.int4_dequantize_out(self.nibbles, self.scales_and_offsets, self.kernel_group, weight)
            return F.linear(x2d, weight)
        if rows >= self.dequantize_min_rows:
            return F.linear(x2d, int4_dequantize(self.nibbles, self.scales_and_offsets, self.kernel_group))
        return int4_matmul(x2d, self.packed, self.scales_and_offsets, self.kernel_group)


@register_linear_method
class Int4Q8Linear(Int4PackedLinear):
    """The int4 layer with 8-bit inputs at few rows: each group of 64 inputs rounded to int8 with one symmetric
    scale (dynamic, per row), integer dot products with the codes, as llama.cpp's Q8 activations do: ~1% relative
    error per output for ~25% less time per token on AVX2 (docs/results/cpu.md). Chosen by the scheme
    (`--int4-activations int8`: core.contract.INT8_GROUP_ACTIVATIONS), never by default."""

    name, priority = "int4-q8-cpu", 20

    @classmethod
    def accepts(cls, qweight, scheme, device):
        acts = scheme.input_activations
        if acts is None or not (acts.type == "int" and acts.bits == 8 and acts.dynamic and acts.sym):
            return False
        plain = type(scheme)(scheme.weights, None)
        if not Int4PackedLinear.accepts(qweight, plain, device):
            return False
        # the kernel's activation groups of 64 never straddle a kernel group
        return int4_group_size(qweight.shape[1], qweight.scheme.group_size) % 64 == 0

    def _few_rows(self, ops, x2d):
        return ops.int4_matmul_rows_q8(x2d, self.nibbles, self.scales_and_offsets, self.kernel_group)

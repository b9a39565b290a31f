"""The runtime's Linear layers for quantized weights, built from a `QuantizedWeight` at load time.

`quantized_linear` picks the fastest layout the weight and device allow: int4-packed (codes of <= 4 bits,
groups aten's kernel can express), int8-packed (8-bit per channel), else a dense weight dequantized once
(act-order checkpoints with permuted groups, odd shapes); on CUDA the Triton W4A16 layer.
"""

from __future__ import annotations

import os
import threading

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.core.contract import QuantizedWeight
from llmopt.runtime.executor.kernels.cpu_ops import GEMV_BATCHED_ROWS, cpu_ops
from llmopt.runtime.executor.kernels.quant_matmul import (
    can_pack_int4, int4_dequantize, int4_matmul, int8_matmul, pack_int4, pack_int4_codes, pack_int8, pack_nibbles,
    unpack_nibbles,
)


class _QuantLinearBase(nn.Module):
    kind = "base"

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.dtype = dtype
        self.bias = None if qweight.bias is None else nn.Parameter(qweight.bias.to(dtype), requires_grad=False)

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        # (dtype casts only when needed: at batch-1 decode each no-op call still costs a few us, x 120 per step)
        y = self._matmul(x2d if x2d.dtype == self.dtype else x2d.to(self.dtype))
        if self.bias is not None:
            y = y + self.bias
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, kind={self.kind}"


class Int4PackedLinear(_QuantLinearBase):
    """aten's int4 kernel for few rows (decode: it reads 4-bit weights, the memory-bound case); for more rows
    (prefill, decode batches of 16+) the weight is dequantized whole and multiplied by the dense GEMM, which on
    CPUs with bf16 matrix units is several times faster than the int4 kernel there (docs/results/runtime.md).
    The plain nibble copy for that costs another half byte per weight."""

    kind = "int4"
    # two copies of the codes, one read per step (aten's layout for bf16 decode, nibbles otherwise; the same
    # size): eval.speed.model_cost counts one
    prefill_only_buffers = ("nibbles",)
    dequantize_min_rows = 256  # the measured crossover on SmolLM2's shapes, bf16, 2 cores (benchmarks/int4_matmul.py)
    # the same with the compiled dequantization (kernels/csrc/int4_cpu.cpp, ~30x faster than the torch one)
    compiled_dequantize_min_rows = 16

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qweight, dtype)
        packed, scales_and_offsets, self.kernel_group = pack_int4(
            qweight.q, qweight.scales, qweight.zeros, qweight.scheme.group_size, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_offsets", scales_and_offsets)
        self.register_buffer("nibbles", pack_nibbles(qweight.q))

    @classmethod
    def stack(cls, parts: list["Int4PackedLinear"]) -> "Int4PackedLinear":
        """One layer computing cat([part(x) for part in parts], -1) in one kernel call (q/k/v, gate/up): the
        parts' rows stacked. Exact: the kernel computes each output column on its own. Needs the same
        in_features, kernel group and dtype (`can_stack`)."""
        nibbles = torch.cat([p.nibbles for p in parts])  # [sum N, K/2]
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        first = parts[0]
        fused.in_features, fused.out_features = first.in_features, nibbles.shape[0]
        fused.dtype, fused.kernel_group = first.dtype, first.kernel_group
        fused.bias = _stacked_bias(parts, first.dtype)
        fused.register_buffer("packed", pack_int4_codes(unpack_nibbles(nibbles)))
        fused.register_buffer("scales_and_offsets", torch.cat([p.scales_and_offsets for p in parts], dim=1))
        fused.register_buffer("nibbles", nibbles)
        return fused

    @staticmethod
    def can_stack(parts: list[nn.Module]) -> bool:
        first = parts[0]
        return all(type(p) is Int4PackedLinear and p.in_features == first.in_features and p.dtype == first.dtype
                   and p.kernel_group == first.kernel_group for p in parts)

    def _matmul(self, x2d):
        rows = x2d.shape[0]
        ops = cpu_ops() if x2d.device.type == "cpu" else None
        if ops is not None and rows < self.compiled_dequantize_min_rows and x2d.dtype != torch.bfloat16:
            # few rows in fp32 / fp16: straight from the codes (aten's kernel serves bf16 well, fp32 ~20x slower);
            # with LLMOPT_INT4_ACTIVATIONS=int8 the inputs are rounded to 8 bits and multiplied as integers
            if int8_activations() and self.kernel_group % 64 == 0:
                return ops.int4_matmul_rows_q8(x2d, self.nibbles, self.scales_and_offsets, self.kernel_group)
            return ops.int4_matmul_rows(x2d, self.nibbles, self.scales_and_offsets, self.kernel_group)
        if ops is not None and rows >= self.compiled_dequantize_min_rows:
            # one compiled pass into a reused buffer, then the dense GEMM
            weight = _dequantize_buffer(self.out_features * self.in_features, self.scales_and_offsets.dtype)
            weight = weight.view(self.out_features, self.in_features)
            ops.int4_dequantize_out(self.nibbles, self.scales_and_offsets, self.kernel_group, weight)
            return F.linear(x2d, weight)
        if rows >= self.dequantize_min_rows:
            return F.linear(x2d, int4_dequantize(self.nibbles, self.scales_and_offsets, self.kernel_group))
        return int4_matmul(x2d, self.packed, self.scales_and_offsets, self.kernel_group)


_buffers = threading.local()


def int8_activations() -> bool:
    """LLMOPT_INT4_ACTIVATIONS=int8: int4 layers at few rows in fp32 / fp16 round their inputs to 8 bits per group
    and multiply integers (as llama.cpp does with its Q8 activations): ~1% relative error in each output for
    ~25% less time per token on AVX2 (docs/results/cpu.md). Off by default: the runtime keeps the artifact's
    numerics unless asked."""
    return os.environ.get("LLMOPT_INT4_ACTIVATIONS", "float") == "int8"


def _dequantize_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread scratch buffer for one dequantized weight at a time (the GEMM reading it finishes before
    the next layer dequantizes): no allocation, and no page faults on fresh memory, per call."""
    buf = getattr(_buffers, "dequantized", None)
    if buf is None or buf.numel() < numel or buf.dtype != dtype:
        buf = _buffers.dequantized = torch.empty(numel, dtype=dtype)
    return buf[:numel]


class Int8PackedLinear(_QuantLinearBase):
    kind = "int8"

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype):
        super().__init__(qweight, dtype)
        signed, scale, correction = pack_int8(qweight.q, qweight.scales, qweight.zeros, dtype)
        self.register_buffer("signed", signed)
        self.register_buffer("scale", scale)
        self.register_buffer("correction", correction)

    @classmethod
    def stack(cls, parts: list["Int8PackedLinear"]) -> "Int8PackedLinear":
        """One layer computing cat([part(x) for part in parts], -1) in one kernel call (exact, as for int4)."""
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        first = parts[0]
        fused.in_features, fused.dtype = first.in_features, first.dtype
        fused.out_features = sum(p.out_features for p in parts)
        fused.bias = _stacked_bias(parts, first.dtype)
        fused.register_buffer("signed", torch.cat([p.signed for p in parts]))
        fused.register_buffer("scale", torch.cat([p.scale for p in parts]))
        corrections = [p.correction if p.correction is not None else torch.zeros_like(p.scale) for p in parts]
        has_correction = any(p.correction is not None for p in parts)
        fused.register_buffer("correction", torch.cat(corrections) if has_correction else None)
        return fused

    @staticmethod
    def can_stack(parts: list[nn.Module]) -> bool:
        first = parts[0]
        return all(type(p) is Int8PackedLinear and p.in_features == first.in_features and p.dtype == first.dtype
                   for p in parts)

    def _matmul(self, x2d):
        return int8_matmul(x2d, self.signed, self.scale, self.correction)


def _stacked_bias(parts: list[nn.Module], dtype: torch.dtype) -> nn.Parameter | None:
    if all(p.bias is None for p in parts):
        return None
    bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=dtype) for p in parts])
    return nn.Parameter(bias, requires_grad=False)


class TritonW4A16Linear(_QuantLinearBase):
    """CUDA: codes of <= 4 bits dequantized in registers by the Triton W4A16 kernel."""

    kind = "w4a16"

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype, device: torch.device | str):
        super().__init__(qweight, dtype)
        from llmopt.runtime.executor.kernels.triton_w4a16 import pack_w4a16

        self.group_size = qweight.scheme.group_width(self.in_features)
        qw, scales, zeros = pack_w4a16(qweight.q.to(device), qweight.scales.to(device), qweight.zeros.to(device),
                                       dtype)
        self.register_buffer("qweight", qw)
        self.register_buffer("scales", scales)
        self.register_buffer("zeros", zeros)

    def _matmul(self, x2d):
        from llmopt.runtime.executor.kernels.triton_w4a16 import w4a16_matmul

        return w4a16_matmul(x2d, self.qweight, self.scales, self.zeros, self.group_size)


def packed_kind(qweight: QuantizedWeight, device: torch.device | str) -> str:
    """'int4', 'int8', 'w4a16' or 'dense': which layer `quantized_linear` builds for this weight on this device."""
    if not qweight.has_trivial_g_idx:
        return "dense"
    n, k = qweight.shape
    if torch.device(device).type == "cuda":
        from llmopt.runtime.executor.kernels.attention import triton_available

        return "w4a16" if qweight.scheme.bits <= 4 and k % 8 == 0 and triton_available() else "dense"
    if torch.device(device).type != "cpu":
        return "dense"
    if can_pack_int4(n, k, qweight.scheme.bits, qweight.scheme.group_size):
        return "int4"
    # aten's int8 kernel reads K in vectors of 16 (it crashes on other widths)
    if qweight.scheme.bits == 8 and qweight.scheme.group_size in (-1, k) and k % 16 == 0:
        return "int8"
    return "dense"


def quantized_linear(qweight: QuantizedWeight, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    kind = packed_kind(qweight, device)
    if kind == "int4":
        return Int4PackedLinear(qweight, dtype)
    if kind == "int8":
        return Int8PackedLinear(qweight, dtype)
    if kind == "w4a16":
        return TritonW4A16Linear(qweight, dtype, device)
    n, k = qweight.shape
    dense = nn.Linear(k, n, bias=qweight.bias is not None, dtype=dtype, device=device)
    with torch.no_grad():
        dense.weight.copy_(qweight.dequantize(dtype))
        if qweight.bias is not None:
            dense.bias.copy_(qweight.bias.to(dtype))
    return dense.requires_grad_(False)


# --- dense projections fused for the runtime --------------------------------------------------------
def _mkldnn_bf16() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class ConcatLinears(nn.Module):
    """Several linears fed the same input, outputs concatenated: exact (each runs as it would alone)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class FusedDenseLinear(nn.Module):
    """Dense linears fed the same input as one matmul over their stacked weights; on CPU in bf16 the weight is
    prepacked into oneDNN's blocked layout once (2-3x faster at decode batch sizes than plain F.linear)."""

    PACK_BATCH_HINT = 256  # oneDNN picks its blocking for this M; measured best over M in 1..2048

    def __init__(self, parts: list[nn.Linear], prepack: bool):
        super().__init__()
        weight = torch.cat([p.weight.detach() for p in parts], dim=0)
        has_bias = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias.detach() if p.bias is not None else weight.new_zeros(p.out_features)
                          for p in parts]) if has_bias else None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.packed = prepack and weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and _mkldnn_bf16()
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_BATCH_HINT)
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)

    def forward_2d(self):
        """A callable for [T, in] inputs, with the weight bound: the decoder's fast loop calls 120 of these per
        step, where the module's attribute lookups and reshapes cost ~10 us each."""
        if not self.packed:
            # fp32 (or no oneDNN bf16): the plain GEMM; MKL's packed sgemm measured no faster at these shapes
            linear, weight, bias = F.linear, self.weight, self.bias
            ops = cpu_ops() if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
            if ops is None or weight.shape[0] < weight.shape[1]:
                return lambda x: linear(x, weight, bias)
            # a few rows (speculative verification at batch 1) of a wide weight: gemv (kernels.cpu_ops)
            gemv, few = ops.gemv, GEMV_BATCHED_ROWS

            def few_rows_or_gemm(x):
                if x.shape[0] in few:
                    y = gemv(x, weight)
                    return y if bias is None else y + bias
                return linear(x, weight, bias)

            return few_rows_or_gemm
        linear, weight, bias = torch.ops.mkldnn._linear_pointwise, self.weight, self.bias
        return lambda x: linear(x, weight, bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            lead = x.shape[:-1]
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.weight, self.bias,
                                                   "none", [], "")
            return y.reshape(*lead, self.out_features)
        return F.linear(x, self.weight, self.bias)


def fuse_linears(parts: list[nn.Module], prepack: bool) -> nn.Module:
    """One module computing cat([part(x) for part in parts], -1).

    prepack=False keeps each part's own numerics (a single part is returned as is); prepack=True stacks dense
    parts into one (prepacked) matmul, and int4 / int8 packed parts into one kernel call (exact). Other
    quantized parts run as themselves."""
    dense = all(type(p) is nn.Linear for p in parts)
    if prepack and dense:
        return FusedDenseLinear(parts, prepack=True)
    if prepack and len(parts) > 1:
        for packed in (Int4PackedLinear, Int8PackedLinear):
            if packed.can_stack(parts):
                return packed.stack(parts)
    return parts[0] if len(parts) == 1 else ConcatLinears(parts)

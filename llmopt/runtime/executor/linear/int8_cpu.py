"""int8 weights, one scale per output channel, on CPU: the compiled kernels (kernels/csrc/int8_weight_cpu.cpp) for
few rows and, tile by tile, for batches; the whole weight dequantized before one GEMM for prefill chunks; aten's
int8 weight-only kernel for bf16 inputs and where the compiled kernels are absent. With 8-bit inputs (the engine's
--input-activations int8, the CPU default) integer dot products (kernels/csrc/int8_q8_cpu.cpp), which also take
symmetric weights with a scale per group of columns (GPTQ's 8-bit groups, a logits head rounded per 32 columns)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.kernels.quant_matmul import (
    int8_group_scales,
    int8_matmul,
    int8_scale_shift,
    int8_zeros_symmetric,
    pack_int8,
    pack_int8_panels,
    pack_int8_q8,
)
from llmopt.runtime.executor.linear.base import LinearMethod, dequantize_buffer, new_stacked, register_linear_method
from llmopt.runtime.executor.linear.q8_inputs import Q8InputsMixin, takes_int8_inputs
from llmopt.runtime.executor.linear.kernel_plans import TILE_BYTES, RowPathsMixin


def cat_optional(values: list[torch.Tensor | None], likes: list[torch.Tensor]) -> torch.Tensor | None:
    """The parts' optional per-output terms (zero-point corrections) side by side, a part without one
    contributing zeros shaped as its `likes` entry; None when no part has one."""
    if all(v is None for v in values):
        return None
    return torch.cat([v if v is not None else torch.zeros_like(like) for v, like in zip(values, likes)])


@register_linear_method
class Int8PackedLinear(RowPathsMixin, LinearMethod):
    name, device_type = "int8-cpu", "cpu"
    prefill_only_buffers = ("panel_codes",)  # another layout of the codes: eval.bench.model_cost counts one

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        signed, scale, correction = pack_int8(qweight.q, qweight.scales, qweight.zeros, dtype)
        self.register_buffer("signed", signed)
        self.register_buffer("scale", scale)
        self.register_buffer("correction", correction)
        self._register_panels()

    def _register_panels(self):
        """The codes in panels of 16 outputs for the batched path (another byte per weight), where N allows."""
        panels = pack_int8_panels(self.signed) if self.out_features % 16 == 0 else None
        self.register_buffer("panel_codes", panels)

    @classmethod
    def accepts(cls, qweight, scheme, device):
        k = qweight.shape[1]
        w = qweight.scheme
        # aten's int8 kernel reads K in vectors of 16 (it crashes on other widths); inputs stay in the compute dtype
        return (scheme.input_activations is None and qweight.has_trivial_g_idx
                and w.type == "int" and w.bits == 8 and w.group_size in (-1, k) and k % 16 == 0)

    @classmethod
    def stack(cls, parts: list[Int8PackedLinear]) -> Int8PackedLinear:
        """One layer computing cat([part(x) for part in parts], -1) in one kernel call (exact: each output column
        is computed on its own)."""
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        fused.register_buffer("signed", torch.cat([p.signed for p in parts]))
        fused.register_buffer("scale", torch.cat([p.scale for p in parts]))
        fused.register_buffer("correction", cat_optional([p.correction for p in parts], [p.scale for p in parts]))
        fused._register_panels()
        return fused

    @staticmethod
    def can_stack(parts) -> bool:
        first = parts[0]
        return all(type(p) is type(first) and p.in_features == first.in_features and p.dtype == first.dtype
                   for p in parts)  # (Int8Q8Linear's parts too: each class stacks only its own)

    # --- paths (kernel_plans.py) --------------------------------------------------------------------------------
    def row_paths(self) -> dict[str, int | None]:
        if cpu_ops() is None:
            return {"aten": None}
        paths = {"rows": 16, "tiled": None, "dequantize": None}
        if self.panel_codes is not None:
            paths["panels"] = 128
        if self.dtype == torch.bfloat16:
            paths["aten"] = None  # (with fp32 inputs aten's kernel is 10-100x slower than these)
        return paths

    def default_path(self, rows: int) -> str:
        if cpu_ops() is None:
            return "aten"
        return "rows" if rows <= 8 else "tiled"

    def _path_rows(self, x2d):
        """The codes read once for all rows, widened in registers (decode)."""
        return cpu_ops().int8_matmul_rows(x2d, self.signed, self.scale, self.correction)

    def _bind_rows(self):
        op, signed, scale, correction = cpu_ops().int8_matmul_rows.default, self.signed, self.scale, self.correction
        return lambda x2d: op(x2d, signed, scale, correction)

    def _path_panels(self, x2d):
        """Each column of 16 outputs widened once for up to 16 rows (batched decode)."""
        return cpu_ops().int8_matmul_panels(x2d, self.panel_codes, self.scale, self.correction)

    def _path_tiled(self, x2d):
        """Dequantized one L2-sized tile at a time, each tile multiplied by all rows (tiled_gemm.h)."""
        return cpu_ops().int8_matmul_tiled(x2d, self.signed, self.scale, self.correction, TILE_BYTES)

    def _path_dequantize(self, x2d):
        """The whole weight dequantized into a reused buffer, then one dense GEMM (prefill chunks: the tiles' many
        small sgemm calls made a prefill slower than the dense model's: docs/results/code-figures.md#int8-prefill)."""
        weight = dequantize_buffer(self.out_features * self.in_features, self.dtype)
        weight = weight.view(self.out_features, self.in_features)
        torch.mul(self.signed, self.scale.unsqueeze(1), out=weight)
        if self.correction is not None:
            weight.add_(self.correction.unsqueeze(1))
        return F.linear(x2d, weight)

    def _path_aten(self, x2d):
        return int8_matmul(x2d, self.signed, self.scale, self.correction)


@register_linear_method
class Int8Q8Linear(Q8InputsMixin, Int8PackedLinear):
    """The int8 layer with 8-bit inputs: each block of 32 inputs rounded to int8 with one scale (dynamic, per row,
    as int4-q8-cpu's), the codes repacked at load so that one 64-byte load serves 16 outputs, and integer dot
    products (vpdpbusd with VNNI, else maddubs + madd) in place of widening every weight to float
    (kernels/csrc/int8_q8_cpu.cpp, `int8_matmul_q8`). On CPUs without bf16 units an fp32 GEMM is compute-bound
    from a few dozen rows, and a float int8 kernel, which does its multiply-adds, can at best tie it: the integer
    dots do more per instruction. Up to 16 rows it always runs; beyond, it is timed against the float paths
    (q8_inputs.py). Every int8 code is exact (-128 included: each weight byte's sign moves onto the input byte)."""

    name, device_type = "int8-q8-cpu", "cpu"
    quantized_inputs = True
    # a decode step reads the q8 layout; the others serve the float paths of larger steps (eval.bench.model_cost)
    prefill_only_buffers = ("signed", "panel_codes")

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        scale, shift = int8_scale_shift(qweight.scales, qweight.zeros)
        self.register_buffer("q8_scale", scale)  # [N] float32
        self.register_buffer("q8_shift", shift)  # [N] float32 or None
        self.register_buffer("q8_codes", pack_int8_q8(self.signed))  # [N/16, K/4, 64]

    @classmethod
    def accepts(cls, qweight, scheme, device):
        acts = scheme.input_activations
        if not takes_int8_inputs(acts) or acts.strategy != "group":  # (per-token inputs: W8A8, w8a8-int8-cpu)
            return False
        n, k = qweight.shape
        plain = type(scheme)(scheme.weights, None)
        return Int8PackedLinear.accepts(qweight, plain, device) and n % 16 == 0 and k % cls.q8_input_block == 0

    @classmethod
    def stack(cls, parts):
        """Exact as the float layer's (the inputs' scales do not depend on the weights)."""
        fused = super().stack(parts)
        fused.register_buffer("q8_scale", torch.cat([p.q8_scale for p in parts]))
        fused.register_buffer("q8_shift", cat_optional([p.q8_shift for p in parts], [p.q8_scale for p in parts]))
        fused.register_buffer("q8_codes", torch.cat([p.q8_codes for p in parts]))  # (panels of whole parts)
        return fused

    def _path_q8(self, x2d):
        return cpu_ops().int8_matmul_q8(x2d, self.q8_codes, self.q8_scale, self.q8_shift, self.q8_input_block)

    def graph_kernels(self):
        shift = [] if self.q8_shift is None else [self.q8_shift]
        return {"q8": ("int8_matmul_q8", [self.q8_codes, self.q8_scale, *shift], [self.q8_input_block])}

    def _bind_q8(self):
        op, codes, scale, shift = cpu_ops().int8_matmul_q8.default, self.q8_codes, self.q8_scale, self.q8_shift
        block = self.q8_input_block
        return lambda x2d: op(x2d, codes, scale, shift, block)


class GroupedInt8Linear(RowPathsMixin, LinearMethod):
    """Symmetric int8 weights with one scale per output and group of G columns, dequantized whole for one GEMM: the
    float path of Int8GroupedQ8Linear (not registered: with float inputs such a weight takes the dense method)."""

    prefill_only_buffers = ("signed",)  # (eval.bench.model_cost: a decode step reads the q8 layout)

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        self.register_buffer("signed", qweight.signed_codes().contiguous())  # [N, K] int8
        self.register_buffer("q8_group_scale", int8_group_scales(qweight.scales, qweight.zeros))  # [G, N] float32

    def plan_key_detail(self) -> str:
        return f"|g{self.in_features // self.q8_group_scale.shape[0]}"

    def row_paths(self) -> dict[str, int | None]:
        return {"dequantize": None}

    def default_path(self, rows: int) -> str:
        return "dequantize"

    def _path_dequantize(self, x2d):
        """The whole weight dequantized into a reused buffer, then one dense GEMM (prefill chunks)."""
        n, k = self.out_features, self.in_features
        groups = self.q8_group_scale.shape[0]
        weight = dequantize_buffer(n * k, self.dtype).view(n, groups, k // groups)
        torch.mul(self.signed.view(n, groups, k // groups), self.q8_group_scale.t().unsqueeze(-1), out=weight)
        return F.linear(x2d, weight.view(n, k))


@register_linear_method
class Int8GroupedQ8Linear(Q8InputsMixin, GroupedInt8Linear):
    """Symmetric int8 weights with one scale per output and group of G columns (G a multiple of 32 dividing K:
    GPTQ's 8-bit groups; `--lm-head int8-g32`, a logits head rounded per 32 columns as llama.cpp's Q8_0) with
    8-bit inputs: `int8_matmul_q8` with grouped scales (each block's integer sum times its input scale and its
    group's weight scale). Beyond decode sizes it is timed against the weight dequantized whole."""

    name, device_type = "int8-grouped-q8-cpu", "cpu"
    quantized_inputs = True

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        self.register_buffer("q8_codes", pack_int8_q8(self.signed))  # [N/16, K/4, 64]

    @classmethod
    def accepts(cls, qweight, scheme, device):
        acts, w = scheme.input_activations, qweight.scheme
        if cpu_ops() is None or not takes_int8_inputs(acts) or acts.strategy != "group":
            return False
        n, k = qweight.shape
        groups = qweight.scales.shape[1]
        return (w.type == "int" and w.bits == 8 and 1 < groups and k % groups == 0
                and (k // groups) % cls.q8_input_block == 0 and n % 16 == 0 and qweight.has_trivial_g_idx
                and int8_zeros_symmetric(qweight.zeros))

    @staticmethod
    def can_stack(parts) -> bool:
        first = parts[0]
        return all(type(p) is type(first) and p.in_features == first.in_features and p.dtype == first.dtype
                   and p.q8_group_scale.shape[0] == first.q8_group_scale.shape[0] for p in parts)

    @classmethod
    def stack(cls, parts):
        """One layer computing cat([part(x) for part in parts], -1) in one call (exact: each output is its own)."""
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        fused.register_buffer("signed", torch.cat([p.signed for p in parts]))
        fused.register_buffer("q8_group_scale", torch.cat([p.q8_group_scale for p in parts], dim=1))
        fused.register_buffer("q8_codes", torch.cat([p.q8_codes for p in parts]))  # (panels of whole parts)
        return fused

    def _path_q8(self, x2d):
        return cpu_ops().int8_matmul_q8(x2d, self.q8_codes, self.q8_group_scale, None, self.q8_input_block)

    def _bind_q8(self):
        op, codes, scale, block = (cpu_ops().int8_matmul_q8.default, self.q8_codes, self.q8_group_scale,
                                   self.q8_input_block)
        return lambda x2d: op(x2d, codes, scale, None, block)

    def graph_kernels(self):
        return {"q8": ("int8_matmul_q8", [self.q8_codes, self.q8_group_scale], [self.q8_input_block])}

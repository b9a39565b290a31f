"""Codes of <= 4 bits on CPU: aten's int4 layout for bf16 decode, the compiled kernels (kernels/csrc/int4_cpu.cpp)
for fp32 / fp16 rows and for dequantizing whole weights before a dense GEMM at prefill sizes; with 8-bit inputs
at decode, the integer-dot kernel (kernels/csrc/int4_q8_cpu.cpp)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.kernels.quant_matmul import (
    can_pack_int4, fits_float16, int4_dequantize, int4_matmul, pack_int4, pack_int4_codes, pack_int4_panels,
    pack_int4_q8, pack_nibbles, unpack_nibbles,
)
from llmopt.runtime.executor.linear.base import LinearMethod, dequantize_buffer, new_stacked, register_linear_method
from llmopt.runtime.executor.linear.q8_inputs import Q8InputsMixin, takes_int8_inputs
from llmopt.runtime.executor.linear.kernel_plans import TILE_BYTES, RowPathsMixin


@register_linear_method
class Int4PackedLinear(RowPathsMixin, LinearMethod):
    """Five kernels ("paths", chosen per step's row count by kernel_plans.py, measured on this machine): the compiled
    few-row kernel straight from the codes ("rows": decode, the memory-bound case); the one that reads the codes
    repacked at load in panels of 16 outputs and decodes each column once for up to 16 rows ("panels": batched
    decode); the one that dequantizes an L2-sized tile at a time and multiplies it by all rows ("tiled": larger
    decode batches); the compiled
    whole-weight dequantization + dense GEMM ("dequantize": prefill chunks, where CPUs with bf16 matrix units
    are several times faster dense, docs/results/runtime.md); aten's int4 kernel ("aten": bf16 decode). The
    plain nibble copy and the panels each cost another half byte per weight."""

    name, device_type = "int4-cpu", "cpu"
    # three layouts of the codes (aten's, the nibbles, the panels), one read per step: eval.bench.model_cost
    # counts aten's
    prefill_only_buffers = ("nibbles", "panel_codes", "panel_scales")
    # the fixed plan's thresholds (--linear-kernels fixed, and before a plan is set):
    dequantize_min_rows = 256  # torch dequantization vs aten's kernel, bf16 (benchmarks/kernels/int4_matmul.py)
    # the same with the compiled dequantization (kernels/csrc/int4_cpu.cpp, ~30x faster than the torch one)
    compiled_dequantize_min_rows = 16
    # fp32 / fp16: "rows" for 1 row, "panels" up to 32, "tiled" up to 64 (benchmarks/runtime/int4_batch.py)
    few_rows_max, panels_max_rows, tiled_max_rows = 1, 32, 64

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        packed, scales_and_offsets, self.kernel_group = pack_int4(
            qweight.q, qweight.scales, qweight.zeros, qweight.scheme.group_size, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_offsets", scales_and_offsets)
        self.register_buffer("nibbles", pack_nibbles(qweight.q))
        self._register_panels()

    def _register_panels(self):
        codes, scales_biases = pack_int4_panels(self.nibbles, self.scales_and_offsets, self.kernel_group)
        self.register_buffer("panel_codes", codes)
        self.register_buffer("panel_scales", scales_biases)

    @classmethod
    def accepts(cls, qweight, scheme, device):
        n, k = qweight.shape
        w = qweight.scheme
        return (scheme.input_activations is None and qweight.has_trivial_g_idx
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
        fused._register_panels()
        return fused

    @classmethod
    def can_stack(cls, parts) -> bool:
        first = parts[0]
        return all(type(p) is cls and p.in_features == first.in_features and p.dtype == first.dtype
                   and p.kernel_group == first.kernel_group for p in parts)

    # --- paths (kernel_plans.py): which kernel runs a step of `rows` inputs -------------------------------------
    def row_paths(self) -> dict[str, int | None]:
        if cpu_ops() is None:
            return {"aten": None, "torch_dequantize": None}
        paths = {"rows": 16, "panels": 128, "tiled": None, "dequantize": None}
        if self.dtype == torch.bfloat16:
            paths["aten"] = 64  # aten's int4 kernel serves bf16 inputs (fp32 ones ~20x slower than "rows")
        return paths

    def default_path(self, rows: int) -> str:
        if cpu_ops() is None:
            return "torch_dequantize" if rows >= self.dequantize_min_rows else "aten"
        if self.dtype == torch.bfloat16:
            return "aten" if rows < self.compiled_dequantize_min_rows else "dequantize"
        if rows <= self.few_rows_max:
            return "rows"
        return "panels" if rows <= self.panels_max_rows else "tiled" if rows <= self.tiled_max_rows else "dequantize"

    def plan_key_detail(self) -> str:
        return f"|g{self.kernel_group}"

    def _path_rows(self, x2d):
        """Straight from the codes, widened in registers for every pair of rows (decode at small batches)."""
        return cpu_ops().int4_matmul_rows(x2d, self.nibbles, self.scales_and_offsets, self.kernel_group)

    def _bind_rows(self):
        op, nibbles, so = cpu_ops().int4_matmul_rows.default, self.nibbles, self.scales_and_offsets
        group = self.kernel_group
        return lambda x2d: op(x2d, nibbles, so, group)

    def graph_kernels(self):
        codes, group = [self.nibbles, self.scales_and_offsets], self.kernel_group
        return {"rows": ("int4_matmul_rows", codes, [group]),
                "tiled": ("int4_matmul_tiled", codes, [group, TILE_BYTES]),
                "panels": ("int4_matmul_panels", [self.panel_codes, self.panel_scales], [group])}

    def _path_panels(self, x2d):
        """From the codes repacked at load in panels of 16 outputs, decoded once per 16 rows (batched decode)."""
        return cpu_ops().int4_matmul_panels(x2d, self.panel_codes, self.panel_scales, self.kernel_group)

    def _path_tiled(self, x2d):
        """Dequantized one L2-sized tile at a time, each tile multiplied by all rows (tiled_gemm.h)."""
        return cpu_ops().int4_matmul_tiled(x2d, self.nibbles, self.scales_and_offsets, self.kernel_group,
                                           TILE_BYTES)

    def _path_dequantize(self, x2d):
        """One compiled pass into a reused buffer, then the dense GEMM (large prefill chunks)."""
        weight = dequantize_buffer(self.out_features * self.in_features, self.scales_and_offsets.dtype)
        weight = weight.view(self.out_features, self.in_features)
        cpu_ops().int4_dequantize_out(self.nibbles, self.scales_and_offsets, self.kernel_group, weight)
        return F.linear(x2d, weight)

    def _path_torch_dequantize(self, x2d):
        return F.linear(x2d, int4_dequantize(self.nibbles, self.scales_and_offsets, self.kernel_group))

    def _path_aten(self, x2d):
        return int4_matmul(x2d, self.packed, self.scales_and_offsets, self.kernel_group)

    def _bind_aten(self):
        op = torch.ops.aten._weight_int4pack_mm_for_cpu.default  # (int4_matmul's op, without its frame)
        packed, so, group = self.packed, self.scales_and_offsets, self.kernel_group
        return lambda x2d: op(x2d, packed, group, so)


@register_linear_method
class Int4Q8Linear(Q8InputsMixin, Int4PackedLinear):
    """The int4 layer with 8-bit inputs, as llama.cpp multiplies its Q4 blocks: each block of 32 inputs rounded to
    int8 with one scale (dynamic, per row), the codes repacked at load so that one 64-byte load serves 16 outputs
    and integer dot products (VNNI, else maddubs) sum 128 weights an instruction (kernels/csrc/int4_q8_cpu.cpp,
    `int4_matmul_q8`): ~0.5% relative error per output, +0.2% wikitext2 ppl, 2-3x less time per int4 linear than
    aten's bf16 kernel at decode (docs/results/peers.md). Up to 16 rows it always runs (on CPUs with AMX-INT8 its
    tile version `q8_amx` too, the same numbers bit for bit, timed against it); beyond, it is timed against the
    float paths with the rest (kernel_plans.py) and the faster runs: in fp32 it was 1.7x ahead of the dense GEMM at
    64 rows on AVX-512, while in bf16 on AMX the codes dequantized a panel at a time into bf16 tiles (`amx_bf16`)
    win from ~32 rows (the float paths being the more precise, a step that takes one is never less accurate than
    asked). Chosen by the scheme (`--input-activations int8`, or `auto` on CPU:
    core.contract.INT8_GROUP_ACTIVATIONS)."""

    name, device_type = "int4-q8-cpu", "cpu"
    quantized_inputs = True
    # a decode step reads the q8 layout; the others serve prefill (eval.bench.model_cost)
    prefill_only_buffers = ("packed", "scales_and_offsets", "nibbles", "panel_codes", "panel_scales")

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        codes, scales_biases = pack_int4_q8(qweight.q, qweight.scales, qweight.zeros, qweight.scheme.group_size,
                                            self.kernel_group)
        self.register_buffer("q8_codes", codes)
        self.register_buffer("q8_scales", scales_biases)

    @classmethod
    def accepts(cls, qweight, scheme, device):
        if not takes_int8_inputs(scheme.input_activations):
            return False
        plain = type(scheme)(scheme.weights, None)
        # the scales and biases are kept in float16 (as GPTQ checkpoints store them)
        return (Int4PackedLinear.accepts(qweight, plain, device)
                and fits_float16(qweight.scales, qweight.scales * qweight.zeros))

    @classmethod
    def stack(cls, parts):
        fused = super().stack(parts)
        fused.register_buffer("q8_codes", torch.cat([p.q8_codes for p in parts]))
        fused.register_buffer("q8_scales", torch.cat([p.q8_scales for p in parts]))
        return fused

    def row_paths(self):
        paths = super().row_paths()  # with "q8" (Q8InputsMixin)
        if cpu_ops() is not None:
            if cpu_ops().amx_int8():  # the same numbers bit for bit, on AMX-INT8 tiles
                paths["q8_amx"] = None
            if self.dtype == torch.bfloat16 and cpu_ops().amx_bf16():  # a float path, on AMX-BF16 tiles
                paths["amx_bf16"] = None
        return paths

    def _path_q8(self, x2d):
        return cpu_ops().int4_matmul_q8(x2d, self.q8_codes, self.q8_scales, self.kernel_group, self.q8_input_block)

    def _path_q8_amx(self, x2d):
        """`int4_matmul_q8` on AMX-INT8 tiles (16 rows x 32 inputs x 16 outputs an instruction): equal to it bit for
        bit, faster from ~16 rows."""
        return cpu_ops().int4_matmul_q8_amx(x2d, self.q8_codes, self.q8_scales, self.kernel_group,
                                            self.q8_input_block)

    def _bind_q8(self):
        return self._bound_q8(cpu_ops().int4_matmul_q8.default)

    def _bind_q8_amx(self):
        return self._bound_q8(cpu_ops().int4_matmul_q8_amx.default)

    def _bound_q8(self, op):
        """`op` (either 8-bit inputs' kernel: the same arguments) with this layer's q8 weights in hand."""
        codes, scales, group, block = self.q8_codes, self.q8_scales, self.kernel_group, self.q8_input_block
        return lambda x2d: op(x2d, codes, scales, group, block)

    def graph_kernels(self):
        q8 = ([self.q8_codes, self.q8_scales], [self.kernel_group, self.q8_input_block])
        return {**super().graph_kernels(), "q8": ("int4_matmul_q8", *q8), "q8_amx": ("int4_matmul_q8_amx", *q8)}

    def _path_amx_bf16(self, x2d):
        """bf16 inputs times the codes dequantized one panel of 16 outputs at a time into AMX-BF16 tiles (the float
        path's numbers without writing the whole dequantized weight: batched decode and prefill chunks)."""
        return cpu_ops().int4_matmul_amx_bf16(x2d, self.q8_codes, self.q8_scales, self.kernel_group)

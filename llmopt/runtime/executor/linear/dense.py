"""Dense linears: the fallback for any quantized weight no kernel holds (dequantized once at load: act-order
checkpoints with permuted groups, odd shapes), and the runtime's fused dense projections (q/k/v, gate/up as one
matmul; on CPU the few-rows `gemv` kernel on the plain weight, and a copy prepacked for oneDNN for more rows)."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.core.contract.activations import InputQuantizedLinear
from llmopt.core.hardware import kernel_isa
from llmopt.runtime.executor.host_memory import room_for_second_copy
from llmopt.runtime.executor.kernels.cpu_ops import GEMV_BATCHED_ROWS, GEMV_MAX_ROWS, cpu_ops
from llmopt.runtime.executor.linear.base import LinearMethod, register_linear_method
from llmopt.runtime.executor.linear.kernel_plans import RowPathsMixin
from llmopt.runtime.executor.platform import Platform


@register_linear_method
class DequantizedLinear(LinearMethod):
    """Any weight, dequantized once into a plain nn.Linear (built by `create`; the class is its registry entry)."""

    name = "dense"
    fallback = True  # chosen only where no other method accepts
    weight_type = object  # any weight with a dense form (`dequantize`)

    @classmethod
    def accepts(cls, qweight, scheme, device):
        return True

    @classmethod
    def create(cls, qweight, dtype, device) -> nn.Linear:
        if qweight.input_activations is not None:  # W8A8 without an integer kernel: the reference's numerics
            return InputQuantizedLinear.of(qweight, dtype, device)
        n, k = qweight.shape
        dense = nn.Linear(k, n, bias=qweight.bias is not None, dtype=dtype, device=device)
        with torch.no_grad():
            dense.weight.copy_(qweight.dequantize(dtype))
            if qweight.bias is not None:
                dense.bias.copy_(qweight.bias.to(dtype))
        return dense.requires_grad_(False)


def _mkldnn_16bit(dtype: torch.dtype) -> bool:
    """Whether oneDNN multiplies this 16-bit dtype on this CPU (else torch's CPU GEMM in it is a slow fallback)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return torch.ops.mkldnn._is_mkldnn_bf16_supported() if dtype == torch.bfloat16 \
        else torch.ops.mkldnn._is_mkldnn_fp16_supported()


def _mkldnn_bf16() -> bool:
    return _mkldnn_16bit(torch.bfloat16)


class ConcatLinears(nn.Module):
    """Several linears fed the same input, outputs concatenated: exact (each runs as it would alone)."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


class FusedDenseLinear(RowPathsMixin, nn.Module):
    """Dense linears fed the same input as one matmul over their stacked weights.

    Paths (kernel_plans.py): `blas` (F.linear; for a prepacked fp32 head oneDNN's linear on it) at any row count; on
    CPU, for plain fp32 and bf16 weights, `gemv` (kernels.cpu_ops: each weight row streamed once, for 1-8 rows;
    the kernel a decode graph calls); for fp32 prefill chunks `onednn` (oneDNN's linear on the plain weight); and at
    any row count `prepacked` (oneDNN's linear on a copy of the weight in its
    blocked layout, made where the host has room: host_memory.room_for_second_copy); for 16-bit prefill chunks on a
    CPU whose oneDNN has no 16-bit GEMM (AVX2: torch then multiplies bf16 in a slow reference loop, several times
    slower than fp32) `widened`: the weight widened to fp32 for the call and
    multiplied in fp32 (bf16 and fp16 values are exact in fp32; one rounding of the sums to the layer's dtype, as
    the 16-bit GEMM's). The decode graph calls `gemv`, `blas` and `prepacked` itself.

    Why a weight is kept twice: at one row `gemv` on the plain weight beats the prepacked layout, while from 16 rows
    the prepacked layout wins (BESIDE_COPY below; docs/results/code-figures.md#dense-paths). The engine times the
    paths per shape (measured plans) where the choice is open, and frees a copy no row count runs. Which is faster
    differs by CPU more than any fixed rule captures; the default (`--linear-kernels fixed`, no engine) is
    `prepacked` where the copy exists beyond 2 fp32 rows (4 in the AVX2 build) or 8 bf16 rows, else up to 8 rows
    cpu_ops.GEMV_BATCHED_ROWS for fp32 and `gemv` for bf16, `blas` beyond. A logits head in fp32 is prepacked only
    (pack_float32; its batch-1 rows go to gemv on an exactly narrowed 16-bit copy, models/llama.py): oneDNN's
    prepacked linear runs it about twice as fast as MKL's sgemm at 32-128 rows."""

    name = "dense"
    # `onednn` is timed for prefill-sized steps only: decode steps (up to 16 rows) run in the decode graph, which
    # calls the plain-layout kernels (`gemv`, `linear`) itself
    ONEDNN_MIN_ROWS = 32
    # BESIDE_COPY: where a weight has its prepacked copy, `gemv` is timed up to FP32_GEMV_ROWS_BESIDE_COPY rows
    # (fp32, by kernel build) or 8 (bf16), and beyond the copy runs, untimed. Each layer timed alone (its weight from
    # memory, kernel_plans.measure_plan) favours the plain-layout kernels over oneDNN's prepacked one by up to 2x
    # against the same calls made in a row as a step makes them: timed alone gemv won at 4-16 fp32 rows, while in
    # the engine the copy made 4 and 8 sequences faster (docs/results/code-figures.md#dense-paths). Other builds
    # time gemv at every row count it takes.
    FP32_GEMV_ROWS_BESIDE_COPY: ClassVar[dict[str, int]] = {"avx512": 2, "avx512_bf16": 2, "avx2": 4}
    PACK_BATCH_HINT = 256  # oneDNN picks its blocking for this M; measured best over M in 1..2048

    def __init__(self, parts: list[nn.Linear], prepack: bool, pack_float32: bool = False):
        """prepack: an fp32 or bf16 weight on CPU gets a copy prepacked for oneDNN (`prepacked` path); with
        pack_float32 an fp32 weight is replaced by its prepacked form instead (a logits head, which no decode graph
        multiplies: the graph's kernels take the plain layout)."""
        super().__init__()
        # (one part: its own tensor, no copy; the checkpoint's module may hold it too)
        weight = torch.cat([p.weight.detach() for p in parts], dim=0) if len(parts) > 1 else parts[0].weight.detach()
        has_bias = any(p.bias is not None for p in parts)
        bias = torch.cat([p.bias.detach() if p.bias is not None else weight.new_zeros(p.out_features)
                          for p in parts]) if has_bias else None
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.dtype = weight.dtype
        cpu = Platform.of(weight.device).host_memory
        self.packed = prepack and pack_float32 and cpu and weight.dtype == torch.float32 \
            and torch.backends.mkldnn.is_available()  # (the fp32 head: the prepacked form only)
        if self.packed:
            weight = torch.ops.mkldnn._reorder_linear_weight(weight, self.PACK_BATCH_HINT)
        self.register_buffer("weight", weight)
        self.register_buffer("bias", bias)
        # the compiled few-rows kernel serves a plain fp32 or bf16 weight on CPU, and oneDNN a prepacked copy of it
        plain_cpu = not self.packed and cpu and self.dtype in (torch.float32, torch.bfloat16)
        with_copy = plain_cpu and prepack and (_mkldnn_bf16() if self.dtype == torch.bfloat16
                                               else torch.backends.mkldnn.is_available()) \
            and room_for_second_copy(weight.numel() * weight.element_size())
        self.with_prepacked_copy = with_copy
        self.register_buffer("prepacked_weight", torch.ops.mkldnn._reorder_linear_weight(
            weight, self.PACK_BATCH_HINT) if with_copy else None)
        self._gemv = plain_cpu and cpu_ops() is not None
        self._onednn = plain_cpu and self.dtype == torch.float32 and torch.backends.mkldnn.is_available()
        self._widened = cpu and self.dtype in (torch.bfloat16, torch.float16) and not _mkldnn_16bit(self.dtype)
        self._fp32_gemv_rows_beside_copy = self.FP32_GEMV_ROWS_BESIDE_COPY.get(kernel_isa(), GEMV_MAX_ROWS)

    # --- paths (kernel_plans.py) --------------------------------------------------------------------------------
    def row_paths(self) -> dict[str, int | None]:
        return {"blas": None} | ({"gemv": self._gemv_rows()} if self._gemv else {}) \
            | ({"onednn": None} if self._onednn else {}) | ({"widened": None} if self._widened else {}) \
            | ({"prepacked": None} if self.prepacked_weight is not None else {})

    def _gemv_rows(self) -> int:
        beside_copy = self.prepacked_weight is not None and self.dtype == torch.float32
        return self._fp32_gemv_rows_beside_copy if beside_copy else GEMV_MAX_ROWS

    def candidate_paths(self, rows: int, paths: dict[str, int | None]) -> list[str]:
        if "prepacked" in paths and rows > self._gemv_rows():
            return ["prepacked"]  # (beyond gemv's rows the copy, untimed: BESIDE_COPY, above)
        names = super().candidate_paths(rows, paths)
        prefill_only = ("onednn", "widened")
        return names if rows >= self.ONEDNN_MIN_ROWS else [name for name in names if name not in prefill_only]

    def default_path(self, rows: int) -> str:
        if self.prepacked_weight is not None and rows > self._gemv_rows():
            return "prepacked"
        if rows > GEMV_MAX_ROWS:
            return "widened" if self._widened and rows >= self.ONEDNN_MIN_ROWS else "blas"
        if self.dtype == torch.bfloat16:  # (oneDNN on the plain bf16 weight is slower than gemv at 1-8 rows)
            return "gemv" if self._gemv else "blas"
        # MKL's sgemm packs the weight from ~3 rows (2x slower than streaming it once); weights taller than wide
        # kept it (cpu_ops.GEMV_BATCHED_ROWS)
        wide = self.out_features >= self.in_features
        return "gemv" if self._gemv and wide and rows in GEMV_BATCHED_ROWS else "blas"

    def plan_key_detail(self) -> str:
        return "|prepacked copy" if self.with_prepacked_copy else ""  # (made at load; freed if unused)

    def set_row_plan(self, plan) -> None:
        super().set_row_plan(plan)
        if self.prepacked_weight is not None and "prepacked" not in self._row_plan.choices.values():
            self.prepacked_weight = None  # (no row count runs it: its bytes back)

    def _bind_blas(self):
        if self.packed:
            return self._bind_onednn()  # (the prepacked fp32 weight)
        linear, weight, bias = F.linear, self.weight, self.bias
        return lambda x: linear(x, weight, bias)

    def _bind_onednn(self):
        linear, weight, bias = torch.ops.mkldnn._linear_pointwise, self.weight, self.bias
        return lambda x: linear(x, weight, bias, "none", [], "")

    def _bind_prepacked(self):
        linear, weight, bias = torch.ops.mkldnn._linear_pointwise, self.prepacked_weight, self.bias
        return lambda x: linear(x, weight, bias, "none", [], "")

    def _bind_widened(self):
        linear, weight = F.linear, self.weight
        bias = None if self.bias is None else self.bias.float()
        return lambda x: linear(x.float(), weight.float(), bias).to(x.dtype)

    def _bind_gemv(self):
        gemv, weight, bias = cpu_ops().gemv, self.weight, self.bias
        return (lambda x: gemv(x, weight)) if bias is None else (lambda x: gemv(x, weight) + bias)

    def graph_kernels(self):
        kernels = {"gemv": ("gemv", [self.weight], [])} if self._gemv else {}
        if self.prepacked_weight is not None:
            kernels["prepacked"] = ("onednn_linear", [self.prepacked_weight], [])
        return kernels if self.packed else {**kernels, "blas": ("linear", [self.weight], [])}

    def _path_blas(self, x: torch.Tensor) -> torch.Tensor:
        return self._bind_blas()(x)

    def _path_gemv(self, x: torch.Tensor) -> torch.Tensor:
        return self._bind_gemv()(x)

    def _path_widened(self, x: torch.Tensor) -> torch.Tensor:
        return self._bind_widened()(x)

    def _path_onednn(self, x: torch.Tensor) -> torch.Tensor:
        return self._bind_onednn()(x)

    def _path_prepacked(self, x: torch.Tensor) -> torch.Tensor:
        return self._bind_prepacked()(x)

    def forward_2d(self):
        """A callable for [T, in] inputs (bias included): the plan's path for the step's rows. The decoder's fast
        loop binds it at build time, before the engine sets the plan (_matmul reads the plan per call); with a
        single path (the prepacked fp32 head, GPU), that path's call itself (no frame to spare)."""
        return self._bind_blas() if len(self.row_paths()) == 1 else self._matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        return self._matmul(x.reshape(-1, self.in_features)).reshape(*lead, self.out_features)


def fuse_linears(parts: list[nn.Module], prepack: bool, pack_float32: bool = False) -> nn.Module:
    """One module computing cat([part(x) for part in parts], -1) (a model's packed modules: q/k/v, gate/up).

    prepack=False keeps each part's own numerics (a single part is returned as is); prepack=True stacks dense
    parts into one (prepacked) matmul, and parts of a method that can stack (int4, int8) into one kernel call
    (exact). Other parts run as themselves. pack_float32: fp32 dense parts prepacked for oneDNN too
    (FusedDenseLinear)."""
    if prepack and all(type(p) is nn.Linear for p in parts):
        return FusedDenseLinear(parts, prepack=True, pack_float32=pack_float32)
    if prepack and len(parts) > 1:
        method = type(parts[0])
        if isinstance(parts[0], LinearMethod) and method.can_stack(parts):
            return method.stack(parts)
    return parts[0] if len(parts) == 1 else ConcatLinears(parts)

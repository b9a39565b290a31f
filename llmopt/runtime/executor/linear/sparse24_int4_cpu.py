"""2:4 sparse weights quantized to 4-bit codes (GPTQ / RTN on a 2:4 model, stored compressed: QuantizedWeight.keep)
on CPU: the kept codes two per byte, 2 bits of position per value and fp32 scale and offset per group — 3 bits per
weight plus the group scales, against 4 plus scales for the dense int4 codes (and the stored bitmask, another bit
per weight, which only the prefill paths read). Paths as the fp32 2:4 method's
(sparse24_cpu.py): "rows" widens and scales 16 codes per chunk in registers and picks their inputs
(kernels/csrc/sparse24_cpu.cpp, decode), "tiled" / "decompress" dequantize into an L2 tile or the whole weight
before the dense GEMM (prefill), chosen per row count by measurement."""

from __future__ import annotations

import torch

from llmopt.core.contract.sparse24 import columns_of, positions_2of4, unpack_mask
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.linear.base import LinearMethod, new_stacked, register_linear_method
from llmopt.runtime.executor.linear.kernel_plans import TILE_BYTES
from llmopt.runtime.executor.linear.sparse_paths import SparsePathsMixin

CHUNK = 32  # input columns per position word


@register_linear_method
class Sparse24Int4Linear(SparsePathsMixin, LinearMethod):
    name, device_type = "sparse24-int4-cpu", "cpu"
    skips_pruned = True  # (so before int4-cpu, which would run the same codes densely)
    prefill_only_buffers = ("bitmask",)  # (eval.bench.model_cost: a decode step reads codes, positions, scales)

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        n, k = qweight.shape
        mask = unpack_mask(qweight.keep, k)
        kept = qweight.q[mask].reshape(n, k // 2).to(torch.uint8)  # [N, K/2], the values' order
        self.group = qweight.scheme.group_width(k)
        self.register_buffer("codes", kept[:, 0::2] | (kept[:, 1::2] << 4))  # [N, K/4]
        self.register_buffer("positions", positions_2of4(mask))  # [N, K/32] int32
        self.register_buffer("scale", qweight.scales.float().contiguous())  # [N, G]
        self.register_buffer("offset", (-qweight.zeros.float() * qweight.scales.float()).contiguous())  # [N, G]
        self.register_buffer("bitmask", qweight.keep.contiguous())  # [N, K/8], as stored: the prefill paths expand it

    @classmethod
    def accepts(cls, qweight, scheme, device):
        n, k = qweight.shape
        w = qweight.scheme
        return (scheme.input_activations is None and qweight.keep is not None
                and w.type == "int" and w.bits <= 4 and qweight.has_trivial_g_idx and k % CHUNK == 0
                and w.group_width(k) % CHUNK == 0)

    @staticmethod
    def can_stack(parts) -> bool:
        first = parts[0]
        return all(type(p) is Sparse24Int4Linear and p.in_features == first.in_features and p.dtype == first.dtype
                   and p.group == first.group for p in parts)

    @classmethod
    def stack(cls, parts: list[Sparse24Int4Linear]) -> Sparse24Int4Linear:
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        fused.group = parts[0].group
        for buffer in ("codes", "positions", "scale", "offset", "bitmask"):
            fused.register_buffer(buffer, torch.cat([getattr(p, buffer) for p in parts]))
        return fused

    def dense_weight(self) -> torch.Tensor:
        """[N, K] the dense weight in the compute dtype, torch only (the reference the kernels are tested against)."""
        n, k = self.out_features, self.in_features
        kept = torch.stack([self.codes & 15, self.codes >> 4], dim=-1).reshape(n, k // 2).float()
        group_of_value = torch.arange(k // 2) * 2 // self.group  # a value's group: its chunk's
        values = kept * self.scale[:, group_of_value] + self.offset[:, group_of_value]
        return torch.zeros(n, k).scatter_(1, columns_of(self.positions, k), values).to(self.dtype)

    # --- paths (sparse_paths.py) ----------------------------------------------------------------------------
    def plan_key_detail(self) -> str:
        return f"|g{self.group}"

    def _path_rows(self, x2d):
        return cpu_ops().sparse24_int4_matmul_rows(x2d, self.codes, self.positions, self.scale, self.offset,
                                                   self.group)

    def _path_tiled(self, x2d):
        return cpu_ops().sparse24_int4_matmul_tiled(x2d, *self._decompress_operands(), TILE_BYTES)

    def decompress_into(self, out):
        cpu_ops().sparse24_int4_decompress_out(*self._decompress_operands(), out)

    def _decompress_operands(self) -> tuple:
        return self.codes, self.positions, self.scale, self.offset, self.bitmask, self.group

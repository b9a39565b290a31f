"""Unstructured sparse weights on CPU, from compressed-tensors' sparse-bitmask layout
(core/contract/sparse_bitmask.py): the non-zeros in the compute dtype, one bit per weight and an offset per row —
(1 - sparsity) of the dense bytes plus 1/32 (fp32). Paths (kernel_plans.py, chosen per step's row count by
measurement): "rows", the compiled kernel that expands each row's next values into their 16 columns and multiplies
them with the inputs as they are (decode: kernels/csrc/sparse_bitmask_cpu.cpp); "tiled" and "decompress", an L2
tile or the whole weight expanded before the dense GEMM (prefill). Without the compiled kernels each product
decompresses the weight with torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.core.contract.sparse_bitmask import BitmaskWeight
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.linear.base import LinearMethod, new_stacked, register_linear_method
from llmopt.runtime.executor.linear.kernel_plans import TILE_BYTES
from llmopt.runtime.executor.linear.sparse_paths import SparsePathsMixin

PAD = 16  # values past a row's last that the kernels' vector loads may read


@register_linear_method
class SparseBitmaskLinear(SparsePathsMixin, LinearMethod):
    name, device_type = "sparse-bitmask-cpu", "cpu"
    skips_pruned = True
    weight_type = BitmaskWeight

    def __init__(self, weight: BitmaskWeight, dtype, device="cpu"):
        super().__init__(weight, dtype, device)
        self.nnz = weight.values.numel()
        self.register_buffer("values", F.pad(weight.values.to(dtype), (0, PAD)))  # [nnz + PAD]
        self.register_buffer("bitmask", weight.bitmask.contiguous())  # [N, K/8] uint8
        self.register_buffer("row_offsets", weight.row_offsets.to(torch.int64).contiguous())  # [N]

    @classmethod
    def accepts(cls, weight, scheme, device):
        return scheme.input_activations is None and weight.shape[1] % 16 == 0

    @staticmethod
    def can_stack(parts) -> bool:
        first = parts[0]
        return all(type(p) is SparseBitmaskLinear and p.in_features == first.in_features and p.dtype == first.dtype
                   for p in parts)

    @classmethod
    def stack(cls, parts: list[SparseBitmaskLinear]) -> SparseBitmaskLinear:
        """One layer computing cat([part(x) for part in parts], -1): the rows stacked, their offsets moved on."""
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        starts = torch.cumsum(torch.tensor([0] + [p.nnz for p in parts[:-1]]), 0)
        fused.nnz = sum(p.nnz for p in parts)
        fused.register_buffer("values", F.pad(torch.cat([p.values[: p.nnz] for p in parts]), (0, PAD)))
        fused.register_buffer("bitmask", torch.cat([p.bitmask for p in parts]))
        fused.register_buffer("row_offsets", torch.cat([p.row_offsets + s for p, s in zip(parts, starts)]))
        return fused

    def dense_weight(self) -> torch.Tensor:
        """[N, K] the dense weight, torch only (the reference the kernels are tested against)."""
        weight = BitmaskWeight(self.values[: self.nnz], self.bitmask, self.row_offsets,
                               (self.out_features, self.in_features))
        return weight.decompress().to(self.dtype)

    # --- paths (sparse_paths.py) ----------------------------------------------------------------------------
    def _path_rows(self, x2d):
        return cpu_ops().bitmask_matmul_rows(x2d, self.values, self.bitmask, self.row_offsets)

    def _path_tiled(self, x2d):
        return cpu_ops().bitmask_matmul_tiled(x2d, self.values, self.bitmask, self.row_offsets, TILE_BYTES)

    def decompress_into(self, out):
        cpu_ops().bitmask_decompress_out(self.values, self.bitmask, self.row_offsets, out)

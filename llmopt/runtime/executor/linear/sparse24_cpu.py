"""2:4 sparse weights on CPU, from the compressed layout (core/contract/sparse24.py): the kept values in the
compute dtype and 2 bits of position per value — 0.53x of fp32's bytes, 0.56x of bf16's (and the stored bitmask,
another 1/32, which only the prefill paths read). Its "rows" path reads the values and positions once for all
rows and picks each value's input in registers (decode, speculative verification: kernels/csrc/sparse24_cpu.cpp);
the prefill paths decompress (sparse_paths.py)."""

from __future__ import annotations

import torch

from llmopt.core.contract.sparse24 import Sparse24Weight, columns_of
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.linear.base import LinearMethod, new_stacked, register_linear_method
from llmopt.runtime.executor.linear.kernel_plans import TILE_BYTES
from llmopt.runtime.executor.linear.sparse_paths import SparsePathsMixin

CHUNK = 32  # input columns per position word (16 kept values)


@register_linear_method
class Sparse24Linear(SparsePathsMixin, LinearMethod):
    name, device_type = "sparse24-cpu", "cpu"
    skips_pruned = True
    prefill_only_buffers = ("bitmask",)  # (eval.bench.model_cost: a decode step reads the values and positions)
    weight_type = Sparse24Weight

    def __init__(self, weight: Sparse24Weight, dtype, device="cpu"):
        super().__init__(weight, dtype, device)
        self.register_buffer("values", weight.values.to(dtype).contiguous())  # [N, K/2]
        self.register_buffer("positions", weight.positions_2of4())  # [N, K/32] int32
        self.register_buffer("bitmask", weight.bitmask)  # [N, K/8] uint8, as stored: the prefill paths expand it

    @classmethod
    def accepts(cls, weight, scheme, device):
        return (scheme.input_activations is None and weight.pattern == "2:4"
                and weight.shape[1] % CHUNK == 0)

    @staticmethod
    def can_stack(parts) -> bool:
        first = parts[0]
        return all(type(p) is Sparse24Linear and p.in_features == first.in_features and p.dtype == first.dtype
                   for p in parts)

    @classmethod
    def stack(cls, parts: list[Sparse24Linear]) -> Sparse24Linear:
        """One layer computing cat([part(x) for part in parts], -1) (q/k/v, gate/up): the rows stacked (exact)."""
        fused = new_stacked(cls, parts[0], sum(p.out_features for p in parts), parts)
        fused.register_buffer("values", torch.cat([p.values for p in parts]))
        fused.register_buffer("positions", torch.cat([p.positions for p in parts]))
        fused.register_buffer("bitmask", torch.cat([p.bitmask for p in parts]))
        return fused

    def dense_weight(self) -> torch.Tensor:
        """[N, K] the dense weight, torch only (the reference the kernels are tested against)."""
        n, k = self.out_features, self.in_features
        return torch.zeros(n, k, dtype=self.dtype).scatter_(1, columns_of(self.positions, k), self.values)

    # --- paths (sparse_paths.py) ----------------------------------------------------------------------------
    def _path_rows(self, x2d):
        return cpu_ops().sparse24_matmul_rows(x2d, self.values, self.positions)

    def _path_tiled(self, x2d):
        return cpu_ops().sparse24_matmul_tiled(x2d, self.values, self.positions, self.bitmask, TILE_BYTES)

    def decompress_into(self, out):
        cpu_ops().sparse24_decompress_out(self.values, self.positions, self.bitmask, out)

"""The paths the sparse linear methods share (sparse24_cpu, sparse24_int4_cpu, sparse_bitmask_cpu; kernel_plans.py
says what a path is): "rows", the method's compiled few-row kernel reading the compressed weight once for all
rows (decode); "tiled", an L2-sized tile decompressed at a time and multiplied by all rows with the dense GEMM;
"decompress", the whole weight decompressed into the reused buffer before the dense GEMM (prefill); and without
the compiled kernels "torch", the weight decompressed by torch on every call. A method gives `dense_weight()`
(torch), `decompress_into(out)` (compiled), `_path_rows` and `_path_tiled`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.linear.base import dequantize_buffer
from llmopt.runtime.executor.linear.kernel_plans import RowPathsMixin


class SparsePathsMixin(RowPathsMixin):
    rows_max = 32  # the few-row kernel is timed up to this many rows (each row re-reads the inputs, not W)
    decompress_min_rows = 9  # the fixed plan's switch to "decompress" (--linear-kernels fixed, and before a plan)

    def row_paths(self) -> dict[str, int | None]:
        if cpu_ops() is None:
            return {"torch": None}
        return {"rows": self.rows_max, "tiled": None, "decompress": None}

    def default_path(self, rows: int) -> str:
        if cpu_ops() is None:
            return "torch"
        return "rows" if rows < self.decompress_min_rows else "decompress"

    def dense_weight(self) -> torch.Tensor:
        raise NotImplementedError

    def decompress_into(self, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _path_decompress(self, x2d):
        weight = dequantize_buffer(self.out_features * self.in_features, self.dtype)
        weight = weight.view(self.out_features, self.in_features)
        self.decompress_into(weight)
        return F.linear(x2d, weight)

    def _path_torch(self, x2d):
        return F.linear(x2d, self.dense_weight())

"""CUDA: 2:4 sparse weights stored compressed (core/contract/sparse24.py), run without decompressing them in memory.
- `sparse24-cuda`: float values. Up to SEMI_STRUCTURED_ROWS rows (decode, speculative verification: bound by the
  weight's bytes) the Triton kernel (kernels/triton_sparse24.py) reads the compressed values and positions; more rows
  (prefill: bound by the multiply) go to the sparse tensor cores through torch's semi-structured tensors
  (cuSPARSELt or CUTLASS) where the GPU (compute capability 8.0+), dtype (fp16/bf16) and shape allow, else the
  Triton kernel as well. The semi-structured copy is another 0.56x of the dense bytes, held only where it is made.
- `sparse24-int4-triton`: 2:4 + 4-bit codes (QuantizedWeight.keep): the kept codes, positions and group scales,
  3 bits per weight plus scales, expanded in registers at every row count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.core.contract.sparse24 import Sparse24Weight, positions_2of4, unpack_mask
from llmopt.runtime.executor.linear.base import LinearMethod, register_linear_method, triton_installed

CHUNK = 32  # columns per position word
SEMI_STRUCTURED_ROWS = 16  # rows above which the sparse tensor cores take the product, where they can
SEMI_STRUCTURED_DTYPES = (torch.float16, torch.bfloat16)
SEMI_STRUCTURED_MULTIPLE = (32, 64)  # weight rows, columns: both backends' shape constraints for fp16/bf16


def semi_structured_weight(weight: Sparse24Weight, dtype: torch.dtype, device: torch.device):
    """The weight as torch's SparseSemiStructuredTensor on `device`, or None where the tensor cores cannot hold it
    (not CUDA, a GPU before Ampere, a dtype other than fp16/bf16, a shape off the backends' multiples)."""
    device = torch.device(device)
    n, k = weight.shape
    if (device.type != "cuda" or dtype not in SEMI_STRUCTURED_DTYPES
            or torch.cuda.get_device_capability(device) < (8, 0)
            or n % SEMI_STRUCTURED_MULTIPLE[0] or k % SEMI_STRUCTURED_MULTIPLE[1]):
        return None
    from torch.sparse import to_sparse_semi_structured

    return to_sparse_semi_structured(weight.decompress(dtype).to(device))


@register_linear_method
class TritonSparse24Linear(LinearMethod):
    name, device_type = "sparse24-cuda", "cuda"
    skips_pruned = True
    available = staticmethod(triton_installed)
    weight_type = Sparse24Weight

    def __init__(self, weight: Sparse24Weight, dtype, device):
        super().__init__(weight, dtype, device)
        from llmopt.runtime.executor.kernels.triton_sparse24 import pack_positions, pack_values

        self.register_buffer("positions", pack_positions(weight.positions_2of4()).to(device))  # [K/32, N]
        self.register_buffer("values", pack_values(weight.values, dtype).to(device))  # [K/2, N]
        self.semi_structured = semi_structured_weight(weight, dtype, device)  # (not a buffer: a tensor subclass)

    @classmethod
    def accepts(cls, weight, scheme, device):
        return (scheme.input_activations is None and weight.pattern == "2:4"
                and weight.shape[1] % CHUNK == 0)

    def _matmul(self, x2d):
        if self.semi_structured is not None and x2d.shape[0] > SEMI_STRUCTURED_ROWS:
            return F.linear(x2d, self.semi_structured)
        from llmopt.runtime.executor.kernels.triton_sparse24 import sparse24_matmul

        return sparse24_matmul(x2d, self.positions, self.values)


@register_linear_method
class TritonSparse24Int4Linear(LinearMethod):
    name, device_type = "sparse24-int4-triton", "cuda"
    skips_pruned = True  # (so before w4a16-triton, which would run the same codes densely)
    available = staticmethod(triton_installed)

    def __init__(self, qweight, dtype, device):
        super().__init__(qweight, dtype, device)
        from llmopt.runtime.executor.kernels.triton_sparse24 import pack_positions
        from llmopt.runtime.executor.kernels.triton_w4a16 import pack_code_words

        n, k = qweight.shape
        mask = unpack_mask(qweight.keep, k)  # [N, K]
        self.group_size = qweight.scheme.group_width(k)
        self.register_buffer("positions", pack_positions(positions_2of4(mask)).to(device))  # [K/32, N]
        self.register_buffer("codes", pack_code_words(qweight.q[mask].reshape(n, k // 2).to(device)))  # [K/16, N]
        self.register_buffer("scales", qweight.scales.t().to(dtype).contiguous().to(device))  # [G, N]
        self.register_buffer("zeros", qweight.zeros.t().to(dtype).contiguous().to(device))  # [G, N]

    @classmethod
    def accepts(cls, qweight, scheme, device):
        k = qweight.shape[1]
        w = qweight.scheme
        return (scheme.input_activations is None and qweight.keep is not None
                and w.type == "int" and w.bits <= 4 and qweight.has_trivial_g_idx and k % CHUNK == 0
                and w.group_width(k) % CHUNK == 0)

    def _matmul(self, x2d):
        from llmopt.runtime.executor.kernels.triton_sparse24 import sparse24_matmul

        return sparse24_matmul(x2d, self.positions, self.codes, self.scales, self.zeros, self.group_size)

"""Unstructured sparse weights stored compressed: compressed-tensors' `sparse-bitmask` layout, shared by export
(which writes it), the format reader and the runtime's unstructured sparse linear method.

A weight W [N, K] is stored as
- `compressed` [nnz]: the non-zeros of every row, row after row, in column order, in the weight's dtype;
- `bitmask` [N, ceil(K/8)] uint8: one bit per weight, set at a non-zero (numpy.packbits(..., bitorder="little")
  along each row, as in sparse-24-bitmask);
- `row_offsets` [N] int64: where each row's values start in `compressed`;
- `shape` [2] int64: N and K.
At a fraction s of zeros an fp32 weight takes (1 - s) + 1/32 of its dense bytes (0.53x at 50%, 0.33x at 70%),
plus 8 bytes per row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.core.contract.sparse24 import Sparse24Weight, pack_mask, unpack_mask
from llmopt.core.errors import ArtifactError

SUFFIXES = ("compressed", "bitmask", "shape", "row_offsets")


@dataclass
class BitmaskWeight:
    """An unstructured sparse linear weight in compressed form: values [nnz], bitmask [N, ceil(K/8)] uint8,
    row_offsets [N] int64, shape (N, K), bias [N] or None."""

    values: torch.Tensor
    bitmask: torch.Tensor
    row_offsets: torch.Tensor
    shape: tuple[int, int]
    bias: torch.Tensor | None = None
    pattern = "unstructured"
    # (the linear-method registry's questions of a weight: no quantization scheme, inputs not quantized)
    scheme = None
    input_activations = None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, bias: torch.Tensor | None = None) -> BitmaskWeight:
        keep = weight != 0
        counts = keep.sum(-1)
        return cls(weight[keep].contiguous(), pack_mask(keep), torch.cumsum(counts, 0) - counts,
                   tuple(weight.shape), bias)

    def mask(self) -> torch.Tensor:
        return unpack_mask(self.bitmask, self.shape[1])

    def decompress(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dense = torch.zeros(self.shape, dtype=self.values.dtype)
        dense[self.mask()] = self.values
        return dense if dtype is None else dense.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(the name every weight of the linear-method registry has for its dense form)"""
        return self.decompress(dtype)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        out = {"compressed": self.values.contiguous(), "bitmask": self.bitmask.contiguous(),
               "shape": torch.tensor(self.shape, dtype=torch.int64), "row_offsets": self.row_offsets.contiguous()}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> BitmaskWeight:
        n, k = (int(v) for v in tensors["shape"].reshape(-1))
        values, bitmask = tensors["compressed"].reshape(-1), tensors["bitmask"].view(torch.uint8)
        offsets = tensors["row_offsets"].reshape(-1).to(torch.int64)
        if tuple(bitmask.shape) != (n, (k + 7) // 8) or offsets.numel() != n:
            raise ArtifactError(f"sparse-bitmask weight of shape [{n}, {k}] with bitmask {list(bitmask.shape)} and "
                                f"{offsets.numel()} row offsets: expected [{n}, {(k + 7) // 8}] and {n}")
        weight = cls(values, bitmask, offsets, (n, k), tensors.get("bias"))
        set_bits = int(weight.mask().sum())
        if set_bits != values.numel():
            raise ArtifactError(f"sparse-bitmask weight [{n}, {k}]: {values.numel()} values for {set_bits} set bits; "
                                "re-create the artifact")
        return weight


def compressed_weight(weight: torch.Tensor, pattern: str, bias: torch.Tensor | None = None, name: str = "weight"):
    """The compressed form of a pruned [N, K] weight: a Sparse24Weight (2:4, 4:8) or a BitmaskWeight
    (unstructured)."""
    if pattern == "unstructured":
        return BitmaskWeight.from_dense(weight, bias)
    return Sparse24Weight.from_dense(weight, pattern, bias, name=name)

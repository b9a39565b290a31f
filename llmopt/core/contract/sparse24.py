"""Half-sparse weights stored compressed: compressed-tensors' `sparse-24-bitmask` layout, shared by export (which
writes it), the format reader and the runtime's sparse linear methods.

A weight W [N, K] in which every group of 4 consecutive input columns (2:4) — or of 8 (4:8) — holds at most half
non-zeros is stored as
- `compressed` [N, K/2]: the kept values of each row in column order, in the weight's dtype;
- `bitmask` [N, ceil(K/8)] uint8: one bit per weight, set where a value is kept, 8 columns per byte with the
  lowest column in the lowest bit (numpy.packbits(..., bitorder="little") along each row);
- `shape` [2, 1] int64: N and K.
Exactly half of each group's bits are set: a group with fewer non-zeros keeps some zeros as values (the first
zero columns of the group), as compressed-tensors' magnitude top-k does. That is 0.53x of fp32's bytes for an fp32
weight and 0.56x of bf16's for a bf16 one.

The runtime's 2:4 kernels read the positions as 2 bits per kept value (`positions_2of4`): [N, K/32] int32, bits
2i..2i+1 of word j give the column within its group of 4 of value 16j + i of the row — the same 4 bits per group of
4 as the bitmask, in the order the kernels consume them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.core.contract.sparsity import COMPRESSED_FORMAT, parse_nm
from llmopt.core.errors import ArtifactError

COMPRESSED_SUFFIXES = ("compressed", "bitmask", "shape")
HALF_PATTERNS = ("2:4", "4:8")  # the N:M patterns this layout holds (exactly half of each group kept)


@dataclass
class Sparse24Weight:
    """A half-sparse linear weight in compressed form. values [N, K/2] (any float dtype), bitmask [N, ceil(K/8)]
    uint8, shape (N, K), bias [N] or None; `pattern` the N:M structure it was pruned to."""

    values: torch.Tensor
    bitmask: torch.Tensor
    shape: tuple[int, int]
    pattern: str = "2:4"
    bias: torch.Tensor | None = None
    # (the linear-method registry's questions of a weight: no quantization scheme, inputs not quantized)
    scheme = None
    input_activations = None

    @classmethod
    def from_dense(cls, weight: torch.Tensor, pattern: str = "2:4", bias: torch.Tensor | None = None,
                   name: str = "weight") -> Sparse24Weight:
        keep = half_mask(weight, pattern, name)
        n, k = weight.shape
        return cls(weight[keep].reshape(n, k // 2).contiguous(), pack_mask(keep), (n, k), pattern, bias)

    def mask(self) -> torch.Tensor:
        """[N, K] bool: where a value is kept."""
        return unpack_mask(self.bitmask, self.shape[1])

    def decompress(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense [N, K] weight, zeros in place."""
        dense = torch.zeros(self.shape, dtype=self.values.dtype)
        dense[self.mask()] = self.values.reshape(-1)
        return dense if dtype is None else dense.to(dtype)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(the name every weight of the linear-method registry has for its dense form)"""
        return self.decompress(dtype)

    def to_tensors(self) -> dict[str, torch.Tensor]:
        """The tensors compressed-tensors stores for it, by suffix (the bias as `bias`)."""
        out = {"compressed": self.values.contiguous(), "bitmask": self.bitmask.contiguous(),
               "shape": torch.tensor(self.shape, dtype=torch.int64).reshape(-1, 1)}
        if self.bias is not None:
            out["bias"] = self.bias
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor], pattern: str = "2:4") -> Sparse24Weight:
        n, k = (int(v) for v in tensors["shape"].reshape(-1))
        values, bitmask = tensors["compressed"], tensors["bitmask"]
        if tuple(values.shape) != (n, k // 2) or tuple(bitmask.shape) != (n, (k + 7) // 8) or k % 2:
            raise ArtifactError(f"sparse weight of shape [{n}, {k}] with values {list(values.shape)} and bitmask "
                                f"{list(bitmask.shape)}: expected [{n}, {k // 2}] and [{n}, {(k + 7) // 8}]")
        if bitmask.dtype != torch.uint8:
            bitmask = bitmask.view(torch.uint8)
        return cls(values, bitmask, (n, k), pattern, tensors.get("bias"))

    def positions_2of4(self) -> torch.Tensor:
        """The runtime's 2:4 kernel layout of this weight's positions (`positions_2of4`)."""
        if self.pattern != "2:4":
            raise ValueError("2:4 positions need a 2:4 weight")
        return positions_2of4(self.mask())


def positions_2of4(mask: torch.Tensor) -> torch.Tensor:
    """[N, K] bool with exactly two kept per group of 4 -> [N, K/32] int32: each kept value's column within its
    group, 2 bits per value, 16 per word. K must be a multiple of 32."""
    n, k = mask.shape
    if k % 32:
        raise ValueError("2:4 positions need in_features a multiple of 32")
    columns = mask.reshape(n, k // 4, 4).nonzero()[:, 2].reshape(n, k // 32, 16).to(torch.int64)
    words = (columns << (2 * torch.arange(16))).sum(-1)  # [N, K/32], < 2^32
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed


def columns_of(positions: torch.Tensor, k: int) -> torch.Tensor:
    """positions_2of4's words [N, K/32] -> [N, K/2] int64: each kept value's column (its inverse)."""
    words = positions.to(torch.int64) & 0xFFFFFFFF
    within = (words.unsqueeze(-1) >> (2 * torch.arange(16))) & 3  # [N, K/32, 16]
    groups = torch.arange(k // 4).reshape(k // 32, 8).repeat_interleave(2, dim=1)  # [K/32, 16]
    return (groups * 4 + within).reshape(positions.shape[0], k // 2)


def half_mask(weight: torch.Tensor, pattern: str, name: str = "weight") -> torch.Tensor:
    """[N, K] bool: exactly half of each group of M columns kept — its non-zeros, then its first zeros.
    ArtifactError when a group holds more than N non-zeros (the weight is not N:M sparse) or K is no multiple
    of M."""
    n_keep, m = parse_nm(pattern)
    if pattern not in HALF_PATTERNS:
        raise ArtifactError(f"{COMPRESSED_FORMAT} holds 2:4 and 4:8 sparsity, not {pattern}")
    rows, k = weight.shape
    if k % m:
        raise ArtifactError(f"{name}: {k} input features are not whole groups of {m} for {pattern} storage")
    groups = weight.reshape(rows, k // m, m) != 0
    if groups.numel() and int(groups.sum(-1).max()) > n_keep:
        raise ArtifactError(f"{name} is not {pattern} sparse (a group of {m} holds more than {n_keep} non-zeros): "
                            "store it dense")
    # rank the columns: non-zeros first, then by column; keep the first n_keep of each group
    order = torch.argsort((~groups).to(torch.int8) * m + torch.arange(m, dtype=torch.int8), dim=-1, stable=True)
    keep = torch.zeros_like(groups)
    keep.scatter_(-1, order[..., :n_keep], True)
    return keep.reshape(rows, k)


def pack_mask(mask: torch.Tensor) -> torch.Tensor:
    """[N, K] bool -> [N, ceil(K/8)] uint8, bit j of byte b = column 8b + j (numpy.packbits, little bit order)."""
    n, k = mask.shape
    padded = torch.zeros(n, (k + 7) // 8 * 8, dtype=torch.uint8)
    padded[:, :k] = mask.to(torch.uint8)
    return (padded.reshape(n, -1, 8) << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)


def unpack_mask(bitmask: torch.Tensor, k: int) -> torch.Tensor:
    """[N, ceil(K/8)] uint8 -> [N, K] bool (pack_mask's inverse)."""
    bits = (bitmask.unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
    return bits.reshape(bitmask.shape[0], -1)[:, :k].bool()


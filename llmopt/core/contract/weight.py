"""What a quantized or sparse weight is, shared by compress, export and runtime.

Convention (every method and format works from it): a weight W [N out, K in] is split into groups of
`group_size` consecutive input columns (group_size = -1: one group per row). Each (row, group) has a scale
s > 0 and an unsigned zero point z in [0, 2^b - 1]; q = clamp(round(W / s) + z, 0, 2^b - 1) and
W ~ s * (q - z). Symmetric schemes fix z = 2^(b-1), so zero is exactly representable. A scheme with a float zero
point (QuantScheme.zero_point "float") lets z be any real number: q = clamp(round(W / s + z), 0, 2^b - 1), the same
W ~ s * (q - z), i.e. a float minimum m = -s z per group (GGUF Q4_1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.core.contract.grid import weight_grid
from llmopt.core.contract.scheme import QuantScheme
from llmopt.core.errors import ConfigError


@dataclass
class QuantizedWeight:
    """The result every quantizer produces and every format packs.

    q:      [N, K] uint8, unsigned codes in [0, 2^bits - 1]; for a float scheme the E4M3 values' bytes (FP8) or
            the E2M1 codes (FP4: core.contract.fp4)
    scales: [N, G] float32 (FP4: the block scales as stored, E4M3 values or powers of two)
    zeros:  [N, G] int32, unsigned zero points (2^(bits-1) when symmetric); float32 for a float zero point scheme
    g_idx:  [K] int32, group of each input column (k // group_size unless act-order permuted groups)
    input_activations: the scheme its inputs are quantized with at run time (W8A8), None for weight-only
    global_scale: [1] float32, NVFP4's per-tensor divisor of every block scale (w = v * s / global), else None
    input_global_scale: [1] float32, the calibrated global scale of NVFP4 inputs (nvfp4-a4), else None
    keep:   [N, ceil(K/8)] uint8, for a 2:4 sparse weight stored compressed: the bitmask of kept positions (bit j of
            byte b = column 8b + j; core.contract.sparse24); q still holds every code, the zero point at the others
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    scheme: QuantScheme
    bias: torch.Tensor | None = None
    input_activations: QuantScheme | None = None
    global_scale: torch.Tensor | None = None
    input_global_scale: torch.Tensor | None = None
    keep: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def has_trivial_g_idx(self) -> bool:
        return torch.equal(self.g_idx, default_g_idx(self.q.shape[1], self.scheme))

    def shard(self, dim: str, rank: int, world: int) -> QuantizedWeight:
        """Rank `rank`'s share of `world` equal slices along out- ("out": rows, column-parallel linears) or
        in-features ("in": whole groups of columns, row-parallel linears; the bias stays with rank 0, as the
        all-reduce adds the shares)."""
        n, k = self.shape
        if dim == "out":
            if n % world:
                raise ConfigError(f"{n} output features do not split into {world} equal shards")
            return self.select_rows([(rank * n // world, (rank + 1) * n // world)])
        if dim != "in":
            raise ValueError(f"dim must be 'in' or 'out', not {dim!r}")
        groups = self.scales.shape[1]
        if groups > 1 and groups % world:
            raise ConfigError(f"{k} input features in {groups} groups do not split into {world} shards of whole "
                              "groups")
        return self.narrow_columns(rank * k // world, (rank + 1) * k // world, keep_bias=rank == 0)

    def select_rows(self, ranges: list[tuple[int, int]]) -> QuantizedWeight:
        """The output features in `ranges` ([start, stop) pairs, concatenated in order): a column-parallel
        linear's share (several ranges for a checkpoint's packed q/k/v)."""
        rows = torch.cat([torch.arange(a, b) for a, b in ranges])
        bias = None if self.bias is None else self.bias[rows]
        return QuantizedWeight(self.q[rows], self.scales[rows], self.zeros[rows], self.g_idx, self.scheme, bias,
                               self.input_activations, self.global_scale, self.input_global_scale,
                               None if self.keep is None else self.keep[rows])

    def narrow_columns(self, start: int, stop: int, keep_bias: bool) -> QuantizedWeight:
        """Input features [start, stop) with their groups: a row-parallel linear's share. The cut must fall on
        group boundaries of a weight with static groups (a per-channel weight's one group per row applies to
        every column: each share keeps it); keep_bias: this share adds the bias (one share of all)."""
        n, k = self.shape
        groups = self.scales.shape[1]
        if groups == 1:
            group_cols, g_idx = slice(0, 1), self.g_idx[start:stop]
        else:
            width = k // groups
            if not self.has_trivial_g_idx or groups * width != k or start % width or stop % width:
                raise ConfigError(f"input features [{start}, {stop}) of {k} do not fall on whole groups of {width} "
                                  "columns (act-order permuted groups cannot be split along in-features): use "
                                  "another --tensor-parallel-size or an artifact with static groups")
            group_cols = slice(start // width, stop // width)
            g_idx = self.g_idx[start:stop] - start // width
        keep = None if self.keep is None or start % 8 else self.keep[:, start // 8: (stop + 7) // 8]
        return QuantizedWeight(self.q[:, start:stop], self.scales[:, group_cols], self.zeros[:, group_cols], g_idx,
                               self.scheme, self.bias if keep_bias else None, self.input_activations,
                               self.global_scale, self.input_global_scale, keep)

    def signed_codes(self) -> torch.Tensor:
        """[N, K] int8: the integer codes less 2^(bits-1), the symmetric zero point (compressed-tensors' stored
        int8 weight; the operand of the W8A8 kernels)."""
        return (self.q.to(torch.int16) - 2 ** (self.scheme.bits - 1)).to(torch.int8)

    @property
    def effective_scales(self) -> torch.Tensor:
        """[N, G] float32 the multiplier of each group's values (NVFP4: block scale / global scale)."""
        return self.scales if self.global_scale is None else self.scales / self.global_scale.float()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] weight s * decode(q), with each column's group taken from g_idx: s * (q - z) for integer codes,
        s * value for a float grid's (core.contract.grid)."""
        g = self.g_idx.long()
        scales = self.effective_scales[:, g]  # [N, K]
        return (scales * weight_grid(self.scheme.type).decode(self.q, self.zeros[:, g], self.scheme)).to(dtype)


def default_g_idx(in_features: int, scheme: QuantScheme) -> torch.Tensor:
    width = scheme.group_width(in_features)
    return (torch.arange(in_features) // width).to(torch.int32)

"""The contract at the bottom: what a quantized or sparse weight is, shared by compress, export and runtime.

Convention (every method and format works from it): a weight W [N out, K in] is split into groups of
`group_size` consecutive input columns (group_size = -1: one group per row). Each (row, group) has a scale
s > 0 and an unsigned zero point z in [0, 2^b - 1]; q = clamp(round(W / s) + z, 0, 2^b - 1) and
W ~ s * (q - z). Symmetric schemes fix z = 2^(b-1), so zero is exactly representable.

Sparsity is recorded in a model's config as `sparsity_config` (`sparsity_entry`): the structure
("unstructured" or an N:M pattern along the input dimension), the method, the targets and the measured
fraction of zeros; the weights themselves stay dense with zeros in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.core.errors import ConfigError

SUPPORTED_BITS = (2, 3, 4, 8)


@dataclass(frozen=True)
class QuantScheme:
    bits: int = 4
    group_size: int = 128  # -1 = per output channel
    sym: bool = True

    @property
    def maxq(self) -> int:
        return 2**self.bits - 1

    def num_groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else in_features // self.group_size

    def group_width(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size

    def check(self, in_features: int, name: str = "layer") -> None:
        if self.bits not in SUPPORTED_BITS:
            raise ConfigError(f"--bits {self.bits} is not supported: choose one of {SUPPORTED_BITS}")
        if self.group_size != -1 and (self.group_size < 1 or in_features % self.group_size):
            raise ConfigError(
                f"--group-size {self.group_size} does not divide {name}'s in_features ({in_features}): "
                "use a divisor of it (or -1 for per channel)"
            )


@dataclass
class QuantizedWeight:
    """The result every quantizer produces and every format packs.

    q:      [N, K] uint8, unsigned codes in [0, 2^bits - 1]
    scales: [N, G] float32
    zeros:  [N, G] int32, unsigned zero points (2^(bits-1) when symmetric)
    g_idx:  [K] int32, group of each input column (k // group_size unless act-order permuted groups)
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    g_idx: torch.Tensor
    scheme: QuantScheme
    bias: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def has_trivial_g_idx(self) -> bool:
        return torch.equal(self.g_idx, default_g_idx(self.q.shape[1], self.scheme))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[N, K] weight s * (q - z), with each column's group taken from g_idx."""
        g = self.g_idx.long()
        scales = self.scales[:, g]  # [N, K]
        zeros = self.zeros[:, g].float()
        return (scales * (self.q.float() - zeros)).to(dtype)


def default_g_idx(in_features: int, scheme: QuantScheme) -> torch.Tensor:
    width = scheme.group_width(in_features)
    return (torch.arange(in_features) // width).to(torch.int32)


def parse_nm(pattern: str) -> tuple[int, int]:
    """'2:4' -> (2, 4); ValueError (for the config validators) unless 0 < N < M."""
    try:
        n, m = (int(v) for v in pattern.split(":"))
    except ValueError:
        raise ValueError(f"pattern {pattern!r} is not N:M (e.g. 2:4)") from None
    if not 0 < n < m:
        raise ValueError(f"pattern {pattern}: need 0 < N < M")
    return n, m


def sparsity_entry(structure: str, method: str, target: float, ignore: list[str], measured: float,
                   targets: list[str]) -> dict:
    """What config.json records about a sparse model (llmopt's `sparsity_config`)."""
    return {"format": "dense", "sparsity_structure": structure, "method": method,
            "targets": targets, "ignore": ["lm_head", "model.embed_tokens", *ignore],
            "target_sparsity": round(target, 6), "global_sparsity": round(measured, 6)}

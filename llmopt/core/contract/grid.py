"""Weight grids: the numbers a weight scheme's codes stand for, one registered class per number format
(`QuantScheme.type`): integers with a scale and zero point (`int_grid`), FP8 / FP4 values under block scales
(`float_grid`), or a plug-in's own. Everything that differs between number formats is asked of the grid, so adding
one is adding a module that registers a grid (and, in the layers above, its compressed-tensors layout and any
linear method of its own):

- `check`: whether a [N, K] weight can be quantized with a scheme of it (bits, blocks);
- `ranges`: the scale and zero point of every (row, group) of a weight, fixed before rounding (RTN; GPTQ for
  grids without `adaptive_groups`, whose ranges GPTQ may instead form from the weights as updated so far);
- `round`: a block of values to codes under given scales and zero points;
- `decode`: codes back to values before scaling (the weight is scale x decode);
- `zero_code`: the code of the value 0 (a pruned weight kept exactly zero through GPTQ);
- `stored_zeros`: the zero points as the contract holds them;
- `methods`: the compress methods that round onto it.

This module imports no torch: a scheme's type is checked against the registered names before any grid loads;
the built-in grids load on first use."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from llmopt.core.registry import Registry

if TYPE_CHECKING:
    import torch

# (scheme: a core.contract.scheme.QuantScheme, not imported here: the scheme module checks its type against this
# registry)

# The built-in grids, by the QuantScheme.type they serve, loaded (with torch) on first use
BUILTIN_GRIDS = {"int": "llmopt.core.contract.int_grid", "float": "llmopt.core.contract.float_grid"}


@dataclass
class GridRanges:
    """A weight's ranges as a grid fixes them: scales [N, G] as stored, zero points [N, G] (float32; unused by
    grids without one: zeros), and NVFP4's global scale [1] (the stored scales are divided by it) or None."""

    scales: Any
    zeros: Any
    global_scale: Any = None

    @property
    def effective_scales(self):
        """[N, G] the multiplier of each group's decoded values."""
        return self.scales if self.global_scale is None else self.scales / self.global_scale


class WeightGrid:
    """One number format's maths (module docstring); every tensor is float32 unless said otherwise."""

    name: ClassVar[str]
    methods: ClassVar[tuple[str, ...]] = ("rtn", "gptq")
    adaptive_groups: ClassVar[bool] = False

    def check(self, scheme, in_features: int, name: str) -> None:
        """Raise ConfigError saying why `scheme` cannot quantize a linear with `in_features` columns (the group
        size dividing them is checked by the scheme itself)."""

    def ranges(self, w: torch.Tensor, scheme, mse: bool = False,
               global_scale: torch.Tensor | None = None) -> GridRanges:
        """The ranges of every (row, group) of `w` [N, K]: from each group's extremes, or searched (mse: the
        ranges minimising the rounding error); global_scale: a shared one given by the caller (NVFP4's fused
        linears)."""
        raise NotImplementedError

    def group_ranges(self, rows: torch.Tensor, scheme, mse: bool = False):
        """(scales [R], zeros [R]) of rows [R, W] each one group: GPTQ's groups formed as it goes (grids with
        adaptive_groups only)."""
        raise NotImplementedError

    def round(self, values: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
              scheme) -> torch.Tensor:
        """Codes of `values` [..., C] under effective scales and zero points broadcastable to them (float codes
        holding integers, or uint8)."""
        raise NotImplementedError

    def decode(self, codes: torch.Tensor, zeros: torch.Tensor, scheme) -> torch.Tensor:
        """The values codes [..., C] stand for before scaling (zero points broadcastable to them)."""
        raise NotImplementedError

    def zero_code(self, zeros: torch.Tensor) -> torch.Tensor:
        """The code of the value 0 for groups with these zero points."""
        raise NotImplementedError

    def stored_zeros(self, zeros: torch.Tensor, scheme) -> torch.Tensor:
        """Zero points [N, G] as the contract holds them (QuantizedWeight.zeros)."""
        return zeros.float()


WEIGHT_GRIDS: Registry[WeightGrid] = Registry("weight grid")


def register_weight_grid(cls: type) -> type:
    """Class decorator: add a grid (an instance of `cls`) to the registry under its `name`."""
    WEIGHT_GRIDS.register(cls.name)(cls())
    return cls


def grid_names() -> list[str]:
    """The scheme types a weight may have: the built-in grids' and the registered ones' (no torch imported)."""
    return sorted(set(BUILTIN_GRIDS) | set(WEIGHT_GRIDS.names()))


def weight_grid(type_name: str) -> WeightGrid:
    """The grid of scheme type `type_name` (the built-ins loaded on first use)."""
    if type_name not in WEIGHT_GRIDS:  # (an unknown name's error lists the built-ins too)
        for module in BUILTIN_GRIDS.values():
            importlib.import_module(module)
    return WEIGHT_GRIDS.get(type_name)

"""The thin lifecycle shared by the sparsity methods, and their registry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from llmopt.compress.base import Quantizer
from llmopt.core.adapters import get_module
from llmopt.core.registry import Registry
from llmopt.prune.config import SparsityConfig
from llmopt.prune.masks import nm_mask, unstructured_mask


class Pruner(Quantizer):
    """Like a Quantizer (same pipeline, same ignore rules) but the result of each linear is its mask."""

    changes_only_stage_linears = True  # see calibration.LayerwiseAlgorithm

    def __init__(self, config: SparsityConfig, model: nn.Module):
        super().__init__(config, model)
        self.masks: dict[str, torch.Tensor] = {}

    def select(self, scores: torch.Tensor, per_row: bool) -> torch.Tensor:
        nm = self.config.nm
        if nm is not None:
            return nm_mask(scores, *nm)
        return unstructured_mask(scores, self.config.sparsity, per_row=per_row)

    def apply(self, layer_index: int, name: str, module: nn.Linear, mask: torch.Tensor) -> None:
        module.weight.data[mask.to(module.weight.device)] = 0
        self.masks[self.full_name(layer_index, name)] = mask.cpu()

    def scores(self, layer_index: int, name: str, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    per_row = False

    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        for name in names:
            module = get_module(layer, name)
            scores = self.scores(layer_index, name, module.weight.data.float())
            if self.is_ignored(self.full_name(layer_index, name)):
                continue
            self.apply(layer_index, name, module, self.select(scores, self.per_row))


@dataclass(frozen=True)
class PruneMethod:
    name: str
    pruner_cls: type[Pruner]


PRUNE_METHODS: Registry[PruneMethod] = Registry("pruning method")

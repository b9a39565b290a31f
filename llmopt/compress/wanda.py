"""Wanda (Sun et al. 2023): score |W_ij| * ||X_j||_2, compared within each output row; no weight update."""

from __future__ import annotations

import torch

from llmopt.compress.base import PRUNE_METHODS, MethodSpec, Pruner
from llmopt.compress.config import SparsityConfig


def wanda_scores(weight: torch.Tensor, input_sq_norms: torch.Tensor) -> torch.Tensor:
    """|W| [N, K] times the L2 norm of each input channel over the calibration tokens ([K] squared norms)."""
    return weight.abs() * input_sq_norms.sqrt().unsqueeze(0)


class WandaPruner(Pruner):
    per_row = True

    def __init__(self, config, model):
        super().__init__(config, model)
        self.sq_norms: dict[str, torch.Tensor] = {}

    def add_batch(self, layer_index, name, module, inputs):
        x = inputs.reshape(-1, inputs.shape[-1]).float()
        self.sq_norms[name] = self.sq_norms.get(name, 0) + x.pow(2).sum(0).cpu()

    def scores(self, layer_index, name, weight):
        return wanda_scores(weight.cpu(), self.sq_norms.pop(name))


PRUNE_METHODS.add("wanda", MethodSpec("wanda", SparsityConfig, WandaPruner))

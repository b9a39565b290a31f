"""Magnitude pruning: no data; the smallest |W| of each matrix go (N:M: within each group of M)."""

from __future__ import annotations

from llmopt.compress.base import PRUNE_METHODS, MethodSpec, Pruner
from llmopt.compress.config import SparsityConfig


class MagnitudePruner(Pruner):
    per_row = False  # one threshold per matrix, the classic layer-wise baseline

    def scores(self, layer_index, name, weight):
        return weight.abs()


PRUNE_METHODS.add("magnitude", MethodSpec("magnitude", SparsityConfig, MagnitudePruner))

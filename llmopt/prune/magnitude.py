"""Magnitude pruning: no data; the smallest |W| of each matrix go (N:M: within each group of M)."""

from __future__ import annotations

from llmopt.prune.base import PRUNE_METHODS, PruneMethod, Pruner


class MagnitudePruner(Pruner):
    per_row = False  # one threshold per matrix, the classic layer-wise baseline

    def scores(self, layer_index, name, weight):
        return weight.abs()


PRUNE_METHODS.add("magnitude", PruneMethod("magnitude", MagnitudePruner))

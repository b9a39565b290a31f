"""Which weights to prune, given importance scores: pure tensor functions. Masks are True where pruned."""

from __future__ import annotations

import torch

from llmopt.core.errors import ConfigError


def check_nm_fits(linears: dict, nm: tuple[int, int]) -> None:
    """Fail before any work unless M divides every linear's in_features (`linears`: name -> nn.Linear)."""
    n, m = nm
    for name, linear in linears.items():
        if linear.in_features % m:
            raise ConfigError(f"pattern {n}:{m} needs in_features divisible by {m}: {name} has {linear.in_features}")


def unstructured_mask(scores: torch.Tensor, sparsity: float, per_row: bool = False) -> torch.Tensor:
    """Prune the `sparsity` fraction of lowest scores, over the whole matrix or within each output row."""
    if per_row:
        num_pruned = int(round(scores.shape[1] * sparsity))
        idx = torch.topk(scores, num_pruned, dim=1, largest=False).indices
        return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, idx, True)
    num_pruned = int(round(scores.numel() * sparsity))
    idx = torch.topk(scores.flatten(), num_pruned, largest=False).indices
    return torch.zeros(scores.numel(), dtype=torch.bool).scatter_(0, idx, True).view_as(scores)


def nm_mask(scores: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """Prune the M - N lowest scores in every M consecutive inputs of each row of `scores` [N_out, K]."""
    rows, k = scores.shape
    if k % m:
        raise ConfigError(f"pattern {n}:{m} needs in_features divisible by {m} (got {k})")
    grouped = scores.reshape(rows, k // m, m)
    idx = torch.topk(grouped, m - n, dim=2, largest=False).indices
    return torch.zeros_like(grouped, dtype=torch.bool).scatter_(2, idx, True).view(rows, k)



"""The N:M sparsity check the pruning tests assert with."""

import torch


def check_nm(weight: torch.Tensor, n: int, m: int) -> bool:
    """True if every M consecutive inputs of every row hold at most N non-zeros."""
    rows, k = weight.shape
    return bool(((weight.reshape(rows, k // m, m) != 0).sum(-1) <= n).all())

"""SparseGPT (Frantar & Alistarh 2023): choose the mask block by block from w^2 / [H^-1]_jj^2 and update
the remaining weights through the inverse Hessian to absorb each pruned weight's error (GPTQ's machinery).
See IST-DASLab sparsegpt `sparsegpt.py` for the original."""

from __future__ import annotations

import torch

from llmopt.compress.base import PRUNE_METHODS, MethodSpec, Pruner
from llmopt.compress.config import SparsityConfig
from llmopt.compress.hessian import HessianModifierMixin, inverse_hessian_cholesky
from llmopt.core.adapters import get_module


def sparsegpt_prune_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    sparsity: float | None = None,
    nm: tuple[int, int] | None = None,
    damp: float = 0.01,
    block_size: int = 128,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prune `weight` [N, K] to `sparsity` (per block of columns) or to an N:M pattern along K.

    Returns (new weight [N, K] with zeros in place, mask [N, K] True where pruned).
    """
    n_out, k = weight.shape
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    hinv = inverse_hessian_cholesky(h, damp)
    mask = torch.zeros(n_out, k, dtype=torch.bool)
    if nm is not None:
        block_size = max(block_size // nm[1], 1) * nm[1]  # whole M-groups per block
    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].t().contiguous()  # [B, N]: one row per column, so updates touch contiguous memory
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        d = torch.diag(hinv1)
        if nm is None:  # adaptive mask for the whole block
            saliency = w1.pow(2) / d.pow(2).unsqueeze(1)
            num = int(round(saliency.numel() * sparsity))
            block_mask = torch.zeros(saliency.numel(), dtype=torch.bool)
            block_mask[torch.topk(saliency.flatten(), num, largest=False).indices] = True
            block_mask = block_mask.view_as(w1)
        else:
            block_mask = torch.zeros_like(w1, dtype=torch.bool)
        for i in range(i2 - i1):
            if nm is not None and i % nm[1] == 0:
                # Saliency of the next M columns, from the weights as updated so far: [M, N].
                saliency = w1[i:i + nm[1]].pow(2) / d[i:i + nm[1]].pow(2).unsqueeze(1)
                idx = torch.topk(saliency, nm[1] - nm[0], dim=0, largest=False).indices
                block_mask[i:i + nm[1]].scatter_(0, idx, True)
            col = w1[i]
            err = torch.where(block_mask[i], col, torch.zeros_like(col)) / hinv1[i, i]  # (col - new) / d
            w1[i:].addr_(hinv1[i, i:], err, alpha=-1)
            w1[i].masked_fill_(block_mask[i], 0)
            err1[i] = err
        w[:, i1:i2] = w1.t()
        mask[:, i1:i2] = block_mask.t()
        w[:, i2:] -= err1.t() @ hinv[i1:i2, i2:]
    w[mask] = 0
    return w, mask


class SparseGPTPruner(HessianModifierMixin, Pruner):
    def __init__(self, config, model):
        super().__init__(config, model)
        self.init_hessians()

    def stages(self, adapter):
        return list(adapter.sequential)

    def process(self, layer_index, layer, names):
        for name in names:
            module = get_module(layer, name)
            if self.is_ignored(self.full_name(layer_index, name)):
                continue
            new, mask = sparsegpt_prune_weight(module.weight.data, self.hessians.get(name).hessian,
                                               self.config.sparsity, self.config.nm, self.config.damp,
                                               self.config.block_size)
            module.weight.data.copy_(new)  # in place: see Quantizer.store
            self.record(layer_index, name, mask)
        self.release_hessians()


PRUNE_METHODS.add("sparsegpt", MethodSpec("sparsegpt", SparsityConfig, SparseGPTPruner))

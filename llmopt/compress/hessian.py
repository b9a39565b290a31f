"""Input Hessians of linear layers, shared by GPTQ and SparseGPT.

H = 2/n * sum x x^T over the calibration inputs x [K] of a linear, accumulated in fp32.
"""

from __future__ import annotations

import math

import torch

from llmopt.core.errors import LLMOptError


class HessianAccumulator:
    """Running H = 2/n * X^T X in fp32, fed batches of inputs [tokens, K].

    Given the full-precision model's inputs for the same tokens (`reference`), it also keeps
    cross = 2/n * (X_ref - X)^T X [K, K], what GPTAQ needs to match the full-precision outputs.
    """

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.cross: torch.Tensor | None = None
        self.num_samples = 0

    def add(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        n = x.shape[0]
        keep = self.num_samples / (self.num_samples + n)
        self.hessian *= keep
        self.num_samples += n
        x = math.sqrt(2 / self.num_samples) * x
        self.hessian.addmm_(x.t(), x)
        if reference is not None:
            if self.cross is None:
                self.cross = torch.zeros_like(self.hessian)
            self.cross *= keep
            dx = math.sqrt(2 / self.num_samples) * reference.reshape(-1, x.shape[-1]).float() - x
            self.cross.addmm_(dx.t(), x)


def inverse_hessian_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 after dampening by damp * mean(diag H); retries with more damping."""
    diag_mean = torch.mean(torch.diag(hessian))
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    for attempt in range(6):
        h = hessian + (damp * 10**attempt) * diag_mean * eye
        chol, info = torch.linalg.cholesky_ex(h)
        if info == 0:
            inv = torch.cholesky_inverse(chol)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if info == 0:
                return upper
    raise LLMOptError("the Hessian stays singular after dampening: use more calibration samples or raise --damp")


class SharedInputHessians:
    """Hessians per linear name for one stage of the calibration pipeline. Linears fed the same tensor
    (q/k/v, gate/up) share one accumulator, so each distinct input is accumulated once."""

    def __init__(self):
        self.by_name: dict[str, HessianAccumulator] = {}
        self._last = None  # (input tensor, its accumulator)

    def add(self, name: str, in_features: int, inputs: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        if self._last is not None and self._last[0] is inputs:
            self.by_name[name] = self._last[1]
            return
        acc = self.by_name.get(name)
        if acc is None:
            acc = self.by_name[name] = HessianAccumulator(in_features, inputs.device)
        acc.add(inputs, reference)
        self._last = (inputs, acc)

    def take(self, name: str) -> HessianAccumulator:
        self._last = None
        return self.by_name.pop(name)

    def pop(self, name: str) -> torch.Tensor:
        return self.take(name).hessian

"""Input Hessians of linear layers, shared by GPTQ and SparseGPT.

H = 2/n * sum x x^T over the calibration inputs x [K] of a linear, accumulated in fp32.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from llmopt.core.errors import LLMOptError


@contextmanager
def _exact_reduced_precision_matmul(enabled: bool):
    """Let fp32 matmuls run on bf16 units (CPU: oneDNN/AMX, 3x faster here; CUDA: TF32) with fp32 accumulation
    and output. Exact when every operand is bf16-representable (inputs from bf16 forwards, unscaled): the
    products are exact and only the summation order differs from a plain fp32 GEMM."""
    if not enabled:
        yield
        return
    backends = [(torch.backends.mkldnn.matmul, "bf16"), (torch.backends.cuda.matmul, "tf32")]
    previous = [b.fp32_precision for b, _ in backends]
    try:
        for b, precision in backends:
            b.fp32_precision = precision
        yield
    finally:
        for (b, _), value in zip(backends, previous):
            b.fp32_precision = value


class HessianAccumulator:
    """Running H = 2/n * X^T X in fp32, fed batches of inputs [tokens, K].

    Given the full-precision model's inputs for the same tokens (`reference`), it also keeps
    cross = 2/n * (X_ref - X)^T X, what GPTAQ needs to match the full-precision outputs. H is exact for bf16
    inputs (see _exact_reduced_precision_matmul). The cross term is a correction, so for bf16 inputs it takes
    the plain bf16 GEMM: (X_ref - X) rounded to bf16, each batch's product rounded to bf16 before the fp32
    sum (relative error ~2e-3 per batch, measured), for 40% less time than an fp32-output GEMM on SmolLM2's
    down projection (K = 1536).
    """

    # From this width on, H's GEMM computes only the block rows' upper trapezoids (H is symmetric): 3 row
    # blocks do 2/3 of the work, 34% less time at K = 1536 here; at K = 576 the smaller GEMMs lose it again.
    SYMMETRIC_FROM = 1024
    ROW_BLOCKS = 3

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self._hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self._lower_stale = False  # True while only the upper triangle (and diagonal blocks) is accumulated
        self.cross: torch.Tensor | None = None
        self.num_samples = 0

    @property
    def hessian(self) -> torch.Tensor:
        """H [K, K], complete (the lower triangle mirrored from the upper one if it was left out)."""
        if self._lower_stale:
            h = self._hessian
            h.copy_(h.triu() + h.triu(1).t())
            self._lower_stale = False
        return self._hessian

    def _accumulate(self, x: torch.Tensor, keep: float, scale: float) -> None:
        """H <- keep * H + scale * x^T x for x [n, K] fp32."""
        k = x.shape[1]
        if k < self.SYMMETRIC_FROM:
            self._hessian.addmm_(x.t(), x, beta=keep, alpha=scale)
            return
        block = -(-k // self.ROW_BLOCKS)
        for first in range(0, k, block):
            rows = slice(first, first + block)
            self._hessian[rows, first:].addmm_(x[:, rows].t(), x[:, first:], beta=keep, alpha=scale)
        self._lower_stale = True

    def add(self, x: torch.Tensor, reference: torch.Tensor | None = None) -> None:
        bf16 = x.dtype == torch.bfloat16 and (reference is None or reference.dtype == torch.bfloat16)
        x = x.reshape(-1, x.shape[-1])
        n = x.shape[0]
        keep = self.num_samples / (self.num_samples + n)
        self.num_samples += n
        scale = 2 / self.num_samples  # applied to the product, so the operands stay exactly as given
        wide = x.float()
        with _exact_reduced_precision_matmul(bf16):
            self._accumulate(wide, keep, scale)
        if reference is None:
            return
        if self.cross is None:
            self.cross = torch.zeros_like(self._hessian)
        drift = reference.reshape(-1, x.shape[-1]) - x  # [n, K]; bf16 - bf16 rounds to bf16
        inputs = x if bf16 else wide
        self.cross.mul_(keep).add_(torch.mm(drift.t(), inputs).float(), alpha=scale)


def inverse_hessian_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of H^-1 after dampening by damp * mean(diag H); retries with more damping."""
    diag_mean = torch.mean(torch.diag(hessian))
    eye = torch.eye(hessian.shape[0], dtype=hessian.dtype, device=hessian.device)
    # Each [K, K] intermediate is dropped as soon as the next exists: at K = 2816 one is 32 MB, and their sum was
    # most of a streamed (--max-memory) GPTQ run's peak.
    for attempt in range(6):
        h = hessian + (damp * 10**attempt) * diag_mean * eye
        chol, info = torch.linalg.cholesky_ex(h)
        del h
        if info == 0:
            inv = torch.cholesky_inverse(chol)
            del chol
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            del inv
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

    def get(self, name: str) -> HessianAccumulator:
        return self.by_name[name]

    def clear(self) -> None:
        """Drop the stage's statistics (after every modifier sharing them has processed the stage)."""
        self.by_name.clear()
        self._last = None


class HessianModifierMixin:
    """For modifiers that work from each linear's input Hessian (GPTQ, SparseGPT). Alone, a modifier owns its
    statistics and drops them after each stage; in a ModifierList, modifiers share one SharedInputHessians that
    the list fills once per input and clears after the last of them has processed the stage."""

    uses_hessians = True

    def init_hessians(self) -> None:
        self.hessians = SharedInputHessians()
        self.owns_hessians = True

    def add_batch(self, layer_index, name, module, inputs, reference=None):
        self.hessians.add(name, module.in_features, inputs, reference)

    def release_hessians(self) -> None:
        if self.owns_hessians:
            self.hessians.clear()

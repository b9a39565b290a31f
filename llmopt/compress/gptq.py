"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each column's error onto the
columns not yet quantized through the inverse Hessian of the layer's inputs. Pure tensor functions.

H = 2/n * sum x x^T over the calibration inputs x [K] of a linear. See IST-DASLab gptq.py for the original.
"""

from __future__ import annotations

import math

import torch

from llmopt.compress.base import QUANT_METHODS, QuantMethod, Quantizer
from llmopt.compress.config import GPTQConfig
from llmopt.compress.quant import QuantizedWeight, QuantScheme, compute_qparams, default_g_idx, mse_qparams
from llmopt.core.errors import LLMOptError


class HessianAccumulator:
    """Running H = 2/n * X^T X in fp32, fed batches of inputs [tokens, K]."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu"):
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.num_samples = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        n = x.shape[0]
        self.hessian *= self.num_samples / (self.num_samples + n)
        self.num_samples += n
        x = math.sqrt(2 / self.num_samples) * x
        self.hessian.addmm_(x.t(), x)


def _inverse_hessian_cholesky(hessian: torch.Tensor, damp: float) -> torch.Tensor:
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
    raise LLMOptError("GPTQ: the Hessian stays singular after dampening: use more calibration samples or raise --damp")


def gptq_quantize_weight(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: QuantScheme,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    static_groups: bool = True,
    mse: bool = False,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> QuantizedWeight:
    """GPTQ-quantize `weight` [N, K] given the input Hessian [K, K].

    act_order: quantize columns by decreasing Hessian diagonal (desc_act). With static_groups the group
    parameters come from the original weight in natural order, so g_idx stays k // group_size.
    mask: [N, K] bool of weights that must stay exactly zero (a sparsity pattern); requires sym.

    >>> qw = gptq_quantize_weight(linear.weight, acc.hessian, QuantScheme(4, 64))  # doctest: +SKIP
    """
    n, k = weight.shape
    scheme.check(k)
    if mask is not None and not scheme.sym:
        raise LLMOptError("keeping a sparsity mask through GPTQ needs --sym (zero must be representable)")
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    width = scheme.group_width(k)
    qparams = mse_qparams if mse else compute_qparams

    static = None
    if static_groups or scheme.group_size == -1:
        flat = w.reshape(n * (k // width), width)
        s, z = qparams(flat, scheme)
        static = (s.view(n, -1), z.view(n, -1))

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
        if mask is not None:
            mask = mask[:, perm]
    hinv = _inverse_hessian_cholesky(h, damp)

    codes = torch.zeros(k, n, dtype=torch.float32)  # filled column by column: rows are columns here
    num_groups = k // width
    scales_t = torch.zeros(num_groups, n) if static is None else static[0].t().contiguous()  # [G, N]
    zeros_t = torch.zeros(num_groups, n) if static is None else static[1].t().contiguous()
    # Natural group of the column at each (possibly permuted) position, as plain ints for the hot loop.
    column_group = (torch.arange(k) // width if perm is None else perm // width).tolist()
    group_at = column_group if static is not None else [col // width for col in range(k)]
    mask_t = None if mask is None else mask.t().contiguous()

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].t().contiguous()  # [B, N]: one row per column, so updates touch contiguous memory
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = i1 + i
            g = group_at[col]
            if static is None and col % width == 0:
                # Groups form in quantization order, from the weights as updated so far.
                upcoming = torch.cat([w1[i:], w[:, i2:].t()], dim=0)[:width]  # [width, N]
                s, z = qparams(upcoming.t(), scheme)
                scales_t[g], zeros_t[g] = s, z
            wcol = w1[i]
            qcol = torch.clamp(torch.round(wcol / scales_t[g]) + zeros_t[g], 0, scheme.maxq)
            if mask_t is not None:  # pruned weights stay exactly zero: code = zero point
                qcol = torch.where(mask_t[col], zeros_t[g], qcol)
            dq = scales_t[g] * (qcol - zeros_t[g])
            codes[col] = qcol
            err = (wcol - dq) / hinv1[i, i]
            w1[i:].addr_(hinv1[i, i:], err, alpha=-1)
            err1[i] = err
        w[:, i2:] -= err1.t() @ hinv[i1:i2, i2:]

    codes = codes.t()
    scales, zeros = scales_t.t(), zeros_t.t()
    g_idx = torch.tensor(group_at, dtype=torch.int32)
    if perm is not None:
        inv = torch.argsort(perm)
        codes, g_idx = codes[:, inv], g_idx[inv]
    return QuantizedWeight(codes.to(torch.uint8).contiguous(), scales.float().contiguous(),
                           zeros.to(torch.int32).contiguous(), g_idx, scheme,
                           None if bias is None else bias.detach().float().clone())


class GPTQQuantizer(Quantizer):
    """Collects each linear's Hessian during the pipeline's stage pass, then GPTQ-quantizes the stage."""

    def __init__(self, config: GPTQConfig, model):
        super().__init__(config, model)
        self.hessians: dict[str, HessianAccumulator] = {}
        self.masks: dict[str, torch.Tensor] = {}  # full name -> [N, K] bool, weights pinned at zero
        self._last_input = None  # (tensor, accumulator): linears fed the same tensor share one Hessian

    def stages(self, adapter):
        return list(adapter.sequential) if self.config.true_sequential else [adapter.linears]

    def add_batch(self, layer_index, name, module, inputs):
        if self._last_input is not None and self._last_input[0] is inputs:
            self.hessians[name] = self._last_input[1]
            return
        acc = self.hessians.get(name)
        if acc is None:
            acc = self.hessians[name] = HessianAccumulator(module.in_features, inputs.device)
        acc.add(inputs)
        self._last_input = (inputs, acc)

    def process(self, layer_index, layer, names):
        from llmopt.core.adapters import get_module

        self._last_input = None
        for name in names:
            module = get_module(layer, name)
            full = self.full_name(layer_index, name)
            acc = self.hessians.pop(name)
            if self.is_ignored(full):
                continue
            qweight = gptq_quantize_weight(
                module.weight.data, acc.hessian, self.config.scheme, damp=self.config.damp,
                block_size=self.config.block_size, act_order=self.config.act_order,
                static_groups=self.config.static_groups, mse=self.config.mse,
                mask=self.masks.get(full), bias=module.bias,
            )
            self.store(layer_index, name, module, qweight)


QUANT_METHODS.add("gptq", QuantMethod("gptq", GPTQConfig, GPTQQuantizer))

"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each column's error onto the
columns not yet quantized through the inverse Hessian of the layer's inputs. Pure tensor functions.

H = 2/n * sum x x^T over the calibration inputs x [K] of a linear. See IST-DASLab gptq.py for the original.
"""

from __future__ import annotations

import torch

from llmopt.compress.base import QUANT_METHODS, MethodSpec, Quantizer
from llmopt.compress.config import GPTQConfig
from llmopt.core.contract import QuantizedWeight, QuantScheme
from llmopt.core.contract.grid import weight_grid
from llmopt.compress.hessian import HessianModifierMixin, inverse_hessian_cholesky
from llmopt.core.adapters import get_module
from llmopt.core.errors import LLMOptError


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
    cross: torch.Tensor | None = None,
    cross_alpha: float = 1.0,
) -> QuantizedWeight:
    """GPTQ-quantize `weight` [N, K] given the input Hessian [K, K].

    act_order: quantize columns by decreasing Hessian diagonal (desc_act). With static_groups the group
    parameters come from the original weight in natural order, so g_idx stays k // group_size.
    mask: [N, K] bool of weights that must stay exactly zero (a sparsity pattern); requires sym.
    cross: [K, K] = 2/n (X_ref - X)^T X from HessianAccumulator (GPTAQ, Li et al. 2025): besides each column's
    rounding error, the update also cancels the drift between the quantized model's inputs X and the
    full-precision model's X_ref, so the layer matches the full-precision outputs rather than its own.
    The correction P = alpha * triu(cross @ U^T, 1) @ U (U the upper Cholesky factor of H^-1) moves the
    columns not yet quantized by w_j P[j, :] as column j is quantized (alpha = 1: the exact correction).

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
    if cross is not None:
        cross = cross.detach().float().clone()
        cross[:, dead] = 0
    width = scheme.group_width(k)
    grid = weight_grid(scheme.type)

    # Ranges fixed from the weight before any rounding (float grids always; integer ones with static groups or
    # one group per row), else each group's formed from the weights as updated so far, as it is reached.
    ranges = None
    if not grid.adaptive_groups or static_groups or scheme.group_size == -1:
        ranges = grid.ranges(w, scheme, mse)

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm[:, None], perm]  # one gather: no [K, K] intermediate
        if cross is not None:
            cross = cross[perm[:, None], perm]
        if mask is not None:
            mask = mask[:, perm]
    hinv = inverse_hessian_cholesky(h, damp)
    del h  # [K, K] copies are freed once used: the column loop below needs only hinv (and correction)
    correction = None if cross is None else cross_alpha * (cross @ hinv.t()).triu_(1) @ hinv  # [K, K]
    cross = None

    codes = torch.zeros(k, n, dtype=torch.float32)  # filled column by column: rows are columns here
    num_groups = k // width
    scales_t = torch.zeros(num_groups, n) if ranges is None else ranges.effective_scales.t().contiguous()  # [G, N]
    zeros_t = torch.zeros(num_groups, n) if ranges is None else ranges.zeros.t().contiguous()
    # Natural group of the column at each (possibly permuted) position, as plain ints for the hot loop.
    column_group = (torch.arange(k) // width if perm is None else perm // width).tolist()
    group_at = column_group if ranges is not None else [col // width for col in range(k)]
    mask_t = None if mask is None else mask.t().contiguous()

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].t().contiguous()  # [B, N]: one row per column, so updates touch contiguous memory
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        before1 = None if correction is None else torch.empty_like(w1)  # each column just before rounding
        for i in range(i2 - i1):
            col = i1 + i
            g = group_at[col]
            if ranges is None and col % width == 0:
                # Groups form in quantization order, from the weights as updated so far.
                upcoming = torch.cat([w1[i:], w[:, i2:].t()], dim=0)[:width]  # [width, N]
                scales_t[g], zeros_t[g] = grid.group_ranges(upcoming.t(), scheme, mse)
            wcol = w1[i]
            qcol = grid.round(wcol, scales_t[g], zeros_t[g], scheme)
            if mask_t is not None:  # pruned weights stay exactly zero: the code of 0
                qcol = torch.where(mask_t[col], grid.zero_code(zeros_t[g]), qcol)
            dq = scales_t[g] * grid.decode(qcol, zeros_t[g], scheme)
            codes[col] = qcol
            err = (wcol - dq) / hinv1[i, i]
            if before1 is not None:
                before1[i] = wcol
                w1[i:].addr_(correction[col, col:i2], before1[i])  # P[j, j] = 0: column j itself stays
            w1[i:].addr_(hinv1[i, i:], err, alpha=-1)
            err1[i] = err
        w[:, i2:] -= err1.t() @ hinv[i1:i2, i2:]
        if before1 is not None:
            w[:, i2:] += before1.t() @ correction[i1:i2, i2:]

    codes = codes.t()
    scales, zeros = (scales_t.t(), zeros_t.t()) if ranges is None else (ranges.scales, ranges.zeros)
    g_idx = torch.tensor(group_at, dtype=torch.int32)
    if perm is not None:
        inv = torch.argsort(perm)
        codes, g_idx = codes[:, inv], g_idx[inv]
    return QuantizedWeight(codes.to(torch.uint8).contiguous(), scales.float().contiguous(),
                           grid.stored_zeros(zeros, scheme).contiguous(), g_idx, scheme,
                           None if bias is None else bias.detach().float().clone(),
                           global_scale=None if ranges is None else ranges.global_scale)


class GPTQQuantizer(HessianModifierMixin, Quantizer):
    """Collects each linear's Hessian during the pipeline's stage pass, then GPTQ-quantizes the stage.

    Weights that must stay zero stay zero (their code is the zero point): those a pruner earlier in the same
    pass removed (`prior_masks`), or the exact zeros of a sparse model (config.sparsity_config).
    """

    changes_only_stage_linears = True  # see calibration.LayerwiseAlgorithm

    def __init__(self, config: GPTQConfig, model):
        super().__init__(config, model)
        self.init_hessians()
        self.keep_sparsity = getattr(model.config, "sparsity_config", None) is not None

    def stages(self, adapter):
        return list(adapter.sequential) if self.config.true_sequential else [adapter.linears]

    @property
    def uses_reference_inputs(self) -> bool:
        """GPTAQ: the pipeline also runs the full-precision layers and passes their inputs to add_batch."""
        return self.config.gptaq

    def process(self, layer_index, layer, names):
        # Linears fed the same input share one Hessian (q/k/v, gate/up). GPTQ treats the rows of a weight
        # independently given H, so they are quantized as one stacked weight: the same result, with a third of
        # the column loop's per-column overhead for q/k/v.
        groups: dict[int, tuple[object, list]] = {}  # id(statistics) -> (statistics, [(name, module)])
        for name in names:
            statistics = self.hessians.get(name)
            if not self.is_ignored(self.full_name(layer_index, name)):
                groups.setdefault(id(statistics), (statistics, []))[1].append((name, get_module(layer, name)))
        for statistics, members in groups.values():
            weight = torch.cat([module.weight.data for _, module in members])  # [sum N, K]
            stacked = gptq_quantize_weight(
                weight, statistics.hessian, self.config.weight_scheme,
                mask=self.kept_zeros(layer_index, members, weight),
                damp=self.config.damp, block_size=self.config.block_size, act_order=self.config.act_order,
                static_groups=self.config.static_groups, mse=self.config.mse, cross=statistics.cross,
                cross_alpha=self.config.gptaq_alpha)
            first = 0
            for name, module in members:
                rows = slice(first, first + module.out_features)
                first = rows.stop
                self.store(layer_index, name, module, rows_of(stacked, rows, module.bias))
        self.release_hessians()

    def kept_zeros(self, layer_index: int, members: list, weight: torch.Tensor) -> torch.Tensor | None:
        """[sum N, K] bool mask of weights to keep at exactly zero, or None."""
        full = [self.full_name(layer_index, name) for name, _ in members]
        if all(name in self.prior_masks for name in full):
            return torch.cat([self.prior_masks[name] for name in full])
        return (weight == 0) if self.keep_sparsity and self.config.sym else None


def rows_of(stacked: QuantizedWeight, rows: slice, bias: torch.Tensor | None) -> QuantizedWeight:
    """The QuantizedWeight of some output rows of a stacked one (g_idx is shared by all rows)."""
    return QuantizedWeight(stacked.q[rows].contiguous(), stacked.scales[rows].contiguous(),
                           stacked.zeros[rows].contiguous(), stacked.g_idx.clone(), stacked.scheme,
                           None if bias is None else bias.detach().float().clone(), global_scale=stacked.global_scale)


QUANT_METHODS.add("gptq", MethodSpec("gptq", GPTQConfig, GPTQQuantizer, "gptq"))

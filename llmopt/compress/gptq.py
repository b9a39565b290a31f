"""GPTQ (Frantar et al. 2022): quantize columns one at a time, pushing each column's error onto the
columns not yet quantized through the inverse Hessian of the layer's inputs. Pure tensor functions.

H = 2/n * sum x x^T over the calibration inputs x [K] of a linear. See IST-DASLab gptq.py for the original.
"""

from __future__ import annotations

import torch

from llmopt.compress.base import QUANT_METHODS, QuantMethod, Quantizer
from llmopt.compress.config import GPTQConfig
from llmopt.compress.quant import QuantizedWeight, QuantScheme, compute_qparams, mse_qparams
from llmopt.compress.hessian import SharedInputHessians, inverse_hessian_cholesky
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
    prune_nm: tuple[int, int] | None = None,
    cross: torch.Tensor | None = None,
    cross_alpha: float = 0.25,
) -> QuantizedWeight:
    """GPTQ-quantize `weight` [N, K] given the input Hessian [K, K].

    act_order: quantize columns by decreasing Hessian diagonal (desc_act). With static_groups the group
    parameters come from the original weight in natural order, so g_idx stays k // group_size.
    mask: [N, K] bool of weights that must stay exactly zero (a sparsity pattern); requires sym.
    prune_nm: (N, M) prunes jointly with quantizing (SparseGPT's joint mode): when GPTQ reaches the first
    column of an M-group (natural order), it prunes the M - N weights per row with the lowest saliency
    w^2 / [H^-1]_jj^2 among the group's weights as updated so far, so one error feedback absorbs both the
    pruning and the rounding error. Pruned weights get the zero point's code (exactly zero); requires sym.
    cross: [K, K] = 2/n (X_ref - X)^T X from HessianAccumulator (GPTAQ, Li et al. 2025): besides each column's
    rounding error, the update also cancels the drift between the quantized model's inputs X and the
    full-precision model's X_ref, so the layer matches the full-precision outputs rather than its own.
    The correction P = alpha * triu(cross @ U^T, 1) @ U (U the upper Cholesky factor of H^-1) moves the
    columns not yet quantized by w_j P[j, :] as column j is quantized; alpha = 0.25 as in the paper's code.

    >>> qw = gptq_quantize_weight(linear.weight, acc.hessian, QuantScheme(4, 64))  # doctest: +SKIP
    """
    n, k = weight.shape
    scheme.check(k)
    if (mask is not None or prune_nm is not None) and not scheme.sym:
        raise LLMOptError("keeping a sparsity mask through GPTQ needs --sym (zero must be representable)")
    if mask is not None and prune_nm is not None:
        raise LLMOptError("give a fixed sparsity mask or a pattern to prune by, not both")
    w = weight.detach().float().clone()
    h = hessian.detach().float().clone()
    dead = torch.diag(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    if cross is not None:
        cross = cross.detach().float().clone()
        cross[:, dead] = 0
    width = scheme.group_width(k)
    qparams = mse_qparams if mse else compute_qparams

    static = None
    if static_groups or scheme.group_size == -1:
        # With joint pruning, ranges fit the weights that will survive: a provisional N:M mask from the
        # one-shot saliency w^2 / diag(H^-1) zeroes the rest, and zeros cost nothing in a symmetric grid.
        source = w if prune_nm is None else w.masked_fill(_provisional_nm_mask(w, h, damp, prune_nm), 0)
        flat = source.reshape(n * (k // width), width)
        s, z = qparams(flat, scheme)
        static = (s.view(n, -1), z.view(n, -1))

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(h), descending=True)
        w, h = w[:, perm], h[perm][:, perm]
        if cross is not None:
            cross = cross[perm][:, perm]
        if mask is not None:
            mask = mask[:, perm]
    hinv = inverse_hessian_cholesky(h, damp)
    correction = None if cross is None else cross_alpha * (cross @ hinv.t()).triu_(1) @ hinv  # [K, K]

    codes = torch.zeros(k, n, dtype=torch.float32)  # filled column by column: rows are columns here
    num_groups = k // width
    scales_t = torch.zeros(num_groups, n) if static is None else static[0].t().contiguous()  # [G, N]
    zeros_t = torch.zeros(num_groups, n) if static is None else static[1].t().contiguous()
    # Natural group of the column at each (possibly permuted) position, as plain ints for the hot loop.
    column_group = (torch.arange(k) // width if perm is None else perm // width).tolist()
    group_at = column_group if static is not None else [col // width for col in range(k)]
    mask_t = None if mask is None else mask.t().contiguous()
    if prune_nm is not None:
        mask_t = torch.zeros(k, n, dtype=torch.bool)  # [K, N] in quantization order, decided group by group
        natural = torch.arange(k) if perm is None else perm
        position = torch.argsort(natural)  # natural column -> position in quantization order
        group_done = [False] * (k // prune_nm[1])

    for i1 in range(0, k, block_size):
        i2 = min(i1 + block_size, k)
        w1 = w[:, i1:i2].t().contiguous()  # [B, N]: one row per column, so updates touch contiguous memory
        err1 = torch.zeros_like(w1)
        hinv1 = hinv[i1:i2, i1:i2]
        before1 = None if correction is None else torch.empty_like(w1)  # each column just before rounding
        for i in range(i2 - i1):
            col = i1 + i
            g = group_at[col]
            if prune_nm is not None and not group_done[int(natural[col]) // prune_nm[1]]:
                group = int(natural[col]) // prune_nm[1]
                group_done[group] = True
                _prune_group(w, w1, err1, hinv, mask_t, position, group, prune_nm, i1, i2, i,
                             before1, correction)
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
            if before1 is not None:
                before1[i] = wcol
                w1[i:].addr_(correction[col, i1 + i:i2], before1[i])  # P[j, j] = 0: column j itself stays
            w1[i:].addr_(hinv1[i, i:], err, alpha=-1)
            err1[i] = err
        w[:, i2:] -= err1.t() @ hinv[i1:i2, i2:]
        if before1 is not None:
            w[:, i2:] += before1.t() @ correction[i1:i2, i2:]

    codes = codes.t()
    scales, zeros = scales_t.t(), zeros_t.t()
    g_idx = torch.tensor(group_at, dtype=torch.int32)
    if perm is not None:
        inv = torch.argsort(perm)
        codes, g_idx = codes[:, inv], g_idx[inv]
    return QuantizedWeight(codes.to(torch.uint8).contiguous(), scales.float().contiguous(),
                           zeros.to(torch.int32).contiguous(), g_idx, scheme,
                           None if bias is None else bias.detach().float().clone())


def _provisional_nm_mask(w: torch.Tensor, h: torch.Tensor, damp: float, nm: tuple[int, int]) -> torch.Tensor:
    """[N, K] True where OBS saliency w^2 / diag(H^-1) is among the M - N lowest of each M-group (one shot)."""
    from llmopt.prune.masks import nm_mask

    diag_mean = torch.mean(torch.diag(h))
    hinv_diag = torch.diag(torch.cholesky_inverse(torch.linalg.cholesky(
        h + damp * diag_mean * torch.eye(h.shape[0], dtype=h.dtype))))
    return nm_mask(w.pow(2) / hinv_diag.unsqueeze(0), *nm)


def _prune_group(w, w1, err1, hinv, mask_t, position, group, nm, i1, i2, i, before1, correction) -> None:
    """Choose the pruned weights of natural M-group `group` from the weights as updated so far.

    w [N, K] holds columns >= i2 before this block's pending update err1 [B, N] @ hinv[i1:i2, i2:] (and the
    GPTAQ correction before1 [B, N] @ correction[i1:i2, i2:]);
    w1 [B, N] holds this block's columns, current. Every member sits at a position >= i1 + i.
    """
    n_keep, m = nm
    members = position[group * m:(group + 1) * m]  # [M] positions in quantization order
    values = []
    for pos in members.tolist():
        if pos < i2:
            values.append(w1[pos - i1])
        else:  # apply the pending update of the columns quantized so far in this block
            value = w[:, pos] - err1[:i].t() @ hinv[i1:i1 + i, pos]
            if before1 is not None:
                value = value + before1[:i].t() @ correction[i1:i1 + i, pos]
            values.append(value)
    current = torch.stack(values, dim=1)  # [N, M]
    # OBS cost of zeroing member q given every column not yet quantized: w_q^2 / [(H_SS)^-1]_qq with S the
    # positions >= p (this column); H^-1 = U^T U gives (H_SS)^-1 = U_SS^T U_SS, so it is |U[p:q+1, q]|^2.
    p = i1 + i
    variance = torch.stack([hinv[p:pos + 1, pos].pow(2).sum() for pos in members.tolist()])
    saliency = current.pow(2) / variance.unsqueeze(0)
    pruned = torch.topk(saliency, m - n_keep, dim=1, largest=False).indices  # [N, M - N]
    rows = torch.arange(current.shape[0]).unsqueeze(1)
    mask_t[members[pruned], rows] = True


class GPTQQuantizer(Quantizer):
    """Collects each linear's Hessian during the pipeline's stage pass, then GPTQ-quantizes the stage.

    Weights that are exactly zero in a sparse model (config.sparsity_config) stay zero (the mask is kept);
    with `prune_pattern` GPTQ prunes to N:M itself while it quantizes (one pass, one error feedback).
    """

    def __init__(self, config: GPTQConfig, model):
        super().__init__(config, model)
        self.hessians = SharedInputHessians()
        self.keep_sparsity = getattr(model.config, "sparsity_config", None) is not None

    def stages(self, adapter):
        return list(adapter.sequential) if self.config.true_sequential else [adapter.linears]

    @property
    def uses_reference_inputs(self) -> bool:
        """GPTAQ: the pipeline also runs the full-precision layers and passes their inputs to add_batch."""
        return self.config.gptaq

    def add_batch(self, layer_index, name, module, inputs, reference=None):
        self.hessians.add(name, module.in_features, inputs, reference)

    def process(self, layer_index, layer, names):
        from llmopt.core.adapters import get_module

        for name in names:
            module = get_module(layer, name)
            statistics = self.hessians.take(name)
            hessian = statistics.hessian
            if self.is_ignored(self.full_name(layer_index, name)):
                continue
            keep = self.keep_sparsity and self.config.sym and self.config.prune_nm is None
            mask = (module.weight.data == 0) if keep else None
            qweight = gptq_quantize_weight(
                module.weight.data, hessian, self.config.scheme, damp=self.config.damp,
                block_size=self.config.block_size, act_order=self.config.act_order,
                static_groups=self.config.static_groups, mse=self.config.mse, mask=mask, bias=module.bias,
                prune_nm=self.config.prune_nm, cross=statistics.cross, cross_alpha=self.config.gptaq_alpha,
            )
            self.store(layer_index, name, module, qweight)


QUANT_METHODS.add("gptq", QuantMethod("gptq", GPTQConfig, GPTQQuantizer))

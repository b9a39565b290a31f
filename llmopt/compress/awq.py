"""AWQ (Lin et al. 2023): activation-aware weight quantization.

For each smoothing group (an op and the linears it feeds), search per-input-channel scales s: the linears
get W * s, the op's output is divided by s (the function is unchanged), so channels with large activations
are quantized more finely. Then search each linear's clipping range; then quantize. The search (scales,
clips) is separate from applying it, and its result is saved so it can be inspected and re-applied.
See mit-han-lab llm-awq `auto_scale.py` / `auto_clip.py` for the original.
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.core.contract import QuantScheme
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.compress.base import QUANT_METHODS, MethodSpec, Quantizer
from llmopt.compress.config import AWQConfig
from llmopt.core.contract.int_grid import compute_qparams, fake_quantize
from llmopt.core.adapters import ArchAdapter, get_module


def fake_quantize_groups(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """RTN fake-quantization of `w` [N, K] group by group."""
    n, k = w.shape
    width = scheme.group_width(k)
    flat = w.reshape(-1, width)
    scale, zero = compute_qparams(flat, scheme)
    return fake_quantize(flat, scale[:, None], zero[:, None], scheme.maxq).view(n, k)


def search_scales(x: torch.Tensor, x_abs_mean: torch.Tensor, weights: list[torch.Tensor], scheme: QuantScheme,
                  grid: int = 20) -> tuple[torch.Tensor, float]:
    """Best per-channel scales [K] for linears `weights` ([N_i, K] each) fed by inputs x [T, K].

    s = x_mean^r / w_mean^(1-r), normalised, for r in 0, 1/grid, ..., (grid-1)/grid; the loss is the squared
    error of the linears' outputs against full precision. Returns (scales, best ratio; None: no scaling won).
    """
    w_cat = torch.cat(weights, 0).float()  # [sum N, K]
    width = scheme.group_width(w_cat.shape[1])
    w_group_norm = w_cat.abs().view(w_cat.shape[0], -1, width)
    w_group_norm = (w_group_norm / w_group_norm.amax(dim=2, keepdim=True).clamp(min=1e-8)).view_as(w_cat)
    w_mean = w_group_norm.mean(0)  # [K]
    reference = x @ w_cat.t()
    best = (float("inf"), None, 0.0)
    # Candidates: no scaling (plain RTN, so the search never does worse than it), then the ratio grid.
    candidates = [(None, torch.ones_like(x_abs_mean))]
    for i in range(grid):
        ratio = i / grid
        s = (x_abs_mean.pow(ratio) / w_mean.pow(1 - ratio).clamp(min=1e-4)).clamp(min=1e-4)
        candidates.append((ratio, s / (s.max() * s.min()).sqrt()))
    for ratio, s in candidates:
        w_q = fake_quantize_groups(w_cat * s, scheme) / s
        loss = (x @ w_q.t() - reference).pow(2).mean().item()
        if loss < best[0]:
            best = (loss, s, ratio)
    return best[1], best[2]


def search_clip(x: torch.Tensor, w: torch.Tensor, scheme: QuantScheme, grid: int = 20, max_shrink: float = 0.5,
                rows_per_chunk: int = 256) -> torch.Tensor:
    """Best clip ratio [N, G] per (row, group) of `w` [N, K], judged on each group's partial output x_g w_g^T."""
    n, k = w.shape
    width = scheme.group_width(k)
    num_groups = k // width
    xg = x.float().view(x.shape[0], num_groups, width)  # [T, G, W]
    ratios = torch.ones(n, num_groups)
    for r0 in range(0, n, rows_per_chunk):
        wg = w[r0:r0 + rows_per_chunk].float().view(-1, num_groups, width)  # [n, G, W]
        reference = torch.einsum("tgw,ngw->ngt", xg, wg)
        best_err = torch.full(wg.shape[:2], float("inf"))
        best_ratio = torch.ones(wg.shape[:2])
        for i in range(int(max_shrink * grid)):
            ratio = 1 - i / grid
            flat = wg.reshape(-1, width)
            scale, zero = compute_qparams(flat, scheme, ratio)
            wq = fake_quantize(flat, scale[:, None], zero[:, None], scheme.maxq).view_as(wg)
            err = (torch.einsum("tgw,ngw->ngt", xg, wq) - reference).pow(2).mean(-1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_ratio = torch.where(better, torch.full_like(best_ratio, ratio), best_ratio)
        ratios[r0:r0 + rows_per_chunk] = best_ratio
    return ratios


def apply_scales(prev: nn.Module, linears: list[nn.Linear], scales: torch.Tensor) -> None:
    """Divide `prev`'s output channels by `scales` [K] and multiply the linears' input channels by them."""
    scales = scales.to(linears[0].weight.device)
    if isinstance(prev, nn.Linear):
        prev.weight.data.div_(scales.view(-1, 1).to(prev.weight.dtype))
        if prev.bias is not None:
            prev.bias.data.div_(scales.to(prev.bias.dtype))
    else:  # an RMSNorm/LayerNorm: its weight scales each output channel
        prev.weight.data.div_(scales.to(prev.weight.dtype))
        if getattr(prev, "bias", None) is not None:
            prev.bias.data.div_(scales.to(prev.bias.dtype))
    for linear in linears:
        linear.weight.data.mul_(scales.view(1, -1).to(linear.weight.dtype))


def clip_weight(w: torch.Tensor, ratios: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """`w` [N, K] clamped, per (row, group), to the range the clip ratios [N, G] select."""
    n, k = w.shape
    width = scheme.group_width(k)
    wg = w.view(n, -1, width)
    r = ratios.to(w.device, w.dtype).unsqueeze(-1)
    lo = (wg.amin(dim=2, keepdim=True) * r).clamp(max=0)
    hi = (wg.amax(dim=2, keepdim=True) * r).clamp(min=0)
    if scheme.sym:
        amax = torch.maximum(lo.abs(), hi)
        lo, hi = -amax, amax
    return torch.maximum(torch.minimum(wg, hi), lo).view(n, k)


def _can_smooth(prev: nn.Module, linears: list[nn.Linear]) -> bool:
    # v -> o only when v's outputs map 1:1 onto o's inputs (no GQA head sharing).
    return not isinstance(prev, nn.Linear) or prev.out_features == linears[0].in_features


class AWQQuantizer(Quantizer):
    """One stage per layer: all inputs are collected from the full-precision layer, then search + apply."""

    def __init__(self, config: AWQConfig, model):
        super().__init__(config, model)
        self.inputs: dict[str, list[torch.Tensor]] = {}  # name -> kept token rows [t, K]
        self.abs_sums: dict[str, torch.Tensor] = {}
        self.num_tokens: dict[str, int] = {}
        self.search: dict[str, torch.Tensor] = {}  # "<layer>.<prev>.scales" / "<layer>.<linear>.clip"
        if config.search_file:
            from safetensors.torch import load_file

            self.search = load_file(config.search_file)
        self._generator = torch.Generator().manual_seed(config.calibration.seed)

    def stages(self, adapter: ArchAdapter):
        return [adapter.linears]

    def add_batch(self, layer_index, name, module, inputs):
        x = inputs.reshape(-1, inputs.shape[-1]).float()
        self.abs_sums[name] = self.abs_sums.get(name, 0) + x.abs().sum(0).cpu()
        self.num_tokens[name] = self.num_tokens.get(name, 0) + x.shape[0]
        # Keep about search_tokens rows over the whole calibration set: every stride-th, from a random offset.
        total = self.config.calibration.num_samples * self.config.calibration.seqlen
        stride = max(1, total // self.config.search_tokens)
        offset = int(torch.randint(stride, (1,), generator=self._generator))
        # clone: a strided view would keep the whole batch alive
        self.inputs.setdefault(name, []).append(x[offset::stride].clone().cpu())

    def process(self, layer_index, layer, names):
        cfg: AWQConfig = self.config
        scheme = cfg.weight_scheme
        transforms: dict[str, torch.Tensor] = {}  # linear -> scales its inputs were divided by
        for prev_name, linear_names in self.adapter.smooth_groups:
            prev = get_module(layer, prev_name)
            linears = [get_module(layer, n) for n in linear_names]
            if not _can_smooth(prev, linears):
                continue
            key = f"{layer_index}.{prev_name}.scales"
            if key not in self.search:
                x = torch.cat(self.inputs[linear_names[0]])
                x_abs_mean = self.abs_sums[linear_names[0]] / self.num_tokens[linear_names[0]]
                self.search[key], _ = search_scales(
                    x, x_abs_mean, [m.weight.data.cpu() for m in linears], scheme, cfg.grid)
            scales = self.search[key]
            apply_scales(prev, linears, scales)
            for n in linear_names:
                transforms[n] = scales
        for name in names:
            module = get_module(layer, name)
            full = self.full_name(layer_index, name)
            if self.is_ignored(full):
                continue
            # q/k outputs meet in a softmax: the original skips clipping them.
            if cfg.clip and not name.endswith(("q_proj", "k_proj", "qkv_proj")):
                key = f"{layer_index}.{name}.clip"
                if key not in self.search:
                    x = torch.cat(self.inputs[name])
                    if name in transforms:
                        x = x / transforms[name]
                    self.search[key] = search_clip(x, module.weight.data.cpu(), scheme, cfg.clip_grid,
                                                   cfg.max_clip_shrink)
                module.weight.data.copy_(clip_weight(module.weight.data, self.search[key], scheme))
            self.store(layer_index, name, module, quantize_rtn(module.weight.data, scheme, cfg.mse, module.bias))
        self.inputs.clear()
        self.abs_sums.clear()
        self.num_tokens.clear()

    def extra_tensors(self):
        return {k: v.contiguous() for k, v in self.search.items()}


QUANT_METHODS.add("awq", MethodSpec("awq", AWQConfig, AWQQuantizer, "awq"))

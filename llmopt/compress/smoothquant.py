"""SmoothQuant (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models"): per smoothing group (a norm or linear and the linears it feeds, the groups AWQ uses), input
channel j is divided by s_j = max|X_j|^alpha / max_n |W_nj|^(1-alpha) and the linears' column j multiplied by
s_j, so the function is unchanged and the per-token activation scale no longer follows a few outlier channels.

It runs as its own calibration pass before the quantizer's (compress.api.compress_model): the smoothed model's
outputs equal the original's, so the quantizer then calibrates on the smoothed weights and inputs.
"""

from __future__ import annotations

import torch

from llmopt.compress.awq import _can_smooth, apply_scales
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.compress.base import Modifier
from llmopt.compress.config import SmoothQuantConfig
from llmopt.core.adapters import get_module
from llmopt.core.contract import PRESETS, fake_quantize_activations

MIN_SCALE = 1e-5


def smoothing_scales(act_max: torch.Tensor, weight_max: torch.Tensor, alpha: float) -> torch.Tensor:
    """s [K] = max|X|^alpha / max|W|^(1 - alpha) per input channel (act_max, weight_max [K]), as the paper's."""
    s = act_max.clamp(min=MIN_SCALE).pow(alpha) / weight_max.clamp(min=MIN_SCALE).pow(1 - alpha)
    return s.clamp(min=MIN_SCALE)


def smoothed_error(x: torch.Tensor, weights: torch.Tensor, s: torch.Tensor, scheme) -> float:
    """Mean squared error of the smoothed, fake-quantized (W8A8 int8 or FP8) product against x @ W^T (x [T, K],
    W [N, K])."""
    reference = x @ weights.t()
    xq = fake_quantize_activations(x / s, scheme.input_activations)
    wq = quantize_rtn(weights * s, scheme.weights).dequantize()  # int or float (FP8) weights alike
    return (xq @ wq.t() - reference).pow(2).mean().item()


def search_alpha(x: torch.Tensor, act_max: torch.Tensor, weights: torch.Tensor, scheme, grid: int
                 ) -> tuple[float, torch.Tensor]:
    """(alpha, scales) of the grid point with the smallest smoothed_error."""
    best = None
    for i in range(grid + 1):
        alpha = i / grid
        s = smoothing_scales(act_max, weights.abs().amax(0), alpha)
        error = smoothed_error(x, weights, s, scheme)
        if best is None or error < best[0]:
            best = (error, alpha, s)
    return best[1], best[2]


class SmoothQuantSmoother(Modifier):
    """One stage per layer: each group's input maxima (and, for the search, a sample of its inputs) are collected
    from the layer, then every group is smoothed in place."""

    kind = "transform"

    def __init__(self, config: SmoothQuantConfig, model):
        super().__init__(config, model)
        self.scheme = PRESETS[config.scheme]
        self.act_max: dict[str, torch.Tensor] = {}
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self.scales: dict[str, torch.Tensor] = {}  # "<layer>.<prev>.smoothquant" -> s
        self.alphas: list[float] = []
        self._generator = torch.Generator().manual_seed(config.calibration.seed)

    def add_batch(self, layer_index, name, module, inputs):
        x = inputs.reshape(-1, inputs.shape[-1]).float()
        peak = x.abs().amax(0).cpu()
        self.act_max[name] = peak if name not in self.act_max else torch.maximum(self.act_max[name], peak)
        if self.config.alpha == "search":
            total = self.config.calibration.num_samples * self.config.calibration.seqlen
            stride = max(1, total // self.config.search_tokens)
            offset = int(torch.randint(stride, (1,), generator=self._generator))
            self.inputs.setdefault(name, []).append(x[offset::stride].clone().cpu())

    def process(self, layer_index, layer, names):
        for prev_name, linear_names in self.adapter.smooth_groups:
            prev = get_module(layer, prev_name)
            linears = [get_module(layer, n) for n in linear_names]
            ignored = any(self.is_ignored(self.full_name(layer_index, n)) for n in linear_names)
            if ignored or not _can_smooth(prev, linears) or linear_names[0] not in self.act_max:
                continue
            act_max = self.act_max[linear_names[0]]
            weights = torch.cat([m.weight.data.float().cpu() for m in linears])  # [sum N, K]
            if self.config.alpha == "search":
                alpha, s = search_alpha(torch.cat(self.inputs[linear_names[0]]), act_max, weights, self.scheme,
                                        self.config.grid)
            else:
                alpha, s = self.config.alpha, smoothing_scales(act_max, weights.abs().amax(0), self.config.alpha)
            apply_scales(prev, linears, s)
            self.scales[f"{layer_index}.{prev_name}.smoothquant"] = s
            self.alphas.append(alpha)
        self.act_max.clear()
        self.inputs.clear()

    def extra_tensors(self):
        return {k: v.contiguous() for k, v in self.scales.items()}

    def facts(self) -> dict:
        return {"smoothquant_groups": len(self.alphas),
                "smoothquant_mean_alpha": round(sum(self.alphas) / len(self.alphas), 4) if self.alphas else None}

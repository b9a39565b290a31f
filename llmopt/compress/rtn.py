"""Round-to-nearest: no calibration data; each group's range from its min/max (or the MSE search)."""

from __future__ import annotations

import torch
from torch import nn

from llmopt.core.contract.float_grid import fp4_global_scale
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.compress.base import QUANT_METHODS, MethodSpec, Quantizer
from llmopt.compress.config import RTNConfig
from llmopt.core.adapters import get_module


class RTNQuantizer(Quantizer):
    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        kept = [name for name in names if not self.is_ignored(self.full_name(layer_index, name))]
        global_scales = self.shared_global_scales(layer, kept)
        for name in kept:
            module = get_module(layer, name)
            qweight = quantize_rtn(module.weight.data, self.config.weight_scheme, self.config.mse, module.bias,
                                   global_scales.get(name))
            self.store(layer_index, name, module, qweight)

    def shared_global_scales(self, layer: nn.Module, kept: list[str]) -> dict[str, torch.Tensor]:
        """NVFP4: one global scale for the linears fed the same input (q/k/v, gate/up), as llm-compressor fuses
        them: runtimes (vLLM, ours) run them as one stacked weight with one global scale. Computed once a group."""
        if self.config.weight_scheme.scale_format != "e4m3":
            return {}
        scales: dict[str, torch.Tensor] = {}
        for name in kept:
            if name in scales:
                continue
            group = [other for other in self.adapter.fed_same_input.get(name, (name,)) if other in kept] or [name]
            scale = fp4_global_scale(torch.cat([get_module(layer, other).weight.data.reshape(-1) for other in group]))
            scales.update(dict.fromkeys(group, scale))
        return scales


QUANT_METHODS.add("rtn", MethodSpec("rtn", RTNConfig, RTNQuantizer, "compressed-tensors"))

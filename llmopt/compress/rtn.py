"""Round-to-nearest: no calibration data; each group's range from its min/max (or the MSE search)."""

from __future__ import annotations

from torch import nn

from llmopt.compress.quant import quantize_rtn
from llmopt.compress.base import QUANT_METHODS, MethodSpec, Quantizer
from llmopt.compress.config import RTNConfig
from llmopt.core.adapters import get_module


class RTNQuantizer(Quantizer):
    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        for name in names:
            module = get_module(layer, name)
            if self.is_ignored(self.full_name(layer_index, name)):
                continue
            qweight = quantize_rtn(module.weight.data, self.config.weight_scheme, self.config.mse, module.bias)
            self.store(layer_index, name, module, qweight)


QUANT_METHODS.add("rtn", MethodSpec("rtn", RTNConfig, RTNQuantizer, "compressed-tensors"))

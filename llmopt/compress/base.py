"""The thin lifecycle shared by the quantizers: which linears, where results go, the registry."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from torch import nn

from llmopt.compress.config import QuantizeConfig
from llmopt.compress.quant import QuantizedWeight
from llmopt.core.adapters import ArchAdapter, adapter_for, decoder_layers, get_module
from llmopt.core.registry import Registry


class Quantizer:
    """Base: stores each linear's QuantizedWeight and writes its dequantized weight back into the model,
    so the rest of the calibration (and any evaluation) sees the quantized model."""

    def __init__(self, config: QuantizeConfig, model: nn.Module):
        self.config = config
        self.adapter: ArchAdapter = adapter_for(model)
        self.results: dict[str, QuantizedWeight] = {}

    def full_name(self, layer_index: int, name: str) -> str:
        return f"{self.adapter.layers}.{layer_index}.{name}"

    def is_ignored(self, full_name: str) -> bool:
        return any(fnmatch.fnmatch(full_name, p) or fnmatch.fnmatch(full_name.split(".", 3)[-1], p)
                   for p in self.config.ignore)

    def store(self, layer_index: int, name: str, module: nn.Linear, qweight: QuantizedWeight) -> None:
        self.results[self.full_name(layer_index, name)] = qweight
        # In place: a model loaded from safetensors is backed by the file's memory map; writing into it keeps
        # one copy of each weight resident, where a new tensor would leave the mapped pages resident beside it
        # (peak RSS +540 MB on SmolLM2).
        module.weight.data.copy_(qweight.dequantize(module.weight.dtype))

    def stages(self, adapter: ArchAdapter) -> list[tuple[str, ...]]:
        return [adapter.linears]

    def add_batch(self, layer_index: int, name: str, module: nn.Linear, inputs: torch.Tensor) -> None:
        pass

    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        raise NotImplementedError

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Search results worth saving beside the artifact (AWQ scales and clips)."""
        return {}


@dataclass(frozen=True)
class QuantMethod:
    name: str
    config_cls: type[QuantizeConfig]
    quantizer_cls: type[Quantizer]


QUANT_METHODS: Registry[QuantMethod] = Registry("quantization method")


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every decoder-layer linear the adapter names, by full module path."""
    adapter = adapter_for(model)
    return {
        f"{adapter.layers}.{i}.{name}": get_module(layer, name)
        for i, layer in enumerate(decoder_layers(model)) for name in adapter.linears
    }

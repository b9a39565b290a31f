"""One layer-by-layer base for every compression method: a `Modifier` is told which linears a stage holds,
sees their calibration inputs and changes their weights (see core.calibration.LayerwiseAlgorithm).
Quantizers record a QuantizedWeight per linear, pruners a mask; `ModifierList` (compress.modifier_list)
runs several of them in one calibration pass."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch
from pydantic import BaseModel
from torch import nn

from llmopt.core.adapters import ArchAdapter, adapter_for, decoder_layers, get_module
from llmopt.core.contract import QuantizedWeight
from llmopt.core.contract.fp4 import nvfp4_global_scale
from llmopt.core.errors import LLMOptError, UnsupportedArchitectureError
from llmopt.core.registry import Registry


class Modifier:
    """The lifecycle shared by all methods: which linears, the ignore rules, where results go."""

    kind = "modifier"  # "quantization" | "pruning"
    changes_only_stage_linears = False  # see calibration.LayerwiseAlgorithm
    uses_reference_inputs = False

    def __init__(self, config: BaseModel, model: nn.Module):
        self.config = config
        self.adapter: ArchAdapter = adapter_for(model)

    @property
    def name(self) -> str:
        return self.config.method

    def full_name(self, layer_index: int, name: str) -> str:
        return f"{self.adapter.layers}.{layer_index}.{name}"

    def is_ignored(self, full_name: str) -> bool:
        return any(ignore_matches(p, full_name) for p in self.config.ignore)

    def stages(self, adapter: ArchAdapter) -> list[tuple[str, ...]]:
        return [adapter.linears]

    def add_batch(self, layer_index: int, name: str, module: nn.Linear, inputs: torch.Tensor) -> None:
        pass

    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        raise NotImplementedError

    def extra_tensors(self) -> dict[str, torch.Tensor]:
        """Search results worth saving beside the artifact (AWQ scales and clips)."""
        return {}


class Quantizer(Modifier):
    """Stores each linear's QuantizedWeight and writes its dequantized weight back into the model, so the
    rest of the calibration (and any evaluation) sees the quantized model."""

    kind = "quantization"

    def __init__(self, config, model: nn.Module):
        super().__init__(config, model)
        self.results: dict[str, QuantizedWeight] = {}
        self.input_amax: dict[str, torch.Tensor] = {}  # full linear name -> its inputs' largest magnitude
        # Masks of weights that must stay exactly zero, by full linear name: set by a pruner that ran before
        # this quantizer in the same pass (ModifierList).
        self.prior_masks: dict[str, torch.Tensor] = {}

    @property
    def calibrates_input_scale(self) -> bool:
        acts = getattr(self.config, "input_activations", None)
        return acts is not None and acts.scale_format == "e4m3"

    def observe_inputs(self, layer_index: int, name: str, inputs: torch.Tensor) -> None:
        """NVFP4 inputs (nvfp4-a4): the running max |x| over the calibration data, from which the checkpoint's
        static input global scale is made (llm-compressor's static_minmax observer)."""
        if not self.calibrates_input_scale:
            return
        key = self.full_name(layer_index, name)
        amax = inputs.detach().abs().amax().float().cpu()
        self.input_amax[key] = amax if key not in self.input_amax else torch.maximum(self.input_amax[key], amax)

    def store(self, layer_index: int, name: str, module: nn.Linear, qweight: QuantizedWeight) -> None:
        key = self.full_name(layer_index, name)
        if self.calibrates_input_scale:
            if key not in self.input_amax:
                raise LLMOptError(f"{key} saw no calibration inputs: NVFP4 inputs need them for their global scale")
            qweight.input_global_scale = nvfp4_global_scale(self.input_amax[key])
        self.results[key] = qweight
        # In place: a model loaded from safetensors is backed by the file's memory map; writing into it keeps
        # one copy of each weight resident, where a new tensor would leave the mapped pages resident beside it
        # (peak RSS +540 MB on SmolLM2).
        module.weight.data.copy_(qweight.dequantize(module.weight.dtype))


class Pruner(Modifier):
    """Zeroes weights; the result of each linear is its mask [N, K] (True where pruned)."""

    kind = "pruning"
    changes_only_stage_linears = True
    per_row = False  # compare scores within each output row (Wanda) or over the whole matrix

    def __init__(self, config, model: nn.Module):
        super().__init__(config, model)
        self.masks: dict[str, torch.Tensor] = {}

    def select(self, scores: torch.Tensor, per_row: bool) -> torch.Tensor:
        from llmopt.compress.masks import nm_mask, unstructured_mask

        nm = self.config.nm
        if nm is not None:
            return nm_mask(scores, *nm)
        return unstructured_mask(scores, self.config.sparsity, per_row=per_row)

    def apply(self, layer_index: int, name: str, module: nn.Linear, mask: torch.Tensor) -> None:
        module.weight.data[mask.to(module.weight.device)] = 0
        self.record(layer_index, name, mask)

    def record(self, layer_index: int, name: str, mask: torch.Tensor) -> None:
        """Keep a linear's mask; pruners sharing one dict (ModifierList) keep the union of theirs."""
        full, mask = self.full_name(layer_index, name), mask.cpu()
        earlier = self.masks.get(full)
        self.masks[full] = mask if earlier is None else earlier | mask

    def scores(self, layer_index: int, name: str, weight: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        for name in names:
            module = get_module(layer, name)
            scores = self.scores(layer_index, name, module.weight.data.float())
            if self.is_ignored(self.full_name(layer_index, name)):
                continue
            self.apply(layer_index, name, module, self.select(scores, self.per_row))


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its typed config and the modifier that runs it."""

    name: str
    config_cls: type[BaseModel]
    modifier_cls: type[Modifier]
    default_format: str | None = None  # quantization: the checkpoint format written unless told otherwise


QUANT_METHODS: Registry[MethodSpec] = Registry("quantization method")
PRUNE_METHODS: Registry[MethodSpec] = Registry("pruning method")


def ignore_matches(pattern: str, full_name: str) -> bool:
    """An --ignore glob matches a linear by its full path or by its path inside the layer (mlp.down_proj)."""
    return fnmatch.fnmatch(full_name, pattern) or fnmatch.fnmatch(full_name.split(".", 3)[-1], pattern)


def quantizable_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """Every decoder-layer linear the adapter names, by full module path."""
    adapter = adapter_for(model)
    reason = adapter.unsupported(model.config)
    if reason:
        raise UnsupportedArchitectureError(reason)
    return {
        f"{adapter.layers}.{i}.{name}": get_module(layer, name)
        for i, layer in enumerate(decoder_layers(model)) for name in adapter.linears
    }

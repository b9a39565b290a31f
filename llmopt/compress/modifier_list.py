"""Several modifiers in one calibration pass: "SparseGPT 2:4 then GPTQ w4" is [SparseGPTPruner, GPTQQuantizer].

Per stage every modifier sees the same inputs; then each processes the stage in list order, so a quantizer
works on the weights its predecessors pruned (and keeps their zeros: `Quantizer.prior_masks`). Modifiers that
work from input Hessians share one set, accumulated once per input (with the full-precision reference inputs
when any of them asks for those).
"""

from __future__ import annotations

from torch import nn

from llmopt.compress.base import Modifier, Pruner, Quantizer
from llmopt.compress.hessian import SharedInputHessians
from llmopt.core.adapters import ArchAdapter
from llmopt.core.errors import ConfigError


class ModifierList:
    """A LayerwiseAlgorithm made of modifiers applied in order within each stage."""

    def __init__(self, modifiers: list[Modifier]):
        if not modifiers:
            raise ConfigError("no compression method given")
        self.modifiers = modifiers
        self._check_order()
        self.uses_reference_inputs = any(m.uses_reference_inputs for m in modifiers)
        self.changes_only_stage_linears = all(m.changes_only_stage_linears for m in modifiers)
        self.hessians = SharedInputHessians()
        for m in self.hessian_modifiers:
            m.hessians, m.owns_hessians = self.hessians, False
        masks: dict = {}  # one dict: every pruner adds to it, the quantizer (checked to come last) keeps its zeros
        for m in modifiers:
            if isinstance(m, Quantizer):
                m.prior_masks = masks
            elif isinstance(m, Pruner):
                m.masks = masks

    @property
    def hessian_modifiers(self) -> list[Modifier]:
        return [m for m in self.modifiers if getattr(m, "uses_hessians", False)]

    def _check_order(self) -> None:
        seen_quantizer = None
        for m in self.modifiers:
            if isinstance(m, Quantizer):
                if seen_quantizer is not None:
                    raise ConfigError(f"{seen_quantizer.name} and {m.name}: one quantization method per pass")
                seen_quantizer = m
            elif isinstance(m, Pruner) and seen_quantizer is not None:
                raise ConfigError(f"prune before quantizing: {m.name} comes after {seen_quantizer.name}")
        pruned = any(isinstance(m, Pruner) for m in self.modifiers)
        if pruned and seen_quantizer is not None and not seen_quantizer.config.sym:
            raise ConfigError("pruning then quantizing needs symmetric quantization (--sym): zero must stay exact")

    def stages(self, adapter: ArchAdapter) -> list[tuple[str, ...]]:
        # The finest split wins: a single-stage method gets the same linears over several passes.
        return max((m.stages(adapter) for m in self.modifiers), key=len)

    def observe_inputs(self, layer_index, name, inputs) -> None:
        for m in self.modifiers:
            if hasattr(m, "observe_inputs"):
                m.observe_inputs(layer_index, name, inputs)

    def add_batch(self, layer_index, name, module, inputs, reference=None) -> None:
        if self.hessian_modifiers:
            self.hessians.add(name, module.in_features, inputs, reference)
        for m in self.modifiers:
            if getattr(m, "uses_hessians", False):
                continue
            if m.uses_reference_inputs:
                m.add_batch(layer_index, name, module, inputs, reference=reference)
            else:
                m.add_batch(layer_index, name, module, inputs)

    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        for m in self.modifiers:
            m.process(layer_index, layer, names)
        self.hessians.clear()

    def extra_tensors(self):
        return {k: v for m in self.modifiers for k, v in m.extra_tensors().items()}

    @property
    def name(self) -> str:
        return "+".join(m.name for m in self.modifiers)

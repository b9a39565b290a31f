"""The model being trained: a copy of the teacher made smaller (layers kept or dropped), a dense or pruned
artifact, a sparse (N:M / unstructured) artifact whose zeros stay zero, or an int-quantized artifact trained
through fake quantization (fake_quant.FakeQuantLinear). Loading them is jobs.distill_students' job."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from llmopt.core.errors import ConfigError
from llmopt.distill.config import DistillConfig
from llmopt.distill.fake_quant import FakeQuantLinear


@dataclass
class Student:
    model: nn.Module
    kind: str  # "dense" | "sparse" | "quantized"
    source: str  # the model or artifact it came from
    teacher_layers: list[int] | None  # the teacher layer each student layer was copied from, when known
    masks: dict[str, torch.Tensor] = field(default_factory=dict)  # parameter name -> bool [N, K], True = kept
    quantization_config: dict | None = None  # the input artifact's, written back unchanged
    compressed_pattern: str | None = None  # the input's linears stored compressed: so are the output's
    format_name: str | None = None
    facts: dict = field(default_factory=dict)

    def enforce_masks(self) -> None:
        """Pruned weights back to exactly zero (after each optimizer step)."""
        if not self.masks:
            return
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, mask in self.masks.items():
                params[name].mul_(mask)

    def fake_quant_layers(self) -> dict[str, FakeQuantLinear]:
        return {name: m for name, m in self.model.named_modules() if isinstance(m, FakeQuantLinear)}


def sparse_masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """bool masks of the nonzero entries of every decoder linear weight (a sparse artifact's pruned zeros)."""
    masks = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and ".layers." in f".{name}":
            masks[f"{name}.weight"] = module.weight.detach() != 0
    return masks


def layer_pairs(config: DistillConfig, student: Student, teacher_depth: int) -> list[tuple[int, int]]:
    """(teacher layer, student layer) pairs whose outputs the hidden-state loss compares."""
    from llmopt.distill.config import parse_layer_map

    depth = student.model.config.num_hidden_layers
    explicit = parse_layer_map(config.layer_map)
    if explicit is not None:
        pairs = sorted(explicit.items())
        for t, s in pairs:
            if not (0 <= t < teacher_depth and 0 <= s < depth):
                raise ConfigError(f"--layer-map {t}:{s}: the teacher has {teacher_depth} layers, the student {depth}")
        return pairs
    if student.teacher_layers is not None and len(student.teacher_layers) == depth:
        return [(t, s) for s, t in enumerate(student.teacher_layers)]
    # evenly spaced: student layer s against the teacher layer at the same relative depth (last with last)
    return [(round((s + 1) * teacher_depth / depth) - 1, s) for s in range(depth)]

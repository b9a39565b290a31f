"""A checkpoint loaded for the runtime without building a transformers model: its config, and its weights by name
(dense tensors in the compute dtype; quantized linears already turned into their linear methods). The engine
builds its model class from it (models.build_runtime_model) as it would from a loaded transformers model."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn


class RuntimeCheckpoint(nn.Module):
    """config, and (name, tensor | linear) pairs in checkpoint order; the tensors and linears are registered, so
    `parameters()` and `modules()` see them."""

    def __init__(self, config, weights: Iterator[tuple[str, object]], activations: str = "float", shard_plan=None,
                 stage_plan=None, load_args: dict | None = None):
        """activations: the input-activation setting its linear methods were chosen for (EngineConfig.activations);
        shard_plan: the tensor-parallel share the weights were narrowed to (sharding.ShardPlan); stage_plan: the
        pipeline stage whose layers it holds (sharding.StagePlan); load_args: load_runtime_model's arguments, with
        which the engine's other ranks load their shares."""
        super().__init__()
        self.config = config
        self.shard_plan, self.stage_plan, self.load_args = shard_plan, stage_plan, load_args
        self.name_or_path = getattr(config, "_name_or_path", "")
        self.activations = activations
        self.tensors = nn.ParameterList()
        self.linears = nn.ModuleList()
        self._order: list[tuple[str, str, int]] = []  # (name, "tensor" | "linear", index)
        for name, value in weights:
            if isinstance(value, nn.Module):
                self._order.append((name, "linear", len(self.linears)))
                self.linears.append(value)
            else:
                self._order.append((name, "tensor", len(self.tensors)))
                self.tensors.append(nn.Parameter(value, requires_grad=False))

    def named_weights(self) -> Iterator[tuple[str, object]]:
        for name, kind, index in self._order:
            yield name, (self.linears[index] if kind == "linear" else self.tensors[index].data)

    @property
    def dtype(self) -> torch.dtype:
        return next(t.dtype for t in self.tensors if t.is_floating_point())

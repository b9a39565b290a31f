"""The runtime's model classes, one module per family; importing the package registers every module in it."""

from __future__ import annotations

import torch
from torch import nn

from llmopt.core.registry import import_submodules
from llmopt.runtime.executor.models.checkpoint import RuntimeCheckpoint
from llmopt.runtime.executor.models.registry import MODEL_FAMILIES, model_class_for, register_model_family  # noqa: F401
from llmopt.runtime.executor.models.weights import module_weights
from llmopt.runtime.executor.platform import Platform

import_submodules(__name__)


def build_runtime_model(model: RuntimeCheckpoint | nn.Module, attention_backend: str = "auto",
                        fast: bool | None = None, kv_cache_dtype: torch.dtype | None = None, group=None):
    """The runtime model for a loaded checkpoint (RuntimeCheckpoint) or a loaded transformers model: its family's
    class, its weights handed over by name, the attention backend chosen once for the KV cache it will be given
    (kv_cache_dtype; None: the model's dtype). A checkpoint loaded as one rank's share (its `shard_plan`) runs
    with that rank's tensor-parallel `group` (distributed.group.TensorParallelGroup); one loaded as a pipeline stage
    (its `stage_plan`) holds that stage's layers."""
    from llmopt.runtime.executor.attention import KVCacheSpec, select_attention_backend

    config = model.config
    cls = model_class_for(config.model_type)
    device, dtype = next(model.parameters()).device, model.dtype  # (a transformers model's dtype: its floats')
    fast = fast if fast is not None else Platform.of(device).fast_by_default
    backend = select_attention_backend(attention_backend, device, cls.cache_layout, fast,
                                       KVCacheSpec.holds_codes(kv_cache_dtype or dtype))
    checkpoint = isinstance(model, RuntimeCheckpoint)
    weights = model.named_weights() if checkpoint else module_weights(model)
    plan, stage = (model.shard_plan, model.stage_plan) if checkpoint else (None, None)
    if plan is None and stage is None:
        return cls(config, weights, backend, fast, dtype, device)
    return cls(config, weights, backend, fast, dtype, device, plan=plan, group=group, stage=stage)

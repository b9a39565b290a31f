"""The runtime's model classes, one module per family; importing the package registers every module in it."""

from __future__ import annotations

from llmopt.core.registry import import_submodules
from llmopt.runtime.executor.models.registry import MODEL_FAMILIES, model_class_for, register_model_family  # noqa: F401

import_submodules(__name__)


def build_runtime_model(hf_model, attention_backend: str = "auto", fast: bool | None = None):
    """The runtime model for a loaded model: its family's class, with the attention backend chosen once."""
    from llmopt.core.adapters import adapter_for
    from llmopt.runtime.executor.attention import select_attention_backend

    cls = model_class_for(hf_model.config.model_type)
    device = next(hf_model.parameters()).device
    fast = fast if fast is not None else device.type == "cpu"
    backend = select_attention_backend(attention_backend, device, cls.cache_layout, fast)
    return cls(hf_model, adapter_for(hf_model), backend, fast)

"""Model families: one runtime model class per family, registered for the `model_type`s it runs."""

from __future__ import annotations

from llmopt.core.errors import UnsupportedArchitectureError
from llmopt.core.registry import Registry

MODEL_FAMILIES: Registry[type] = Registry("runtime model family")


def register_model_family(*model_types: str):
    """Class decorator: the runtime runs these model types with the class."""
    def decorator(cls: type) -> type:
        for model_type in model_types:
            MODEL_FAMILIES.register(model_type)(cls)
        return cls

    return decorator


def model_class_for(model_type: str) -> type:
    if model_type not in MODEL_FAMILIES:
        raise UnsupportedArchitectureError(
            f"the runtime runs {', '.join(MODEL_FAMILIES.names())}; {model_type} runs with --backend hf")
    return MODEL_FAMILIES.get(model_type)

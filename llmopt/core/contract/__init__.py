"""The contract at the bottom, shared by compress, export and runtime: how a tensor is quantized (the typed
`scheme`), what a quantized weight is (`weight`), how sparsity is recorded (`sparsity`).

The weight's names load on first use: the scheme is imported by configs that must not import torch."""

from llmopt.core.contract.scheme import (  # noqa: F401
    FP8_CHANNEL_WEIGHTS, FP8_TOKEN_ACTIVATIONS, INT8_GROUP_ACTIVATIONS, INT8_TOKEN_ACTIVATIONS, PRESETS,
    QUANTIZE_PRESETS, SUPPORTED_BITS, LinearScheme, QuantRecord, QuantScheme, preset, register_preset,
    unregister_preset,
)
from llmopt.core.contract.sparsity import parse_nm, sparsity_entry  # noqa: F401

_WEIGHT_NAMES = ("QuantizedWeight", "default_g_idx", "quantize_activations", "fake_quantize_activations")


def __getattr__(name: str):
    if name in _WEIGHT_NAMES:
        from llmopt.core.contract import activations, weight

        return getattr(weight if hasattr(weight, name) else activations, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

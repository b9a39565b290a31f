"""Half-sparse (2:4, 4:8) linears written compressed: compressed-tensors' `sparse-24-bitmask` (the layout:
core/contract/sparse24.py), recorded in config.json as that library records it — a `sparsity_config` inside a
`quantization_config` of quant_method compressed-tensors, with no quantization groups when the values stay in
floating point.

    "quantization_config": {"quant_method": "compressed-tensors", "format": "dense", "quantization_status":
      "compressed", "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
      "targets": ["re:.*mlp.down_proj$", ...], "ignore": ["lm_head"], "global_sparsity": 0.5, ...}}
"""

from __future__ import annotations

from typing import Iterable

import torch

from llmopt.core.contract.sparse24 import HALF_PATTERNS, Sparse24Weight
from llmopt.core.contract.sparsity import COMPRESSED_FORMAT


def stores_compressed(structure: str) -> bool:
    """Whether a model pruned to `structure` has a compressed layout (half of every group kept)."""
    return structure in HALF_PATTERNS


def compress_linears(tensors: dict[str, torch.Tensor], linears: Iterable[str], pattern: str) -> dict[str, torch.Tensor]:
    """`tensors` (a state dict by full name) with each of `linears`' `.weight` replaced by its compressed tensors
    (`.compressed`, `.bitmask`, `.shape`); everything else, biases included, unchanged."""
    out = dict(tensors)
    for name in linears:
        weight = out.pop(f"{name}.weight")
        stored = Sparse24Weight.from_dense(weight, pattern, name=name).to_tensors()
        out.update({f"{name}.{suffix}": tensor for suffix, tensor in stored.items()})
    return out


def sparsity_quantization_config(pattern: str, suffixes: list[str], ignore: list[str], measured: float) -> dict:
    """config.json's quantization_config for a model whose linears ending in `suffixes` are stored compressed."""
    targets = [f"re:.*{suffix.replace('.', '[.]')}$" for suffix in suffixes]
    return {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
        "config_groups": {},
        "sparsity_config": {"format": COMPRESSED_FORMAT, "sparsity_structure": pattern, "targets": targets,
                            "ignore": ["lm_head", *ignore], "global_sparsity": round(measured, 6),
                            "registry_requires_subclass": False},
    }


"""Pruned linears written compressed: half-sparse ones (2:4, 4:8) in compressed-tensors' `sparse-24-bitmask`
(core/contract/sparse24.py), unstructured ones in its `sparse-bitmask` (core/contract/sparse_bitmask.py); recorded
in config.json as that library records it — a `sparsity_config` inside a `quantization_config` of quant_method
compressed-tensors, with no quantization groups when the values stay in floating point. 2:4 linears quantized to
integer codes in pack-quantized store only their kept codes and the bitmask (`mark_kept_codes`,
`kept_codes_records`; formats.layouts).

    "quantization_config": {"quant_method": "compressed-tensors", "format": "dense", "quantization_status":
      "compressed", "sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4",
      "targets": ["re:.*mlp.down_proj$", ...], "ignore": ["lm_head"], "global_sparsity": 0.5, ...}}
"""

from __future__ import annotations

from typing import Iterable

import torch

from llmopt.core.contract.sparse24 import HALF_PATTERNS, half_mask, pack_mask
from llmopt.core.contract.sparse_bitmask import compressed_weight
from llmopt.core.contract.sparsity import compressed_format
from llmopt.core.errors import ArtifactError


def stores_compressed(structure: str) -> bool:
    """Whether a model pruned to `structure` has a compressed layout: half of every group kept (2:4, 4:8:
    sparse-24-bitmask) or unstructured (sparse-bitmask); other N:M patterns stay dense."""
    return structure in HALF_PATTERNS or structure == "unstructured"


def compress_linears(tensors: dict[str, torch.Tensor], linears: Iterable[str],
                     pattern: str) -> dict[str, torch.Tensor]:
    """`tensors` (a state dict by full name) with each of `linears`' `.weight` replaced by its compressed tensors
    (`.compressed`, `.bitmask`, `.shape`); everything else, biases included, unchanged."""
    out = dict(tensors)
    for name in linears:
        weight = out.pop(f"{name}.weight")
        stored = compressed_weight(weight, pattern, name=name).to_tensors()
        out.update({f"{name}.{suffix}": tensor for suffix, tensor in stored.items()})
    return out


def sparsity_quantization_config(pattern: str, suffixes: list[str], ignore: list[str], measured: float) -> dict:
    """config.json's quantization_config for a model whose linears ending in `suffixes` are stored compressed."""
    targets = [f"re:.*{suffix.replace('.', '[.]')}$" for suffix in suffixes]
    return {
        "quant_method": "compressed-tensors", "format": "dense", "quantization_status": "compressed",
        "config_groups": {},
        "sparsity_config": {"format": compressed_format(pattern), "sparsity_structure": pattern,
                            "targets": targets, "ignore": list(dict.fromkeys(["lm_head", *ignore])),
                            "global_sparsity": round(measured, 6), "registry_requires_subclass": False},
    }



def mark_kept_codes(qweights: dict, sparsity_record: dict | None, fmt_name: str) -> list[str]:
    """A 2:4 model quantized into compressed-tensors' pack-quantized (integer weight-only codes): mark each 2:4
    linear's kept codes (QuantizedWeight.keep) so the format stores only those; return the names marked (none for
    other models, formats and schemes)."""
    structure = (sparsity_record or {}).get("sparsity_structure")
    if structure != "2:4" or fmt_name != "compressed-tensors":
        return []
    marked = []
    for name, qweight in qweights.items():
        scheme = qweight.scheme
        if scheme.type != "int" or qweight.input_activations is not None or scheme.scale_format is not None:
            continue
        try:
            keep = half_mask(qweight.q != qweight.zeros[:, qweight.g_idx.long()], structure)
        except ArtifactError:
            continue  # (a linear left dense by --ignore)
        qweight.keep = pack_mask(keep)
        marked.append(name)
    return marked


def kept_codes_records(config: dict, marked: list[str], qcfg: dict) -> tuple[dict, dict]:
    """(config.json dict, quantization_config) of a model whose `marked` linears store only their kept codes:
    the format's quantization_config `qcfg` gains compressed-tensors' sparsity_config, llmopt's sparsity record
    names the compressed format. Unchanged when none is marked."""
    if not marked:
        return config, qcfg
    record = config["sparsity_config"]
    suffixes = sorted({name.split(".", 3)[-1] for name in marked})
    sparsity = sparsity_quantization_config(record["sparsity_structure"], suffixes, record.get("ignore", []),
                                            record.get("global_sparsity", 0.5))["sparsity_config"]
    return ({**config, "sparsity_config": {**record, "format": sparsity["format"]}},
            {**qcfg, "sparsity_config": sparsity})

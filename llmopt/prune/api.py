"""One verb per kind: sparsify a loaded model in place (`sparsify_model`), or prune it to a smaller model
(`llmopt.prune.structured.prune_structured`)."""

from __future__ import annotations

import time
from typing import Callable

import torch

from llmopt.compress.base import quantizable_linears
from llmopt.core.errors import ConfigError
from llmopt.prune.base import PRUNE_METHODS
from llmopt.prune.config import SparsityConfig
from llmopt.prune.masks import check_nm_fits


def _load_methods() -> None:
    from llmopt.prune import magnitude, sparsegpt, wanda  # noqa: F401


def make_sparsity_config(**settings) -> SparsityConfig:
    from llmopt.compress.config import build_config

    return build_config(SparsityConfig, "pruning", **settings)


def sparsify_model(model, tokenizer, config: SparsityConfig,
                   progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Zero weights of every decoder linear in place; returns (masks by linear name, facts)."""
    from llmopt.core.calibration import apply_algorithm

    _load_methods()
    if config.nm is not None:
        check_nm_fits(quantizable_linears(model), config.nm)
    pruner = PRUNE_METHODS.get(config.method).pruner_cls(config, model)
    start = time.perf_counter()
    facts = apply_algorithm(model, tokenizer, pruner, config.calibration if config.needs_calibration else None,
                            progress)
    if not pruner.masks:
        raise ConfigError("nothing was pruned: every linear matched --ignore")
    facts["prune_wall_s"] = time.perf_counter() - start
    return pruner.masks, facts


def measure_sparsity(model) -> dict:
    """Parameter and zero counts over the decoder linears and the whole model."""
    linears = quantizable_linears(model)
    linear_params = sum(m.weight.numel() for m in linears.values())
    linear_zeros = sum(int((m.weight == 0).sum()) for m in linears.values())
    total = sum(p.numel() for p in model.parameters())
    nonzero = sum(int((p != 0).sum()) for p in model.parameters())
    return {"num_parameters": total, "num_nonzero": nonzero, "linear_parameters": linear_params,
            "linear_sparsity": linear_zeros / linear_params if linear_params else 0.0}


def sparsity_config_entry(config: SparsityConfig, measured: float, targets: list[str]) -> dict:
    """What config.json records about the sparsity (llmopt's `sparsity_config`)."""
    return sparsity_entry(config.structure, config.method, config.target_sparsity, config.ignore, measured,
                          targets)


def sparsity_entry(structure: str, method: str, target: float, ignore: list[str], measured: float,
                   targets: list[str]) -> dict:
    return {"format": "dense", "sparsity_structure": structure, "method": method,
            "targets": targets, "ignore": ["lm_head", "model.embed_tokens", *ignore],
            "target_sparsity": round(target, 6), "global_sparsity": round(measured, 6)}

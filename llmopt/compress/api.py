"""One verb: quantize a loaded model with a method's config, and write the artifact."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from llmopt.compress.base import QUANT_METHODS, quantizable_linears
from llmopt.compress.config import QuantizeConfig
from llmopt.compress.quant import QuantizedWeight
from llmopt.core.errors import ConfigError


def _load_methods() -> None:
    # Importing a method's module registers it.
    from llmopt.compress import awq, gptq, rtn  # noqa: F401


def make_config(method: str, **settings) -> QuantizeConfig:
    """The typed config of `method` from flat settings (CLI options or a recipe stage)."""
    from llmopt.compress.config import build_config

    _load_methods()
    return build_config(QUANT_METHODS.get(method).config_cls, method, method=method, **settings)


@dataclass
class QuantizeResult:
    qweights: dict[str, QuantizedWeight]
    extra_tensors: dict[str, torch.Tensor]
    facts: dict = field(default_factory=dict)


def check_model_fits(model, config: QuantizeConfig) -> None:
    """Fail before any work if the scheme cannot apply to some linear (e.g. group size not dividing K)."""
    linears = quantizable_linears(model)
    for name, linear in linears.items():
        config.scheme.check(linear.in_features, name)
    if getattr(config, "prune_nm", None) is not None:
        from llmopt.prune.masks import check_nm_fits

        check_nm_fits(linears, config.prune_nm)


def quantize_model(model, tokenizer, config: QuantizeConfig,
                   progress: Callable[[int, int], None] | None = None) -> QuantizeResult:
    """Quantize `model` in place (its linears end up holding the dequantized weights).

    >>> result = quantize_model(model, tok, make_config("gptq", bits=4, group_size=64))  # doctest: +SKIP
    """
    from llmopt.core.calibration import apply_algorithm

    _load_methods()
    check_model_fits(model, config)
    quantizer = QUANT_METHODS.get(config.method).quantizer_cls(config, model)
    start = time.perf_counter()
    facts = apply_algorithm(model, tokenizer, quantizer,
                            config.calibration if config.needs_calibration else None, progress)
    if not quantizer.results:
        raise ConfigError("nothing was quantized: every linear matched --ignore")
    facts["quantize_wall_s"] = time.perf_counter() - start
    facts["num_quantized_linears"] = len(quantizer.results)
    if getattr(config, "prune_nm", None) is not None:  # pruned too: record it as a pruned model would
        from llmopt.prune.api import sparsity_entry

        n, m = config.prune_nm
        measured = zero_fraction(quantizer.results)
        suffixes = sorted({name.split(".", 3)[-1] for name in quantizer.results})
        model.config.sparsity_config = sparsity_entry(config.prune_pattern, "sparsegpt+gptq", 1 - n / m,
                                                      config.ignore, measured, suffixes)
        facts["measured_sparsity"] = measured
    return QuantizeResult(quantizer.results, quantizer.extra_tensors(), facts)


def zero_fraction(qweights: dict[str, QuantizedWeight]) -> float:
    """Fraction of the quantized weights that dequantize to exactly zero (code == zero point)."""
    zeros = total = 0
    for qw in qweights.values():
        zero_points = qw.zeros[:, qw.g_idx.long()]  # [N, K]
        zeros += int((qw.q.to(torch.int32) == zero_points).sum())
        total += qw.q.numel()
    return zeros / total


def quantized_bytes(qweights: dict[str, QuantizedWeight], fmt_name: str) -> tuple[int, int]:
    """(bytes of the packed quantized linears, bytes the same linears take in fp16)."""
    from llmopt.export.formats import FORMATS

    fmt = FORMATS.get(fmt_name)
    packed = sum(t.numel() * t.element_size() for qw in qweights.values() for t in fmt.pack(qw).values())
    fp16 = sum(qw.q.numel() * 2 for qw in qweights.values())
    return packed, fp16



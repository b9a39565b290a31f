"""Recipe stages: each turns an input MODEL into an artifact. A stage's options are exactly the library
settings the CLI builds (same keys as the CLI options, with underscores), validated by the same configs.

Adding a stage (distill, when it lands) is adding an entry to STAGES.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmopt.core.errors import ConfigError
from llmopt.core.registry import Registry

CALIBRATION_KEYS = ("calib", "num_samples", "seqlen", "batch_size", "seed", "device", "compute_dtype")
QUANT_FORMAT_DEFAULT = {"rtn": "compressed-tensors", "gptq": "gptq", "awq": "awq"}


@dataclass(frozen=True)
class Stage:
    name: str
    validate: Callable[[dict], None]  # raises ConfigError naming the bad option
    run: Callable[[str, Path, dict], dict]  # (input MODEL, output folder, options) -> facts


STAGES: Registry[Stage] = Registry("stage")


def _split_quantize(options: dict) -> tuple[str, dict, str]:
    settings = dict(options)
    method = settings.pop("method", None)
    if method is None:
        raise ConfigError("quantize needs method: rtn, gptq or awq")
    fmt = settings.pop("format", QUANT_FORMAT_DEFAULT.get(method, "compressed-tensors"))
    return method, settings, fmt


def _validate_quantize(options: dict) -> None:
    from llmopt.compress.api import make_config
    from llmopt.export.formats import FORMATS

    method, settings, fmt = _split_quantize(options)
    make_config(method, **settings)
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS.names())}")


def _run_quantize(model: str, output: Path, options: dict) -> dict:
    from llmopt.compress.pipeline import quantize_to_artifact

    method, settings, fmt = _split_quantize(options)
    return quantize_to_artifact(model, output, method, settings, fmt, overwrite=True)


def _validate_prune(options: dict) -> None:
    from llmopt.prune.api import make_sparsity_config
    from llmopt.prune.pipeline import _structured_config

    if options.get("structured") is not None:
        _structured_config(dict(options))
    else:
        make_sparsity_config(**options)


def _run_prune(model: str, output: Path, options: dict) -> dict:
    from llmopt.prune.pipeline import prune_to_artifact

    return prune_to_artifact(model, output, dict(options), overwrite=True)


STAGES.add("quantize", Stage("quantize", _validate_quantize, _run_quantize))
STAGES.add("prune", Stage("prune", _validate_prune, _run_prune))

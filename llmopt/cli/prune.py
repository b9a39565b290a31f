"""`llmopt prune`: sparsity (magnitude / Wanda / SparseGPT) or structured pruning to a smaller model."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmopt.cli.options import JsonOpt, MaxMemoryOpt, ModelArg, OutputOpt, OverwriteOpt, TrustRemoteCodeOpt
from llmopt.cli.options import calib_dtype_label, config_option, with_calibration_options, with_config_options
from llmopt.cli.output import print_json, print_table, progress_bar
from llmopt.compress.config import SparsityConfig, StructuredConfig
from llmopt.compress.defaults import CALIBRATION, STRUCTURED_NUM_SAMPLES

# The options are the configs' fields (cli.options.config_option): the sparsity config's, or the structured
# pruner's; None when not given, but for the two whose defaults the help shows.
SPARSITY_FIELDS = ("method", "sparsity", "pattern")
STRUCTURED_FIELDS = ("structured", "ratio", "scores_file")
PRUNE_OPTIONS = (*(config_option(SparsityConfig, name, given=True) for name in SPARSITY_FIELDS),
                 *(config_option(StructuredConfig, name, given=True) for name in STRUCTURED_FIELDS),
                 config_option(SparsityConfig, "damp"), config_option(SparsityConfig, "ignore", given=True),
                 config_option(SparsityConfig, "save_compressed"))


@with_calibration_options
@with_config_options(PRUNE_OPTIONS)
def prune(
    model: ModelArg,
    output: OutputOpt,
    num_samples: Annotated[Optional[int], typer.Option(
        "--num-samples", help=f"Calibration samples (default {CALIBRATION['num_samples']}; "
        f"{STRUCTURED_NUM_SAMPLES} for structured).")] = None,
    max_memory: MaxMemoryOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    calibration: dict | None = None,
    settings: dict | None = None,
) -> None:
    """Prune MODEL: zero weights (--method with --sparsity or --pattern), or shrink it (--structured --ratio)."""
    from llmopt.core.errors import ConfigError
    from llmopt.core.offload import parse_memory
    from llmopt.jobs.prune import prune_config, prune_to_artifact

    if "structured" in settings:
        if any(name in settings for name in SPARSITY_FIELDS):
            raise ConfigError("--structured cannot be combined with --method/--sparsity/--pattern")
        if "ratio" not in settings:
            raise ConfigError("--structured needs --ratio F (the fraction to remove, in (0, 1))")
        settings = {k: v for k, v in settings.items() if k in STRUCTURED_FIELDS}
        settings.update(num_samples=num_samples or STRUCTURED_NUM_SAMPLES, **calibration)
    else:
        if "method" not in settings:
            raise ConfigError("give --method magnitude|wanda|sparsegpt (with --sparsity or --pattern), "
                              "or --structured mlp|heads|layers with --ratio")
        if "ratio" in settings or "scores_file" in settings:
            raise ConfigError("--ratio and --scores apply to --structured pruning only")
        settings.update(num_samples=num_samples or CALIBRATION["num_samples"], **calibration)
    with progress_bar(f"pruning layers ({calib_dtype_label(calibration)} forwards)") as update:
        facts = prune_to_artifact(model, output, prune_config(settings), overwrite, trust_remote_code, update,
                                  parse_memory(max_memory) if max_memory is not None else None)
    if as_json:
        print_json(facts)
    else:
        print_table(f"pruned {model} -> {output}", facts)

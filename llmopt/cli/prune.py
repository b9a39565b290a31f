"""`llmopt prune`: sparsity (magnitude / Wanda / SparseGPT) or structured pruning to a smaller model."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmopt.cli.options import IgnoreOpt, JsonOpt, MaxMemoryOpt, ModelArg, OutputOpt, OverwriteOpt, StructuredKind
from llmopt.cli.options import PruneMethod as PruneMethodName
from llmopt.cli.options import TrustRemoteCodeOpt, calib_dtype_label, with_calibration_options
from llmopt.cli.output import print_json, print_table, progress_bar
from llmopt.compress.defaults import CALIBRATION, SPARSEGPT_DAMP, STRUCTURED_NUM_SAMPLES


@with_calibration_options
def prune(
    model: ModelArg,
    output: OutputOpt,
    method: Annotated[Optional[PruneMethodName], typer.Option("--method", help="Sparsity method.")] = None,
    sparsity: Annotated[Optional[float], typer.Option("--sparsity", help="Fraction of weights to zero.")] = None,
    pattern: Annotated[Optional[str], typer.Option("--pattern", help="N:M, e.g. 2:4 or 4:8.")] = None,
    structured: Annotated[Optional[StructuredKind], typer.Option(
        "--structured", help="Remove MLP channels, attention heads or decoder layers.")] = None,
    ratio: Annotated[Optional[float], typer.Option("--ratio", help="Structured: fraction to remove.")] = None,
    scores: Annotated[Optional[str], typer.Option(
        "--scores", help="Structured: replay importance scores saved in an artifact.")] = None,
    damp: Annotated[float, typer.Option("--damp", help="SparseGPT dampening.")] = SPARSEGPT_DAMP,
    ignore: IgnoreOpt = None,
    num_samples: Annotated[Optional[int], typer.Option(
        "--num-samples", help=f"Calibration samples (default {CALIBRATION['num_samples']}; "
        f"{STRUCTURED_NUM_SAMPLES} for structured).")] = None,
    save_compressed: Annotated[bool, typer.Option(
        "--save-compressed/--save-dense",
        help="Store the kept values and a bitmask (compressed-tensors' sparse-24-bitmask for 2:4 and 4:8, "
        "sparse-bitmask for unstructured; 0.53x of fp32 at 50%), or the dense weights with zeros in place.")] = True,
    max_memory: MaxMemoryOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    calibration: dict | None = None,
) -> None:
    """Prune MODEL: zero weights (--method with --sparsity or --pattern), or shrink it (--structured --ratio)."""
    from llmopt.core.errors import ConfigError
    from llmopt.core.offload import parse_memory
    from llmopt.jobs.prune import prune_config, prune_to_artifact

    if structured is not None:
        if method is not None or sparsity is not None or pattern is not None:
            raise ConfigError("--structured cannot be combined with --method/--sparsity/--pattern")
        if ratio is None:
            raise ConfigError("--structured needs --ratio F (the fraction to remove, in (0, 1))")
        settings = dict(structured=structured.value, ratio=ratio, scores_file=scores,
                        num_samples=num_samples or STRUCTURED_NUM_SAMPLES, **calibration)
    else:
        if method is None:
            raise ConfigError("give --method magnitude|wanda|sparsegpt (with --sparsity or --pattern), "
                              "or --structured mlp|heads|layers with --ratio")
        if ratio is not None or scores is not None:
            raise ConfigError("--ratio and --scores apply to --structured pruning only")
        settings = dict(method=method.value, sparsity=sparsity, pattern=pattern, ignore=ignore or [], damp=damp,
                        save_compressed=save_compressed, num_samples=num_samples or CALIBRATION["num_samples"],
                        **calibration)
    with progress_bar(f"pruning layers ({calib_dtype_label(calibration)} forwards)") as update:
        facts = prune_to_artifact(model, output, prune_config(settings), overwrite, trust_remote_code, update,
                                  parse_memory(max_memory) if max_memory is not None else None)
    if as_json:
        print_json(facts)
    else:
        print_table(f"pruned {model} -> {output}", facts)

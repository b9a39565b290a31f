"""`llmopt prune`: sparsity (magnitude / Wanda / SparseGPT) or structured pruning to a smaller model."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from llmopt.cli.options import (
    JsonOpt, ModelArg, OutputOpt, OverwriteOpt, SeedOpt, TrustRemoteCodeOpt, calib_dtype_label,
)
from llmopt.cli.output import print_json, print_table, progress_bar
from llmopt.cli.quantize import CalibDtype


class PruneMethodName(str, Enum):
    magnitude = "magnitude"
    wanda = "wanda"
    sparsegpt = "sparsegpt"


class StructuredKind(str, Enum):
    mlp = "mlp"
    heads = "heads"
    layers = "layers"


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
    damp: Annotated[float, typer.Option("--damp", help="SparseGPT dampening.")] = 0.01,
    ignore: Annotated[Optional[list[str]], typer.Option("--ignore", help="Glob of linears to keep dense.")] = None,
    calib: Annotated[str, typer.Option("--calib", help="Calibration dataset(s), comma-separated.")] = "c4",
    num_samples: Annotated[Optional[int], typer.Option(
        "--num-samples", help="Calibration samples (default 128; 32 for structured).")] = None,
    seqlen: Annotated[int, typer.Option("--seqlen", help="Tokens per calibration sample.")] = 512,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Calibration samples per forward.")] = 8,
    calib_dtype: Annotated[CalibDtype, typer.Option("--calib-dtype", help="dtype of calibration forwards.")
                           ] = CalibDtype.auto,
    device: Annotated[str, typer.Option("--device", help="Where layers are calibrated.")] = "cpu",
    seed: SeedOpt = 0,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Prune MODEL: zero weights (--method with --sparsity or --pattern), or shrink it (--structured --ratio)."""
    from llmopt.core.errors import ConfigError
    from llmopt.prune.pipeline import prune_to_artifact

    calibration = dict(calib=calib, seqlen=seqlen, batch_size=batch_size, seed=seed, device=device,
                       compute_dtype=calib_dtype.value)
    if structured is not None:
        if method is not None or sparsity is not None or pattern is not None:
            raise ConfigError("--structured cannot be combined with --method/--sparsity/--pattern")
        if ratio is None:
            raise ConfigError("--structured needs --ratio F (the fraction to remove, in (0, 1))")
        settings = dict(structured=structured.value, ratio=ratio, scores_file=scores,
                        num_samples=num_samples or 32, **calibration)
    else:
        if method is None:
            raise ConfigError("give --method magnitude|wanda|sparsegpt (with --sparsity or --pattern), "
                              "or --structured mlp|heads|layers with --ratio")
        if ratio is not None or scores is not None:
            raise ConfigError("--ratio and --scores apply to --structured pruning only")
        settings = dict(method=method.value, sparsity=sparsity, pattern=pattern, ignore=ignore or [], damp=damp,
                        num_samples=num_samples or 128, **calibration)
    with progress_bar(f"pruning layers ({calib_dtype_label(calib_dtype, device)} forwards)") as update:
        facts = prune_to_artifact(model, output, settings, overwrite, trust_remote_code, update)
    if as_json:
        print_json(facts)
    else:
        print_table(f"pruned {model} -> {output}", facts)

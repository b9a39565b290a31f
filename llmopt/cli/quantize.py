"""`llmopt quantize`: RTN / GPTQ / AWQ into a GPTQ, AWQ or compressed-tensors artifact."""

from __future__ import annotations

from typing import Annotated, Optional, get_args

import typer

from llmopt.cli.options import (
    FormatName, JsonOpt, MaxMemoryOpt, ModelArg, OutputOpt, OverwriteOpt, SchemeName, config_option, given_settings,
    option_flag, with_config_options,
)
from llmopt.cli.options import QuantMethod as Method
from llmopt.cli.options import TrustRemoteCodeOpt, calib_dtype_label, with_calibration_options
from llmopt.cli.output import print_json, print_table, progress_bar
from llmopt.compress.config import QuantizeConfig
from llmopt.compress.defaults import CALIBRATION, ROTATION_SEED, SCHEME_PREPASSES

# each method's config by its name (every QuantizeConfig subclass states its method as a one-value Literal)
METHOD_CONFIGS = {get_args(c.model_fields["method"].annotation)[0]: c for c in QuantizeConfig.__subclasses__()}
# The options that are fields of the methods' configs, generated from them (cli.options.config_option): None
# when not given, so the method's config (or --scheme) decides.
METHOD_FIELDS = ("bits", "group_size", "sym", "zero_point", "mse", "act_order", "static_groups", "damp", "gptaq",
                 "search_file", "ignore")
METHOD_OPTIONS = tuple(config_option(METHOD_CONFIGS, name, given=True) for name in METHOD_FIELDS)
# option -> the methods it applies to: a field's, those whose config has it; the composite options' by hand
METHOD_ONLY = {name: tuple(m for m, c in METHOD_CONFIGS.items() if name in c.model_fields) for name in METHOD_FIELDS}
METHOD_ONLY["prune_pattern"] = ("gptq",)


FLAGS = {name: option_flag(kind) for name, kind, _ in METHOD_OPTIONS} | {"prune_pattern": "--prune-pattern"}


@with_calibration_options
@with_config_options(METHOD_OPTIONS, "method_settings")
def quantize(
    model: ModelArg,
    output: OutputOpt,
    method: Annotated[Method, typer.Option("--method", help="Quantization algorithm.")] = Method.gptq,
    scheme: Annotated[Optional[SchemeName], typer.Option(
        "--scheme", help="A named scheme: sets bits, group size and symmetry, and for w8a8-int8 8-bit per-token "
        "dynamic input activations (written as compressed-tensors int-quantized). Unless --smoothquant-alpha or "
        "--rotate is given, a scheme runs the pre-passes measured best for it: "
        f"{'; '.join(f'{k}: ' + ', '.join(f'{o} {v}' for o, v in p.items()) for k, p in SCHEME_PREPASSES.items())} "
        "(--smoothquant-alpha none: no pre-pass).")] = None,
    prune_pattern: Annotated[Optional[str], typer.Option(
        "--prune-pattern", help="GPTQ: SparseGPT-prune each linear to N:M (e.g. 2:4) first, in the same pass.")
    ] = None,
    smoothquant_alpha: Annotated[Optional[str], typer.Option(
        "--smoothquant-alpha", help="SmoothQuant before quantizing (schemes with quantized inputs): migration "
        "strength in [0, 1] (0.5 is the paper's), 'search' to pick it per group on the calibration data, or 'none'.")
    ] = None,
    rotate: Annotated[Optional[str], typer.Option(
        "--rotate", help="Fold random orthogonal rotations into the weights first (QuaRot / SpinQuant style, exact "
        "in full precision): R1 the residual stream, R2 each attention head's values; e.g. R1,R2. Spreads outlier "
        "channels; the lm_head is untied. 'none': no rotation.")] = None,
    rotate_seed: Annotated[Optional[int], typer.Option(
        "--rotate-seed", help=f"Seed of the --rotate matrices (default {ROTATION_SEED}).")] = None,
    num_samples: Annotated[int, typer.Option(
        "--num-samples", help="Calibration samples.")] = CALIBRATION["num_samples"],
    fmt: Annotated[Optional[FormatName], typer.Option(
        "--format", help="Checkpoint format (default per method: gptq, awq; compressed-tensors for rtn).")] = None,
    max_memory: MaxMemoryOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    calibration: dict | None = None,
    method_settings: dict | None = None,
) -> None:
    """Quantize MODEL's decoder linears and write an artifact loadable everywhere a MODEL is accepted."""
    from llmopt.compress.api import quantize_configs, with_scheme_prepasses
    from llmopt.jobs.quantize import quantize_to_artifact
    from llmopt.core.errors import ConfigError
    from llmopt.core.offload import parse_memory

    given = {**method_settings, **given_settings({"prune_pattern": prune_pattern})}
    for option, value in given.items():
        if method.value not in METHOD_ONLY[option]:
            raise ConfigError(f"{FLAGS[option]} applies to {', '.join(METHOD_ONLY[option])} only, not {method.value}")
    settings = dict(num_samples=num_samples, **calibration, **given)
    if scheme is not None:
        settings["scheme"] = scheme.value
    if smoothquant_alpha is not None:
        settings["smoothquant_alpha"] = smoothquant_alpha
    if rotate is not None or rotate_seed is not None:
        settings.update(rotate=rotate, rotate_seed=rotate_seed)
    memory = parse_memory(max_memory) if max_memory is not None else None
    with progress_bar(f"{method.value} layers ({calib_dtype_label(calibration)} forwards)") as update:
        facts = quantize_to_artifact(
            model, output, quantize_configs(method.value, with_scheme_prepasses(settings)), fmt.value if fmt else None,
            overwrite=overwrite, trust_remote_code=trust_remote_code, progress=update, max_memory=memory,
        )
    if as_json:
        print_json(facts)
    else:
        print_table(f"quantized {model} -> {output}", {k: v for k, v in facts.items() if not isinstance(v, dict)})

"""`llmopt quantize`: RTN / GPTQ / AWQ into a GPTQ, AWQ or compressed-tensors artifact."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmopt.cli.options import (
    FormatName, IgnoreOpt, JsonOpt, MaxMemoryOpt, ModelArg, OutputOpt, OverwriteOpt, SchemeName, ZeroPoint,
)
from llmopt.cli.options import QuantMethod as Method
from llmopt.cli.options import TrustRemoteCodeOpt, calib_dtype_label, with_calibration_options
from llmopt.cli.output import print_json, print_table, progress_bar
from llmopt.compress.defaults import CALIBRATION, QUANTIZE, ROTATION_SEED, SCHEME_PREPASSES

METHOD_ONLY = {  # option -> the methods it applies to
    "act_order": ("gptq",), "damp": ("gptq",), "static_groups": ("gptq",), "prune_pattern": ("gptq",),
    "gptaq": ("gptq",),
    "awq_search": ("awq",),
}


@with_calibration_options
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
    # None: not given (the config's default, or the scheme's)
    bits: Annotated[Optional[int], typer.Option(
        "--bits", show_default=False, help=f"2, 3, 4 or 8 (default {QUANTIZE['bits']}).")] = None,
    group_size: Annotated[Optional[int], typer.Option(
        "--group-size", show_default=False,
        help=f"Input columns per scale; -1 = per channel (default {QUANTIZE['group_size']}).")] = None,
    sym: Annotated[Optional[bool], typer.Option(
        "--sym/--asym", show_default=False, help="Symmetric (zero point fixed; the default) or asymmetric.")] = None,
    zero_point: Annotated[Optional[ZeroPoint], typer.Option(
        "--zero-point", help="With --asym: int (codes; GPTQ, AWQ, compressed-tensors pack-quantized) or float (a "
        "float minimum per group, as GGUF Q4_1; written as compressed-tensors naive-quantized, exported to Q4_1 to "
        "fp32 rounding). Default int.")] = None,
    act_order: Annotated[Optional[bool], typer.Option(
        "--act-order/--no-act-order",
        help="GPTQ: quantize columns by decreasing Hessian diagonal (desc_act; default on).")] = None,
    static_groups: Annotated[Optional[bool], typer.Option(
        "--static-groups/--no-static-groups",
        help="GPTQ act-order: group parameters fixed up front, so g_idx stays k // group_size (default on).")] = None,
    damp: Annotated[Optional[float], typer.Option(
        "--damp", help="GPTQ dampening, fraction of mean diag(H) (default 0.1).")] = None,
    gptaq: Annotated[Optional[bool], typer.Option(
        "--gptaq/--no-gptaq",
        help="GPTQ: match the full-precision model's outputs (GPTAQ asymmetric calibration; default on).")
    ] = None,
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
    mse: Annotated[Optional[bool], typer.Option(
        "--mse/--no-mse", help="Choose group ranges by minimising weight error (default: on for GPTQ).")] = None,
    num_samples: Annotated[int, typer.Option(
        "--num-samples", help="Calibration samples.")] = CALIBRATION["num_samples"],
    ignore: IgnoreOpt = None,
    awq_search: Annotated[Optional[str], typer.Option(
        "--awq-search", help="AWQ: re-apply scales/clips saved in an artifact instead of searching.")] = None,
    fmt: Annotated[Optional[FormatName], typer.Option(
        "--format", help="Checkpoint format (default per method: gptq, awq; compressed-tensors for rtn).")] = None,
    max_memory: MaxMemoryOpt = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    calibration: dict | None = None,
) -> None:
    """Quantize MODEL's decoder linears and write an artifact loadable everywhere a MODEL is accepted."""
    from llmopt.compress.api import quantize_configs, with_scheme_prepasses
    from llmopt.jobs.quantize import quantize_to_artifact
    from llmopt.core.errors import ConfigError
    from llmopt.core.offload import parse_memory

    given = {"act_order": act_order, "damp": damp, "static_groups": static_groups,
             "prune_pattern": prune_pattern, "gptaq": gptaq, "awq_search": awq_search}
    for option, value in given.items():
        if value is not None and method.value not in METHOD_ONLY[option]:
            flag = "--" + option.replace("_", "-")
            raise ConfigError(f"{flag} applies to {', '.join(METHOD_ONLY[option])} only, not {method.value}")
    settings = dict(ignore=ignore or [], num_samples=num_samples, **calibration)
    given_scheme = {"scheme": scheme.value if scheme else None, "bits": bits, "group_size": group_size, "sym": sym}
    settings.update({k: v for k, v in given_scheme.items() if v is not None})
    if mse is not None:
        settings["mse"] = mse
    if zero_point is not None:
        settings["zero_point"] = zero_point.value
    if smoothquant_alpha is not None:
        settings["smoothquant_alpha"] = smoothquant_alpha
    if rotate is not None or rotate_seed is not None:
        settings.update(rotate=rotate, rotate_seed=rotate_seed)
    if method is Method.gptq:
        settings.update({k: v for k, v in given.items() if k != "awq_search" and v is not None})
    if awq_search is not None:
        settings["search_file"] = awq_search
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

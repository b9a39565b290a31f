"""`llmopt quantize`: RTN / GPTQ / AWQ into a GPTQ, AWQ or compressed-tensors artifact."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from llmopt.cli.options import (
    JsonOpt, ModelArg, OutputOpt, OverwriteOpt, SeedOpt, TrustRemoteCodeOpt, calib_dtype_label,
)
from llmopt.cli.output import print_json, print_table, progress_bar


class Method(str, Enum):
    rtn = "rtn"
    gptq = "gptq"
    awq = "awq"


class FormatName(str, Enum):
    gptq = "gptq"
    awq = "awq"
    compressed_tensors = "compressed-tensors"


class CalibDtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


DEFAULT_FORMAT = {"rtn": "compressed-tensors", "gptq": "gptq", "awq": "awq"}
METHOD_ONLY = {  # option -> the methods it applies to
    "act_order": ("gptq",), "damp": ("gptq",), "static_groups": ("gptq",), "prune_pattern": ("gptq",), "gptaq": ("gptq",),
    "awq_search": ("awq",),
}


def quantize(
    model: ModelArg,
    output: OutputOpt,
    method: Annotated[Method, typer.Option("--method", help="Quantization algorithm.")] = Method.gptq,
    bits: Annotated[int, typer.Option("--bits", help="2, 3, 4 or 8.")] = 4,
    group_size: Annotated[int, typer.Option("--group-size", help="Input columns per scale; -1 = per channel.")] = 128,
    sym: Annotated[bool, typer.Option("--sym/--asym", help="Symmetric (zero point fixed) or asymmetric.")] = True,
    act_order: Annotated[Optional[bool], typer.Option(
        "--act-order/--no-act-order",
        help="GPTQ: quantize columns by decreasing Hessian diagonal (desc_act; default on).")] = None,
    static_groups: Annotated[Optional[bool], typer.Option(
        "--static-groups/--no-static-groups",
        help="GPTQ act-order: group parameters fixed up front, so g_idx stays k // group_size (default on).")] = None,
    damp: Annotated[Optional[float], typer.Option(
        "--damp", help="GPTQ dampening, fraction of mean diag(H) (default 0.1).")] = None,
    gptaq: Annotated[Optional[bool], typer.Option(
        "--gptaq/--no-gptaq", help="GPTQ: match the full-precision model's outputs (GPTAQ asymmetric calibration; default on).")
    ] = None,
    prune_pattern: Annotated[Optional[str], typer.Option(
        "--prune-pattern", help="GPTQ: SparseGPT-prune each linear to N:M (e.g. 2:4) first, in the same pass.")
    ] = None,
    mse: Annotated[Optional[bool], typer.Option(
        "--mse/--no-mse", help="Choose group ranges by minimising weight error (default: on for GPTQ).")] = None,
    calib: Annotated[str, typer.Option("--calib", help="Calibration dataset(s), comma-separated to mix.")] = "c4",
    num_samples: Annotated[int, typer.Option("--num-samples", help="Calibration samples.")] = 128,
    seqlen: Annotated[int, typer.Option("--seqlen", help="Tokens per calibration sample.")] = 512,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Calibration samples per forward.")] = 8,
    calib_dtype: Annotated[CalibDtype, typer.Option(
        "--calib-dtype", help="dtype of the calibration forwards; weights and statistics stay fp32.")
    ] = CalibDtype.auto,
    ignore: Annotated[Optional[list[str]], typer.Option("--ignore", help="Glob of linears to keep dense.")] = None,
    awq_search: Annotated[Optional[str], typer.Option(
        "--awq-search", help="AWQ: re-apply scales/clips saved in an artifact instead of searching.")] = None,
    fmt: Annotated[Optional[FormatName], typer.Option("--format", help="Checkpoint format (default per method).")] = None,
    device: Annotated[str, typer.Option("--device", help="Where layers are calibrated: cpu, cuda.")] = "cpu",
    seed: SeedOpt = 0,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Quantize MODEL's decoder linears and write an artifact loadable everywhere a MODEL is accepted."""
    from llmopt.compress.pipeline import quantize_to_artifact
    from llmopt.core.errors import ConfigError

    given = {"act_order": act_order, "damp": damp, "static_groups": static_groups,
             "prune_pattern": prune_pattern, "gptaq": gptaq, "awq_search": awq_search}
    for option, value in given.items():
        if value is not None and method.value not in METHOD_ONLY[option]:
            flag = "--" + option.replace("_", "-")
            raise ConfigError(f"{flag} applies to {', '.join(METHOD_ONLY[option])} only, not {method.value}")
    settings = dict(bits=bits, group_size=group_size, sym=sym, ignore=ignore or [], calib=calib,
                    num_samples=num_samples, seqlen=seqlen, batch_size=batch_size, seed=seed, device=device,
                    compute_dtype=calib_dtype.value)
    if mse is not None:
        settings["mse"] = mse
    if method is Method.gptq:
        settings.update({k: v for k, v in given.items() if k != "awq_search" and v is not None})
    if awq_search is not None:
        settings["search_file"] = awq_search
    with progress_bar(f"{method.value} layers ({calib_dtype_label(calib_dtype, device)} forwards)") as update:
        facts = quantize_to_artifact(
            model, output, method.value, settings, (fmt.value if fmt else DEFAULT_FORMAT[method.value]),
            overwrite=overwrite, trust_remote_code=trust_remote_code, progress=update,
        )
    if as_json:
        print_json(facts)
    else:
        print_table(f"quantized {model} -> {output}", {k: v for k, v in facts.items() if not isinstance(v, dict)})

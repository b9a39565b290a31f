"""Option types shared by every command, so the same option reads the same everywhere."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


ModelArg = Annotated[str, typer.Argument(
    help="An alias (smollm2-135m, tiny-random-llama), a model or llmopt artifact folder, a .gguf file, or a hub id.",
    show_default=False,
)]
DtypeOpt = Annotated[Dtype, typer.Option(
    "--dtype", help="Weights and compute dtype; auto: bfloat16 on CUDA and on CPUs with bf16 units "
    "(AVX512_BF16, AMX, Arm BF16), else float32.")]
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Run model code shipped with the checkpoint (off by default: it is arbitrary code).",
)]
DatasetOpt = Annotated[str, typer.Option(
    "--dataset", help="pystdlib, wikitext2, c4, sharegpt, or a .txt/.jsonl/.json file.",
)]
TextFieldOpt = Annotated[str, typer.Option("--text-field", help="Field holding the text in .jsonl/.json files.")]
SeqlenOpt = Annotated[int, typer.Option("--seqlen", help="Tokens per window / sample.")]
MaxTokensOpt = Annotated[Optional[int], typer.Option("--max-tokens", help="Use at most this many tokens of the text.")]
OutputOpt = Annotated[str, typer.Option("-o", "--output", help="Output folder (written atomically).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output folder.")]


def resolve_dtype_option(dtype: Dtype | str, device: str) -> str:
    """The concrete dtype for --dtype / --calib-dtype; prints once (stderr) what auto chose, or that an explicit
    half precision will be slow on this CPU."""
    from llmopt.cli.output import stderr
    from llmopt.core.hardware import dtype_note, resolve_dtype

    name = dtype.value if isinstance(dtype, Enum) else dtype
    note = dtype_note(name, device)
    if note:
        stderr.print(note, highlight=False, markup=False, soft_wrap=True)
    return resolve_dtype(name, device)


def calib_dtype_label(dtype: Enum | str, device: str) -> str:
    """The calibration forwards' dtype as the progress bar names it: 'float32 (auto)', or the explicit choice with
    the warning when it will be slow on this CPU. (Calibration configs resolve 'auto' the same way.)"""
    from llmopt.compress.config import calibration_dtype
    from llmopt.core.hardware import dtype_note

    name = dtype.value if isinstance(dtype, Enum) else dtype
    if name == "auto":
        return f"{calibration_dtype(name, device)} (auto)"
    note = dtype_note(name, device)
    return f"{name}, slow here: no native units" if note else name

"""Option types shared by every command, so the same option reads the same everywhere."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer


class Dtype(str, Enum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


ModelArg = Annotated[str, typer.Argument(
    help="An alias (smollm2-135m, tiny-random-llama), a model or llmopt artifact folder, a .gguf file, or a hub id.",
    show_default=False,
)]
DtypeOpt = Annotated[Dtype, typer.Option("--dtype", help="Weights and compute dtype.")]
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

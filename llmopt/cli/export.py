"""`llmopt export`: convert a quantized artifact to another checkpoint format, or to one GGUF file."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import ExportFormatName, JsonOpt, OverwriteOpt, TrustRemoteCodeOpt
from llmopt.cli.output import print_json, print_table


def export(
    artifact: Annotated[str, typer.Argument(help="A quantized artifact folder (GPTQ, AWQ or compressed-tensors).")],
    fmt: Annotated[ExportFormatName, typer.Option(
        "--format", help="Target checkpoint format; gguf: one file for llama.cpp (its block types that hold the "
        "codes: Q4_0, Q4_1, Q8_0).")],
    output: Annotated[str, typer.Option("-o", "--output", help="Output folder, or the .gguf file (written "
                                                                "atomically).")],
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Convert ARTIFACT to --format, or say why the target cannot express it."""
    if fmt.value == "gguf":
        from llmopt.formats.gguf import export_gguf

        facts = export_gguf(artifact, output, overwrite, trust_remote_code)
    else:
        from llmopt.formats.convert import export_artifact

        facts = export_artifact(artifact, output, fmt.value, overwrite, trust_remote_code)
    if as_json:
        print_json(facts)
    else:
        print_table(f"exported {artifact} -> {output}", facts)

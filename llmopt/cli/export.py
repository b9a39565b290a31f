"""`llmopt export`: convert a quantized artifact to another checkpoint format."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import JsonOpt, OutputOpt, OverwriteOpt, TrustRemoteCodeOpt
from llmopt.cli.output import print_json, print_table
from llmopt.cli.options import FormatName


def export(
    artifact: Annotated[str, typer.Argument(help="A quantized artifact folder (GPTQ, AWQ or compressed-tensors).")],
    fmt: Annotated[FormatName, typer.Option("--format", help="Target checkpoint format.")],
    output: OutputOpt,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Convert ARTIFACT to --format, or say why the target cannot express it."""
    from llmopt.export.convert import export_artifact

    facts = export_artifact(artifact, output, fmt.value, overwrite, trust_remote_code)
    if as_json:
        print_json(facts)
    else:
        print_table(f"exported {artifact} -> {output}", facts)

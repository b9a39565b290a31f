"""`llmopt report`: compare recipe runs in one HTML page (plots embedded) and a Markdown summary."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


def report(
    run_dirs: Annotated[list[Path], typer.Argument(help="Recipe run folders (with results.json).")],
    output: Annotated[Path, typer.Option("-o", "--output", help="HTML file to write.")] = Path("report.html"),
    markdown_path: Annotated[Optional[Path], typer.Option("--markdown", help="Also write a Markdown summary.")] = None,
) -> None:
    """Write an accuracy-vs-speed comparison of one or more recipe runs."""
    from llmopt.cli.output import stderr
    from llmopt.core.io import check_output_file
    from llmopt.report.html import write_report
    from llmopt.report.tables import load_run, markdown

    check_output_file(output, "report")
    if markdown_path is not None:
        check_output_file(markdown_path, "--markdown file")
    runs = [load_run(d) for d in run_dirs]
    write_report(runs, output, markdown_path)
    stderr.print(f"wrote {output}" + (f" and {markdown_path}" if markdown_path else ""))
    print(markdown(runs), end="")

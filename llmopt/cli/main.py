"""The `llmopt` command: command groups, --version, and the one error boundary."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import click
import typer
from typer.core import TyperGroup

from llmopt import __version__
from llmopt.core.errors import LLMOptError


class ErrorBoundaryGroup(TyperGroup):
    """Turns LLMOptError into one red line on stderr and exit code 1 (traceback with LLMOPT_DEBUG=1)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LLMOptError as e:
            if os.environ.get("LLMOPT_DEBUG"):
                raise
            from llmopt.cli.output import stderr

            stderr.print(f"[red]error:[/red] {e}", markup=True, highlight=False, soft_wrap=True)
            sys.exit(1)
        except KeyboardInterrupt:
            sys.exit(130)


app = typer.Typer(
    name="llmopt", cls=ErrorBoundaryGroup, no_args_is_help=True, pretty_exceptions_enable=False,
    add_completion=False, help="Make Hugging Face causal LMs smaller and faster, and prove it.",
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmopt {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.")] = False,
) -> None:
    """Make Hugging Face causal LMs smaller and faster, and prove it."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _register() -> None:
    from llmopt.cli import env, eval as eval_cli, generate, models

    app.add_typer(models.app, name="models")
    app.add_typer(eval_cli.app, name="eval")
    app.command("generate")(generate.generate)
    app.command("env")(env.env)
    from llmopt.cli import bench, distill, export, prune, quantize, recipe, report, serve

    app.command("quantize")(quantize.quantize)
    app.command("prune")(prune.prune)
    app.command("distill")(distill.distill)
    app.command("export")(export.export)
    app.command("bench")(bench.bench)
    app.command("serve")(serve.serve)
    app.add_typer(recipe.app, name="recipe")
    app.command("report")(report.report)


_register()


def main() -> None:
    app()

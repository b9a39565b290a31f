"""`llmopt recipe validate|run`: YAML pipelines of compression stages, evaluation and bench."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(no_args_is_help=True, help="Validate and run YAML recipes.")

RecipeArg = Annotated[Path, typer.Argument(help="A recipe YAML file.", show_default=False)]


@app.command("validate")
def validate(recipe_file: RecipeArg) -> None:
    """Check a recipe without running anything: its schema, stage options, and every check `recipe run` makes
    before work (the model exists, each stage's options fit the model it will get), reading configs only."""
    from llmopt.cli.output import stdout
    from llmopt.recipe.schema import load_recipe

    recipe = load_recipe(recipe_file, check_inputs=True)
    stdout.print(f"{recipe_file}: ok ({recipe.name}: {len(recipe.variants)} variants)")


@app.command("run")
def run(
    recipe_file: RecipeArg,
    output: Annotated[Optional[Path], typer.Option("-o", "--output", help="Run folder (default runs/NAME).")] = None,
    only: Annotated[Optional[list[str]], typer.Option("--only", help="Run only this variant (repeatable).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Reuse finished stages and measurements (always on: "
                                         "results are cached by content; kept for clarity).")] = False,
) -> None:
    """Run every variant's stages, evaluation and bench; write RUN_DIR/results.json."""
    from llmopt.cli.output import stderr
    from llmopt.core.errors import ConfigError
    from llmopt.recipe.runner import RecipeRunner
    from llmopt.recipe.schema import load_recipe
    from llmopt.report.tables import markdown

    recipe = load_recipe(recipe_file, check_inputs=True)
    unknown = [v for v in (only or []) if v not in recipe.variants]
    if unknown:
        raise ConfigError(f"--only {unknown[0]!r} is not a variant; allowed: {', '.join(recipe.variants)}")
    run_dir = output or Path("runs") / recipe.name
    _check_run_dir(run_dir)
    if recipe.defaults.data_dir:
        import os

        os.environ.setdefault("LLMOPT_DATA_DIR", recipe.defaults.data_dir)
    created = [p for p in (run_dir, run_dir / "cache") if not p.exists()]
    try:
        runner = RecipeRunner(recipe, run_dir, log=lambda m: stderr.print(m, style="dim", markup=False,
                                                                          highlight=False, soft_wrap=True))
        results = runner.run(only)
    except BaseException:
        _remove_if_empty(reversed(created))  # a run that failed before writing anything leaves no folders
        raise
    results["run_dir"] = str(run_dir)
    stderr.print(f"wrote {run_dir / 'results.json'}")
    print(markdown([results]), end="")


def _remove_if_empty(folders) -> None:
    for folder in folders:
        try:
            folder.rmdir()  # only an empty folder
        except OSError:
            pass


def _check_run_dir(run_dir: Path) -> None:
    """A run folder that could not be written fails now, not after the first variant's stages."""
    from llmopt.core.errors import ArtifactError
    from llmopt.core.io import check_writable_location

    if run_dir.exists() and not run_dir.is_dir():
        raise ArtifactError(f"run folder {run_dir} is a file: give a folder to -o")
    check_writable_location(run_dir / "results.json", "run folder")

"""`llmopt models`: what models llmopt knows and what is inside one."""

from __future__ import annotations

import typer

from llmopt.cli.options import JsonOpt, ModelArg, TrustRemoteCodeOpt
from llmopt.cli.output import print_json, print_table

app = typer.Typer(no_args_is_help=True, help="List model aliases and inspect models.")


@app.command("list")
def list_models(as_json: JsonOpt = False) -> None:
    """List the model aliases, whether each is installed and cached."""
    from llmopt.core.adapters import supported_model_types
    from llmopt.core.models import ALIASES, alias_cache_dir

    rows = []
    for name in ALIASES.names():
        alias = ALIASES.get(name)
        cache = alias_cache_dir(name)
        rows.append({
            "alias": name, "available": alias.is_available(), "cached": (cache / "config.json").exists(),
            "description": alias.description,
        })
    if as_json:
        print_json({"aliases": rows, "supported_model_types": supported_model_types()})
    else:
        print_table("model aliases", rows)


@app.command("info")
def info(model: ModelArg, as_json: JsonOpt = False, trust_remote_code: TrustRemoteCodeOpt = False) -> None:
    """Show a model's architecture, size and how it was compressed (without loading its weights)."""
    from llmopt.core.models import describe_model, resolve_model

    facts = describe_model(resolve_model(model), trust_remote_code)
    if as_json:
        print_json(facts)
    else:
        print_table(f"model {model}", {k: v for k, v in facts.items() if v is not None})

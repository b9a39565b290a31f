"""`llmopt eval`: measure a model's quality."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmopt.cli.options import (
    DatasetOpt, DeviceOpt, Dtype, DtypeOpt, JsonOpt, MaxTokensOpt, ModelArg, SeqlenOpt, TextFieldOpt,
    TrustRemoteCodeOpt, resolve_dtype_option,
)
from llmopt.cli.output import print_json, print_table, progress_bar

app = typer.Typer(no_args_is_help=True, help="Evaluate models: perplexity and zero-shot task accuracy.")


@app.command("ppl")
def ppl(
    model: ModelArg,
    dataset: DatasetOpt = "wikitext2",
    seqlen: SeqlenOpt = 512,
    max_tokens: MaxTokensOpt = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per forward pass.")] = 4,
    text_field: TextFieldOpt = "text",
    dtype: DtypeOpt = Dtype.float32,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Perplexity over non-overlapping windows of --seqlen tokens."""
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.core.errors import ConfigError
    from llmopt.core.models import check_within_context
    from llmopt.export.load import load_model
    from llmopt.eval.perplexity import perplexity

    if seqlen < 2:
        raise ConfigError(f"--seqlen must be at least 2 (got {seqlen})")
    if max_tokens is not None and max_tokens < seqlen:
        raise ConfigError(f"--max-tokens ({max_tokens}) must be at least --seqlen ({seqlen})")
    resolved = resolve_dtype_option(dtype, device)
    lm, tokenizer, source = load_model(model, dtype=resolved, device=device, trust_remote_code=trust_remote_code)
    check_within_context(seqlen, lm.config, "--seqlen")
    token_ids = tokenize_corpus(tokenizer, dataset, max_tokens, "eval", text_field)
    with progress_bar(f"ppl {dataset}") as update:
        result = perplexity(lm, token_ids, seqlen=seqlen, batch_size=batch_size, progress=update)
    facts = {**result.to_dict(), "model": model, "dataset": dataset, "dtype": resolved}
    if as_json:
        print_json(facts)
    else:
        print_table(f"perplexity of {model} on {dataset}", facts)


@app.command("tasks")
def tasks(
    model: ModelArg,
    task_names: Annotated[str, typer.Option(
        "--tasks", help="Comma-separated: arc_easy, arc_challenge, piqa, hellaswag, lambada, winogrande.")
    ] = "arc_easy,arc_challenge,piqa,hellaswag,lambada,winogrande",
    limit: Annotated[Optional[int], typer.Option("--limit", help="First N documents of each task.")] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per forward pass.")] = 16,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = "cpu",
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Zero-shot accuracy, scored by log-likelihood as lm-evaluation-harness does."""
    from llmopt.core.errors import ConfigError
    from llmopt.export.load import load_model
    from llmopt.eval.tasks import TASKS, evaluate_task

    names = [t.strip() for t in task_names.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ConfigError(f"unknown task {unknown[0] if unknown else '(none)'!r}: choose from {', '.join(TASKS.names())}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1 (got {limit})")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1 (got {batch_size})")
    resolved = resolve_dtype_option(dtype, device)
    lm, tokenizer, _ = load_model(model, dtype=resolved, device=device, trust_remote_code=trust_remote_code)
    results = {}
    for name in names:
        with progress_bar(name) as update:
            results[name] = evaluate_task(lm, tokenizer, name, limit, batch_size, update)
    if as_json:
        print_json({"model": model, "limit": limit, "dtype": resolved, "tasks": results})
    else:
        print_table(f"task accuracy of {model}", [{"task": k, **{m: v.get(m) for m in ("acc", "acc_norm", "ppl",
                                                   "num_docs")}} for k, v in results.items()])

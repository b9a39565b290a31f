"""`llmopt eval`: measure a model's quality."""

from __future__ import annotations

import atexit
from typing import Annotated, Optional

import typer

from llmopt.cli.options import (
    DEFAULT_DEVICE, Backend, DatasetOpt, DeviceOpt, Dtype, DtypeOpt, JsonOpt, MaxTokensOpt, ModelArg, SeqlenOpt,
    TextFieldOpt, TrustRemoteCodeOpt, resolve_dtype_option, with_engine_options,
)
from llmopt.cli.output import print_json, print_table, progress_bar

app = typer.Typer(no_args_is_help=True, help="Evaluate models: perplexity and zero-shot task accuracy.")


EvalBackendOpt = Annotated[Backend, typer.Option(
    "--backend", help="hf: transformers' forward over the weights; runtime: llmopt's engine (its kernels and paged "
    "KV cache, --kv-cache-dtype included: what `llmopt serve` computes), each text prefilled in chunks.")]


def load_for_eval(model: str, resolved_dtype: str, device: str, trust_remote_code: bool, backend: Backend, engine):
    """(what scores: a transformers model or, for --backend runtime, an Engine; the tokenizer; the model's config;
    the facts about what computes the numbers, for the JSON)."""
    if backend is Backend.runtime:
        from llmopt.runtime.engine.engine import Engine
        from llmopt.runtime.executor.loader import load_for_engine

        lm, tokenizer, _ = load_for_engine(model, engine, dtype=resolved_dtype, device=device,
                                           trust_remote_code=trust_remote_code)
        scorer = Engine(lm, tokenizer, engine, record_steps=False)
        return scorer, tokenizer, lm.config, {"backend": "runtime", "kv_cache_dtype": scorer.runner.kv_dtype_label,
                                              "attention_backend": scorer.runner.decoder.attention.name}
    from llmopt.formats.load import load_model

    lm, tokenizer, _ = load_model(model, dtype=resolved_dtype, device=device, trust_remote_code=trust_remote_code)
    return lm, tokenizer, lm.config, {"backend": "hf"}


def check_engine_options(backend: Backend, engine) -> None:
    """Engine options change only the runtime's numbers: with --backend hf they would be ignored."""
    from dataclasses import fields

    from llmopt.core.errors import ConfigError
    from llmopt.runtime.engine.config import ENGINE_DEFAULTS, engine_flag

    if backend is Backend.runtime:
        if engine.speculative is not None:
            raise ConfigError("--speculative changes no score: drop it from eval", param="speculative")
        return
    changed = [f.name for f in fields(engine) if f.name != "speculative"
               and getattr(engine, f.name) != getattr(ENGINE_DEFAULTS, f.name)]
    if changed or engine.speculative is not None:
        flag = engine_flag(changed[0]) if changed else "speculative"
        raise ConfigError(f"--{flag} configures the runtime: add --backend runtime or drop it", param=flag)


@app.command("ppl")
@with_engine_options
def ppl(
    model: ModelArg,
    dataset: DatasetOpt = "wikitext2",
    seqlen: SeqlenOpt = 512,
    max_tokens: MaxTokensOpt = None,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", help="Windows per forward pass (--backend hf; the runtime batches by --max-num-seqs / "
        "--max-num-batched-tokens).")] = 4,
    text_field: TextFieldOpt = "text",
    dtype: DtypeOpt = Dtype.float32,
    device: DeviceOpt = DEFAULT_DEVICE,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    backend: EvalBackendOpt = Backend.hf,
    engine=None,
) -> None:
    """Perplexity over non-overlapping windows of --seqlen tokens."""
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.core.errors import ConfigError
    from llmopt.core.models import check_within_context
    from llmopt.eval.perplexity import perplexity
    from llmopt.eval.runtime_scoring import runtime_perplexity

    if seqlen < 2:
        raise ConfigError(f"--seqlen must be at least 2 (got {seqlen})")
    if max_tokens is not None and max_tokens < seqlen:
        raise ConfigError(f"--max-tokens ({max_tokens}) must be at least --seqlen ({seqlen})")
    check_engine_options(backend, engine)
    resolved = resolve_dtype_option(dtype, device)
    scorer, tokenizer, config, facts = load_for_eval(model, resolved, device, trust_remote_code, backend, engine)
    close = getattr(scorer, "close", None)
    if close is not None:  # the runtime's engine: its other ranks stop with the command
        atexit.register(close)
    check_within_context(seqlen, config, "--seqlen")
    token_ids = tokenize_corpus(tokenizer, dataset, max_tokens, "eval", text_field)
    with progress_bar(f"ppl {dataset}") as update:
        if backend is Backend.runtime:
            result = runtime_perplexity(scorer, token_ids, seqlen=seqlen, progress=update)
        else:
            result = perplexity(scorer, token_ids, seqlen=seqlen, batch_size=batch_size, progress=update)
    facts = {**result.to_dict(), "model": model, "dataset": dataset, "dtype": resolved, **facts}
    if as_json:
        print_json(facts)
    else:
        print_table(f"perplexity of {model} on {dataset}", facts)


@app.command("tasks")
@with_engine_options
def tasks(
    model: ModelArg,
    task_names: Annotated[str, typer.Option(
        "--tasks", help="Comma-separated: arc_easy, arc_challenge, piqa, hellaswag, lambada, winogrande.")
    ] = "arc_easy,arc_challenge,piqa,hellaswag,lambada,winogrande",
    limit: Annotated[Optional[int], typer.Option("--limit", help="First N documents of each task.")] = None,
    batch_size: Annotated[int, typer.Option(
        "--batch-size", help="Sequences per forward pass (--backend hf; the runtime batches by --max-num-seqs / "
        "--max-num-batched-tokens).")] = 16,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = DEFAULT_DEVICE,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    backend: EvalBackendOpt = Backend.hf,
    engine=None,
) -> None:
    """Zero-shot accuracy, scored by log-likelihood as lm-evaluation-harness does."""
    from llmopt.core.errors import ConfigError
    from llmopt.eval.runtime_scoring import evaluate_task_runtime
    from llmopt.eval.tasks import TASKS, evaluate_task

    names = [t.strip() for t in task_names.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or not names:
        raise ConfigError(f"unknown task {unknown[0] if unknown else '(none)'!r}: choose from {', '.join(TASKS.names())}")
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1 (got {limit})")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1 (got {batch_size})")
    check_engine_options(backend, engine)
    resolved = resolve_dtype_option(dtype, device)
    scorer, tokenizer, _, facts = load_for_eval(model, resolved, device, trust_remote_code, backend, engine)
    close = getattr(scorer, "close", None)
    if close is not None:  # the runtime's engine: its other ranks stop with the command
        atexit.register(close)
    results = {}
    for name in names:
        with progress_bar(name) as update:
            if backend is Backend.runtime:
                results[name] = evaluate_task_runtime(scorer, tokenizer, name, limit, update)
            else:
                results[name] = evaluate_task(scorer, tokenizer, name, limit, batch_size, update)
    if as_json:
        print_json({"model": model, "limit": limit, "dtype": resolved, **facts, "tasks": results})
    else:
        print_table(f"task accuracy of {model}", [{"task": k, **{m: v.get(m) for m in ("acc", "acc_norm", "ppl",
                                                   "num_docs")}} for k, v in results.items()])

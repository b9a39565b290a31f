"""`llmopt eval`: measure a model's quality."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import (
    DatasetOpt, DeviceOpt, Dtype, DtypeOpt, JsonOpt, MaxTokensOpt, ModelArg, SeqlenOpt, TextFieldOpt,
    TrustRemoteCodeOpt,
)
from llmopt.cli.output import print_json, print_table, progress_bar

app = typer.Typer(no_args_is_help=True, help="Evaluate models: perplexity (tasks come later).")


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
    from llmopt.core.models import load_model
    from llmopt.eval.perplexity import perplexity

    if seqlen < 2:
        raise ConfigError(f"--seqlen must be at least 2 (got {seqlen})")
    if max_tokens is not None and max_tokens < seqlen:
        raise ConfigError(f"--max-tokens ({max_tokens}) must be at least --seqlen ({seqlen})")
    lm, tokenizer, source = load_model(model, dtype=dtype.value, device=device, trust_remote_code=trust_remote_code)
    token_ids = tokenize_corpus(tokenizer, dataset, max_tokens, "eval", text_field)
    with progress_bar(f"ppl {dataset}") as update:
        result = perplexity(lm, token_ids, seqlen=seqlen, batch_size=batch_size, progress=update)
    facts = {**result.to_dict(), "model": model, "dataset": dataset, "dtype": dtype.value}
    if as_json:
        print_json(facts)
    else:
        print_table(f"perplexity of {model} on {dataset}", facts)

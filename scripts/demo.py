"""`make demo`: load SmolLM2-135M, answer a chat prompt with llmopt's runtime (in the dtype `auto` picks for this
CPU), and measure perplexity on a slice of pystdlib (fp32)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.table import Table


def main() -> None:
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.core.hardware import cpu_line, resolve_dtype
    from llmopt.formats.load import load_model
    from llmopt.eval.perplexity import perplexity
    from llmopt.runtime.engine.engine import Engine
    from llmopt.eval.hf_baseline import encode_prompts
    from llmopt.runtime.engine.sampling import SamplingParams

    console = Console()
    console.print(f"CPU: {cpu_line()}", markup=False, highlight=False)
    dtype = resolve_dtype("auto")
    start = time.perf_counter()
    model, tokenizer, _ = load_model("smollm2-135m", dtype=dtype)
    engine = Engine(model, tokenizer)
    load_s = time.perf_counter() - start

    question = "In two sentences, why do people compress neural networks?"
    prompt_ids = encode_prompts(tokenizer, [question], chat=True)
    start = time.perf_counter()
    answer_ids = engine.generate(prompt_ids, SamplingParams(max_tokens=64))[0].token_ids
    generate_s = time.perf_counter() - start
    console.print(f"[bold]> {question}[/bold]")
    console.print(tokenizer.decode(answer_ids, skip_special_tokens=True), markup=False, highlight=False)

    ids = tokenize_corpus(tokenizer, "pystdlib", 4096)
    del engine, model
    model, _, _ = load_model("smollm2-135m", dtype="float32")
    result = perplexity(model, ids, seqlen=512, batch_size=2)

    table = Table(title=f"llmopt demo: SmolLM2-135M-Instruct (runtime in {dtype}, perplexity in fp32, CPU)")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_row("load time (model + engine)", f"{load_s:.1f} s")
    table.add_row("answer tokens / time (llmopt runtime)", f"{len(answer_ids)} / {generate_s:.1f} s")
    table.add_row("perplexity, pystdlib (4,096 tokens, seqlen 512)", f"{result.ppl:.3f}")
    table.add_row("tokens scored", f"{result.num_tokens:,}")
    table.add_row("eval throughput", f"{result.tokens_per_s:,.0f} tok/s")
    console.print(table)


if __name__ == "__main__":
    main()

"""`llmopt generate`: complete a prompt (or a chat turn) with a model."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import (
    DEFAULT_DEVICE, Backend, DeviceOpt, Dtype, DtypeOpt, JsonOpt, ModelArg, SeedOpt, TrustRemoteCodeOpt,
    resolve_dtype_option, with_engine_options,
)
from llmopt.cli.output import print_json, stdout


@with_engine_options
def generate(
    model: ModelArg,
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="Prompt text; repeat for several.")],
    chat: Annotated[bool, typer.Option("--chat", help="Wrap each prompt in the tokenizer's chat template.")] = False,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="New tokens at most.")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus sampling mass, in (0, 1].")] = 1.0,
    top_k: Annotated[int, typer.Option("--top-k", help="Sample among the k most likely tokens (0 = off).")] = 0,
    stop: Annotated[list[str] | None, typer.Option(
        "--stop", help="Stop string (repeatable); the text ends before it. Runtime backend only.")] = None,
    seed: SeedOpt = 0,
    backend: Annotated[Backend, typer.Option(
        "--backend", help="llmopt's runtime (paged KV cache, continuous batching) or transformers' generate.")
    ] = Backend.runtime,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = DEFAULT_DEVICE,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    engine=None,
) -> None:
    """Generate a completion for each --prompt."""
    from llmopt.core.errors import ConfigError
    from llmopt.core.models import check_within_context
    from llmopt.formats.load import load_model
    from llmopt.eval.hf_baseline import encode_prompts, hf_generate
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.runtime.executor.loader import load_for_engine

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=tuple(stop or ()))
    if stop and backend is Backend.hf:
        raise ConfigError("--stop needs the runtime backend: drop --backend hf")
    if engine.speculative is not None and backend is Backend.hf:
        raise ConfigError("--speculative needs the runtime backend: drop --backend hf")
    for text in prompt:
        _check_utf8(text)
    dtype = resolve_dtype_option(dtype, device)
    if backend is Backend.runtime:
        lm, tokenizer, _ = load_for_engine(model, engine, dtype=dtype, device=device,
                                           trust_remote_code=trust_remote_code)
    else:
        lm, tokenizer, _ = load_model(model, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    prompt_ids = encode_prompts(tokenizer, prompt, chat)
    if backend is Backend.hf:  # the runtime engine refuses these itself
        for ids in prompt_ids:
            check_within_context(len(ids) + max_tokens, lm.config, "the prompt + --max-tokens")
        outputs = hf_generate(lm, tokenizer, prompt_ids, params)
        texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in outputs]
    else:
        runtime = Engine(lm, tokenizer, engine)
        try:
            finished = runtime.generate(prompt_ids, params)
        finally:
            runtime.close()  # (tensor-parallel ranks: stopped, this thread's cores given back)
        outputs, texts = [o.token_ids for o in finished], [o.text for o in finished]
    if as_json:
        print_json({"outputs": [
            {"prompt": p, "text": t, "num_prompt_tokens": len(pi), "num_output_tokens": len(o)}
            for p, t, pi, o in zip(prompt, texts, prompt_ids, outputs)
        ]})
        return
    for p, t in zip(prompt, texts):
        if len(prompt) > 1:
            stdout.print(f"[bold]> {p}[/bold]", highlight=False)
        stdout.print(t, highlight=False, markup=False)


def _check_utf8(text: str) -> None:
    """A command-line argument that is not UTF-8 arrives with surrogate escapes; the tokenizer would fail on it."""
    from llmopt.core.errors import ConfigError

    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        byte = ord(text[e.start]) - 0xDC00 if 0xDC80 <= ord(text[e.start]) <= 0xDCFF else None
        shown = f" (byte 0x{byte:02x} at character {e.start})" if byte is not None else ""
        raise ConfigError(f"--prompt is not valid UTF-8 text{shown}: pass the prompt encoded as UTF-8",
                          param="prompt") from None

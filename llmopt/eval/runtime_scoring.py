"""Scoring text through the runtime (`eval ppl --backend runtime`, `eval tasks --backend runtime`): every
log-probability comes from the engine's own forward — its linear methods, attention kernels and paged KV cache
in the configured dtype (an 8-bit cache included), each prompt prefilled in chunks through the cache — so what is
measured is what `llmopt serve` computes, not transformers' forward over the same weights.

Each text is one request asking for its prompt log-probabilities (as lm-eval's loglikelihood requests to a
server do); requests run with continuous batching, and those sharing a scored prefix (a multiple-choice
question's context) reuse it from the prefix cache.
"""

from __future__ import annotations

import math
import time
from typing import Callable

import torch

from llmopt.eval.perplexity import PerplexityResult, windows_of
from llmopt.eval.tasks import encode_pairs, pair_origins, score, scoring_length, task_pairs
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams

ProgressFn = Callable[[int, int], None]


def score_prompts(engine: Engine, prompts: list[list[int]], top_n: int = 0, progress: ProgressFn | None = None,
                  done: int = 0, total: int | None = None) -> list[list[dict[int, float] | None]]:
    """The prompt log-probabilities of each prompt ([None, {token: logprob}, ...], one per prompt token), in
    order. top_n: also the n most likely tokens at each position."""
    params = SamplingParams(max_tokens=1, prompt_logprobs=top_n)
    ids = [engine.add_request(p, params) for p in prompts]
    results: dict[int, list] = {}
    total = total or len(prompts)
    for out in engine.stream():
        if out.finished:
            results[out.request_id] = out.prompt_logprobs
            if progress is not None:
                progress(done + len(results), total)
    return [results[i] for i in ids]


def runtime_perplexity(engine: Engine, token_ids: torch.Tensor, seqlen: int = 512,
                       progress: ProgressFn | None = None) -> PerplexityResult:
    """perplexity.perplexity through the engine: the same windows, every token of a window but its first scored."""
    windows = windows_of(token_ids, seqlen)
    start = time.perf_counter()
    scored = score_prompts(engine, windows.tolist(), 0, progress)
    wall = time.perf_counter() - start
    total_nll = 0.0
    for window, entries in zip(windows.tolist(), scored):
        total_nll -= math.fsum(entry[token] for token, entry in zip(window[1:], entries[1:]))
    num_scored = windows.shape[0] * (seqlen - 1)
    mean_nll = total_nll / num_scored
    return PerplexityResult(
        ppl=math.exp(mean_nll), num_tokens=num_scored, num_windows=windows.shape[0], seqlen=seqlen,
        nll=mean_nll, tokens_per_s=windows.numel() / wall if wall > 0 else float("inf"), wall_s=wall,
    )


def runtime_loglikelihoods(engine: Engine, tokenizer, pairs: list[tuple[str, str]], max_length: int | None = None,
                           progress: ProgressFn | None = None,
                           origins: list[str] | None = None) -> list[tuple[float, bool]]:
    """tasks.loglikelihoods through the engine: (sum of log p(continuation | context), whether every continuation
    token is the most likely) per pair. The first pair of each distinct context runs first, the others after it,
    so their contexts come from the prefix cache instead of being prefilled again."""
    if max_length is None:  # (each pair is a prompt scored with one new token: the context holds it and that token)
        max_length = scoring_length(engine.max_context, 2)
    encoded = encode_pairs(tokenizer, pairs, max_length, origins)
    seen, first_of_context, rest = set(), [], []
    for i, (context, _) in enumerate(pairs):
        (rest if context in seen else first_of_context).append(i)
        seen.add(context)
    results: list[tuple[float, bool] | None] = [None] * len(pairs)
    for wave in (first_of_context, rest):
        scored = score_prompts(engine, [encoded[i][0] for i in wave], 1, progress,
                               done=len(pairs) - len(wave) if wave is rest else 0, total=len(pairs))
        for i, entries in zip(wave, scored):
            ids, num_cont = encoded[i]
            positions = range(len(ids) - num_cont, len(ids))
            logprob = math.fsum(entries[p][ids[p]] for p in positions)
            greedy = all(entries[p][ids[p]] >= max(entries[p].values()) for p in positions)
            results[i] = (logprob, greedy)
    return results


def evaluate_task_runtime(engine: Engine, tokenizer, name: str, limit: int | None = None,
                          progress: ProgressFn | None = None) -> dict:
    """tasks.evaluate_task through the engine (its requests batched by the engine)."""
    docs, pairs = task_pairs(name, limit)
    return score(docs, runtime_loglikelihoods(engine, tokenizer, pairs, progress=progress,
                                              origins=pair_origins(docs)))

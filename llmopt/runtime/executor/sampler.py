"""Turning logits into tokens: greedy, temperature, top-k, top-p, with a per-request seeded generator."""

from __future__ import annotations

import torch

from llmopt.runtime.engine.sampling import SamplingParams


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a sampling request draws from: softmax of logits [..., vocab] (fp32) / temperature, cut
    to the top-k and to the smallest prefix whose mass reaches top-p (the most likely token always stays)."""
    logits = logits / params.temperature
    if params.top_k:
        kth = torch.topk(logits, min(params.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
        probs = probs / probs.sum(dim=-1, keepdim=True)  # rejection sampling compares these as probabilities
    return probs


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None) -> int:
    """One token from `logits` [vocab] (fp32)."""
    if params.is_greedy:
        return int(torch.argmax(logits))
    return int(torch.multinomial(probabilities(logits, params), 1, generator=generator))


def token_logprobs(logits: torch.Tensor, token_id: int, top_n: int) -> dict[int, float]:
    """{token id: log-probability} for the sampled token and the top_n most likely ones (logits [vocab])."""
    return rows_token_logprobs(logits[None], [token_id], top_n)[0]


def rows_token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[dict[int, float]]:
    """token_logprobs for each row of logits [R, vocab] and its token, in one pass over the rows."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    picked = logprobs.gather(1, torch.tensor(token_ids, dtype=torch.long)[:, None])[:, 0].tolist()
    if not top_n:
        return [{token: value} for token, value in zip(token_ids, picked)]
    values, ids = torch.topk(logprobs, min(top_n, logprobs.shape[-1]), dim=-1)
    rows = []
    for top_ids, top_values, token, value in zip(ids.tolist(), values.tolist(), token_ids, picked):
        entry = dict(zip(top_ids, top_values))
        entry[token] = value
        rows.append(entry)
    return rows

"""Perplexity over non-overlapping windows.

The text is tokenized once without special tokens and truncated to `max_tokens`; it is cut into
`num_tokens // seqlen` windows of `seqlen` tokens (the remainder is dropped), and every token of a window
but its first is scored. ppl = exp(total NLL / tokens scored).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.core.errors import ConfigError


@dataclass
class PerplexityResult:
    ppl: float
    num_tokens: int  # tokens scored
    num_windows: int
    seqlen: int
    nll: float  # mean negative log-likelihood (nats per token)
    tokens_per_s: float  # tokens through the model per second (including unscored first tokens)
    wall_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def windows_of(token_ids: torch.Tensor, seqlen: int) -> torch.Tensor:
    """[num_windows, seqlen] non-overlapping windows of a 1-D token tensor."""
    if seqlen < 2:
        raise ConfigError(f"--seqlen must be at least 2 (got {seqlen}): a window scores all its tokens but the first")
    num_windows = token_ids.numel() // seqlen
    if num_windows == 0:
        raise ConfigError(
            f"only {token_ids.numel()} tokens, fewer than one window of {seqlen}: lower --seqlen or raise --max-tokens"
        )
    return token_ids[: num_windows * seqlen].view(num_windows, seqlen)


@torch.inference_mode()
def window_nll(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Summed NLL per window [batch] of `input_ids` [batch, seqlen], scoring tokens 1..seqlen-1, in fp32."""
    logits = model(input_ids=input_ids, use_cache=False).logits  # [batch, seqlen, vocab]
    logits = logits[:, :-1].float()
    targets = input_ids[:, 1:].to(logits.device)
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return nll.view(targets.shape).sum(dim=1)


def perplexity(
    model,
    token_ids: torch.Tensor,
    seqlen: int = 512,
    batch_size: int = 4,
    progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of `model` on `token_ids` [num_tokens].

    >>> perplexity(model, tokenize_corpus(tok, "wikitext2", 32768), seqlen=512).ppl  # doctest: +SKIP
    """
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be at least 1 (got {batch_size})")
    windows = windows_of(token_ids, seqlen)
    device = next(model.parameters()).device
    total_nll = 0.0
    start = time.perf_counter()
    for first in range(0, windows.shape[0], batch_size):
        batch = windows[first: first + batch_size].to(device)
        total_nll += float(window_nll(model, batch).double().sum())
        if progress is not None:
            progress(min(first + batch_size, windows.shape[0]), windows.shape[0])
    wall = time.perf_counter() - start
    num_scored = windows.shape[0] * (seqlen - 1)
    mean_nll = total_nll / num_scored
    return PerplexityResult(
        ppl=math.exp(mean_nll), num_tokens=num_scored, num_windows=windows.shape[0], seqlen=seqlen,
        nll=mean_nll, tokens_per_s=windows.numel() / wall if wall > 0 else float("inf"), wall_s=wall,
    )

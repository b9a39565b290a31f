"""Prompt lookup: when the last n tokens occurred earlier in the sequence (prompt or output), propose the tokens
that followed them there. No model, nearly free; it pays off when the output copies its input (code edits,
quoting summaries, retrieval-augmented answers)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from llmopt.runtime.engine.config import SpeculativeConfig
from llmopt.runtime.engine.sequence import Sequence
from llmopt.runtime.spec_decode.proposer import PROPOSERS


def prompt_lookup(token_ids: list[int] | np.ndarray, ngram_min: int, ngram_max: int, num_tokens: int) -> list[int]:
    """Up to num_tokens tokens that followed the latest earlier occurrence of the longest suffix n-gram
    (n from ngram_max down to ngram_min); [] when no suffix of those lengths occurred before."""
    tokens = np.asarray(token_ids)
    length = len(tokens)
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        # windows starting at i = 0 .. length - n - 1: each is followed by at least one token
        windows = sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + num_tokens].tolist()
    return []


class NgramProposer:
    def __init__(self, config: SpeculativeConfig):
        self.ngram_min, self.ngram_max = config.ngram_min, config.ngram_max

    def propose(self, seqs: list[Sequence], num_tokens: dict[int, int]) -> dict[int, list[int]]:
        found = {}
        for seq in seqs:
            drafts = prompt_lookup(seq.token_ids, self.ngram_min, self.ngram_max, num_tokens[seq.seq_id])
            if drafts:
                found[seq.seq_id] = drafts
        return found

    def release(self, seq_id: int) -> None:
        pass


PROPOSERS.add("ngram", lambda config, hf_model, runner, engine_config: NgramProposer(config))

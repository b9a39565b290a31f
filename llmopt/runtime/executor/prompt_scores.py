"""Prompt log-probabilities kept with the prefix cache, so requests that score their prompt (lm-eval's
loglikelihood requests: echo + logprobs) reuse a cached prefix instead of prefilling it again.

A cached KV block saves the keys and values of its tokens, but a scoring request also needs, for every prompt
position, the log-probability of the next token (and the top-n). Those depend only on the tokens up to that next
token, so for each full block b of a scored prompt this keeps:
- `entries`: the scores of block b's tokens as targets (positions b * bs - 1 ... b * bs + bs - 2 predicting tokens
  b * bs ... b * bs + bs - 1; block 0 has none for token 0), computed with `top_n`;
- `last_hidden` [hidden]: the final hidden state at the block's last position, from which the score of whatever
  token follows the block (the next request's own) is one vocabulary projection.
Blocks are keyed by a hash chained over every token up to the block's end (equal keys: equal prefixes), and the
least recently used are dropped beyond `max_blocks`. The block manager asks `available` how many leading blocks
of a prompt it may take from the prefix cache for a scoring request.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

MAX_SCORED_BLOCKS = 8192  # ~ 8192 x (16 entries + 576 floats) for SmolLM2: ~40 MB


@dataclass
class BlockScores:
    entries: list[dict[int, float]]
    last_hidden: torch.Tensor  # [hidden]
    top_n: int


def block_keys(token_ids: list[int], block_size: int, num_blocks: int) -> list[int]:
    """The chained hash of each of the first num_blocks full blocks (key b covers tokens [0, (b + 1) * bs))."""
    keys, key = [], 0
    for b in range(num_blocks):
        key = hash((key, tuple(token_ids[b * block_size:(b + 1) * block_size])))
        keys.append(key)
    return keys


@dataclass
class SequenceScoring:
    """One scoring request's progress: its scores so far (targets 1, 2, ...), the final hidden state at each
    block end computed so far, and how many of its blocks are stored."""

    keys: list[int]  # of its prompt's full blocks
    entries: list[dict[int, float]] = field(default_factory=list)
    block_ends: dict[int, torch.Tensor] = field(default_factory=dict)  # block -> hidden at its last position
    stored: int = 0


class PromptScoreCache:
    def __init__(self, block_size: int, max_blocks: int = MAX_SCORED_BLOCKS):
        self.block_size, self.max_blocks = block_size, max_blocks
        self.blocks: OrderedDict[int, BlockScores] = OrderedDict()
        self.sequences: dict[int, SequenceScoring] = {}

    def available(self, token_ids: list[int], max_blocks: int, top_n: int) -> int:
        """How many leading full blocks of token_ids (at most max_blocks) have scores computed with top_n."""
        count = 0
        for key in block_keys(token_ids, self.block_size, max_blocks):
            block = self.blocks.get(key)
            if block is None or block.top_n != top_n:
                break
            self.blocks.move_to_end(key)
            count += 1
        return count

    def start(self, seq_id: int, prompt: list[int]) -> SequenceScoring:
        """A scoring request (re)admitted: its state from the start."""
        state = self.sequences[seq_id] = SequenceScoring(block_keys(prompt, self.block_size,
                                                                    len(prompt) // self.block_size))
        return state

    def cached_entries(self, state: SequenceScoring, num_blocks: int) -> tuple[list[dict[int, float]], torch.Tensor]:
        """The scores of targets 1 ... num_blocks * bs - 1 and the hidden state that scores the next one."""
        entries = []
        for key in state.keys[:num_blocks]:
            entries += self.blocks[key].entries
        return entries, self.blocks[state.keys[num_blocks - 1]].last_hidden

    def record(self, state: SequenceScoring, entries: list[dict[int, float]], block_ends: dict[int, torch.Tensor],
               top_n: int) -> None:
        """Append this step's scores and block-end hidden states; store every block now complete."""
        state.entries += entries
        state.block_ends.update(block_ends)
        bs = self.block_size
        while state.stored < len(state.keys):
            b = state.stored
            last_target = (b + 1) * bs - 1  # the block's last token: entries[last_target - 1]
            if len(state.entries) < last_target or b not in state.block_ends:
                break
            key = state.keys[b]
            kept = self.blocks.get(key)
            if kept is None or kept.top_n != top_n:  # (another top-n: the latest request's replaces it)
                self.blocks[key] = BlockScores(state.entries[max(0, b * bs - 1):last_target],
                                               state.block_ends[b], top_n)
                self.blocks.move_to_end(key)
                if len(self.blocks) > self.max_blocks:
                    self.blocks.popitem(last=False)
            state.stored += 1

    def release(self, seq_id: int) -> None:
        self.sequences.pop(seq_id, None)

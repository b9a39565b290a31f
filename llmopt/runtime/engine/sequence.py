"""A request as the runtime sees it: its tokens, where its KV lives, how far it has been computed."""

from __future__ import annotations

import itertools
import time
from enum import Enum

from llmopt.runtime.engine.sampling import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    """Token ids (prompt then output), the block table of its KV cache, and its progress.

    num_computed_tokens: tokens whose KV is in the cache (prefix-cache hits included);
    num_cached_tokens: of those, how many came from the prefix cache at the last admission.
    """

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                 seq_id: int | None = None, arrival_time: float | None = None):
        if not prompt_token_ids:
            raise ValueError("a sequence needs at least one prompt token")
        self.seq_id = next(_ids) if seq_id is None else seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params or SamplingParams()
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.token_times: list[float] = []  # when each output token was produced
        # speculative decoding: tokens a proposer guessed to follow token_ids, verified by the next step
        self.draft_token_ids: list[int] = []
        self.num_verifications = 0  # steps that verified drafts of this sequence
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_tokens = 0  # of those, accepted

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def num_blocks(self, block_size: int, num_tokens: int | None = None) -> int:
        n = self.num_tokens if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def append_token(self, token_id: int, now: float | None = None) -> None:
        self.token_ids.append(token_id)
        self.token_times.append(time.perf_counter() if now is None else now)

    @property
    def is_decoding(self) -> bool:
        """Every token but the newest has its KV: the next step computes one token (or verifies drafts)."""
        return self.num_computed_tokens == self.num_tokens - 1

    def reset_for_recompute(self) -> None:
        """After preemption: the KV is gone; everything (prompt and output so far) is recomputed."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions += 1
        self.status = SequenceStatus.WAITING
        self.draft_token_ids = []

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"{self.status.value})")

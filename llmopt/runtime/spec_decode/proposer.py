"""The proposer interface and its registry (one proposer per SpeculativeConfig.method)."""

from __future__ import annotations

from typing import Protocol

from llmopt.core.registry import Registry
from llmopt.runtime.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: list[Sequence], num_tokens: dict[int, int]) -> dict[int, list[int]]:
        """Draft tokens to follow each sequence's token_ids, at most num_tokens[seq_id] of them (a sequence
        may get none: nothing to propose)."""

    def release(self, seq_id: int) -> None:
        """Forget a finished request's state."""


# method -> builder(config: SpeculativeConfig, hf_model, runner: ModelRunner, engine_config: EngineConfig)
PROPOSERS: Registry = Registry("speculative method")

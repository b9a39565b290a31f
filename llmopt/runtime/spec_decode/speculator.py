"""The engine's side of speculative decoding: before a step, ask the proposer for drafts for the sequences
worth it (AdaptiveSpeculation); after it, count what the target accepted."""

from __future__ import annotations

import time

from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
from llmopt.runtime.engine.scheduler import SchedulerOutput
from llmopt.runtime.engine.sequence import Sequence, SequenceStatus
from llmopt.runtime.engine.stats import SpecDecodeStats
from llmopt.runtime.spec_decode import draft, medusa, ngram  # noqa: F401  (register the proposers)
from llmopt.runtime.spec_decode.adaptive import AdaptiveSpeculation
from llmopt.runtime.spec_decode.proposer import PROPOSERS


def speculates(seq: Sequence) -> bool:
    """Whether a sequence may get drafts this step: it decodes, and asks for no log-probabilities (those are
    reported per sampled token; a request that wants them decodes one token per step)."""
    params = seq.params
    return (seq.status is SequenceStatus.RUNNING and seq.is_decoding and params.logprobs is None
            and params.prompt_logprobs is None)


class Speculator:
    def __init__(self, config: SpeculativeConfig, hf_model, runner, engine_config: EngineConfig):
        self.config = config
        self.proposer = PROPOSERS.get(config.method)(config, hf_model, runner, engine_config)
        self.controller = AdaptiveSpeculation(config.adaptive)
        self.stats = SpecDecodeStats()

    def propose(self, running: list[Sequence], max_context: int | None) -> None:
        """Set draft_token_ids of the running sequences that speculate this step."""
        wanted: dict[int, int] = {}
        candidates = [seq for seq in running if speculates(seq)]
        for seq in candidates:
            room = min(self.config.num_speculative_tokens, seq.params.max_tokens - seq.num_output_tokens - 1)
            if max_context:  # verified positions run up to num_tokens - 1 + k
                room = min(room, max_context - seq.num_tokens)
            k = self.controller.num_tokens(seq.seq_id, room, len(running))
            if k > 0:
                wanted[seq.seq_id] = k
        if not wanted:
            return
        started = time.perf_counter()
        drafts = self.proposer.propose([seq for seq in candidates if seq.seq_id in wanted], wanted)
        self.controller.record_proposal(sum(len(d) for d in drafts.values()), time.perf_counter() - started)
        for seq in candidates:
            seq.draft_token_ids = drafts.get(seq.seq_id, [])[:wanted.get(seq.seq_id, 0)]

    def observe(self, out: SchedulerOutput, accepted: dict[int, list[int]], seconds: float) -> None:
        """After the step: its cost for the model, and each verification's accepted drafts."""
        self.controller.record_step(out.num_batched_tokens, seconds)
        for item in out.scheduled:
            if item.num_draft_tokens:
                num_accepted = len(accepted.get(item.seq.seq_id, []))
                self.stats.record(item.num_draft_tokens, num_accepted)
                self.controller.record_verification(item.seq.seq_id, item.num_draft_tokens, num_accepted)

    def release(self, seq_id: int) -> None:
        self.proposer.release(seq_id)
        self.controller.release(seq_id)

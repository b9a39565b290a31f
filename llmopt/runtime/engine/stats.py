"""What the engine computed: per-step records for the bench's throughput and utilization metrics, and the
counters a caller reads through `Engine.stats()`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    duration: float
    num_seqs: int
    num_prefill_tokens: int  # tokens whose KV was computed for prompts (or recomputation) this step
    num_decode_tokens: int  # tokens of decoding sequences: each one's newest token, and the drafts it verifies
    num_context_tokens: int  # KV entries read by attention this step (sum of context lengths)
    num_attention_pairs: int  # (query token, cached token) pairs attended this step
    kv_usage: float  # fraction of KV blocks in use after the step


def step_stats(scheduled, duration: float, kv_usage: float) -> StepStats:
    """The record of one step from its SchedulerOutput (read before postprocess advances the sequences)."""
    items = scheduled.scheduled
    num_decode = sum(s.num_new_tokens for s in items
                     if s.num_new_tokens - s.num_draft_tokens == 1 and s.seq.num_output_tokens > 0 and s.samples)
    return StepStats(
        duration, len(items), scheduled.num_batched_tokens - num_decode, num_decode,
        sum(s.seq.num_computed_tokens + s.num_new_tokens for s in items),
        sum(s.num_new_tokens * (s.seq.num_computed_tokens + s.num_new_tokens) for s in items), kv_usage)


@dataclass
class SpecDecodeStats:
    """Speculative decoding's counters: verifications (a sequence's step that verified drafts), drafted and
    accepted tokens, and both per draft position (position j: the j-th token after the last accepted one; for
    Medusa, head j)."""

    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_verifications += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for counts in (self.drafted_per_position, self.accepted_per_position):
            counts.extend([0] * (num_drafts - len(counts)))
        for j in range(num_drafts):
            self.drafted_per_position[j] += 1
            self.accepted_per_position[j] += j < num_accepted

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification step emits on average: the accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_verifications if self.num_verifications else 0.0

    def per_position_acceptance(self) -> list[float]:
        """Of the verifications that drafted position j, the fraction that accepted it."""
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_verifications, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.drafted_per_position), list(self.accepted_per_position))

    def to_json(self) -> dict:
        return {"num_verifications": self.num_verifications, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate,
                "mean_accepted_length": self.mean_accepted_length,
                "acceptance_per_position": self.per_position_acceptance()}


@dataclass
class EngineStats:
    """Counters since the engine started or since `reset_stats()`."""

    steps: list[StepStats] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_finished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)  # finished requests by finish reason
    spec_decode: SpecDecodeStats | None = None  # with speculative decoding
    # tensor parallelism: rank 0's all-reduces (waiting for the other ranks included) and their time
    num_all_reduces: int = 0
    all_reduce_seconds: float = 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

"""What the engine computed: per-step records for the bench's throughput and utilization metrics, and the
counters a caller reads through `Engine.stats()`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepStats:
    duration: float
    num_seqs: int
    num_prefill_tokens: int  # tokens whose KV was computed for prompts (or recomputation) this step
    num_decode_tokens: int  # sequences that computed exactly their newest token
    num_context_tokens: int  # KV entries read by attention this step (sum of context lengths)
    num_attention_pairs: int  # (query token, cached token) pairs attended this step
    kv_usage: float  # fraction of KV blocks in use after the step


def step_stats(scheduled, duration: float, kv_usage: float) -> StepStats:
    """The record of one step from its SchedulerOutput (read before postprocess advances the sequences)."""
    items = scheduled.scheduled
    num_decode = sum(1 for s in items if s.num_new_tokens == 1 and s.seq.num_output_tokens > 0 and s.samples)
    return StepStats(
        duration, len(items), scheduled.num_batched_tokens - num_decode, num_decode,
        sum(s.seq.num_computed_tokens + s.num_new_tokens for s in items),
        sum(s.num_new_tokens * (s.seq.num_computed_tokens + s.num_new_tokens) for s in items), kv_usage)


@dataclass
class EngineStats:
    """Counters since the engine started or since `reset_stats()`."""

    steps: list[StepStats] = field(default_factory=list)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    num_finished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)  # finished requests by finish reason

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

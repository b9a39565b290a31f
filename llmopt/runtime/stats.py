"""What one engine step computed, recorded for the bench's throughput and utilization metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StepStats:
    duration: float
    num_seqs: int
    num_prefill_tokens: int  # tokens whose KV was computed for prompts (or recomputation) this step
    num_decode_tokens: int  # sequences that computed exactly their newest token
    num_context_tokens: int  # KV entries read by attention this step (sum of context lengths)
    num_attention_pairs: int  # (query token, cached token) pairs attended this step
    kv_usage: float  # fraction of KV blocks in use after the step

"""Prometheus metrics in vLLM's names (prefix `llmopt:`), so dashboards built for vLLM read them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from llmopt.runtime.engine.output import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """One registry per server: gauges read from the engine at scrape time, counters and histograms fed as
    requests finish."""

    def __init__(self, engine):
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        Gauge("llmopt:num_requests_running", "Requests in the running batch", registry=r).set_function(
            lambda: engine.num_running)
        Gauge("llmopt:num_requests_waiting", "Requests waiting to be scheduled", registry=r).set_function(
            lambda: engine.num_waiting)
        Gauge("llmopt:kv_cache_usage_perc", "Fraction of KV-cache blocks in use", registry=r).set_function(
            lambda: engine.engine.block_manager.usage)
        Gauge("llmopt:prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up",
              registry=r).set_function(lambda: engine.engine.stats().prefix_cache_hit_rate)
        Gauge("llmopt:num_preemptions", "Preemptions since start", registry=r).set_function(
            lambda: engine.engine.scheduler.num_preemptions)
        self.prompt_tokens = Counter("llmopt:prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("llmopt:generation_tokens", "Generated tokens of finished requests",
                                         registry=r)
        self.request_success = Counter("llmopt:request_success", "Finished requests by finish reason",
                                       ["finished_reason"], registry=r)
        self.ttft = Histogram("llmopt:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=LATENCY_BUCKETS)
        self.tpot = Histogram("llmopt:time_per_output_token_seconds", "Time per output token after the first",
                              registry=r, buckets=LATENCY_BUCKETS)
        self.spec_verifications = Counter(
            "llmopt:spec_decode_num_drafts", "Speculative decoding: verification steps of finished requests",
            registry=r)
        self.spec_draft_tokens = Counter("llmopt:spec_decode_num_draft_tokens",
                                         "Speculative decoding: draft tokens verified", registry=r)
        self.spec_accepted_tokens = Counter("llmopt:spec_decode_num_accepted_tokens",
                                            "Speculative decoding: draft tokens accepted", registry=r)
        self.spec_acceptance = Histogram(
            "llmopt:spec_decode_request_acceptance_rate", "Speculative decoding: accepted / drafted tokens of each "
            "request that speculated", registry=r, buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0))
        self.e2e = Histogram("llmopt:e2e_request_latency_seconds", "Request latency", registry=r,
                             buckets=LATENCY_BUCKETS)

    def finished(self, output: RequestOutput, num_prompt_tokens: int, ttft: float | None, e2e: float) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(len(output.token_ids))
        self.request_success.labels(output.finish_reason or "unknown").inc()
        self.e2e.observe(e2e)
        if output.num_draft_tokens:
            self.spec_verifications.inc(output.num_verifications)
            self.spec_draft_tokens.inc(output.num_draft_tokens)
            self.spec_accepted_tokens.inc(output.num_accepted_tokens)
            self.spec_acceptance.observe(output.num_accepted_tokens / output.num_draft_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if len(output.token_ids) > 1:
                self.tpot.observe((e2e - ttft) / (len(output.token_ids) - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

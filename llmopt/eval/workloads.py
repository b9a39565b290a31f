"""Benchmark workloads: lists of requests (prompt token ids, output length, arrival offset).

random:            uniform random token ids; lengths in [len * (1 - range_ratio), len * (1 + range_ratio)]
sharegpt:          real first-turn prompts from the data dir's ShareGPT file. The file keeps prompts only
                   (responses were dropped upstream), so output lengths are drawn like `random`'s.
prefix-repetition: num_prefixes shared prefixes of prefix_len tokens, each request one of them plus a unique
                   suffix, in shuffled order (the prefix cache's workload).
Arrivals: all at time 0 (request_rate = inf) or a Poisson process (exponential gaps, seeded).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from llmopt.core.errors import ConfigError
from llmopt.core.registry import Registry


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_offset: float = 0.0  # seconds after the start of the run
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class WorkloadSpec:
    dataset: str = "random"
    num_requests: int = 64
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 1024
    num_prefixes: int = 4
    request_rate: float = math.inf  # requests per second; inf = all at once
    seed: int = 0
    dataset_path: str | None = None  # sharegpt: a file instead of the data dir's

    def __post_init__(self):
        if self.num_requests < 1:
            raise ConfigError(f"--num-requests must be at least 1 (got {self.num_requests})")
        if self.input_len < 1 or self.output_len < 1:
            raise ConfigError("--input-len and --output-len must be at least 1")
        if not 0 <= self.range_ratio < 1:
            raise ConfigError(f"--range-ratio must be in [0, 1) (got {self.range_ratio})")
        if not self.request_rate > 0:
            raise ConfigError(f"--request-rate must be > 0 (got {self.request_rate}); use inf for all at once")
        if self.dataset not in WORKLOADS:
            raise ConfigError(f"unknown --dataset {self.dataset!r}: choose one of {', '.join(WORKLOADS.names())}")


WORKLOADS: Registry = Registry("workload")


def _length(rng: random.Random, length: int, range_ratio: float) -> int:
    low, high = max(1, int(length * (1 - range_ratio))), max(1, int(length * (1 + range_ratio)))
    return rng.randint(low, high)


def _random_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    # skip the first ids, which tokenizers reserve for special tokens
    low = min(100, vocab_size // 2)
    return [rng.randrange(low, vocab_size) for _ in range(n)]


@WORKLOADS.register("random")
def random_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    return [BenchRequest(_random_ids(rng, _length(rng, spec.input_len, spec.range_ratio), vocab_size),
                         _length(rng, spec.output_len, spec.range_ratio)) for _ in range(spec.num_requests)]


@WORKLOADS.register("sharegpt")
def sharegpt_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> list[BenchRequest]:
    from llmopt.core.datasets import documents

    prompts = list(documents(spec.dataset_path or "sharegpt"))
    rng = random.Random(spec.seed)
    rng.shuffle(prompts)
    requests = []
    for text in prompts:
        ids = tokenizer(text, add_special_tokens=True)["input_ids"]
        if not 4 <= len(ids) <= spec.input_len * 8:  # vLLM's filter drops very short and very long prompts
            continue
        requests.append(BenchRequest(ids, _length(rng, spec.output_len, max(spec.range_ratio, 0.9)),
                                     meta={"source": "sharegpt"}))
        if len(requests) == spec.num_requests:
            break
    if len(requests) < spec.num_requests:
        raise ConfigError(f"the ShareGPT file has only {len(requests)} usable prompts: lower --num-requests")
    return requests


@WORKLOADS.register("prefix-repetition")
def prefix_repetition_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    prefixes = [_random_ids(rng, spec.prefix_len, vocab_size) for _ in range(spec.num_prefixes)]
    requests = [BenchRequest(prefixes[i % spec.num_prefixes] + _random_ids(rng, spec.input_len, vocab_size),
                             spec.output_len, meta={"prefix": i % spec.num_prefixes})
                for i in range(spec.num_requests)]
    rng.shuffle(requests)
    return requests


def build_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> list[BenchRequest]:
    requests = WORKLOADS.get(spec.dataset)(spec, tokenizer, vocab_size)
    if math.isfinite(spec.request_rate):
        rng = random.Random(spec.seed + 1)
        t = 0.0
        for request in requests:
            t += rng.expovariate(spec.request_rate)
            request.arrival_offset = t
    return requests

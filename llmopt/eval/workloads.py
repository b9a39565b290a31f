"""Benchmark workloads: lists of requests (prompt token ids, output length, arrival offset).

random:            uniform random token ids; lengths in [len * (1 - range_ratio), len * (1 + range_ratio)]
sharegpt:          real first-turn prompts from the data dir's ShareGPT file. The file keeps prompts only
                   (responses were dropped upstream), so output lengths are drawn like `random`'s.
grounded:          input-grounded prompts whose answer copies the prompt (where prompt lookup pays): "repeat this
                   code, renaming one name" over Python standard library functions, and, when WikiText-2 is in
                   the data dir, "repeat this passage word for word" over its paragraphs; about input_len tokens
                   of source each, deterministic for a seed.
prefix-repetition: num_prefixes shared prefixes of prefix_len tokens, each request one of them plus a unique
                   suffix, in shuffled order (the prefix cache's workload).
Arrivals: all at time 0 (request_rate = inf) or a Poisson process (exponential gaps, seeded).
"""

from __future__ import annotations

import builtins
import keyword
import math
import random
import re
import textwrap
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


_IDENTIFIER = re.compile(r"\b[a-z_][a-z0-9_]{2,}\b")


def _code_prompt(code: str) -> str:
    """Repeat `code` with its most frequent local name renamed."""
    names = [n for n in _IDENTIFIER.findall(code) if not keyword.iskeyword(n) and n not in dir(builtins)
             and n != "self"]
    old = max(sorted(set(names)), key=names.count) if names else "x"
    return (f"```python\n{code}\n```\nRepeat the code above exactly, renaming `{old}` to `new_{old}`:\n"
            f"```python\n")


def _passage_prompt(passage: str) -> str:
    return f"Passage:\n{passage}\n\nRepeat the passage above word for word, then say what it is about:\n"


def _code_chunks(rng: random.Random, tokenizer, size: int, count: int) -> list[str]:
    """`count` runs of whole lines of about `size` tokens, from function bodies of standard-library files."""
    from llmopt.core.datasets import documents

    docs = documents("pystdlib")
    chunks = []
    while len(chunks) < count:
        lines = docs[rng.randrange(len(docs))].splitlines()
        starts = [i for i, line in enumerate(lines) if line.lstrip().startswith("def ")]
        if not starts:
            continue
        start, taken, tokens = rng.choice(starts), [], 0
        for line in lines[start:]:
            tokens += len(tokenizer(line + "\n", add_special_tokens=False)["input_ids"])
            taken.append(line)
            if tokens >= size:
                break
        if tokens >= size // 2:
            chunks.append(textwrap.dedent("\n".join(taken)))
    return chunks


def _passages(rng: random.Random, tokenizer, size: int, count: int) -> list[str]:
    """WikiText-2 paragraphs cut to about `size` tokens at a sentence end; [] without the data file."""
    from llmopt.core.datasets import DatasetError, documents

    try:
        text = documents("wikitext2")[0]
    except DatasetError:
        return []
    paragraphs = [p.strip() for p in text.split("\n") if len(p.strip()) > 400 and not p.strip().startswith("=")]
    rng.shuffle(paragraphs)
    out = []
    for para in paragraphs[:count]:
        ids = tokenizer(para, add_special_tokens=False)["input_ids"][:size]
        cut = tokenizer.decode(ids)
        out.append(cut[:cut.rfind(". ") + 1] if ". " in cut else cut)
    return out


@WORKLOADS.register("grounded")
def grounded_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    passages = _passages(rng, tokenizer, spec.input_len, spec.num_requests // 2)
    prompts = [("code", _code_prompt(c)) for c in _code_chunks(rng, tokenizer, spec.input_len,
                                                               spec.num_requests - len(passages))]
    prompts += [("passage", _passage_prompt(p)) for p in passages]
    rng.shuffle(prompts)
    return [BenchRequest(tokenizer(text, add_special_tokens=True)["input_ids"],
                         _length(rng, spec.output_len, spec.range_ratio), meta={"source": kind})
            for kind, text in prompts]


def build_workload(spec: WorkloadSpec, tokenizer, vocab_size: int) -> list[BenchRequest]:
    requests = WORKLOADS.get(spec.dataset)(spec, tokenizer, vocab_size)
    if math.isfinite(spec.request_rate):
        rng = random.Random(spec.seed + 1)
        t = 0.0
        for request in requests:
            t += rng.expovariate(spec.request_rate)
            request.arrival_offset = t
    return requests

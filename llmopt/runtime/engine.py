"""The engine: requests in, tokens out. `step()` is glue: schedule, run the model, record the tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator

from llmopt.core.errors import ConfigError
from llmopt.runtime.block_manager import BlockManager
from llmopt.runtime.defaults import KV_CACHE_MEMORY_FRACTION
from llmopt.runtime.model_runner import ModelRunner
from llmopt.runtime.sampling import SamplingParams
from llmopt.runtime.scheduler import Scheduler, SchedulerConfig
from llmopt.runtime.sequence import Sequence
from llmopt.runtime.stats import StepStats


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    kv_cache_bytes: int | None = None  # None: kv_cache_memory_fraction of the available memory (model_runner)
    kv_cache_memory_fraction: float = KV_CACHE_MEMORY_FRACTION
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_cache: bool = True
    policy: str = "continuous"
    fast_path: bool | None = None  # fused projections and compiled kernels; default: on for CPU (model.py)


@dataclass
class StepOutput:
    seq_id: int
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class Engine:
    def __init__(self, hf_model, tokenizer, config: EngineConfig | None = None):
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self.runner = ModelRunner(hf_model, self.config.block_size, self.config.kv_cache_bytes,
                                  fast=self.config.fast_path,
                                  kv_cache_memory_fraction=self.config.kv_cache_memory_fraction,
                                  max_num_seqs=self.config.max_num_seqs)
        self.block_manager = BlockManager(self.runner.num_blocks, self.config.block_size,
                                          self.config.enable_prefix_cache)
        self.scheduler = Scheduler(
            SchedulerConfig(self.config.max_num_seqs, self.config.max_num_batched_tokens,
                            self.config.enable_chunked_prefill, self.config.policy),
            self.block_manager, eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None,
            stop_string_matcher=self._match_stop_string if tokenizer is not None else None)
        self.max_context = getattr(hf_model.config, "max_position_embeddings", None)
        self.sequences: dict[int, Sequence] = {}
        self.record_steps = True
        self.step_stats: list[StepStats] = []

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None) -> int:
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise ConfigError("stop strings need the model's tokenizer; give stop_token_ids instead")
        if not prompt_token_ids:
            raise ConfigError("empty prompt: give at least one token")
        if self.max_context and len(prompt_token_ids) + params.max_tokens > self.max_context:
            raise ConfigError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                              f"the model's context of {self.max_context}: shorten the prompt or lower max_tokens")
        seq = Sequence(prompt_token_ids, params)
        self.scheduler.add(seq)  # refuses a request larger than the whole KV cache
        self.sequences[seq.seq_id] = seq
        return seq.seq_id

    def abort(self, seq_id: int) -> bool:
        self.runner.release(seq_id)
        return self.scheduler.abort(seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def step(self) -> list[StepOutput]:
        started = time.perf_counter()
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        # what this step computes, for the bench's throughput / utilization metrics (read before postprocess)
        num_decode = sum(1 for s in out.scheduled if s.num_new_tokens == 1 and s.seq.num_output_tokens > 0
                         and s.samples)
        num_context = sum(s.seq.num_computed_tokens + s.num_new_tokens for s in out.scheduled)
        num_pairs = sum(s.num_new_tokens * (s.seq.num_computed_tokens + s.num_new_tokens) for s in out.scheduled)
        num_seqs = len(out.scheduled)
        result = self.runner.execute(out)
        for seq_id, logprobs in result.logprobs.items():
            self.sequences[seq_id].logprobs.append(logprobs)
        finished = {seq.seq_id for seq in self.scheduler.postprocess(out, result.tokens)}
        for seq_id in finished:
            self.runner.release(seq_id)
        if self.record_steps:
            self.step_stats.append(StepStats(time.perf_counter() - started, num_seqs,
                                             out.num_batched_tokens - num_decode, num_decode, num_context, num_pairs,
                                             self.block_manager.usage))
        return [StepOutput(seq_id, [token], seq_id in finished, self.sequences[seq_id].finish_reason)
                for seq_id, token in result.tokens.items()]

    def _match_stop_string(self, seq: Sequence) -> bool:
        """Whether the output text now contains one of the request's stop strings; records where it ends."""
        # The whole output is decoded (a byte-level token may only complete a character later), but only its
        # tail can hold a match that was not there one token ago.
        longest = max(len(s) for s in seq.params.stop)
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        tail_from = max(0, len(text) - longest - 16)
        hits = [i for s in seq.params.stop if (i := text.find(s, tail_from)) != -1]
        if not hits:
            return False
        seq.stop_text_end = min(hits)
        return True

    def text(self, seq_id: int) -> str:
        """The request's output text (ending before a matched stop string)."""
        seq = self.sequences[seq_id]
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return text if seq.stop_text_end is None else text[: seq.stop_text_end]

    def stream(self) -> Iterator[StepOutput]:
        """Yield new tokens per request as they are produced, until every request has finished."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[list[int]]:
        """Offline: output token ids for each prompt."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        for _ in self.stream():
            pass
        return [self.sequences[i].output_token_ids for i in ids]


def build_engine(model_name: str, dtype: str = "float32", config: EngineConfig | None = None,
                 device: str = "cpu", trust_remote_code: bool = False) -> Engine:
    """An engine over MODEL (alias, folder or artifact); quantized artifacts get the packed int4/int8 layers."""
    from llmopt.core.models import load_model

    model, tokenizer, _ = load_model(model_name, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                                     packed_kernels=True)
    return Engine(model, tokenizer, config)



"""The engine: requests in, RequestOutputs out. `step()` is glue: schedule, execute, record tokens, build the
outputs. A finished request is forgotten after the step that reports it, so memory stays flat however many
requests come through.

    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=32))
    rid = engine.add_request(prompt_ids, SamplingParams(max_tokens=64, stop=("\\n\\n",)))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.new_text, end="")
"""

from __future__ import annotations

import time
from typing import Iterator

from llmopt.core.core_share import CoreShare
from llmopt.core.errors import ConfigError
from llmopt.core.models import model_limits
from llmopt.runtime.engine.block_manager import BlockManager
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.output import OutputProcessor, RequestOutput
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.engine.scheduler import Scheduler, SchedulerOutput
from llmopt.runtime.engine.sequence import Sequence
from llmopt.runtime.engine.stats import EngineStats, SpecDecodeStats, step_stats


def check_token_ids(token_ids, vocab_size: int | None, param: str) -> None:
    """Refuse token ids outside the vocabulary (the embedding lookup would fail deep inside a step)."""
    if not token_ids or vocab_size is None:
        return
    low, high = min(token_ids), max(token_ids)
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        raise ConfigError(f"token id {bad} is outside the vocabulary (0 to {vocab_size - 1})", param=param)


def check_request(prompt_token_ids: list[int], params: SamplingParams, has_tokenizer: bool, vocab_size: int | None,
                  max_context: int | None) -> None:
    """What a request must satisfy before any engine queues it (ConfigError naming the field)."""
    if params.stop and not has_tokenizer:
        raise ConfigError("stop strings need the model's tokenizer; give stop_token_ids instead", param="stop")
    if not prompt_token_ids:
        raise ConfigError("empty prompt: give at least one token", param="prompt")
    check_token_ids(prompt_token_ids, vocab_size, "prompt")
    check_token_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    if max_context and len(prompt_token_ids) + params.max_tokens > max_context:
        raise ConfigError(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                          f"the model's context of {max_context}: shorten the prompt or lower max_tokens",
                          param="max_tokens")


class Engine:
    def __init__(self, hf_model, tokenizer, config: EngineConfig | None = None, record_steps: bool = True):
        from llmopt.runtime.executor.model_runner import ModelRunner

        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        if self.config.data_parallel_size > 1:
            raise ConfigError("an Engine is one replica: --data-parallel-size is for serve and bench (the "
                              "replicas are built by runtime.fronts.create.create_engine)",
                              param="data_parallel_size")
        if self.config.disaggregate is not None:
            raise ConfigError("an Engine is one process: --disaggregate is for serve and bench (the workers are "
                              "built by runtime.fronts.create.create_engine)", param="disaggregate")
        if self.config.tensor_parallel_size > 1 or self.config.pipeline_parallel_size > 1:
            from llmopt.runtime.executor.workers import parallel_runner

            self.runner = parallel_runner(hf_model, self.config)
        else:
            self.runner = ModelRunner(hf_model, self.config)
        self.block_manager = self._new_block_manager()
        self.scheduler = Scheduler(self.config, self.block_manager,
                                   eos_token_id=tokenizer.eos_token_id if tokenizer is not None else None)
        self.outputs = OutputProcessor(tokenizer)
        self.max_context, self.vocab_size = model_limits(hf_model.config)
        self._live: dict[int, Sequence] = {}  # requests not yet reported finished
        # ended outside a step (aborted; a handed-over request whose first token reached a stop string): reported
        # by the next step
        self._ended: set[int] = set()
        self._stats = EngineStats()
        # per-step records for benchmarks; a server that runs for days turns them off to keep memory flat
        self.record_steps = record_steps
        # (one process on CPU: tensor-parallel ranks and replicas own their cores)
        self.core_share = CoreShare() if (self.config.adaptive_threads and self.runner.platform.host_memory
                                          and self.runner.workers is None) else None
        self.speculator = None
        if self.config.speculative is not None:
            from llmopt.runtime.spec_decode.speculator import Speculator

            self.speculator = Speculator(self.config.speculative, hf_model, self.runner, self.config)

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> int:
        """Queue a request; returns its id. arrival_time (perf_counter) defaults to now."""
        params = params or SamplingParams()
        check_request(prompt_token_ids, params, self.tokenizer is not None, self.vocab_size, self.max_context)
        seq = Sequence(prompt_token_ids, params, arrival_time=arrival_time)
        self.scheduler.add(seq)  # refuses a request larger than the whole KV cache
        self._live[seq.seq_id] = seq
        self.outputs.add(seq)
        return seq.seq_id

    def check_token_ids(self, token_ids, param: str) -> None:
        """Refuse token ids outside the vocabulary (the embedding lookup would fail deep inside a step)."""
        check_token_ids(token_ids, self.vocab_size, param)

    def abort(self, request_id: int) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes from the next step()."""
        self.runner.release(request_id)
        aborted = self.scheduler.abort(request_id)
        if aborted:
            self._ended.add(request_id)
        return aborted

    def has_unfinished(self) -> bool:
        """True while some request has not yet been reported finished."""
        return bool(self._live)

    def poll(self) -> None:
        """What an idle server calls between requests: the multi-process fronts read their workers' news there (a
        worker that died, one ready again); one engine in this process has none."""

    def unavailable(self) -> str | None:
        """Why no request could be served now (None: it can). One engine in this process always can."""
        return None

    @property
    def num_live_requests(self) -> int:
        return len(self._live)

    @property
    def num_waiting(self) -> int:
        """Requests not yet running (queued, or preempted and waiting to resume)."""
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    # --- stepping -------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled batch; one RequestOutput per request that produced a token or finished."""
        if self.core_share is None:
            return self._step()
        with self.core_share.limited():  # (the threads the cores other processes leave free allow)
            return self._step()

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        adopted = self._before_schedule()
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.max_context)
        out = self.scheduler.schedule()
        sampled: dict[int, int] = {}
        if not out.is_empty:
            stats = step_stats(out, 0.0, 0.0) if self.record_steps else None  # read before postprocess
            executed = time.perf_counter()
            result = self.runner.execute(out)
            self._executed(out)
            if self.speculator is not None:
                self.speculator.observe(out, result.accepted, time.perf_counter() - executed)
            for seq_id, (first, entries) in result.prompt_logprobs.items():
                self.outputs.add_prompt_logprobs(seq_id, first, entries)
            self.scheduler.postprocess(out, result.tokens, result.accepted)
            for seq_id in result.tokens:
                if self.outputs.update(seq_id, result.logprobs.get(seq_id)):
                    self._stop_on_string(seq_id)
            sampled = result.tokens
            if stats is not None:
                stats.duration, stats.kv_usage = time.perf_counter() - started, self.block_manager.usage
                self._stats.steps.append(stats)
        # requests ended outside a step report once, even in a step that ran nothing for them
        changed = [*adopted, *(i for i in sampled if i not in adopted)]
        changed += [i for i in self._ended if i not in sampled and i not in adopted]
        self._ended.clear()
        return [self._report(seq_id) for seq_id in changed]

    def _before_schedule(self) -> list[int]:
        """What an engine of a front does before each schedule (a decode worker adopts handed-over requests:
        runtime/fronts/handover.py); the ids whose first output this step reports. Here: nothing."""
        return []

    def _executed(self, out: SchedulerOutput) -> None:
        """What an engine of a front does once a step ran, before its blocks can be freed (a prefill worker reads
        each finished prompt's KV: runtime/fronts/handover.py). Here: nothing."""

    def _stop_on_string(self, seq_id: int) -> None:
        seq = self._live[seq_id]
        if seq.finish_reason is None:
            self.scheduler.finish(seq_id, "stop")
        else:  # it also hit max_tokens this step: the stop string is the reason reported
            seq.finish_reason = "stop"

    def _report(self, seq_id: int) -> RequestOutput:
        output = self.outputs.output(seq_id)
        if output.finished:
            self.runner.release(seq_id)
            if self.speculator is not None:
                self.speculator.release(seq_id)
            del self._live[seq_id]
            self._stats.num_finished += 1
            reasons = self._stats.finish_reasons
            reasons[output.finish_reason] = reasons.get(output.finish_reason, 0) + 1
        return output

    def stream(self) -> Iterator[RequestOutput]:
        """Yield outputs as they are produced, until every request has finished."""
        while self.has_unfinished():
            yield from self.step()

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Offline: the finished RequestOutput of each prompt, in order."""
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        wanted, done = set(ids), {}
        while wanted - done.keys():
            for output in self.step():
                if output.finished and output.request_id in wanted:
                    done[output.request_id] = output
        return [done[i] for i in ids]

    # --- statistics -----------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        """Counters since start or the last reset_stats(): per-step records, preemptions, prefix-cache hits."""
        bm = self.block_manager
        num_all_reduces, all_reduce_seconds = self.runner.communication()
        return EngineStats(list(self._stats.steps), self.scheduler.num_preemptions, bm.num_lookup_tokens,
                           bm.num_hit_tokens, self._stats.num_finished, dict(self._stats.finish_reasons),
                           self.speculator.stats.copy() if self.speculator is not None else None,
                           num_all_reduces, all_reduce_seconds)

    def _new_block_manager(self) -> BlockManager:
        """Block bookkeeping for the runner's cache; prompt-scoring requests may take the cached prefixes whose
        scores the runner kept."""
        manager = BlockManager(self.runner.num_blocks, self.config.block_size, self.config.enable_prefix_cache)
        manager.score_lookup = self.runner.prompt_scores.available
        return manager

    def reset_stats(self, clear_prefix_cache: bool = False) -> None:
        """Zero the counters (after a warm-up, say); clear_prefix_cache also forgets the cached prefixes."""
        self._stats = EngineStats()
        self.runner.reset_communication()
        self.scheduler.num_preemptions = 0
        if self.speculator is not None:
            self.speculator.stats = SpecDecodeStats()
        if clear_prefix_cache:
            self.block_manager.reset_prefix_cache()
        self.block_manager.num_lookup_tokens = self.block_manager.num_hit_tokens = 0

    def reset(self) -> None:
        """Drop every request and all scheduling state, as after a restart: the model and the KV cache tensors
        stay (their contents are garbage to the new block tables), the counters too. What a server runs after its
        engine loop failed mid-step, when the scheduler's state can no longer be trusted."""
        for seq_id in list(self._live):
            self.runner.release(seq_id)
            if self.speculator is not None:
                self.speculator.release(seq_id)
        self.block_manager = self._new_block_manager()
        self.scheduler = Scheduler(self.config, self.block_manager,
                                   eos_token_id=self.tokenizer.eos_token_id if self.tokenizer is not None else None)
        self.outputs = OutputProcessor(self.tokenizer)
        self._live.clear()
        self._ended.clear()

    def close(self) -> None:
        """Stop the engine's other processes (tensor-parallel ranks); also at interpreter exit."""
        self.runner.close()

    def kv_cache_info(self) -> dict:
        """The KV cache: bytes, token capacity, dtype and how its size was chosen."""
        r = self.runner
        return {"bytes": r.kv_cache_bytes, "tokens": r.num_blocks * r.block_size,
                "dtype": r.kv_dtype_label, "summary": r.kv_cache_summary(),
                "bytes_per_token": r.kv_cache_spec.bytes_per_token, "layout": r.kv_cache_spec.layout,
                "tokens_per_dtype": r.tokens_per_dtype(),
                # blocks whose memory is committed ahead of use (EngineConfig.kv_cache_commit; None: lazily)
                "committed_blocks": None if r.kv_cache_committer is None else r.kv_cache_committer.committed_blocks}

    def numerics(self) -> dict:
        """Every setting that changes the numbers computed, as configured and as resolved at start: the config's
        numerics fields, the attention backend, the linear methods chosen (name -> count) and, for methods with
        several kernels, the kernel each layer shape runs per row bucket (layer key -> {rows: path})."""
        decoder = self.runner.decoder
        return {**self.config.numerics(), "fast_path_resolved": decoder.fast,
                "activations_resolved": self.runner.activations,
                "attention_backend_resolved": decoder.attention.name,
                "kv_cache_dtype_resolved": self.runner.kv_dtype_label,
                "linear_methods": self.runner.linear_methods, "linear_paths": self.runner.linear_paths,
                "decode_graph_rows": self.runner.decode_graph_rows,
                # decode steps replayed from captured graphs (executor/step_graphs.py): a padded batch's GEMMs may
                # round otherwise than the step's own size
                "step_graph_buckets": [] if self.runner.step_graphs is None else self.runner.step_graphs.buckets}

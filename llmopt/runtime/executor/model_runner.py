"""The only runtime class that touches device tensors: owns the model and the KV cache, turns a scheduler
step into one forward over all scheduled tokens, and samples."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch
from torch import nn

from llmopt.core.errors import ConfigError, ParallelError
from llmopt.core.models import model_limits
from llmopt.runtime.engine.config import (
    ACTIVATION_SCHEMES, KV_CACHE_DTYPES, KV_CACHE_MAX_FRACTION, LM_HEAD_GROUPS, EngineConfig,
)
from llmopt.runtime.executor.attention import KVCacheSpec
from llmopt.runtime.executor.attention.kv_commit import commit_kv_cache
from llmopt.runtime.executor.host_memory import keep_freed_host_memory, weights_to_huge_pages
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.kernels.kv_quant import KV_CODE_DTYPES
from llmopt.runtime.executor.models import RuntimeCheckpoint, build_runtime_model
from llmopt.runtime.executor.platform import Platform
from llmopt.runtime.executor.linear.kernel_plans import plan_linears
from llmopt.runtime.executor.prompt_scores import PromptScoreCache
from llmopt.runtime.executor.step_graphs import StepGraphs, graph_memory_bytes
from llmopt.runtime.distributed.group import to_wire
from llmopt.runtime.distributed.pipeline import split_tokens
from llmopt.runtime.executor.sampler import probabilities, rows_token_logprobs, sample, token_logprobs
from llmopt.runtime.engine.scheduler import SchedulerOutput
from llmopt.runtime.executor.verify import accept_greedy, rejection_sample


@dataclass
class StepResult:
    tokens: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token
    # seq_id -> the draft tokens verified and accepted before `tokens[seq_id]` (speculative decoding)
    accepted: dict[int, list[int]] = field(default_factory=dict)
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)  # seq_id -> {token: logprob}
    # seq_id -> (first prompt position scored, [{token: logprob}] for positions first, first + 1, ...): the
    # log-probability of prompt token p (and the top-n) given the tokens before it
    prompt_logprobs: dict[int, tuple[int, list[dict[int, float]]]] = field(default_factory=dict)


log = logging.getLogger(__name__)
SCORE_ROWS = 256  # prompt positions scored per vocabulary projection


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """--kv-cache-dtype (EngineConfig's spelling) -> the dtype the cache stores."""
    if name == "auto":
        return model_dtype
    return KV_CODE_DTYPES.get(name) or getattr(torch, name)


def kv_dtype_name(dtype: torch.dtype) -> str:
    """The cache dtype as --kv-cache-dtype spells it."""
    codes = {d: n for n, d in KV_CODE_DTYPES.items()}
    return codes.get(dtype) or str(dtype).removeprefix("torch.")


def check_kv_cache_fits(kv_cache_bytes: int, config: EngineConfig, device: torch.device) -> None:
    """Refuse, before any allocation, a KV cache the user sized (--kv-cache-bytes / --kv-cache-tokens) beyond
    KV_CACHE_MAX_FRACTION of the memory available."""
    platform = Platform.of(device)
    available = platform.available_memory()
    if kv_cache_bytes <= KV_CACHE_MAX_FRACTION * available:
        return
    if config.kv_cache_tokens is not None:
        given, param = f"--kv-cache-tokens {config.kv_cache_tokens:,}", "kv_cache_tokens"
    else:
        given, param = f"--kv-cache-bytes {config.kv_cache_bytes:,}", "kv_cache_bytes"
    raise ConfigError(f"{given} needs a KV cache of {kv_cache_bytes / 2**30:,.1f} GiB, more than the "
                      f"{available / 2**30:,.1f} GiB of {platform.memory_name} memory "
                      f"available: lower it, or leave it out (the cache is then sized from the memory)", param=param)


def default_kv_cache_bytes(device: torch.device, fraction: float, max_useful_bytes: int | None = None,
                           reserved: int = 0) -> int:
    """fraction (checked by EngineConfig) x available memory, less `reserved` (what the step graphs will take), no
    more than the engine could ever fill."""
    budget = int(Platform.of(device).available_memory() * fraction) - reserved
    return min(budget, max_useful_bytes) if max_useful_bytes else budget


@dataclass
class StepInputs:
    """One step's flat batch as plain lists (what rank 0 sends the other tensor-parallel ranks): the tokens,
    their positions and cache slots, each sequence's first row (`starts`, one more than sequences), context
    length and block table."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    starts: list[int]
    context_lens: list[int]
    tables: list[list[int]]


def step_part(step: StepInputs, first: int, stop: int) -> StepInputs:
    """Sequences [first, stop) of a step as a step of their own (a pipeline micro-batch)."""
    a, b = step.starts[first], step.starts[stop]
    return StepInputs(step.input_ids[a:b], step.positions[a:b], step.slots[a:b],
                      [s - a for s in step.starts[first:stop + 1]], step.context_lens[first:stop],
                      step.tables[first:stop])


class ModelRunner:
    """Start-up runs as named phases, in this order: load the model (`_load_model`), prepare its kernels
    (`_prepare_kernels`), size the KV cache from the memory left after what the step graphs will take
    (`_size_kv_cache`), allocate it (`_allocate_kv_cache`) and capture the decode graphs (`_capture_graphs`)."""

    def __init__(self, model: RuntimeCheckpoint | nn.Module, config: EngineConfig, num_blocks: int | None = None,
                 group=None, workers=None, stages=None):
        """model: a loaded checkpoint (load_runtime_model) or a transformers model. config.kv_cache_bytes None:
        sized from the machine (default_kv_cache_bytes), up to what config.max_num_seqs sequences of the model's
        full context could hold. num_blocks: exactly that many blocks instead (a draft model's cache holds as many
        tokens as its target's, a tensor-parallel worker as many as rank 0's). group: this rank's
        distributed.group.TensorParallelGroup when the model is one rank's share; workers (rank 0 only): the other
        ranks, sent each step's inputs and each vocabulary projection's rows. stages: this process's
        distributed.pipeline.PipelineStages when the model is one pipeline stage."""
        self.group, self.workers, self.stages = group, workers, stages
        self.block_size = config.block_size
        self._load_model(model, config)
        self._prepare_kernels(config)
        self._size_kv_cache(model, config, num_blocks)
        self._allocate_kv_cache(config)
        self._capture_graphs(config)
        log.info(self.kv_cache_summary())
        self.generators: dict[int, torch.Generator] = {}
        self.prompt_scores = PromptScoreCache(self.block_size)
        # Medusa heads read the hidden state [hidden] that produced each sequence's newest token
        self.keep_last_hidden = False
        self.last_hidden: dict[int, torch.Tensor] = {}

    def _load_model(self, model, config: EngineConfig) -> None:
        """The runtime decoder from the loaded model, with the attention backend for the KV cache's dtype; the
        logits head quantized if asked; on CPU, the weights moved to huge pages."""
        # (auto: whatever the model was loaded with; load_for_engine resolves it by device and fast path)
        self.activations = loaded_with = model.activations if isinstance(model, RuntimeCheckpoint) else "float"
        if config.activations not in ("auto", loaded_with):
            raise ConfigError(f"the model's linears were built for --input-activations {loaded_with}, the engine is "
                              f"configured for {config.activations}: load it with load_runtime_model(..., "
                              f"activations={config.activations!r})", param="activations")
        self.device = next(model.parameters()).device
        self.platform = Platform.of(self.device)
        self.kv_dtype = kv_cache_torch_dtype(config.kv_cache_dtype, model.dtype)
        self.kv_dtype_label = kv_dtype_name(self.kv_dtype)  # as --kv-cache-dtype spells it
        self.decoder = build_runtime_model(model, config.attention_backend, config.fast_path, self.kv_dtype,
                                           group=self.group)
        self.kv_cache_spec = self.decoder.kv_cache_spec(self.kv_dtype)
        self.linear_methods = dict(sorted(self.decoder.linear_methods.items()))
        if config.lm_head != "model":
            self._quantize_lm_head(config.lm_head)
        self.weights_in_huge_pages = 0  # bytes
        if self.platform.host_memory:
            keep_freed_host_memory()  # each step's activations reuse freed memory instead of new pages
            # (before any path is timed)
            self.weights_in_huge_pages = weights_to_huge_pages(self.decoder, sharing=(model,))
            if self.weights_in_huge_pages:
                log.info("weights: %.1f MB in transparent huge pages (LLMOPT_WEIGHTS_HUGE_PAGES=0: malloc's pages)",
                         self.weights_in_huge_pages / 1e6)

    def _prepare_kernels(self, config: EngineConfig) -> None:
        """Each linear's kernel per row count (kernel_plans.plan_linears: measured where the choice is close)."""
        self.linear_paths = plan_linears(self.decoder, config.linear_kernels)

    def _size_kv_cache(self, model, config: EngineConfig, num_blocks: int | None) -> None:
        """The cache's byte budget and block count: given blocks, tokens or bytes (refused beyond the memory
        available), or a fraction of the memory left, no more than the engine could ever fill."""
        block_size, kv_cache_bytes = self.block_size, config.kv_cache_bytes
        # every rank has as many blocks: the budget holds them for the rank with the most KV heads, or the stage
        # with the most layers
        budget_spec = self.kv_cache_spec
        if self.group is not None:
            budget_spec = replace(budget_spec, num_kv_heads=self.decoder.plan.max_kv_heads)
        if self.stages is not None:
            budget_spec = replace(budget_spec, num_layers=self.stages.plan.max_layers)
        per_block = budget_spec.bytes_per_block(block_size)
        context = model_limits(model.config)[0]
        # the step graphs' block tables cover the longest context (or, without one, 1024 blocks)
        self.graph_max_blocks = -(-context // block_size) if context else 1024
        self.captures_graphs = self._graphs_wanted(config)
        self.graph_reserve = (graph_memory_bytes(model.config, config.max_num_seqs, self.graph_max_blocks,
                                                 self.decoder.dtype) if self.captures_graphs else 0)
        self.kv_cache_source = "given"
        if num_blocks is not None:
            kv_cache_bytes, self.kv_cache_source = num_blocks * per_block, f"{num_blocks} blocks"
        elif config.kv_cache_tokens is not None:
            kv_cache_bytes = -(-config.kv_cache_tokens // block_size) * per_block
            self.kv_cache_source = f"{config.kv_cache_tokens:,} tokens asked"
        elif kv_cache_bytes is None:
            fraction, max_num_seqs = config.kv_cache_memory_fraction, config.max_num_seqs
            useful = (max_num_seqs * -(-context // block_size) * per_block) if context and max_num_seqs else None
            kv_cache_bytes = default_kv_cache_bytes(self.device, fraction, useful, self.graph_reserve)
            self.kv_cache_source = f"{fraction:.0%} of available memory"
            if useful is not None and kv_cache_bytes == useful:
                self.kv_cache_source = f"{max_num_seqs} sequences x the full context"
        if num_blocks is None and (config.kv_cache_tokens is not None or config.kv_cache_bytes is not None):
            check_kv_cache_fits(kv_cache_bytes, config, self.device)
        self.kv_cache_budget = kv_cache_bytes  # (the cache is whole blocks of it)
        self.num_blocks = kv_cache_bytes // per_block
        if self.num_blocks < 1:
            raise ConfigError(f"--kv-cache-bytes {kv_cache_bytes} holds no block of {block_size} tokens "
                              f"({per_block} bytes each): raise it")

    def _allocate_kv_cache(self, config: EngineConfig) -> None:
        """The cache's tensors, and (CPU) their memory committed as --kv-cache-commit says."""
        # (step graphs: one block more, past those the scheduler hands out, where padding rows store and attend)
        sink_blocks = 1 if self.captures_graphs else 0
        self.kv_cache = self.kv_cache_spec.allocate(self.num_blocks + sink_blocks, self.block_size, self.device)
        self.kv_cache_bytes = self.kv_cache.num_bytes
        self.kv_cache_committer = commit_kv_cache(self.kv_cache, config.kv_cache_commit)

    def _capture_graphs(self, config: EngineConfig) -> None:
        """Decode steps of the sizes in decode_graph_rows run the layers as one compiled call
        (models/decode_graph.py): built wherever they can be unless --no-decode-graph; refused if asked for and
        impossible."""
        wants_graph = config.decode_graph is not False
        self.decode_graph_rows = self.decoder.build_decode_graphs(self.kv_cache) if wants_graph else []
        self.step_graphs = None
        if self.captures_graphs:
            self.step_graphs = StepGraphs(self.decoder, self.kv_cache, self.block_size, config.max_num_seqs,
                                          min(self.graph_max_blocks, self.num_blocks), self.num_blocks,
                                          self.platform.step_graph_capture(), self.device)
            log.info("step graphs: %s sequences, %.1f MiB pool (%.1f MiB reserved)", self.step_graphs.buckets,
                     self.step_graphs.pool_bytes / 2**20, self.graph_reserve / 2**20)
        if config.decode_graph and not self.decode_graph_rows:
            raise ConfigError("--decode-graph: this engine cannot run its decodes as one compiled call (that needs the "
                              "CPU fast path in one process, the compiled cpu attention backend, and a KV cache in "
                              "the model's dtype, in 8 bits, or fp16 / bf16 under fp32): drop --decode-graph",
                              param="decode_graph")

    def _graphs_wanted(self, config: EngineConfig) -> bool:
        """Whether decode steps will be captured as graphs (executor/step_graphs.py): where the platform captures
        them, unless --enforce-eager, in one process (no rank or stage exchanging tensors mid-step), with an
        attention backend whose decode reads only the step's tensors."""
        return (not config.enforce_eager and self.platform.captures_steps and self.group is None
                and self.workers is None and self.stages is None and self.decoder.attention.captures)

    def _quantize_lm_head(self, mode: str) -> None:
        """--lm-head int8 / int8-g32 (EngineConfig.lm_head): the decoder's logits head rounded to int8, counted with
        the linear methods."""
        if not self.decoder.lm_head_quantizable or self.stages is not None:
            why = "pipeline stages" if self.stages is not None else f"not for {type(self.decoder).__name__}"
            raise ConfigError(f"--lm-head {mode} runs on llama-family models in one process ({why}): use --lm-head "
                              "model", param="lm_head")
        method = self.decoder.quantize_lm_head(ACTIVATION_SCHEMES[self.activations], LM_HEAD_GROUPS[mode])
        if method == "dense":  # (a grouped head no kernel holds with these inputs: dequantized, nothing gained)
            raise ConfigError(f"--lm-head {mode} needs 8-bit inputs (--input-activations int8, the CPU default with "
                              "the fast path), the compiled CPU kernels, a vocabulary of a multiple of 16 and a "
                              "hidden size of a multiple of 32: use --lm-head int8", param="lm_head")
        self.linear_methods = dict(sorted({**self.linear_methods, f"lm_head: {method}": 1}.items()))

    def kv_cache_summary(self) -> str:
        """One line for start-up: the KV cache's size, where it came from, the tokens it holds, and what the same
        bytes would hold in each other cache dtype."""
        return (f"KV cache: {self.kv_cache_bytes / 2**30:.2f} GiB ({self.kv_cache_source}), "
                f"{self.kv_cache.num_tokens:,} tokens in {self.kv_dtype_label} "
                f"({self.kv_cache_spec.bytes_per_token:,} bytes per token, {self.kv_cache_spec.layout} layout; the "
                f"same budget holds {self.tokens_per_dtype_text()}); attention backend {self.decoder.attention.name}")

    def tokens_per_dtype(self) -> dict[str, int]:
        """Tokens this cache's byte budget holds in each cache dtype the model's layout takes."""
        dtypes = {n: kv_cache_torch_dtype(n, self.kv_dtype) for n in KV_CACHE_DTYPES if n != "auto"}
        # (an 8-bit cache needs the kv layout: KVCacheSpec)
        names = [n for n, d in dtypes.items() if self.kv_cache_spec.layout == "kv" or not KVCacheSpec.holds_codes(d)]
        per_block = {n: self.kv_cache_spec.with_dtype(dtypes[n]).bytes_per_block(self.block_size) for n in names}
        return {n: self.kv_cache_budget // b * self.block_size for n, b in per_block.items()}

    def tokens_per_dtype_text(self) -> str:
        return ", ".join(f"{tokens:,} in {name}" for name, tokens in self.tokens_per_dtype().items())

    @torch.no_grad()  # the loaded model's parameters still require grad: no step may record an autograd graph
    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one step; samples a token for each sequence that reached its last token. A tensor-parallel rank
        that failed ends every rank (ParallelError, naming it): no process is left waiting."""
        try:
            return self._execute(out)
        except ParallelError:
            self.close()
            raise

    def _execute(self, out: SchedulerOutput) -> StepResult:
        input_ids, positions, slots, starts, context_lens, tables, sample_rows = [], [], [], [0], [], [], []
        bs = self.block_size
        for item in out.scheduled:
            seq, first = item.seq, item.seq.num_computed_tokens
            last = first + item.num_new_tokens
            table = seq.block_table
            drafts = seq.draft_token_ids[:item.num_draft_tokens]
            if item.num_new_tokens == 1:  # decode: skip the per-token range machinery
                input_ids.append(seq.token_ids[first])
                positions.append(first)
                slots.append(table[first // bs] * bs + first % bs)
            else:
                input_ids.extend(seq.token_ids[first:last - len(drafts)] + drafts)
                positions.extend(range(first, last))
                slots.extend(table[p // bs] * bs + p % bs for p in range(first, last))
            starts.append(starts[-1] + item.num_new_tokens)
            context_lens.append(last)
            tables.append(table)
            if item.samples:  # the rows of the last real token and of each draft after it
                sample_rows.append((starts[-1] - 1 - len(drafts), seq, drafts))
        hidden = self.forward(StepInputs(input_ids, positions, slots, starts, context_lens, tables))
        result = StepResult()
        self._score_prompts(out, starts, hidden, result)
        if sample_rows:
            self._sample(hidden, sample_rows, result)
        return result

    def forward(self, step: StepInputs) -> torch.Tensor:
        """The decoder over one step's batch -> final hidden states [T, hidden] (rank 0 first hands the step to
        the other tensor-parallel ranks, which run it alongside)."""
        if self.workers is not None:
            self.workers.send(("forward", step))
        if self.stages is not None:
            return self._forward_pipelined(step)
        return self._forward_part(step)

    def _forward_part(self, step: StepInputs, hidden: torch.Tensor | None = None, final: bool = True
                      ) -> torch.Tensor:
        if self.step_graphs is not None and self.step_graphs.serves(step):
            return self.step_graphs.run(step)
        meta = self.decoder.attention.build_metadata(
            step.starts, step.context_lens, step.tables, torch.tensor(step.slots, dtype=torch.long, device=self.device),
            self.block_size, self.device)
        args = (torch.tensor(step.input_ids, device=self.device), torch.tensor(step.positions, device=self.device),
                meta, self.kv_cache)
        return self.decoder(*args) if self.stages is None else self.decoder(*args, hidden, final)

    def _forward_pipelined(self, step: StepInputs) -> torch.Tensor | None:
        """This stage's layers over each micro-batch of the step (parallel/pipeline.py); rank 0 returns the final
        hidden states [T, hidden] the last stage sent back, the others None."""
        stages = self.stages
        plan = stages.plan
        counts = [b - a for a, b in zip(step.starts, step.starts[1:])]
        parts = [step_part(step, a, b) for a, b in split_tokens(counts, stages.micro_batches)]
        sends = []
        for part in parts:
            rows = len(part.input_ids)
            hidden = None if plan.is_first else stages.recv(rows, plan.stage - 1)
            out = self._forward_part(part, hidden, final=plan.is_last)
            if not plan.is_last:
                sends.append(stages.send(out, plan.stage + 1))
            elif stages.returns_finals:
                sends.append(stages.send(out, 0))
        finals = ([stages.recv(len(part.input_ids), plan.stages - 1) for part in parts] if stages.collects_finals
                  else None)
        for request in sends:
            stages.wait(request)
        return torch.cat(finals) if finals is not None else None

    def logits(self, hidden: torch.Tensor, as_float: bool) -> torch.Tensor:
        """[R, hidden] -> [R, vocab] (the other tensor-parallel ranks project the same rows onto their shares)."""
        if self.group is not None and self.workers is not None:
            self.workers.send(("logits", to_wire(hidden), as_float))
        return self.decoder.logits(hidden, as_float=as_float)

    def communication(self) -> tuple[int, float]:
        """(all-reduces, seconds in them) on this rank since start or the last reset (0, 0.0 in one process)."""
        group = self.group
        return (group.num_all_reduces, group.all_reduce_seconds) if group is not None else (0, 0.0)

    def reset_communication(self) -> None:
        if self.group is not None:
            self.group.num_all_reduces, self.group.all_reduce_seconds = 0, 0.0

    def close(self) -> None:
        """Stop committing the KV cache's memory and the other tensor-parallel ranks."""
        if self.kv_cache_committer is not None:
            self.kv_cache_committer.stop()
        if self.workers is not None:
            self.workers.stop()

    def _sample(self, hidden: torch.Tensor, sample_rows: list[tuple[int, object, list[int]]], result: StepResult
                ) -> None:
        """The next token of each sequence that reached its last token; a sequence with drafts gets the ones
        the target accepts (executor/verify.py) and the target's token after them."""
        rows = [first + j for first, _, drafts in sample_rows for j in range(len(drafts) + 1)]
        last_hidden = hidden if rows == list(range(hidden.shape[0])) else hidden[rows]
        # [R, vocab] in the model's dtype: the greedy rows need no fp32 copy (argmax over bf16 values is the
        # argmax over their exact fp32 values); rows that sample or report logprobs are converted one by one
        logits = self.logits(last_hidden, as_float=False)
        if self.platform.logits_to_host:
            # one call for the whole batch (most requests are greedy); torch.argmax is slow on wide rows
            ops = cpu_ops()
            greedy = (ops.argmax_rows(logits) if ops is not None else logits.float().argmax(dim=-1)).tolist()
        else:  # (a device: the argmax there, and the ids alone to the host unless a row samples or reports logprobs)
            greedy = logits.argmax(dim=-1).tolist()
            wanted = any(not seq.params.is_greedy or seq.params.logprobs is not None for _, seq, _ in sample_rows)
            logits = logits.cpu() if wanted else None
        offset, final_rows = 0, []
        for _, seq, drafts in sample_rows:
            params, width = seq.params, len(drafts) + 1
            if drafts:
                if params.is_greedy:
                    taken = accept_greedy(greedy[offset:offset + width], drafts)
                    token = greedy[offset + taken]
                else:
                    probs = probabilities(logits[offset:offset + width].float(), params)
                    taken, token = rejection_sample(probs, drafts, None, self._generator(seq))
                result.accepted[seq.seq_id] = drafts[:taken]
            else:
                taken = 0
                row = None if params.is_greedy and params.logprobs is None else logits[offset].float()
                token = greedy[offset] if params.is_greedy else sample(row, params, self._generator(seq))
                if params.logprobs is not None:
                    result.logprobs[seq.seq_id] = token_logprobs(row, token, params.logprobs)
            result.tokens[seq.seq_id] = token
            final_rows.append(offset + taken)
            offset += width
        if self.keep_last_hidden:
            kept = last_hidden[final_rows].clone()  # [S, hidden]
            for i, (_, seq, _) in enumerate(sample_rows):
                self.last_hidden[seq.seq_id] = kept[i]

    def _score_prompts(self, out: SchedulerOutput, starts: list[int], hidden: torch.Tensor, result: StepResult
                       ) -> None:
        """Prompt log-probabilities for requests that ask for them: the row computed at position p scores prompt
        token p + 1 (the vocabulary projection in slices of SCORE_ROWS rows: a 2048-token chunk's fp32 logits
        would take 400 MB at once). A request admitted with a cached prefix gets that prefix's scores from
        prompt_scores (kept when it was first scored); every full prompt block scored is kept there."""
        bs, scores = self.block_size, self.prompt_scores
        for i, item in enumerate(out.scheduled):
            seq = item.seq
            top = seq.params.prompt_logprobs
            if top is None:
                continue
            first, num_prompt = seq.num_computed_tokens, seq.num_prompt_tokens
            last = min(first + item.num_new_tokens, num_prompt - 1)  # positions whose next token is prompt
            rows = hidden[starts[i]: starts[i] + max(0, last - first)]  # [positions, hidden]
            targets = seq.token_ids[first + 1: last + 1]
            first_scored, entries = first + 1, []  # the prompt position entries[0] scores
            state = scores.sequences.get(seq.seq_id)
            if state is None or first == seq.num_cached_tokens:  # (re)admitted
                state = scores.start(seq.seq_id, seq.token_ids[:num_prompt])
                if first:  # a prefix-cache hit: its kept scores, and the next token's from the hit's last hidden
                    # state, projected with this step's rows
                    entries, hidden_end = scores.cached_entries(state, first // bs)
                    rows, targets = torch.cat([hidden_end[None], rows]), [seq.token_ids[first], *targets]
                    first_scored, state.stored = 1, first // bs
            for r in range(0, len(targets), SCORE_ROWS):
                logits = self.logits(rows[r:r + SCORE_ROWS], as_float=True).cpu()  # [rows, vocab]
                entries += rows_token_logprobs(logits, targets[r:r + SCORE_ROWS], top)
            # the hidden state at the last position of each full prompt block computed in this step
            end = min(first + item.num_new_tokens, num_prompt // bs * bs)
            block_ends = {p // bs: hidden[starts[i] + p - first].clone()
                          for p in range(first // bs * bs + bs - 1, end, bs) if p >= first}
            scores.record(state, entries, block_ends, top)
            if entries:
                result.prompt_logprobs[seq.seq_id] = (first_scored, entries)

    def _generator(self, seq) -> torch.Generator | None:
        if seq.params.seed is None:
            return None
        generator = self.generators.get(seq.seq_id)
        if generator is None:
            generator = self.generators[seq.seq_id] = torch.Generator().manual_seed(seq.params.seed)
        return generator

    def read_kv_blocks(self, block_ids: list[int], out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """The contents of these cache blocks, as stored (8-bit codes and their scales in an 8-bit cache): one
        tensor [len(block_ids), block_size, ...] per cache tensor, layer by layer (a KV hand-over's payload);
        written into `out`'s tensors when given (views of one buffer: no second copy to pack them)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        tensors = [t for layer in self.kv_cache for t in layer.tensors]
        if out is None:
            return [t.index_select(0, index) for t in tensors]
        for t, part in zip(tensors, out, strict=True):
            torch.index_select(t, 0, index, out=part)
        return out

    def write_kv_blocks(self, block_ids: list[int], contents: list[torch.Tensor]) -> None:
        """Store read_kv_blocks' tensors (another engine's, same model and cache dtype) into these blocks."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for t, part in zip((t for layer in self.kv_cache for t in layer.tensors), contents, strict=True):
            t.index_copy_(0, index, part.to(t.device))

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)
        self.prompt_scores.release(seq_id)
        self.last_hidden.pop(seq_id, None)

    def has_request_state(self) -> bool:
        """Whether any request still holds per-request state here (seeded generators)."""
        return bool(self.generators or self.last_hidden or self.prompt_scores.sequences)

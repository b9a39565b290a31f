"""Iteration-level (continuous) batching with a token budget, chunked prefill and preemption by
recompute; or request-level (static) batches, so the two can be compared. Never touches a tensor.

Each step: running sequences first (oldest first): a decode takes 1 token of the budget (1 + k when it
verifies k draft tokens of speculative decoding; drafts are cut to fit the budget), an unfinished prefill takes
the next chunk. When a sequence needs a block and none is free, the newest running sequence is
preempted (its KV dropped, back to the front of the waiting queue, recomputed later). Then, if nothing was
preempted, waiting sequences are admitted FCFS while the budget, the sequence cap and the blocks allow.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llmopt.core.errors import ConfigError
from llmopt.runtime.engine.block_manager import BlockManager
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step, from seq.num_computed_tokens on (drafts included)
    num_draft_tokens: int = 0  # of those, the last ones are seq.draft_token_ids[:num_draft_tokens]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the sequence's last token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_new_tokens - self.num_draft_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


def check_schedulable(num_prompt_tokens: int, config: EngineConfig) -> None:
    """Refuse a prompt that no step could ever take: longer than --max-num-batched-tokens with chunked prefill off
    (it would wait forever, and every request behind it too). A ConfigError naming the option to change."""
    budget = config.max_num_batched_tokens
    if not config.enable_chunked_prefill and num_prompt_tokens > budget:
        raise ConfigError(f"prompt of {num_prompt_tokens} tokens is longer than one step takes without chunked "
                          f"prefill (--max-num-batched-tokens {budget}): raise --max-num-batched-tokens to at least "
                          f"{num_prompt_tokens} or drop --no-chunked-prefill", param="prompt")


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, eos_token_id: int | None = None):
        self.config = config
        self.block_manager = block_manager
        self.eos_token_id = eos_token_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # --- requests -------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        """Queue a request; one that could never fit in the whole KV cache is refused here."""
        self.check_fits(seq)
        self.waiting.append(seq)

    def check_fits(self, seq: Sequence) -> None:
        """Refuse a request that could never be scheduled: a prompt longer than one step's token budget when prompts
        are not chunked, or more KV than the whole cache holds (its prompt and max_tokens new tokens)."""
        check_schedulable(seq.num_prompt_tokens, self.config)
        bm = self.block_manager
        needed = seq.num_blocks(bm.block_size, seq.num_prompt_tokens + seq.params.max_tokens)
        if needed > bm.num_blocks:
            tokens, held = needed * bm.block_size, bm.num_blocks * bm.block_size
            raise ConfigError(
                f"a request of {seq.num_prompt_tokens} prompt + {seq.params.max_tokens} new tokens needs {tokens} "
                f"tokens of KV cache ({needed} blocks) but the cache holds {held}: {self._grow_cache_advice(tokens)}",
                param="max_tokens")

    def _grow_cache_advice(self, tokens: int) -> str:
        """How to make room for `tokens`, naming the option that sized the cache (the one the user gave)."""
        config = self.config
        if config.kv_cache_tokens is not None:
            return f"raise --kv-cache-tokens to at least {tokens}"
        if config.kv_cache_bytes is not None:
            return f"raise --kv-cache-bytes (or give --kv-cache-tokens {tokens} instead)"
        return f"give --kv-cache-tokens {tokens} (or raise --kv-cache-memory-fraction)"

    def abort(self, seq_id: int) -> bool:
        return self.finish(seq_id, "abort")

    def finish(self, seq_id: int, reason: str) -> bool:
        """End a waiting or running request now (aborted, or its text reached a stop string)."""
        for queue in (self.waiting, self.running):
            for seq in list(queue):
                if seq.seq_id == seq_id:
                    queue.remove(seq)
                    self._finish(seq, reason)
                    return True
        return False

    def adopt(self, seq: Sequence, num_computed_tokens: int) -> bool:
        """Run a sequence whose first `num_computed_tokens` tokens' KV another engine computed (prefill/decode
        disaggregation): fresh blocks for all its tokens, then the running batch; False (nothing changed) while
        the blocks or the sequence cap do not allow it."""
        if len(self.running) >= self.config.max_num_seqs or not self.block_manager.allocate_fresh(seq):
            return False
        seq.num_computed_tokens = num_computed_tokens
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # --- scheduling -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING or budget == 0:
                continue
            num_new = self._chunk(seq, budget)
            if num_new == 0:
                continue
            num_draft = min(len(seq.draft_token_ids), budget - 1) if seq.is_decoding else 0
            if num_draft and not bm.can_grow(seq, seq.num_computed_tokens + num_new + num_draft):
                num_draft = 0  # drafts never cost another sequence its KV
            num_new += num_draft
            while not bm.can_grow(seq, seq.num_computed_tokens + num_new):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                bm.grow(seq, seq.num_computed_tokens + num_new)
                out.scheduled.append(ScheduledSeq(seq, num_new, num_draft))
                budget -= num_new
        may_admit = self.config.policy == "continuous" or not self.running
        # After a preemption only an idle engine admits (the preempted request is first in line).
        if may_admit and (not out.preempted or not self.running):
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                seq = self.waiting[0]
                if not bm.can_allocate(seq):
                    break
                bm.allocate(seq)
                num_new = self._chunk(seq, budget)
                if num_new == 0:  # no chunking and the whole prompt does not fit this step
                    bm.free(seq)
                    seq.num_computed_tokens = seq.num_cached_tokens = 0
                    break
                self.waiting.popleft()
                seq.status = SequenceStatus.RUNNING
                self.running.append(seq)
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
        return out

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of `seq` to compute this step: the rest, or what the budget allows when chunking. Without chunked
        prefill a prompt runs whole (admission refused any longer than a step), but a preempted sequence's recompute
        (its prompt and output so far, which may exceed a step) is chunked: it could never be scheduled otherwise."""
        remaining = seq.num_tokens - seq.num_computed_tokens
        if self.config.enable_chunked_prefill or seq.num_output_tokens > 0:
            return min(remaining, budget)
        return remaining if remaining <= budget else 0

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Drop the sequence's KV; it goes back to the front of the queue and is recomputed later."""
        self.running.remove(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        self.num_preemptions += 1

    # --- after the model ran --------------------------------------------------------------------
    def postprocess(self, out: SchedulerOutput, sampled: dict[int, int],
                    accepted: dict[int, list[int]] | None = None) -> list[Sequence]:
        """Record computed tokens and the new tokens of each sequence; returns the ones finished.

        sampled: the token the model chose after the sequence's last (accepted) token; accepted: of a sequence
        that verified drafts, the drafts accepted before it. The KV of rejected drafts is dropped: they do not
        count as computed, so their blocks never enter the prefix cache, and blocks holding only them are freed."""
        finished = []
        bm = self.block_manager
        for item in out.scheduled:
            seq = item.seq
            samples = item.samples
            taken = (accepted or {}).get(seq.seq_id, []) if item.num_draft_tokens else []
            full_blocks = seq.num_computed_tokens // bm.block_size
            seq.num_computed_tokens += item.num_new_tokens - item.num_draft_tokens + len(taken)
            seq.draft_token_ids = []
            if item.num_draft_tokens:
                seq.num_verifications += 1
                seq.num_draft_tokens += item.num_draft_tokens
                seq.num_accepted_tokens += len(taken)
            if seq.num_computed_tokens // bm.block_size > full_blocks:  # a block just filled
                bm.cache_full_blocks(seq)
            if not samples:
                continue
            reason = None
            for token in [*taken, sampled[seq.seq_id]]:
                seq.append_token(token)
                if (reason := self._stop_reason(seq, token)) is not None:
                    break
            if reason is not None:
                self.running.remove(seq)
                self._finish(seq, reason)
                finished.append(seq)
            elif item.num_draft_tokens:
                bm.truncate(seq, seq.num_tokens)
        return finished

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        params = seq.params
        if not params.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id:
            return "stop"
        if token in params.stop_token_ids:
            return "stop"
        if seq.num_output_tokens >= params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

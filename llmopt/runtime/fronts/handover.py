"""The two engines of prefill/decode disaggregation (disaggregated.py runs one per worker process): a prefill
engine hands each prompt's KV over when its last chunk is computed (before its blocks are freed); a decode engine
adopts handed-over requests (prompt, first token, KV) as soon as blocks and the sequence cap allow."""

from __future__ import annotations

from collections import deque
from typing import Callable

from llmopt.runtime.engine.engine import Engine, check_request
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.engine.scheduler import SchedulerOutput
from llmopt.runtime.engine.sequence import Sequence


class PrefillEngine(Engine):
    """An engine whose `on_prefilled(seq)` is called for each prompt whose last chunk ran (its KV complete, its
    blocks still held)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_prefilled: Callable[[Sequence], None] | None = None

    def _executed(self, out: SchedulerOutput) -> None:
        if self.on_prefilled is None:
            return
        for item in out.scheduled:
            if item.samples and item.seq.num_output_tokens == 0:
                self.on_prefilled(item.seq)


class DecodeEngine(Engine):
    """An engine that also takes requests whose prompt another engine computed (`add_prefilled`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._handed_over: deque[tuple[Sequence, list]] = deque()  # (request, its KV blocks) not yet adopted

    def add_prefilled(self, prompt_token_ids: list[int], first_token: int, params: SamplingParams,
                      kv_blocks: list, arrival_time: float | None = None, num_cached_tokens: int = 0) -> int:
        """Queue a request whose prompt another engine computed: its first sampled token and its prompt's KV as
        that engine's cache held it (`kv_blocks`: runner.read_kv_blocks of its first ceil(prompt / block_size)
        blocks). It decodes from the second token on; its first output reports the first token."""
        check_request(prompt_token_ids, params, self.tokenizer is not None, self.vocab_size, self.max_context)
        seq = Sequence(prompt_token_ids, params, arrival_time=arrival_time)
        seq.num_cached_tokens = num_cached_tokens  # (served by the prefill side's prefix cache)
        self.scheduler.check_fits(seq)
        seq.append_token(first_token)
        self._live[seq.seq_id] = seq
        self.outputs.add(seq)
        if self.outputs.update(seq.seq_id, None):  # the first token's text already holds a stop string
            seq.finish_reason = "stop"
            self._ended.add(seq.seq_id)
        else:
            self._handed_over.append((seq, kv_blocks))
        return seq.seq_id

    def _before_schedule(self) -> list[int]:
        """Move handed-over requests into the running batch while blocks and the sequence cap allow (oldest
        first): their KV written into fresh blocks, the first token's KV computed by the next step. Returns the
        ids adopted (each reports its first token this step)."""
        adopted = []
        while self._handed_over:
            seq, kv_blocks = self._handed_over[0]
            if not self.scheduler.adopt(seq, seq.num_prompt_tokens):
                break
            self._handed_over.popleft()
            self.runner.write_kv_blocks(seq.block_table[:len(kv_blocks[0])], kv_blocks)
            adopted.append(seq.seq_id)
        return adopted

    def abort(self, request_id: int) -> bool:
        waiting = [item for item in self._handed_over if item[0].seq_id == request_id]  # handed over, not adopted
        if not waiting:
            return super().abort(request_id)
        self.runner.release(request_id)
        self._handed_over = deque(item for item in self._handed_over if item[0].seq_id != request_id)
        waiting[0][0].finish_reason = "abort"
        self._ended.add(request_id)
        return True

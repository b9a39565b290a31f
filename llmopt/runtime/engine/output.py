"""From sampled token ids to what a caller sees: incremental text, stop strings, one RequestOutput per request
per step. Never touches a tensor; the tokenizer is only asked to decode short windows of token ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.runtime.engine.sequence import Sequence

REPLACEMENT_CHAR = "\ufffd"  # what a decode shows for an incomplete UTF-8 sequence


@dataclass
class RequestOutput:
    """What one step produced for one request; the last one (finished) also carries the whole output.

    new_token_ids / new_text / new_logprobs / new_token_times: this step's part (new_text may be empty while a
    multi-byte character or a possible stop string is incomplete). token_ids, text, token_times, logprobs: the
    whole output, filled in the finished output only (so a step costs nothing per token already sent).
    Times are time.perf_counter() values.
    """

    request_id: int
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" (EOS, a stop token or string), "length", "abort"
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    new_token_times: list[float] = field(default_factory=list)
    arrival_time: float = 0.0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at the last admission
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    token_times: list[float] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which nothing
    # predicts), in the first output after the whole prompt was scored and again in the finished one
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # speculative decoding, in the finished output: verification steps, drafts verified, drafts accepted
    num_verifications: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class IncrementalDetokenizer:
    """Text of a growing list of token ids, decoding only a short window per token.

    A window from `prefix_offset` is decoded with and without the newest tokens; the difference is the new
    text (as vLLM and transformers' TextStreamer do, so a token whose text depends on its neighbours, like a
    leading space, decodes as it would in the whole). Text ending in an incomplete character waits for the
    token that completes it.
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text they complete (possibly empty)."""
        self.token_ids.extend(token_ids)
        prefix = self.decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT_CHAR):
            return ""
        new = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.text += new
        return new


def first_stop(text: str, stops: tuple[str, ...], start: int = 0) -> int | None:
    """Where the earliest of the stop strings begins in text[start:] (an index into text), or None."""
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None


class RequestState:
    """The output side of one request: its detokenizer, the text already handed out, a stop-string match."""

    def __init__(self, seq: Sequence, tokenizer):
        self.seq = seq
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None and seq.params.detokenize \
            else None
        self.num_tokens_sent = 0
        self.num_chars_sent = 0
        self.stopped_at: int | None = None  # text length once a stop string matched
        self.logprobs: list[dict[int, float]] = []
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] * seq.num_prompt_tokens if seq.params.prompt_logprobs is not None else None)
        self.prompt_logprobs_sent = False

    @property
    def text(self) -> str:
        if self.detokenizer is None:
            return ""
        text = self.detokenizer.text
        return text if self.stopped_at is None else text[:self.stopped_at]

    def finish_text(self) -> None:
        """At the end, the text is the whole output decoded at once (window decodes can differ from it in a
        tokenizer's clean-up of spaces), cut before the first stop string."""
        if self.detokenizer is None:
            return
        detok = self.detokenizer
        detok.text = detok.decode(detok.token_ids)
        if self.stopped_at is not None:
            found = first_stop(detok.text, self.seq.params.stop)
            self.stopped_at = len(detok.text) if found is None else found

    def match_stop(self) -> bool:
        """Whether the text now holds a stop string (only its tail can hold a new match); records where."""
        stops = self.seq.params.stop
        if not stops or self.detokenizer is None or self.stopped_at is not None:
            return False
        tail_from = max(0, self.num_chars_sent - max(len(s) for s in stops))
        self.stopped_at = first_stop(self.detokenizer.text, stops, tail_from)
        return self.stopped_at is not None

    def sendable_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, the last len(longest stop) - 1 characters are held back, as
        they may begin a stop string."""
        text = self.text
        end = len(text)
        if not finished and self.seq.params.stop:
            end = max(self.num_chars_sent, end - max(len(s) for s in self.seq.params.stop) + 1)
        new = text[self.num_chars_sent:end]
        self.num_chars_sent = end
        return new


class OutputProcessor:
    """Owns detokenization and stop strings for every live request, and builds the RequestOutputs."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.states: dict[int, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        self.states[seq.seq_id] = RequestState(seq, self.tokenizer)

    def add_prompt_logprobs(self, seq_id: int, first: int, entries: list[dict[int, float]]) -> None:
        """Scores of prompt positions first, first + 1, ... (a recomputed prompt overwrites them alike)."""
        self.states[seq_id].prompt_logprobs[first:first + len(entries)] = entries

    def update(self, seq_id: int, logprobs: dict[int, float] | None) -> bool:
        """Take the request's newly sampled tokens; True when its text reached a stop string."""
        state = self.states[seq_id]
        if logprobs is not None:
            state.logprobs.append(logprobs)
        if state.detokenizer is None:
            return False
        output_ids = state.seq.output_token_ids
        state.detokenizer.add(output_ids[len(state.detokenizer.token_ids):])
        return state.match_stop()

    def output(self, seq_id: int) -> RequestOutput:
        """This step's RequestOutput; a finished request's state is dropped with it."""
        state = self.states[seq_id]
        seq = state.seq
        finished = seq.finish_reason is not None
        if finished:
            state.finish_text()
        new_ids = seq.output_token_ids[state.num_tokens_sent:]
        new_times = seq.token_times[state.num_tokens_sent:]
        new_logprobs = state.logprobs[state.num_tokens_sent:]
        state.num_tokens_sent = seq.num_output_tokens
        out = RequestOutput(seq.seq_id, new_ids, state.sendable_text(finished), finished, seq.finish_reason,
                            new_logprobs, new_times, seq.arrival_time, seq.num_prompt_tokens, seq.num_cached_tokens)
        scored = state.prompt_logprobs
        if scored is not None and not state.prompt_logprobs_sent and (
                seq.num_computed_tokens >= seq.num_prompt_tokens - 1 or finished):
            out.prompt_logprobs, state.prompt_logprobs_sent = scored, True
        if finished:
            out.token_ids, out.text = seq.output_token_ids, state.text
            out.token_times, out.logprobs = list(seq.token_times), list(state.logprobs)
            out.prompt_logprobs = state.prompt_logprobs
            out.num_verifications, out.num_draft_tokens = seq.num_verifications, seq.num_draft_tokens
            out.num_accepted_tokens = seq.num_accepted_tokens
            del self.states[seq_id]
        return out

    def __len__(self) -> int:
        return len(self.states)

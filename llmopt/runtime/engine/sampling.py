"""Sampling parameters of one request, validated once where they enter."""

from __future__ import annotations

from dataclasses import dataclass, field

from llmopt.core.errors import ConfigError


MAX_LOGPROBS = 20
# what torch.Generator.manual_seed takes: a signed or unsigned 64-bit integer
MIN_SEED, MAX_SEED = -(2 ** 63), 2 ** 64 - 1


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings; the text ends before the first match
    ignore_eos: bool = False
    logprobs: int | None = None  # also return the log-probabilities of the top-n tokens at each step
    detokenize: bool = True  # False: token ids only (no text, so no stop strings), as a benchmark wants
    # also return each prompt token's log-probability (and the top-n at each prompt position); such a request
    # computes its whole prompt (no prefix-cache hit), as scoring needs every position's logits
    prompt_logprobs: int | None = None

    def __post_init__(self):
        if self.max_tokens < 1:
            raise ConfigError(f"max_tokens must be at least 1 (got {self.max_tokens})", param="max_tokens")
        if self.temperature < 0:
            raise ConfigError(f"temperature must be >= 0 (got {self.temperature}); 0 means greedy",
                              param="temperature")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p must be in (0, 1] (got {self.top_p})", param="top_p")
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if any(not s for s in self.stop):
            raise ConfigError("a stop string must not be empty", param="stop")
        if self.stop and not self.detokenize:
            raise ConfigError("stop strings need detokenize=True (they are matched on the text)", param="stop")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"logprobs must be in [0, {MAX_LOGPROBS}] (got {self.logprobs})", param="logprobs")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ConfigError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] (got {self.prompt_logprobs})",
                              param="prompt_logprobs")
        if self.seed is not None and not MIN_SEED <= self.seed <= MAX_SEED:
            raise ConfigError(f"seed must fit in 64 bits ({MIN_SEED} to {MAX_SEED}; got {self.seed})", param="seed")
        if self.top_k < 0:
            raise ConfigError(f"top_k must be >= 0 (got {self.top_k}); 0 turns it off", param="top_k")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

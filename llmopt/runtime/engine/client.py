"""EngineClient: what the server, the bench and the eval drive. The one-process Engine and the multi-process
fronts (runtime/fronts: data-parallel replicas, disaggregated prefill / decode workers) each implement it, so a
caller holds any of them the same way; a test checks that every front has every member.

A caller adds requests, steps until nothing is unfinished and reads RequestOutputs; between requests an idle
server calls `poll()` (a front reads its workers' news) and `unavailable()` (why nothing could be served now)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional, Protocol, runtime_checkable

from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.output import RequestOutput
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.engine.stats import EngineStats


@runtime_checkable
class EngineClient(Protocol):
    config: EngineConfig
    tokenizer: object  # the model's tokenizer (None: token ids in, token ids out)
    max_context: Optional[int]  # the model's longest sequence (None: not stated by its config)
    vocab_size: Optional[int]

    # --- requests
    def add_request(self, prompt_token_ids: list[int], params: Optional[SamplingParams] = None,
                    arrival_time: Optional[float] = None) -> int:
        """Queue a request (refused with a ConfigError-style one-line error if it can never run); its id."""

    def abort(self, request_id: int) -> bool:
        """Stop a request; its final output (finish_reason "abort") comes from the next step()."""

    def check_token_ids(self, token_ids, param: str) -> None:
        """Refuse token ids outside the vocabulary, naming `param`."""

    # --- stepping
    def step(self) -> list[RequestOutput]:
        """One step: an output per request that produced a token or finished."""

    def has_unfinished(self) -> bool: ...

    def stream(self) -> Iterator[RequestOutput]:
        """step() until nothing is unfinished, each output as it comes."""

    def generate(self, prompts: list[list[int]], params=None) -> list[RequestOutput]:
        """Every prompt to its end; the final outputs in prompt order."""

    # --- health and load
    def poll(self) -> None: ...

    def unavailable(self) -> Optional[str]: ...

    @property
    def num_live_requests(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    # --- measurements and life
    def stats(self) -> EngineStats: ...

    def reset_stats(self, clear_prefix_cache: bool = False) -> None: ...

    def reset(self) -> None: ...

    def kv_cache_info(self) -> dict: ...

    def numerics(self) -> dict: ...

    def close(self) -> None: ...

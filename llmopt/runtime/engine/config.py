"""The runtime's one config object, from the CLI to the scheduler, and its defaults (defined here once;
importing this module does not import torch, so the CLI can show the defaults in its help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llmopt.core.errors import ConfigError

# The KV cache's default size: this fraction of the memory available when the engine starts (CPU: the host's
# available memory; CUDA: the device's free memory after the weights), as vLLM's VLLM_CPU_KVCACHE_SPACE /
# gpu_memory_utilization size it from the machine. On CPU the cache is zero pages that the OS commits as blocks
# are first written, so an unused budget costs address space, not memory.
KV_CACHE_MEMORY_FRACTION = 0.25
KV_CACHE_MAX_FRACTION = 0.95  # the rest stays for weights, activations and the OS

SPECULATIVE_METHODS = ("ngram", "draft", "medusa")
MEDUSA_HEADS_FILE = "medusa_heads.safetensors"  # next to the model, or named by --speculative medusa:PATH


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens, the target verifies them in one forward.

    method: ngram (prompt lookup: copy what followed the last n tokens where they occurred before), draft (a
    smaller model with the same tokenizer, `model` its path), medusa (extra heads on the target's last hidden
    state, `model` the heads' file). adaptive: per sequence, speculate only as many tokens as its acceptance
    pays for at the measured cost of a token in this batch (large batches are compute-bound)."""

    method: Literal["ngram", "draft", "medusa"] = "ngram"
    model: str | None = None
    num_speculative_tokens: int = 5
    ngram_min: int = 1
    ngram_max: int = 4
    adaptive: bool = True

    def __post_init__(self):
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)} "
                             f"(got {self.method!r})")
        if self.num_speculative_tokens < 1:
            raise ConfigError(f"--num-speculative-tokens must be >= 1 (got {self.num_speculative_tokens})")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ConfigError(f"need 1 <= --ngram-min <= --ngram-max (got {self.ngram_min}, {self.ngram_max})")
        if self.method == "draft" and not self.model:
            raise ConfigError("--speculative draft needs its model: draft:MODEL")

    @classmethod
    def parse(cls, text: str, **fields) -> SpeculativeConfig:
        """From the CLI's form: ngram, draft:MODEL, medusa or medusa:PATH."""
        method, _, model = text.partition(":")
        if method not in SPECULATIVE_METHODS:
            raise ConfigError(f"--speculative {text!r}: use ngram, draft:MODEL or medusa[:PATH]")
        if method == "ngram" and model:
            raise ConfigError(f"--speculative {text!r}: ngram takes no model")
        return cls(method, model or None, **fields)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine batches and caches. `kv_cache_bytes` None: `kv_cache_memory_fraction` of the available
    memory, capped at what `max_num_seqs` full-context sequences can fill."""

    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float = KV_CACHE_MEMORY_FRACTION
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_cache: bool = True
    policy: Literal["continuous", "static"] = "continuous"
    fast_path: bool | None = None  # fused projections and compiled kernels; None: on for CPU (executor.model)
    speculative: SpeculativeConfig | None = None

    def __post_init__(self):
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got {getattr(self, name)})",
                                  param=name)
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes must be positive (got {self.kv_cache_bytes})", param="kv_cache_bytes")
        if not 0 < self.kv_cache_memory_fraction <= KV_CACHE_MAX_FRACTION:
            raise ConfigError(f"--kv-cache-memory-fraction {self.kv_cache_memory_fraction}: give a fraction in "
                              f"(0, {KV_CACHE_MAX_FRACTION}]", param="kv_cache_memory_fraction")
        if self.policy not in ("continuous", "static"):
            raise ConfigError(f"--policy must be continuous or static (got {self.policy!r})", param="policy")


ENGINE_DEFAULTS = EngineConfig()  # what the CLI and recipes show as defaults

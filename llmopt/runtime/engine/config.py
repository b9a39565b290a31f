"""The runtime's one config object, from the CLI to the scheduler, and its defaults (defined here once;
importing this module does not import torch, so the CLI can show the defaults in its help)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# The KV cache's default size: this fraction of the memory available when the engine starts (CPU: the host's
# available memory; CUDA: the device's free memory after the weights), as vLLM's VLLM_CPU_KVCACHE_SPACE /
# gpu_memory_utilization size it from the machine. On CPU the cache is zero pages that the OS commits as blocks
# are first written, so an unused budget costs address space, not memory.
KV_CACHE_MEMORY_FRACTION = 0.25


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

    def __post_init__(self):
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.policy not in ("continuous", "static"):
            raise ValueError(f"policy must be continuous or static (got {self.policy!r})")


ENGINE_DEFAULTS = EngineConfig()  # what the CLI and recipes show as defaults

"""What the runtime asks of a model family's class (registry.py registers one per family): the contract the
runner is written against. A new family subclasses RuntimeDecoder in one file of this package."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from llmopt.runtime.executor.attention import AttentionBackend, KVCache, KVCacheSpec
from llmopt.runtime.executor.attention.metadata import AttentionMetadata


class RuntimeDecoder(nn.Module):
    """Built as cls(config, weights by name, attention backend, fast, dtype, device[, plan, group, stage]).
    Attributes set by each family: `attention` (its backend), `dtype`, `linear_methods` ({method: count})."""

    cache_layout: ClassVar[str] = "kv"  # the KV cache layout it writes (attention/kv_cache.py)
    tensor_parallel: ClassVar[bool] = False  # its checkpoints shard by sharding.ShardPlan / StagePlan
    lm_head_quantizable: ClassVar[bool] = False  # quantize_lm_head rounds its logits head (--lm-head int8)

    attention: AttentionBackend
    dtype: torch.dtype
    linear_methods: dict[str, int]

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv_cache: KVCache
                ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        raise NotImplementedError

    def logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor | None:
        """[S, hidden] -> [S, vocab]."""
        raise NotImplementedError

    def quantize_lm_head(self, input_activations, group_size: int = -1) -> str:
        """The logits head rounded to int8 (where lm_head_quantizable); returns its linear method."""
        raise NotImplementedError

    def prepare_graphs(self, max_positions: int) -> None:
        """Before its forward is captured (executor/step_graphs.py): anything it would otherwise size from a step's
        values on the host (rotary tables) sized for every position up to max_positions."""

    def build_decode_graphs(self, kv_cache: KVCache) -> list[int]:
        """Capture the decode graphs over `kv_cache` where this model and cache allow them (models/decode_graph.py);
        the step sizes that run through one (none: a family without graphs)."""
        return []

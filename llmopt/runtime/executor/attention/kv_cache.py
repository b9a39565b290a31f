"""The paged KV cache as one object: its spec (layout, dtype, geometry) says how many bytes a token takes, and
every size is computed from it — the engine's block budget, start-up's summary, the bench's bytes per step.

Layouts:
- "kv": a key and a value per KV head per token (multi-head, grouped- and multi-query attention);
  per layer two tensors [num_blocks, block_size, num_kv_heads, head_dim].
- "latent": one compressed vector per token (DeepSeek's multi-head latent attention: the kv_lora_rank latent and
  the shared rope key, latent_dim + rope_dim values); per layer one tensor [num_blocks, block_size, 1,
  latent_dim + rope_dim].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch


@dataclass(frozen=True)
class KVCacheSpec:
    layout: Literal["kv", "latent"]
    num_layers: int
    dtype: torch.dtype
    num_kv_heads: int = 0  # "kv"
    head_dim: int = 0  # "kv"
    latent_dim: int = 0  # "latent": kv_lora_rank
    rope_dim: int = 0  # "latent": qk_rope_head_dim

    @property
    def element_bytes(self) -> int:
        return torch.tensor([], dtype=self.dtype).element_size()

    @property
    def values_per_token_per_layer(self) -> int:
        if self.layout == "kv":
            return 2 * self.num_kv_heads * self.head_dim
        return self.latent_dim + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        """All layers' cached values for one token."""
        return self.num_layers * self.values_per_token_per_layer * self.element_bytes

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def block_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The shapes of one layer's tensors."""
        if self.layout == "kv":
            shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
            return [shape, shape]
        return [(num_blocks, block_size, 1, self.latent_dim + self.rope_dim)]

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> KVCache:
        layers = [tuple(zeros_lazily(shape, self.dtype, device) for shape in self.block_shapes(num_blocks, block_size))
                  for _ in range(self.num_layers)]
        return KVCache(self, num_blocks, block_size, layers)


@dataclass
class KVCache:
    """The allocated cache: `layers[i]` is layer i's (key, value) pair, or its (latent,) one-tuple."""

    spec: KVCacheSpec
    num_blocks: int
    block_size: int
    layers: list[tuple[torch.Tensor, ...]]

    @property
    def num_bytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block(self.block_size)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def __iter__(self):
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, ...]:
        return self.layers[layer]


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from calloc'ed memory (numpy's zeros), whose pages the OS commits on first write."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    element = torch.tensor([], dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * element, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)

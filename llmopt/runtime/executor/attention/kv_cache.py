"""The paged KV cache as one object: its spec (layout, dtype, geometry) says how many bytes a token takes, and
every size is computed from it — the engine's block budget, start-up's summary, the bench's bytes per step.

Layouts:
- "kv": a key and a value per KV head per token (multi-head, grouped- and multi-query attention);
  per layer two tensors [num_blocks, block_size, num_kv_heads, head_dim].
  With an 8-bit dtype (int8, float8_e4m3fn: kernels/kv_quant.py) two more per layer, the fp32 scale of each
  token's key and value per KV head: [num_blocks, block_size, num_kv_heads].
- "latent": one compressed vector per token (DeepSeek's multi-head latent attention: the kv_lora_rank latent and
  the shared rope key, latent_dim + rope_dim values); per layer one tensor [num_blocks, block_size, 1,
  latent_dim + rope_dim].
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal, Optional

import numpy as np
import torch

from llmopt.runtime.executor.host_memory import HUGE_PAGE_BYTES, huge_page_zeros
from llmopt.runtime.executor.kernels.kv_quant import CODE_MAX
from llmopt.runtime.executor.platform import Platform

SCALE_DTYPE = torch.float32  # an 8-bit cache's per-vector scales


@dataclass(frozen=True)
class KVCacheSpec:
    layout: Literal["kv", "latent"]
    num_layers: int
    dtype: torch.dtype
    num_kv_heads: int = 0  # "kv"
    head_dim: int = 0  # "kv"
    latent_dim: int = 0  # "latent": kv_lora_rank
    rope_dim: int = 0  # "latent": qk_rope_head_dim

    def __post_init__(self):
        if self.quantized and self.layout != "kv":
            raise ValueError(f"an 8-bit KV cache needs the kv layout (got {self.layout})")

    @property
    def quantized(self) -> bool:
        """Whether the values are 8-bit codes with a scale per token and KV head."""
        return self.holds_codes(self.dtype)

    @staticmethod
    def holds_codes(dtype: torch.dtype) -> bool:
        """Whether a cache of `dtype` holds 8-bit codes (kernels/kv_quant.py): the one place this is decided."""
        return dtype in CODE_MAX

    @property
    def element_bytes(self) -> int:
        return self.dtype.itemsize

    @property
    def values_per_token_per_layer(self) -> int:
        if self.layout == "kv":
            return 2 * self.num_kv_heads * self.head_dim
        return self.latent_dim + self.rope_dim

    @property
    def bytes_per_token(self) -> int:
        """All layers' cached values for one token (with their scales in an 8-bit cache)."""
        scales = 2 * self.num_kv_heads * SCALE_DTYPE.itemsize if self.quantized else 0
        return self.num_layers * (self.values_per_token_per_layer * self.element_bytes + scales)

    def with_dtype(self, dtype: torch.dtype) -> KVCacheSpec:
        return replace(self, dtype=dtype)

    def bytes_per_block(self, block_size: int) -> int:
        return block_size * self.bytes_per_token

    def block_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The shapes of one layer's tensors."""
        if self.layout == "kv":
            shape = (num_blocks, block_size, self.num_kv_heads, self.head_dim)
            return [shape, shape]
        return [(num_blocks, block_size, 1, self.latent_dim + self.rope_dim)]

    def scale_shapes(self, num_blocks: int, block_size: int) -> list[tuple[int, ...]]:
        """The shapes of one layer's scale tensors (an 8-bit cache's; none otherwise)."""
        return [(num_blocks, block_size, self.num_kv_heads)] * 2 if self.quantized else []

    def allocate(self, num_blocks: int, block_size: int, device: torch.device) -> KVCache:
        """Per layer: the value tensors, then (8-bit) the key and value scales."""
        layers = [LayerCache(*[zeros_lazily(shape, self.dtype, device)
                               for shape in self.block_shapes(num_blocks, block_size)],
                             *[zeros_lazily(shape, SCALE_DTYPE, device)
                               for shape in self.scale_shapes(num_blocks, block_size)])
                  for _ in range(self.num_layers)]
        return KVCache(self, num_blocks, block_size, layers)


class LayerCache(tuple):
    """One layer's cache tensors, as a tuple of those it holds (what a KV hand-over copies and the decode graph is
    given) with each one named. "kv" layout: `key` and `value` [num_blocks, block_size, kv_heads, head_dim], and in
    8 bits their scales `key_scale`, `value_scale` [num_blocks, block_size, kv_heads] (else None). "latent"
    layout: `key` alone, each token's [latent ; rope key] row [num_blocks, block_size, 1, latent + rope] (the whole
    row is the key, its latent part the value)."""

    def __new__(cls, key: torch.Tensor, value: Optional[torch.Tensor] = None,
                key_scale: Optional[torch.Tensor] = None, value_scale: Optional[torch.Tensor] = None):
        self = super().__new__(cls, [t for t in (key, value, key_scale, value_scale) if t is not None])
        self.key, self.value, self.key_scale, self.value_scale = key, value, key_scale, value_scale
        return self

    @property
    def scales(self) -> Optional[tuple[torch.Tensor, torch.Tensor]]:
        """(key scales, value scales) of an 8-bit cache; None for a full-precision one."""
        return None if self.key_scale is None else (self.key_scale, self.value_scale)

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(self)


@dataclass
class KVCache:
    """The allocated cache: `layers[i]` is layer i's LayerCache."""

    spec: KVCacheSpec
    num_blocks: int
    block_size: int
    layers: list[LayerCache]

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

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]


def zeros_lazily(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor; on CPU from memory whose pages the OS commits on first write (a GBs-sized cache costs
    nothing until used), asked for in transparent huge pages where the kernel gives them (madvise: Linux's
    default THP mode hands them out only on request). Each sequence's new blocks are first writes: with 4 KiB
    pages a decode step's KV stores fault in a fresh page per block per layer (a large share of a batch-1 step:
    docs/results/code-figures.md#kv-cache-pages); a 2 MiB page is one fault per ~170 of SmolLM2's 16-token blocks
    a layer."""
    if not Platform.of(device).host_memory:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = huge_page_zeros(nbytes) if nbytes >= HUGE_PAGE_BYTES else None
    if raw is None:
        return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)  # calloc'ed
    return raw.view(dtype).view(shape)

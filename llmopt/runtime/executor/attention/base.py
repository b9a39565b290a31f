"""Attention backends: how a layer writes this step's keys and values into the paged cache and attends over it.
One backend is chosen at engine start (`select_attention_backend`: by name, or the highest priority that accepts
the device, cache layout and numerics mode) and every attention layer calls it; its name goes into `llmopt env`,
the bench JSON and the server's /v1/models. A backend registers itself by its module being in this package.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from llmopt.core.errors import ConfigError
from llmopt.core.registry import Registry
from llmopt.runtime.executor.kernels.attention import AttentionMetadata, Scales

ATTENTION_BACKENDS: Registry[type] = Registry("attention backend")


def register_attention_backend(cls: type) -> type:
    return ATTENTION_BACKENDS.register(cls.name)(cls)


class AttentionBackend:
    """store(k, v, cache, meta): this step's keys / values into their slots; attend(q, cache, meta, scale, k, v):
    [T, heads, head_dim] outputs, each query over its sequence's cached keys up to its own position. `cache` is
    one layer's tuple of tensors (KVCache.layers[i]): (key, value), or in 8 bits (key, value, key scales, value
    scales)."""

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    layouts: ClassVar[tuple[str, ...]] = ("kv",)
    quantized_cache: ClassVar[bool] = True  # reads 8-bit caches (kernels/kv_quant.py)
    # its decode store and attention are the compiled CPU kernels a decode graph calls (models/decode_graph.py)
    decode_graph: ClassVar[bool] = False

    @classmethod
    def accepts(cls, device: torch.device, layout: str, fast: bool, quantized: bool = False) -> bool:
        """Whether it runs here: the cache layouts it reads (backends narrow it to a device or the fast path)."""
        return layout in cls.layouts and (cls.quantized_cache or not quantized)

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
              ) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata, scale: float,
               k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def cache_scales(cache: tuple[torch.Tensor, ...]) -> Scales:
    """An 8-bit layer cache's (key scales, value scales); None for a full-precision one."""
    return (cache[2], cache[3]) if len(cache) == 4 else None


def select_attention_backend(name: str, device: torch.device | str, layout: str, fast: bool,
                             quantized: bool = False) -> AttentionBackend:
    """The backend called `name` (refused if it cannot run here), or for "auto" the highest priority that
    accepts. quantized: the cache is 8-bit."""
    device = torch.device(device)
    cache = f"{'an 8-bit' if quantized else 'a'} {layout} cache"
    if name != "auto":
        backend = ATTENTION_BACKENDS.get(name)
        if not backend.accepts(device, layout, fast, quantized):
            raise ConfigError(f"--attention-backend {name} cannot run here ({device.type}, {cache}"
                              f"{', --no-fast-path' if not fast else ''}): choose auto", param="attention_backend")
        return backend()
    ranked = sorted((ATTENTION_BACKENDS.get(n) for n in ATTENTION_BACKENDS), key=lambda b: -b.priority)
    for backend in ranked:
        if backend.accepts(device, layout, fast, quantized):
            return backend()
    hint = ": choose --kv-cache-dtype auto" if quantized else ""
    raise ConfigError(f"no attention backend runs {cache} on {device.type}{hint}", param="kv_cache_dtype")

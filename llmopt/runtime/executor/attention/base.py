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
from llmopt.runtime.executor.kernels.attention import AttentionMetadata

ATTENTION_BACKENDS: Registry[type] = Registry("attention backend")


def register_attention_backend(cls: type) -> type:
    return ATTENTION_BACKENDS.register(cls.name)(cls)


class AttentionBackend:
    """store(k, v, cache, meta): this step's keys / values into their slots; attend(q, cache, meta, scale, k, v):
    [T, heads, head_dim] outputs, each query over its sequence's cached keys up to its own position. `cache` is
    one layer's tuple of tensors (KVCache.layers[i])."""

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    layouts: ClassVar[tuple[str, ...]] = ("kv",)

    @classmethod
    def accepts(cls, device: torch.device, layout: str, fast: bool) -> bool:
        """Whether it runs here: the cache layouts it reads (backends narrow it to a device or the fast path)."""
        return layout in cls.layouts

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata
              ) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, cache: tuple[torch.Tensor, ...], meta: AttentionMetadata, scale: float,
               k_new: torch.Tensor, v_new: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


def select_attention_backend(name: str, device: torch.device | str, layout: str, fast: bool) -> AttentionBackend:
    """The backend called `name` (refused if it cannot run here), or for "auto" the highest priority that
    accepts."""
    device = torch.device(device)
    if name != "auto":
        backend = ATTENTION_BACKENDS.get(name)
        if not backend.accepts(device, layout, fast):
            raise ConfigError(f"--attention-backend {name} cannot run here ({device.type}, {layout} cache"
                              f"{', --no-fast-path' if not fast else ''}): choose auto", param="attention_backend")
        return backend()
    ranked = sorted((ATTENTION_BACKENDS.get(n) for n in ATTENTION_BACKENDS), key=lambda b: -b.priority)
    for backend in ranked:
        if backend.accepts(device, layout, fast):
            return backend()
    raise ConfigError(f"no attention backend runs a {layout} cache on {device.type}")

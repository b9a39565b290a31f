"""Attention backends: how a layer writes this step's keys and values into the paged cache and attends over it.

A backend owns its work: it builds the step's metadata (`build_metadata`, once per step, read by every layer),
stores the new keys and values (`store`) and attends over the cache (`attend`) for each cache layout and dtype it
accepts. One backend is chosen at engine start (`select_attention_backend`: by name, or the highest priority that
accepts the device, the KV cache spec and the numerics mode) and every attention layer calls it; its name goes
into `llmopt env`, the bench JSON and the server's /v1/models. A backend registers itself by its module being in
this package: adding one is one new file.
"""

from __future__ import annotations

from typing import ClassVar, Optional

import torch

from llmopt.core.errors import ConfigError
from llmopt.core.registry import Registry
from llmopt.runtime.executor.attention.kv_cache import LayerCache
from llmopt.runtime.executor.attention.metadata import AttentionMetadata, DecodeGroup

ATTENTION_BACKENDS: Registry[type] = Registry("attention backend")

Scales = Optional[tuple[torch.Tensor, torch.Tensor]]  # an 8-bit cache's (key, value) scales [blocks, bs, kv_heads]


def register_attention_backend(cls: type) -> type:
    return ATTENTION_BACKENDS.register(cls.name)(cls)


class AttentionBackend:
    """store(k, v, cache, meta): this step's keys / values [T, kv_heads, head_dim] into their slots;
    attend(q, cache, meta, scale, k_new, v_new): [T, heads, head_dim] outputs, each query over its sequence's
    cached keys up to its own position. `cache` is one layer's LayerCache (its scales set in an 8-bit cache)."""

    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    device_type: ClassVar[Optional[str]] = None  # the one device type it runs on (None: any)
    layouts: ClassVar[tuple[str, ...]] = ("kv",)
    quantized_cache: ClassVar[bool] = True  # reads 8-bit caches (kernels/kv_quant.py)
    fast_only: ClassVar[bool] = False  # only on the fast path (the exact mode keeps the torch numerics)
    # its decode store and attention are the compiled CPU kernels a decode graph calls (models/decode_graph.py)
    decode_graph: ClassVar[bool] = False
    # a decode-only step's store and attention read only the metadata's tensors (no Python decision on their values,
    # nothing cached from them): the step can be captured as a graph and replayed (executor/step_graphs.py)
    captures: ClassVar[bool] = False

    @classmethod
    def accepts(cls, device: torch.device, layout: str, fast: bool, quantized: bool = False) -> bool:
        """Whether it runs here: its device, the cache layouts and dtypes it reads, the numerics mode."""
        return ((cls.device_type is None or device.type == cls.device_type) and layout in cls.layouts
                and (cls.quantized_cache or not quantized) and (fast or not cls.fast_only) and cls.available())

    @classmethod
    def available(cls) -> bool:
        """Whether its kernels exist in this environment (built, installed)."""
        return True

    def build_metadata(self, query_starts: list[int], context_lens: list[int], block_tables: list[list[int]],
                       slot_mapping: torch.Tensor, block_size: int, device: torch.device | str = "cpu"
                       ) -> AttentionMetadata:
        return AttentionMetadata.build(query_starts, context_lens, block_tables, slot_mapping, block_size, device)

    def graph_metadata(self, rows: int, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, block_size: int) -> AttentionMetadata:
        """A decode-only step of `rows` sequences over static tensors (a captured graph's, refilled before each
        replay): slot_mapping [rows], block_tables [rows, max_blocks], context_lens [rows]. (Its Python lists are
        placeholders: a backend that `captures` reads the tensors alone.)"""
        return AttentionMetadata(list(range(rows + 1)), [1] * rows, [[0]] * rows, slot_mapping, [],
                                 DecodeGroup(torch.arange(rows, device=slot_mapping.device), block_tables,
                                             context_lens, True, block_size))

    def store(self, k: torch.Tensor, v: torch.Tensor, cache: LayerCache, meta: AttentionMetadata) -> None:
        raise NotImplementedError

    def attend(self, q: torch.Tensor, cache: LayerCache, meta: AttentionMetadata, scale: float,
               k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


def select_attention_backend(name: str, device: torch.device | str, layout: str, fast: bool,
                             quantized: bool = False) -> AttentionBackend:
    """The backend called `name` (refused if it cannot run here), or for "auto" the highest priority that
    accepts. quantized: the cache is 8-bit (KVCacheSpec.quantized)."""
    device = torch.device(device)
    cache = f"{'an 8-bit' if quantized else 'a'} {layout} cache"
    if name != "auto":
        backend = ATTENTION_BACKENDS.get(name)
        if not backend.accepts(device, layout, fast, quantized):
            raise ConfigError(f"--attention-backend {name} cannot run here ({device}, {cache}"
                              f"{', --no-fast-path' if not fast else ''}): choose auto", param="attention_backend")
        return backend()
    ranked = sorted((ATTENTION_BACKENDS.get(n) for n in ATTENTION_BACKENDS), key=lambda b: -b.priority)
    for backend in ranked:
        if backend.accepts(device, layout, fast, quantized):
            return backend()
    hint = ": choose --kv-cache-dtype auto" if quantized else ""
    raise ConfigError(f"no attention backend runs {cache} on {device}{hint}", param="kv_cache_dtype")

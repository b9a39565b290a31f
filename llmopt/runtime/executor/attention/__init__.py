"""Attention backends (base.py: the contract; one module per backend), their per-step metadata (metadata.py) and
the KV cache (kv_cache.py); importing the package registers every backend module in it."""

from llmopt.core.registry import import_submodules
from llmopt.runtime.executor.attention.base import (  # noqa: F401
    ATTENTION_BACKENDS, AttentionBackend, register_attention_backend, select_attention_backend,
)
from llmopt.runtime.executor.attention.kv_cache import KVCache, KVCacheSpec, LayerCache  # noqa: F401
from llmopt.runtime.executor.attention.metadata import AttentionMetadata  # noqa: F401

import_submodules(__name__)

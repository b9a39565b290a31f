"""Attention backends and the KV cache (base.py, kv_cache.py); importing the package registers every backend
module in it."""

from llmopt.core.registry import import_submodules
from llmopt.runtime.executor.attention.base import (  # noqa: F401
    ATTENTION_BACKENDS, AttentionBackend, register_attention_backend, select_attention_backend,
)
from llmopt.runtime.executor.attention.kv_cache import KVCache, KVCacheSpec  # noqa: F401

import_submodules(__name__)

"""The reference backend: torch ops only (SDPA over gathered blocks). The exact mode (--no-fast-path) uses it, so
greedy tokens match transformers' in fp32; every faster backend is tested against it."""

from __future__ import annotations

from llmopt.runtime.executor.attention.base import AttentionBackend, cache_scales, register_attention_backend
from llmopt.runtime.executor.kernels.attention import reference_paged_attention, reference_store_kv


@register_attention_backend
class TorchAttention(AttentionBackend):
    name, priority, layouts = "torch", 0, ("kv",)

    def store(self, k, v, cache, meta):
        reference_store_kv(k, v, cache[0], cache[1], meta.slot_mapping, cache_scales(cache))

    def attend(self, q, cache, meta, scale, k_new, v_new):
        return reference_paged_attention(q, cache[0], cache[1], meta, scale, k_new, v_new, compiled=False,
                                         scales=cache_scales(cache))

"""The Triton backend on CUDA (kernels/triton_*): the slot store, split-KV decode and the prefill kernel over
every sequence of a step."""

from __future__ import annotations

from llmopt.runtime.executor.attention.base import AttentionBackend, cache_scales, register_attention_backend
from llmopt.runtime.executor.kernels.attention import triton_available, triton_paged_attention


@register_attention_backend
class TritonAttention(AttentionBackend):
    name, priority, layouts = "triton", 20, ("kv",)

    @classmethod
    def accepts(cls, device, layout, fast, quantized=False):
        return device.type == "cuda" and super().accepts(device, layout, fast, quantized) and triton_available()

    def store(self, k, v, cache, meta):
        from llmopt.runtime.executor.kernels.triton_store_kv import store_kv

        store_kv(k, v, cache[0], cache[1], meta.slot_mapping, cache_scales(cache))

    def attend(self, q, cache, meta, scale, k_new, v_new):
        return triton_paged_attention(q, cache[0], cache[1], meta, scale, cache_scales(cache))

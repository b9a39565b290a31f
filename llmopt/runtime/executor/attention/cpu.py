"""The compiled CPU backend (kernels/csrc/paged_attention_cpu.cpp): decodes read the paged blocks in place (8-bit
ones too), the store is one compiled copy (or quantization); prompts and prefill chunks attend through the compiled
prefill attention (csrc/prefill_attention_cpu.cpp: fresh prompts over this step's keys, chunks after a cached
prefix over the gathered blocks). The fast path's default on CPU."""

from __future__ import annotations

from llmopt.runtime.executor.attention.base import AttentionBackend, cache_scales, register_attention_backend
from llmopt.runtime.executor.kernels.attention import compiled_store_kv, reference_paged_attention
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops


@register_attention_backend
class CpuAttention(AttentionBackend):
    name, priority, layouts = "cpu", 10, ("kv",)
    decode_graph = True

    @classmethod
    def accepts(cls, device, layout, fast, quantized=False):
        # the exact mode keeps the reference (its decode rounding differs in the last bits)
        return (device.type == "cpu" and super().accepts(device, layout, fast, quantized) and fast
                and cpu_ops() is not None)

    def store(self, k, v, cache, meta):
        compiled_store_kv(k, v, cache[0], cache[1], meta.slot_mapping, cache_scales(cache))

    def attend(self, q, cache, meta, scale, k_new, v_new):
        return reference_paged_attention(q, cache[0], cache[1], meta, scale, k_new, v_new, compiled=True,
                                         scales=cache_scales(cache))

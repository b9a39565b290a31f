"""The compiled CPU backend: the torch backend with its kernels swapped for compiled ones. Decodes read the paged
blocks in place (kernels/csrc/paged_attention_cpu.cpp, 8-bit ones too), the store is one compiled copy (or
quantization); prompts and prefill chunks attend through the compiled prefill attention
(csrc/prefill_attention_cpu.cpp: fresh prompts over this step's keys, chunks after a cached prefix over the
gathered blocks). The fast path's default on CPU; the exact mode keeps the torch backend (its decode rounding
differs in the last bits)."""

from __future__ import annotations

import torch

from llmopt.runtime.executor.attention.base import Scales, register_attention_backend
from llmopt.runtime.executor.attention.kv_cache import LayerCache
from llmopt.runtime.executor.attention.metadata import DecodeGroup
from llmopt.runtime.executor.attention.torch_sdpa import TorchAttention, store_kv
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops


@register_attention_backend
class CpuAttention(TorchAttention):
    name, priority, layouts, device_type = "cpu", 10, ("kv",), "cpu"
    fast_only = True
    decode_graph = True
    captures = True  # (a decode reads block_tables and context_lens in the kernel)

    @classmethod
    def available(cls) -> bool:
        return cpu_ops() is not None

    def store(self, k, v, cache: LayerCache, meta) -> None:
        compiled_store_kv(k, v, cache.key, cache.value, meta.slot_mapping, cache.scales)

    def decode(self, q: torch.Tensor, cache: LayerCache, decode: DecodeGroup, scale: float) -> torch.Tensor:
        """The compiled decode over the blocks in place (8-bit codes as bytes, q and the output in q's dtype)."""
        ops = cpu_ops()
        k_cache, v_cache, scales = cache.key, cache.value, cache.scales
        if scales is not None:
            return ops.paged_decode_attention_quantized(
                q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), scales[0], scales[1], decode.block_tables,
                decode.context_lens, scale, k_cache.dtype == torch.float8_e4m3fn)
        # (an fp32 q over an fp16 / bf16 cache goes in as it is: the kernel reads it in fp32)
        same = q.dtype == k_cache.dtype or narrowing_cache(q.dtype, k_cache.dtype)
        out = ops.paged_decode_attention(q if same else q.to(k_cache.dtype), k_cache, v_cache, decode.block_tables,
                                         decode.context_lens, scale)
        return out if out.dtype == q.dtype else out.to(q.dtype)

    def prefill_kernel(self, q: torch.Tensor):
        return compiled_prefill_kernel(q)


def narrowing_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the compiled CPU store and decode take `dtype` tensors for a `cache_dtype` cache as they are: fp32
    keys, values and queries over an fp16 / bf16 cache, or those of the other 16-bit type (a bf16 model beside an
    fp16 cache, llama.cpp's default type). The store rounds each value as `.to()` does; the decode reads the
    queries in fp32 and rounds its output once to their dtype."""
    return dtype != cache_dtype and dtype in (torch.float32, torch.float16, torch.bfloat16) \
        and cache_dtype in (torch.float16, torch.bfloat16)


def compiled_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, scales: Scales = None) -> None:
    """The compiled CPU store where the layouts allow it (the same bits as torch_sdpa.store_kv: a copy, fp32
    rounded to a 16-bit cache as `.to()` rounds it, or in 8 bits the same quantization), else that store."""
    takes_dtype = scales is not None or k.dtype == k_cache.dtype or narrowing_cache(k.dtype, k_cache.dtype)
    if (k.dtype == v.dtype and takes_dtype and k.stride(-1) == v.stride(-1) == 1
            and k.stride(1) == v.stride(1) == k.shape[2]):
        ops = cpu_ops()
        if scales is None:
            return ops.store_kv_(k_cache, v_cache, k, v, slot_mapping)
        return ops.store_kv_quantized_(k_cache, v_cache, scales[0], scales[1], k, v, slot_mapping)
    store_kv(k, v, k_cache, v_cache, slot_mapping, scales)


def compiled_prefill_kernel(q: torch.Tensor):
    """The compiled CPU prefill attention (csrc/prefill_attention_cpu.cpp) for q, or None where it does not run (a
    build without vectors, a head_dim not a multiple of 16). Called as kernel(q [S * new, heads, hd], k, v [S * ctx,
    kv_heads, hd] in q's dtype, new, scale): each sequence's new queries causally over its ctx keys, the last new
    ones at the end (torch's SDPA computes a short prompt's whole score square; docs/results/kvcache.md has the
    kernel against it)."""
    if q.shape[-1] % 16 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    ops = cpu_ops()
    return ops.causal_prefill_attention if ops is not None and ops.vectorized() else None

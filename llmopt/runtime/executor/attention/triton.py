"""The Triton backend on CUDA (kernels/triton_*): the slot store, split-KV decode and the prefill kernel over
every sequence of a step. Its metadata carries the step's layout as device tensors, built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmopt.runtime.executor.attention.base import AttentionBackend, register_attention_backend
from llmopt.runtime.executor.attention.kv_cache import LayerCache
from llmopt.runtime.executor.attention.metadata import AttentionMetadata
from llmopt.runtime.executor.kernels.triton_support import triton_available


@dataclass
class TritonMetadata(AttentionMetadata):
    query_starts_tensor: torch.Tensor | None = None  # [num_seqs + 1] int32
    context_lens_tensor: torch.Tensor | None = None  # [num_seqs] int32
    block_tables_tensor: torch.Tensor | None = None  # [num_seqs, max_blocks] int32, padded with block 0
    max_new_tokens: int = 0  # the most new tokens of any sequence this step


@register_attention_backend
class TritonAttention(AttentionBackend):
    name, priority, layouts, device_type = "triton", 20, ("kv",), "cuda"
    captures = True  # (its kernels read the metadata's tensors; the decode's splits follow the tables' width)

    @classmethod
    def available(cls) -> bool:
        return triton_available()

    def build_metadata(self, query_starts, context_lens, block_tables, slot_mapping, block_size, device="cpu"
                       ) -> TritonMetadata:
        width = max(len(t) for t in block_tables)
        return TritonMetadata.build(
            query_starts, context_lens, block_tables, slot_mapping, block_size, device,
            query_starts_tensor=torch.tensor(query_starts, dtype=torch.int32, device=device),
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables_tensor=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                             device=device),
            max_new_tokens=max(b - a for a, b in zip(query_starts, query_starts[1:])))

    def graph_metadata(self, rows, slot_mapping, block_tables, context_lens, block_size) -> TritonMetadata:
        base = super().graph_metadata(rows, slot_mapping, block_tables, context_lens, block_size)
        return TritonMetadata(base.query_starts, base.context_lens, base.block_tables, slot_mapping, [], base.decode,
                              context_lens_tensor=context_lens, block_tables_tensor=block_tables, max_new_tokens=1)

    def store(self, k, v, cache: LayerCache, meta: TritonMetadata) -> None:
        from llmopt.runtime.executor.kernels.triton_store_kv import store_kv

        store_kv(k, v, cache.key, cache.value, meta.slot_mapping, cache.scales)

    def attend(self, q, cache: LayerCache, meta: TritonMetadata, scale: float, k_new=None, v_new=None):
        """Decode-only steps: the split-KV decode kernel; steps with prefill chunks: the prefill kernel over every
        sequence (a decode is a one-token chunk). An 8-bit cache's codes are decoded in registers."""
        from llmopt.runtime.executor.kernels.triton_decode_attention import decode_attention
        from llmopt.runtime.executor.kernels.triton_prefill_attention import prefill_attention

        if not meta.prefills:
            return decode_attention(q, cache.key, cache.value, meta.block_tables_tensor, meta.context_lens_tensor,
                                    scale, scales=cache.scales)
        new = meta.max_new_tokens
        return prefill_attention(q, cache.key, cache.value, meta.query_starts_tensor, meta.context_lens_tensor,
                                 meta.block_tables_tensor, scale, new, block_m=16 if new <= 16 else 64,
                                 scales=cache.scales)

"""Attention over the paged KV cache (prefill over a cached prefix + new tokens, and decode), and the KV
write into slots. Plain torch: the reference every faster kernel is tested against.

Shapes: q [T, num_heads, head_dim] for the T tokens of this step (sequences concatenated);
k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_starts: list[int]  # [num_seqs + 1] offsets of each sequence's new tokens in the flat batch
    context_lens: list[int]  # [num_seqs] tokens in the cache after this step (cached + new)
    block_tables: list[list[int]]  # [num_seqs][blocks]
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, num_kv_heads, head_dim] into their slots."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys; returns [T, num_heads, head_dim]."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    num_heads = q.shape[1]
    out = torch.empty_like(q)
    for i, ctx in enumerate(meta.context_lens):
        start, end = meta.query_starts[i], meta.query_starts[i + 1]
        num_new = end - start
        blocks = torch.tensor(meta.block_tables[i][: (ctx + block_size - 1) // block_size], dtype=torch.long)
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx]
        query_pos = torch.arange(ctx - num_new, ctx).unsqueeze(1)  # [new, 1]
        mask = torch.arange(ctx).unsqueeze(0) <= query_pos  # [new, ctx]
        o = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=mask, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[start:end] = o[0].transpose(0, 1)
    return out

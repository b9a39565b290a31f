"""Attention over a latent cache (DeepSeek's MLA), in torch: each token's cached row is [latent ; rope key]
(kv_lora_rank + qk_rope_head_dim values, one per token for all heads). With the key and value up-projections
absorbed into the query and output (models/deepseek.py), attention is multi-query attention whose key is the whole
row and whose value is its latent part: queries [T, heads, latent + rope] -> outputs [T, heads, latent]."""

from __future__ import annotations

import torch

from llmopt.runtime.executor.attention.base import AttentionBackend, register_attention_backend


@register_attention_backend
class LatentTorchAttention(AttentionBackend):
    name, priority, layouts = "latent-torch", 0, ("latent",)
    quantized_cache = False

    def store(self, latent, unused, cache, meta):
        """latent [T, 1, latent + rope] into its slots."""
        rows = cache.key.view(-1, cache.key.shape[-1])
        rows[meta.slot_mapping] = latent.reshape(latent.shape[0], -1).to(rows.dtype)

    def attend(self, q, cache, meta, scale, latent_new=None, unused=None):
        """q [T, heads, latent + rope]; each sequence's new queries over its cached rows, causally."""
        cached = cache.key
        num_blocks, block_size, _, width = cached.shape
        rows = cached.view(-1, width)
        value_width = self.value_width
        out = q.new_empty(q.shape[0], q.shape[1], value_width)
        for i, context in enumerate(meta.context_lens):
            start, end = meta.query_starts[i], meta.query_starts[i + 1]
            table = torch.tensor(meta.block_tables[i][: -(-context // block_size)], device=q.device)
            slots = (table[:, None] * block_size + torch.arange(block_size, device=q.device)).reshape(-1)[:context]
            kv = rows[slots].to(q.dtype)  # [context, latent + rope]
            scores = torch.einsum("thw,cw->htc", q[start:end], kv) * scale  # [heads, new, context]
            new = end - start
            query_pos = torch.arange(context - new, context, device=q.device)[:, None]
            scores = scores.masked_fill(torch.arange(context, device=q.device)[None, :] > query_pos, float("-inf"))
            weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
            out[start:end] = torch.einsum("htc,cv->thv", weights, kv[:, :value_width])
        return out

    value_width = 0  # set by the model: kv_lora_rank (the latent part of a row)

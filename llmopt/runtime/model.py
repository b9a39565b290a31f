"""The runtime's decoder for the Llama family (Llama, Mistral, Qwen2, Qwen3): one forward over the flat
batch of all scheduled tokens, attention over the paged KV cache.

It reads the weights of a loaded transformers model (any artifact llmopt reads: dense, dequantized
GPTQ / AWQ / compressed-tensors, pruned); norms and rotary embeddings are the model's own modules, so
numerics match transformers exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.core.adapters import adapter_for, get_module
from llmopt.core.errors import UnsupportedArchitectureError
from llmopt.runtime.kernels.attention import AttentionMetadata, paged_attention, store_kv

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RuntimeDecoder(nn.Module):
    def __init__(self, hf_model):
        super().__init__()
        config = hf_model.config
        adapter = adapter_for(hf_model)
        if adapter.family not in SUPPORTED:
            raise UnsupportedArchitectureError(
                f"the runtime supports {', '.join(SUPPORTED)}; {adapter.family} runs with --backend hf")
        self.config = config
        self.embed = get_module(hf_model, adapter.embed)
        self.layers = get_module(hf_model, adapter.layers)
        self.norm = get_module(hf_model, adapter.final_norm)
        self.lm_head = get_module(hf_model, adapter.lm_head)
        self.rotary = get_module(hf_model, adapter.layers.rsplit(".", 1)[0] + ".rotary_emb")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scale = self.head_dim ** -0.5

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        h = self.embed(input_ids)  # [T, H]
        cos, sin = self.rotary(h.unsqueeze(0), positions.unsqueeze(0))
        cos, sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, head_dim]
        num_tokens = input_ids.shape[0]
        for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
            k = attn.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            v = attn.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
            if hasattr(attn, "q_norm"):  # Qwen3: per-head RMSNorm before the rotation
                q, k = attn.q_norm(q), attn.k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            o = paged_attention(q, k_cache, v_cache, meta, self.scale)
            h = h + attn.o_proj(o.reshape(num_tokens, -1))
            x = layer.post_attention_layernorm(h)
            mlp = layer.mlp
            h = h + mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
        return self.norm(h)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

"""The runtime's model class for DeepSeek-V2 / V3 with multi-head latent attention (MLA).

Per token the cache holds only the compressed latent c = norm(kv_a(x))[:kv_lora_rank] and the rope key k_pe shared
by every head: kv_lora_rank + qk_rope_head_dim values per layer (a "latent" KVCacheSpec), against
2 x heads x head_dim for multi-head attention. Keys and values are never expanded: kv_b_proj's weight splits per
head into W_UK [nope, latent] and W_UV [v, latent], absorbed at load into the query and the output —

    score(t, j) = (W_UK^T q_nope) . c_j + q_pe . k_pe_j        o = W_UV (sum_j p_j c_j)

so attention runs over the latent rows (attention/latent_torch.py). Prefill and decode take the same path. Layers
with a mixture of experts are refused (core.adapters.ArchAdapter.unsupported).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.core.adapters import get_module
from llmopt.core.errors import UnsupportedArchitectureError
from llmopt.runtime.executor.attention import AttentionBackend, KVCache, KVCacheSpec
from llmopt.runtime.executor.kernels.attention import AttentionMetadata
from llmopt.runtime.executor.linear import fuse_linears
from llmopt.runtime.executor.models.layers import RMSNorm
from llmopt.runtime.executor.models.registry import register_model_family


def dense_weight(linear: nn.Module, in_features: int) -> torch.Tensor:
    """[out, in] fp32: the weight a linear (any linear method) multiplies by, read through the method itself."""
    dtype, device = (linear.weight.dtype, linear.weight.device) if isinstance(linear, nn.Linear) else (
        linear.dtype, next(linear.buffers()).device)
    eye = torch.eye(in_features, dtype=dtype, device=device)
    with torch.no_grad():
        out = linear(eye)
    bias = getattr(linear, "bias", None)
    if bias is not None:
        out = out - bias
    return out.float().t().contiguous()


class MlaRope(nn.Module):
    """Rotation of the rope dims: adjacent pairs (DeepSeek-V2's complex form, V3's rope_interleave) or the two
    halves (rotate_half). Queries and keys are rotated alike, so only their dot products matter."""

    def __init__(self, inv_freq: torch.Tensor, scaling: float, interleaved: bool):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.scaling, self.interleaved = scaling, interleaved

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, rope] -> rotated, same shape and dtype."""
        angles = positions[:, None].float() * self.inv_freq[None, :]  # [T, rope / 2]
        cos, sin = (angles.cos() * self.scaling)[:, None], (angles.sin() * self.scaling)[:, None]
        xf = x.float()
        a, b = (xf[..., 0::2], xf[..., 1::2]) if self.interleaved else xf.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


@dataclass
class MlaBlock:
    input_norm: RMSNorm
    post_norm: RMSNorm
    q_a: nn.Module | None  # None: full-rank q_proj in q_b
    q_a_norm: RMSNorm | None
    q_b: nn.Module
    kv_a: nn.Module
    kv_a_norm: RMSNorm
    w_uk: torch.Tensor  # [heads, nope, latent]
    w_uv: torch.Tensor  # [heads, v, latent]
    o_proj: nn.Module
    gate_up: nn.Module
    down_proj: nn.Module


@register_model_family("deepseek_v2", "deepseek_v3")
class DeepseekMlaDecoder(nn.Module):
    cache_layout = "latent"

    def __init__(self, hf_model, adapter, attention: AttentionBackend, fast: bool | None = None):
        super().__init__()
        config = hf_model.config
        reason = adapter.unsupported(config)
        if reason:
            raise UnsupportedArchitectureError(reason)
        param = next(hf_model.parameters())
        self.dtype, self.config = param.dtype, config
        self.fast = fast if fast is not None else param.device.type == "cpu"
        self.num_heads = config.num_attention_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.latent, self.v_dim = config.kv_lora_rank, config.v_head_dim
        self.attention = attention
        attention.value_width = self.latent
        self.embed = get_module(hf_model, adapter.embed)
        self.norm = RMSNorm.of(get_module(hf_model, adapter.final_norm))
        self.lm_head = get_module(hf_model, adapter.lm_head)
        self.logits_head = fuse_linears([self.lm_head], prepack=self.fast)
        layers = get_module(hf_model, adapter.layers)
        rotary = get_module(hf_model, adapter.layers.rsplit(".", 1)[0] + ".rotary_emb")
        interleaved = config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", False))
        self.rope = MlaRope(rotary.inv_freq.detach().clone(), float(getattr(rotary, "attention_scaling", 1.0)),
                            interleaved)
        self.scale = float(get_module(layers[0], adapter.attention).scaling)
        self.blocks = [self._block(layer) for layer in layers]
        self.num_layers = len(self.blocks)

    def _block(self, layer) -> MlaBlock:
        attn, mlp = layer.self_attn, layer.mlp
        heads = self.num_heads
        w = dense_weight(attn.kv_b_proj, self.latent).view(heads, self.nope + self.v_dim, self.latent)
        low_rank = getattr(attn, "q_a_proj", None) is not None
        return MlaBlock(
            RMSNorm.of(layer.input_layernorm), RMSNorm.of(layer.post_attention_layernorm),
            attn.q_a_proj if low_rank else None, RMSNorm.of(attn.q_a_layernorm) if low_rank else None,
            attn.q_b_proj if low_rank else attn.q_proj, attn.kv_a_proj_with_mqa, RMSNorm.of(attn.kv_a_layernorm),
            w[:, : self.nope].to(self.dtype).contiguous(), w[:, self.nope:].to(self.dtype).contiguous(),
            attn.o_proj, fuse_linears([mlp.gate_proj, mlp.up_proj], prepack=self.fast), mlp.down_proj)

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec("latent", self.num_layers, dtype, latent_dim=self.latent, rope_dim=self.rope_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_cache: KVCache) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        h = self.embed(input_ids)
        num_tokens, heads = input_ids.shape[0], self.num_heads
        for block, cache in zip(self.blocks, kv_cache):
            x = block.input_norm(h)
            q_in = block.q_a_norm(block.q_a(x)) if block.q_a is not None else x
            q = block.q_b(q_in).view(num_tokens, heads, self.nope + self.rope_dim)
            q_nope, q_pe = q[..., : self.nope], q[..., self.nope:]
            compressed = block.kv_a(x)  # [T, latent + rope]
            c = block.kv_a_norm(compressed[:, : self.latent])
            k_pe = self.rope(compressed[:, None, self.latent:], positions)  # [T, 1, rope]
            q_pe = self.rope(q_pe, positions)
            q_latent = torch.einsum("thn,hnl->thl", q_nope, block.w_uk)  # [T, heads, latent]
            row = torch.cat([c[:, None], k_pe], dim=-1)  # [T, 1, latent + rope]: what the cache keeps
            self.attention.store(row, None, cache, meta)
            o_latent = self.attention.attend(torch.cat([q_latent, q_pe], dim=-1), cache, meta, self.scale, row)
            o = torch.einsum("thl,hvl->thv", o_latent, block.w_uv).reshape(num_tokens, heads * self.v_dim)
            h = h + block.o_proj(o)
            x = block.post_norm(h)
            gate, up = block.gate_up(x).chunk(2, dim=-1)
            h = h + block.down_proj(F.silu(gate) * up)
        return self.norm(h)

    def logits(self, hidden: torch.Tensor, as_float: bool = True) -> torch.Tensor:
        logits = self.logits_head(hidden)
        return logits.float() if as_float else logits

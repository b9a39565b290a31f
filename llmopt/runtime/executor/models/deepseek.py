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

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmopt.core.adapters import adapter_for
from llmopt.core.errors import UnsupportedArchitectureError
from llmopt.runtime.executor.attention import AttentionBackend, KVCache, KVCacheSpec
from llmopt.runtime.executor.attention.metadata import AttentionMetadata
from llmopt.runtime.executor.linear import fuse_linears
from llmopt.runtime.executor.models.base import RuntimeDecoder
from llmopt.runtime.executor.models.weights import DecoderWeights, rope_tables
from llmopt.runtime.executor.models.registry import register_model_family


def dense_weight(linear: nn.Module, in_features: int) -> torch.Tensor:
    """[out, in] fp32: the weight a linear (any linear method) multiplies by, read through the method itself."""
    dtype, device = (linear.weight.dtype, linear.weight.device) if isinstance(linear, nn.Linear) else (
        linear.dtype, next(linear.buffers()).device)
    eye = torch.eye(in_features, dtype=dtype, device=device)
    with torch.no_grad():
        out = linear(eye)
    bias = linear.bias  # (nn.Linear and every linear method have one, None without)
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


class MlaBlock(nn.Module):
    """One layer: the query path (q_a -> norm -> q_b, or q_proj alone: q_a None), the latent path (kv_a -> norm),
    kv_b_proj split per head into W_UK [heads, nope, latent] and W_UV [heads, v, latent], o_proj, the MLP."""

    def __init__(self, input_norm, post_norm, q_a, q_a_norm, q_b, kv_a, kv_a_norm, w_uk, w_uv, o_proj, gate_up,
                 down_proj):
        super().__init__()
        self.input_norm, self.post_norm, self.q_a, self.q_a_norm, self.q_b = input_norm, post_norm, q_a, q_a_norm, q_b
        self.kv_a, self.kv_a_norm, self.o_proj = kv_a, kv_a_norm, o_proj
        self.gate_up, self.down_proj = gate_up, down_proj
        self.register_buffer("w_uk", w_uk)
        self.register_buffer("w_uv", w_uv)


def softmax_scale(config) -> float:
    """(qk_nope + qk_rope)^-0.5, times YaRN's mscale squared when the rope is scaled with mscale_all_dim (as
    transformers' DeepSeek attention computes it)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = dict(getattr(config, "rope_parameters", None) or {})
    if params.get("rope_type", "default") != "default" and params.get("mscale_all_dim"):
        factor = params["factor"]
        mscale = 1.0 if factor <= 1 else 0.1 * params["mscale_all_dim"] * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


@register_model_family("deepseek_v2", "deepseek_v3")
class DeepseekMlaDecoder(RuntimeDecoder):
    cache_layout = "latent"

    def __init__(self, config, weights, attention: AttentionBackend, fast: bool, dtype: torch.dtype,
                 device: torch.device):
        super().__init__()
        reason = adapter_for(config).unsupported(config)
        if reason:
            raise UnsupportedArchitectureError(reason)
        self.config, self.dtype, self.fast, self.attention = config, dtype, fast, attention
        self.num_heads = config.num_attention_heads
        self.nope, self.rope_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.latent, self.v_dim = config.kv_lora_rank, config.v_head_dim
        self.num_layers = config.num_hidden_layers
        attention.value_width = self.latent
        inv_freq, scaling = rope_tables(config)
        interleaved = config.model_type == "deepseek_v2" or bool(getattr(config, "rope_interleave", False))
        self.rope = MlaRope(inv_freq.to(device), scaling, interleaved)
        self.scale = softmax_scale(config)
        self._load(config, weights)
        self.logits_head = fuse_linears([self.lm_head], prepack=self.fast, pack_float32=True)

    def _load(self, config, weights) -> None:
        """A loader per checkpoint name (models/weights.py), then the blocks with kv_b_proj absorbed."""
        low_rank = config.q_lora_rank is not None
        linears = (["self_attn.q_a_proj", "self_attn.q_b_proj"] if low_rank else ["self_attn.q_proj"]) + [
            "self_attn.kv_a_proj_with_mqa", "self_attn.kv_b_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj"]
        norms = ["input_layernorm", "post_attention_layernorm", "self_attn.kv_a_layernorm"] + (
            ["self_attn.q_a_layernorm"] if low_rank else [])
        shared = DecoderWeights(config)
        slots = []
        for i in range(self.num_layers):
            slots.append({name: shared.linear(f"model.layers.{i}.{name}") for name in linears})
            for norm in norms:
                shared.keep(f"model.layers.{i}.{norm}.weight")
        self.embed, self.norm, self.lm_head = shared.load(weights)
        blocks = []
        for i, layer in enumerate(slots):
            built = {name: shared.build(slot) for name, slot in layer.items()}
            blocks.append(self._block(built, {n: shared.norm(f"model.layers.{i}.{n}") for n in norms}, low_rank))
        self.linear_methods = shared.linear_methods
        self.blocks = nn.ModuleList(blocks)

    def _block(self, linears: dict, norms: dict, low_rank: bool) -> MlaBlock:
        w = dense_weight(linears["self_attn.kv_b_proj"], self.latent).view(
            self.num_heads, self.nope + self.v_dim, self.latent)
        return MlaBlock(
            norms["input_layernorm"], norms["post_attention_layernorm"],
            linears["self_attn.q_a_proj"] if low_rank else None, norms.get("self_attn.q_a_layernorm"),
            linears["self_attn.q_b_proj" if low_rank else "self_attn.q_proj"], linears["self_attn.kv_a_proj_with_mqa"],
            norms["self_attn.kv_a_layernorm"], w[:, : self.nope].to(self.dtype).contiguous(),
            w[:, self.nope:].to(self.dtype).contiguous(), linears["self_attn.o_proj"],
            fuse_linears([linears["mlp.gate_proj"], linears["mlp.up_proj"]], prepack=self.fast),
            linears["mlp.down_proj"])

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

"""The torch backend: torch ops only (SDPA over gathered blocks), on any device. The exact mode (--no-fast-path)
uses it, so greedy tokens match transformers' in fp32; every faster backend is tested against it, and the compiled
CPU backend (cpu.py) is this one with its decode, store and prefill kernels swapped in.

Shapes: q [T, num_heads, head_dim] for the T tokens of this step (sequences concatenated); the cache's key and
value [num_blocks, block_size, num_kv_heads, head_dim].

An 8-bit cache's values are what attention sees everywhere: this step's keys and values are taken as the cache
holds them (fake_quantize_kv), so a prompt attends to the same numbers whether its prefix was just computed, came
from the prefix cache or from an earlier chunk.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.attention.base import AttentionBackend, Scales, register_attention_backend
from llmopt.runtime.executor.attention.kv_cache import LayerCache
from llmopt.runtime.executor.attention.metadata import AttentionMetadata, DecodeGroup, PrefillGroup
from llmopt.runtime.executor.kernels.kv_quant import dequantize_kv, fake_quantize_kv, quantize_kv

# Prefill chunks after a cached prefix of at least this many tokens attend without a [chunk, context] mask
# (attend_after_prefix: two tiled kernels merged by log-sum-exp); shorter ones through one masked SDPA, whose
# fixed cost is lower and whose mask is small.
TILED_MIN_CHUNK = 128


@register_attention_backend
class TorchAttention(AttentionBackend):
    name, priority, layouts = "torch", 0, ("kv",)

    def store(self, k, v, cache: LayerCache, meta: AttentionMetadata) -> None:
        store_kv(k, v, cache.key, cache.value, meta.slot_mapping, cache.scales)

    def attend(self, q, cache: LayerCache, meta: AttentionMetadata, scale: float, k_new=None, v_new=None):
        """Causal attention of each sequence's new queries over its cached keys; returns [T, num_heads, head_dim].

        k_new, v_new [T, num_kv_heads, head_dim]: this step's keys and values (already stored): prompts with
        nothing cached before attend over them directly, equal-length ones in one batched causal attention (a
        2048-token chunk of 128-token prompts: one call per layer instead of 16 gathers, masks and calls)."""
        k_cache, v_cache, scales = cache.key, cache.value, cache.scales
        decode = meta.decode
        if decode is not None and decode.contiguous and not meta.prefills:
            return self.decode(q, cache, decode, scale)
        out = torch.empty_like(q)
        if decode is not None:
            out[decode.rows] = self.decode(q[decode.rows], cache, decode, scale)
        prefills = meta.prefills
        prefill_kernel = self.prefill_kernel(q)
        if k_new is None or (scales is None and k_new.dtype != k_cache.dtype) or q.device.type != "cpu":
            # (callers without this step's keys, and devices without the tiled CPU kernel: one masked SDPA each, or
            # the prefill kernel over the gathered blocks)
            for p in prefills:
                out[p.start:p.end] = attend_masked(q[p.start:p.end], cache, p, scale, prefill_kernel)
            return out
        runs, prefills = fresh_runs(prefills)
        if scales is not None and (runs or (prefill_kernel is None and any(tiled(p) for p in prefills))):
            # this step's keys are attended directly (the compiled kernel reads a prefixed chunk's from the cache):
            # taken as the cache holds them
            k_new, v_new = (fake_quantize_kv(x, c.dtype).to(q.dtype) for x, c in ((k_new, k_cache), (v_new, v_cache)))
        for start, count, length in runs:
            end = start + count * length
            out[start:end] = attend_fresh(q[start:end], k_new[start:end], v_new[start:end], count, length, scale,
                                          prefill_kernel)
        for p in prefills:
            if prefill_kernel is not None:  # (no mask, no square of the chunk: the kernel stops at each row's limit)
                out[p.start:p.end] = attend_masked(q[p.start:p.end], cache, p, scale, prefill_kernel)
            elif tiled(p):
                out[p.start:p.end] = attend_after_prefix(q[p.start:p.end], k_new[p.start:p.end],
                                                         v_new[p.start:p.end], cache, p, scale)
            else:  # a short chunk: its mask is small, one SDPA costs less
                out[p.start:p.end] = attend_masked(q[p.start:p.end], cache, p, scale)
        return out

    def decode(self, q: torch.Tensor, cache: LayerCache, decode: DecodeGroup, scale: float) -> torch.Tensor:
        """q [B, num_heads, head_dim] -> [B, num_heads, head_dim], each over its own cached keys: one SDPA over the
        gathered blocks with the padding masked."""
        num_seqs, width = decode.block_tables.shape
        block_size, num_kv_heads, head_dim = cache.key.shape[1:]
        # index_select over whole blocks is a plain memcpy per block, several times faster than advanced
        # indexing; -> [B, kv_heads, blocks * block_size, hd]
        flat = decode.block_tables.reshape(-1)
        k, v = (x.view(num_seqs, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
                for x in gather_keys_values(cache, flat, q.dtype))
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=decode.mask,
                                           scale=scale, enable_gqa=q.shape[1] != num_kv_heads)
        return o[:, :, 0]

    def prefill_kernel(self, q: torch.Tensor):
        """A kernel that attends prompts and chunks without a mask (cpu.compiled_prefill_kernel's contract), or
        None: the torch ops."""
        return None


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales: Scales = None) -> None:
    """Write k, v [T, num_kv_heads, head_dim] into their slots; an 8-bit cache (`scales` given) gets their codes
    and scales (kv_quant.quantize_kv)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if scales is None:
        k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)
        return
    for x, cache, scale in ((k, k_cache, scales[0]), (v, v_cache, scales[1])):
        codes, vector_scales = quantize_kv(x, cache.dtype)
        # (float8 tensors take no index_put: write their bytes)
        cache.view(torch.uint8).view(-1, num_kv_heads, head_dim)[slot_mapping] = codes.view(torch.uint8)
        scale.view(-1, num_kv_heads)[slot_mapping] = vector_scales


def gather_kv(cache: torch.Tensor, scale: torch.Tensor | None, block_ids: torch.Tensor, dtype: torch.dtype
              ) -> torch.Tensor:
    """The rows of whole blocks [len(block_ids) * block_size, kv_heads, head_dim] in dtype (an 8-bit cache's
    dequantized: only these blocks, never the whole cache)."""
    num_kv_heads, head_dim = cache.shape[2:]
    rows = cache.index_select(0, block_ids) if cache.dtype != torch.float8_e4m3fn else (
        cache.view(torch.uint8).index_select(0, block_ids).view(cache.dtype))
    rows = rows.reshape(-1, num_kv_heads, head_dim)
    if scale is None:
        return rows.to(dtype)
    return dequantize_kv(rows, scale.index_select(0, block_ids).reshape(-1, num_kv_heads), dtype)


def gather_keys_values(cache: LayerCache, block_ids: torch.Tensor, dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv of the key and the value cache: (keys, values) [len(block_ids) * block_size, kv_heads, hd]."""
    return (gather_kv(cache.key, cache.key_scale, block_ids, dtype),
            gather_kv(cache.value, cache.value_scale, block_ids, dtype))


def fresh_runs(prefills: list[PrefillGroup]) -> tuple[list[tuple[int, int, int]], list[PrefillGroup]]:
    """Split prefills into runs of sequences with nothing cached before this step, of one length and adjacent in
    the flat batch ([(start, count, length)]: one batched causal attention each), and the rest."""
    runs, rest = [], []
    for p in prefills:
        length = p.end - p.start
        if p.context_len != length:
            rest.append(p)
        elif runs and runs[-1][2] == length and runs[-1][0] + runs[-1][1] * length == p.start:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, length)
        else:
            runs.append((p.start, 1, length))
    return runs, rest


def tiled(p: PrefillGroup) -> bool:
    """Whether a chunk after a cached prefix attends through attend_after_prefix (else attend_masked)."""
    return p.end - p.start >= TILED_MIN_CHUNK


def attend_fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, count: int, length: int, scale: float,
                 prefill_kernel=None) -> torch.Tensor:
    """`count` prompts of `length` tokens with nothing cached before, adjacent in q [count * length, heads, hd],
    causally over their own keys k, v [count * length, kv_heads, hd]."""
    if prefill_kernel is not None:
        return prefill_kernel(q, k.to(q.dtype), v.to(q.dtype), length, scale)
    num_heads, head_dim = q.shape[1:]
    # [count, heads, length, head_dim] views of the flat batch
    qb, kb, vb = (t.view(count, length, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))
    o = F.scaled_dot_product_attention(qb, kb.to(q.dtype), vb.to(q.dtype), is_causal=True, scale=scale,
                                       enable_gqa=num_heads != k.shape[1])
    return o.transpose(1, 2).reshape(count * length, num_heads, head_dim)


def attend_masked(q: torch.Tensor, cache: LayerCache, p: PrefillGroup, scale: float, prefill_kernel=None
                  ) -> torch.Tensor:
    """q [new, heads, hd] over the sequence's gathered blocks with its [new, context] causal mask (or, given a
    prefill kernel, through it: the same causal limits without a mask)."""
    k, v = (x[: p.context_len] for x in gather_keys_values(cache, p.block_ids, q.dtype))
    if prefill_kernel is not None:
        return prefill_kernel(q, k, v, q.shape[0], scale)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=p.mask, scale=scale,
                                       enable_gqa=q.shape[1] != cache.key.shape[2])
    return o[0].transpose(0, 1)


def attend_after_prefix(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cache: LayerCache,
                        p: PrefillGroup, scale: float) -> torch.Tensor:
    """A prefill chunk after a cached prefix, without a [new, context] mask or score matrix: the new queries
    q [new, heads, hd] over the prefix's keys (no mask) and, causally, over their own (k_new, v_new [new,
    kv_heads, hd]), each through a tiled (flash) attention kernel that returns its log-sum-exp; the two halves
    are merged by those. Memory: the prefix's rows once, never the square of the chunk."""
    new, num_heads, head_dim = q.shape
    num_kv_heads = cache.key.shape[2]
    group = num_heads // num_kv_heads
    prefix_len = p.context_len - new
    prefix_blocks = p.block_ids[: -(-prefix_len // cache.key.shape[1])]
    k, v = (x[:prefix_len] for x in gather_keys_values(cache, prefix_blocks, q.dtype))
    # prefix: no mask, so each KV head's query rows (its group's heads x new tokens) attend together
    q_grouped = q.view(new, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(1, num_kv_heads,
                                                                                         group * new, head_dim)
    o_prefix, lse_prefix = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_grouped, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0), 0.0, False, scale=scale)[:2]
    o_prefix = o_prefix.reshape(num_heads, new, head_dim)  # rows were (group, new) per KV head
    lse_prefix = lse_prefix.reshape(num_heads, new)
    # the chunk itself, causally: its keys repeated per query head (the chunk's rows only)
    k_heads, v_heads = (x.to(q.dtype).repeat_interleave(group, dim=1).transpose(0, 1).unsqueeze(0)
                        for x in (k_new, v_new))
    o_chunk, lse_chunk = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1).unsqueeze(0), k_heads, v_heads, 0.0, True, scale=scale)[:2]
    o_chunk, lse_chunk = o_chunk[0], lse_chunk[0]  # [heads, new, hd], [heads, new]
    # softmax over both halves: weights exp(lse_half - lse_total)
    lse = torch.logaddexp(lse_prefix, lse_chunk)
    merged = (o_prefix.float() * torch.exp(lse_prefix - lse)[..., None]
              + o_chunk.float() * torch.exp(lse_chunk - lse)[..., None])
    return merged.to(q.dtype).transpose(0, 1)

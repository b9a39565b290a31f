"""Attention over the paged KV cache (prefill over a cached prefix + new tokens, and decode), and the KV
write into slots. Plain torch: the reference every faster kernel is tested against.

Shapes: q [T, num_heads, head_dim] for the T tokens of this step (sequences concatenated);
k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim].

On CUDA tensors the Triton kernels (triton_store_kv, triton_decode_attention, triton_prefill_attention) run
instead; on CPU, decodes go to the compiled kernel (csrc/paged_attention_cpu.cpp) that reads the blocks in
place: by default for bf16/fp16 caches, and for fp32 when the caller asks (`compiled=True`: the runtime's fast
mode, whose prompts and prefill chunks also go to the compiled prefill attention, csrc/prefill_attention_cpu.cpp).
These functions stay their reference (and the exact fp32 mode, which must match transformers token for
token, keeps them).

Per step the metadata is built once (`AttentionMetadata.build`) and read by every layer: sequences whose
step is a single token (decodes) are attended together in one padded batch; sequences with several new
tokens (prefill chunks) one by one, each with its causal mask over cached + new tokens; a few new tokens after a
cached prefix (speculative verification) become decode rows, each over the keys up to its own position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Optional

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
from llmopt.runtime.executor.kernels.kv_quant import dequantize_kv, fake_quantize_kv, quantize_kv


# Prefill chunks after a cached prefix of at least this many tokens attend without a [chunk, context] mask
# (_attend_after_prefix: two tiled kernels merged by log-sum-exp); shorter ones through one masked SDPA, whose
# fixed cost is lower (a 20-token chunk: ~0.1 ms less per layer) and whose mask is small.
TILED_MIN_CHUNK = 128

# Sequences with at most this many new tokens after a cached prefix attend as decode rows (batched with the
# decodes, through the compiled kernel on CPU) instead of one masked SDPA per sequence.
MAX_QUERIES_AS_DECODES = 8


@dataclass
class PrefillGroup:
    start: int  # offset of the sequence's new tokens in the flat batch
    end: int
    block_ids: torch.Tensor  # [ceil(context_len / block_size)]
    context_len: int
    mask: torch.Tensor  # [new, context_len] bool, causal over cached + new tokens


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [B] positions in the flat batch of the single new token of each sequence
    block_tables: torch.Tensor  # [B, max_blocks] (padded with block 0; the mask hides the padding)
    context_lens: torch.Tensor  # [B] int64
    contiguous: bool  # rows are 0..B-1 in order (no gather/scatter needed)
    block_size: int

    @cached_property
    def mask(self) -> torch.Tensor:
        """[B, 1, 1, max_blocks * block_size] bool: slot < context_len. Only the torch path reads it (the compiled
        kernels read context_lens): made on first use, not every step (four ops at ~10 us each)."""
        slots = torch.arange(self.block_tables.shape[1] * self.block_size, device=self.context_lens.device)
        return (slots.unsqueeze(0) < self.context_lens.unsqueeze(1))[:, None, None, :]


@dataclass
class AttentionMetadata:
    query_starts: list[int]  # [num_seqs + 1] offsets of each sequence's new tokens in the flat batch
    context_lens: list[int]  # [num_seqs] tokens in the cache after this step (cached + new)
    block_tables: list[list[int]]  # [num_seqs][blocks]
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) of each new token
    prefills: list[PrefillGroup]
    decode: DecodeGroup | None
    device_tensors: dict | None  # CUDA: query_starts, context_lens, padded block_tables as tensors

    @classmethod
    def build(cls, query_starts: list[int], context_lens: list[int], block_tables: list[list[int]],
              slot_mapping: torch.Tensor, block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        prefills, decode_rows, decode_tables, decode_lens = [], [], [], []
        for i, ctx in enumerate(context_lens):
            start, end = query_starts[i], query_starts[i + 1]
            num_blocks = (ctx + block_size - 1) // block_size
            if end - start == 1 or (end - start <= MAX_QUERIES_AS_DECODES and ctx > end - start):
                # a decode, or a few new tokens after a cached prefix (speculative verification, a short chunk):
                # each query row attends as a decode over the keys up to its own position
                table = block_tables[i][:num_blocks]
                for row in range(start, end):
                    decode_rows.append(row)
                    decode_tables.append(table)
                    decode_lens.append(ctx - (end - 1 - row))
                continue
            query_pos = torch.arange(ctx - (end - start), ctx, device=device).unsqueeze(1)
            mask = torch.arange(ctx, device=device).unsqueeze(0) <= query_pos
            prefills.append(PrefillGroup(start, end, torch.tensor(block_tables[i][:num_blocks], device=device),
                                         ctx, mask))
        decode = None
        if decode_rows:
            width = max(len(t) for t in decode_tables)
            tables = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables], device=device)
            lens = torch.tensor(decode_lens, device=device)
            decode = DecodeGroup(torch.tensor(decode_rows, device=device), tables, lens,
                                 decode_rows == list(range(len(decode_rows))), block_size)
        device_tensors = None
        if torch.device(device).type == "cuda":
            width = max(len(t) for t in block_tables)
            device_tensors = {
                "query_starts": torch.tensor(query_starts, dtype=torch.int32, device=device),
                "context_lens": torch.tensor(context_lens, dtype=torch.int32, device=device),
                "block_tables": torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                             device=device),
                "max_new_tokens": max(b - a for a, b in zip(query_starts, query_starts[1:])),
            }
        return cls(query_starts, context_lens, block_tables, slot_mapping, prefills, decode, device_tensors)


@lru_cache(maxsize=1)
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, scales: Scales = None
                           ) -> torch.Tensor:
    """Decode-only steps: the split-KV decode kernel; steps with prefill chunks: the prefill kernel over every
    sequence (a decode is a one-token chunk). scales: an 8-bit cache's (its codes decoded in registers)."""
    from llmopt.runtime.executor.kernels.triton_decode_attention import decode_attention
    from llmopt.runtime.executor.kernels.triton_prefill_attention import prefill_attention

    t = meta.device_tensors
    if not meta.prefills:
        return decode_attention(q, k_cache, v_cache, t["block_tables"], t["context_lens"], scale, scales=scales)
    return prefill_attention(q, k_cache, v_cache, t["query_starts"], t["context_lens"], t["block_tables"], scale,
                             t["max_new_tokens"], block_m=16 if t["max_new_tokens"] <= 16 else 64, scales=scales)


Scales = Optional[tuple[torch.Tensor, torch.Tensor]]  # an 8-bit cache's (key, value) scales [blocks, bs, kv_heads]


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales: Scales = None) -> None:
    """Write k, v [T, num_kv_heads, head_dim] into their slots (Triton on CUDA, the compiled copy on CPU); an
    8-bit cache (`scales` given) gets their codes and scales (kv_quant.quantize_kv)."""
    if k_cache.is_cuda and triton_available():
        from llmopt.runtime.executor.kernels.triton_store_kv import store_kv as triton_store_kv

        return triton_store_kv(k, v, k_cache, v_cache, slot_mapping, scales)
    return compiled_store_kv(k, v, k_cache, v_cache, slot_mapping, scales)


def narrowing_cache(dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the compiled CPU store and decode take `dtype` tensors for a `cache_dtype` cache as they are: fp32
    keys, values and queries over an fp16 / bf16 cache, or those of the other 16-bit type (a bf16 model beside an
    fp16 cache, llama.cpp's default type). The store rounds each value as `.to()` does; the decode reads the
    queries in fp32 and rounds its output once to their dtype."""
    return dtype != cache_dtype and dtype in (torch.float32, torch.float16, torch.bfloat16) \
        and cache_dtype in (torch.float16, torch.bfloat16)


def compiled_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, scales: Scales = None) -> None:
    """The compiled CPU store where the layouts allow it (the same bits as the reference: a copy, fp32 rounded to
    a 16-bit cache as `.to()` rounds it, or in 8 bits the same quantization)."""
    if (k_cache.device.type == "cpu" and k.dtype == v.dtype and (scales is not None or k.dtype == k_cache.dtype
                                                                 or narrowing_cache(k.dtype, k_cache.dtype))
            and k.stride(-1) == v.stride(-1) == 1 and k.stride(1) == v.stride(1) == k.shape[2]):
        ops = cpu_ops()
        if ops is not None:
            if scales is None:
                return ops.store_kv_(k_cache, v_cache, k, v, slot_mapping)
            return ops.store_kv_quantized_(k_cache, v_cache, scales[0], scales[1], k, v, slot_mapping)
    reference_store_kv(k, v, k_cache, v_cache, slot_mapping, scales)


def reference_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, scales: Scales = None) -> None:
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


def gather_keys_values(k_cache: torch.Tensor, v_cache: torch.Tensor, scales: Scales, block_ids: torch.Tensor,
                       dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """gather_kv of the key and the value cache: (keys, values) [len(block_ids) * block_size, kv_heads, hd]."""
    return (gather_kv(k_cache, None if scales is None else scales[0], block_ids, dtype),
            gather_kv(v_cache, None if scales is None else scales[1], block_ids, dtype))


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeGroup,
                    scale: float, compiled: bool | None = None, scales: Scales = None) -> torch.Tensor:
    """q [B, num_heads, head_dim] -> [B, num_heads, head_dim], each over its own cached keys. compiled: use the
    CPU kernel (None: for half-precision and 8-bit caches only)."""
    if compiled is None:
        compiled = k_cache.dtype != torch.float32
    if compiled and k_cache.device.type == "cpu":
        ops = cpu_ops()
        if ops is not None and scales is not None:
            # the 8-bit blocks read in place: the codes as bytes, q and the output in q's dtype
            return ops.paged_decode_attention_quantized(
                q, k_cache.view(torch.uint8), v_cache.view(torch.uint8), scales[0], scales[1], decode.block_tables,
                decode.context_lens, scale, k_cache.dtype == torch.float8_e4m3fn)
        if ops is not None:
            # (an fp32 q over an fp16 / bf16 cache goes in as it is: the kernel reads it in fp32)
            same = q.dtype == k_cache.dtype or narrowing_cache(q.dtype, k_cache.dtype)
            out = ops.paged_decode_attention(q if same else q.to(k_cache.dtype), k_cache,
                                             v_cache, decode.block_tables, decode.context_lens, scale)
            return out if out.dtype == q.dtype else out.to(q.dtype)
    num_seqs, width = decode.block_tables.shape
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    # index_select over whole blocks is a plain memcpy per block, several times faster than advanced indexing;
    # -> [B, kv_heads, blocks * block_size, hd]
    flat = decode.block_tables.reshape(-1)
    k, v = (x.view(num_seqs, width * block_size, num_kv_heads, head_dim).transpose(1, 2)
            for x in gather_keys_values(k_cache, v_cache, scales, flat, q.dtype))
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=decode.mask,
                                       scale=scale, enable_gqa=q.shape[1] != num_kv_heads)
    return o[:, :, 0]


def _fresh_runs(prefills: list[PrefillGroup]) -> tuple[list[tuple[int, int, int]], list[PrefillGroup]]:
    """Split prefills into runs of sequences with nothing cached before this step, of one length and adjacent in
    the flat batch ([(start, count, length)]: one batched causal SDPA each), and the rest."""
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


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                    compiled: bool | None = None, scales: Scales = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys; returns [T, num_heads, head_dim].

    k_new, v_new [T, num_kv_heads, head_dim]: this step's keys and values (already stored): prompts with nothing
    cached before attend over them directly, equal-length ones in one batched causal SDPA (a 2048-token chunk of
    128-token prompts: one call per layer instead of 16 gathers, masks and calls). compiled: decodes through the
    CPU kernel (None: for half-precision and 8-bit caches only). scales: an 8-bit cache's. On CUDA with Triton:
    the Triton kernels."""
    if meta.device_tensors is not None and triton_available():
        return triton_paged_attention(q, k_cache, v_cache, meta, scale, scales)
    return reference_paged_attention(q, k_cache, v_cache, meta, scale, k_new, v_new, compiled, scales)


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                              compiled: bool | None = None, scales: Scales = None) -> torch.Tensor:
    """paged_attention in torch (decodes through the compiled CPU kernel when `compiled`; with compiled=True the
    prompts and chunks through the compiled prefill attention too, compiled_prefill_kernel).

    An 8-bit cache's values are what attention sees everywhere: this step's keys and values are taken as the
    cache holds them (fake_quantize_kv), so a prompt attends to the same numbers whether its prefix was just
    computed, came from the prefix cache or from an earlier chunk."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_heads = q.shape[1]
    if meta.decode is not None and meta.decode.contiguous and not meta.prefills:
        return _attend_decodes(q, k_cache, v_cache, meta.decode, scale, compiled, scales)
    out = torch.empty_like(q)
    if meta.decode is not None:
        rows = meta.decode.rows
        out[rows] = _attend_decodes(q[rows], k_cache, v_cache, meta.decode, scale, compiled, scales)
    prefills = meta.prefills
    prefill_kernel = compiled_prefill_kernel(q) if compiled else None
    if k_new is None or (scales is None and k_new.dtype != k_cache.dtype) or q.device.type != "cpu":
        # (callers without this step's keys, and devices without the tiled CPU kernel: one masked SDPA each, or the
        # compiled prefill kernel over the gathered blocks)
        for p in prefills:
            out[p.start:p.end] = _attend_masked(q[p.start:p.end], k_cache, v_cache, p, scale, scales, prefill_kernel)
        return out
    runs, prefills = _fresh_runs(prefills)
    if scales is not None and (runs or (prefill_kernel is None and any(_tiled(p) for p in prefills))):
        # this step's keys are attended directly (the compiled kernel reads a prefixed chunk's from the cache):
        # taken as the cache holds them
        k_new, v_new = (fake_quantize_kv(x, c.dtype).to(q.dtype) for x, c in ((k_new, k_cache), (v_new, v_cache)))
    for start, count, length in runs:
        end = start + count * length
        if prefill_kernel is not None:
            out[start:end] = prefill_kernel(q[start:end], k_new[start:end].to(q.dtype), v_new[start:end].to(q.dtype),
                                            length, scale)
            continue
        # [count, heads, length, head_dim] views of the flat batch
        qb, kb, vb = (t[start:end].view(count, length, t.shape[1], head_dim).transpose(1, 2)
                      for t in (q, k_new, v_new))
        o = F.scaled_dot_product_attention(qb, kb.to(q.dtype), vb.to(q.dtype), is_causal=True, scale=scale,
                                           enable_gqa=num_heads != num_kv_heads)
        out[start:end] = o.transpose(1, 2).reshape(end - start, num_heads, head_dim)
    for p in prefills:
        if prefill_kernel is not None:  # (no mask, no square of the chunk: the kernel stops at each row's limit)
            out[p.start:p.end] = _attend_masked(q[p.start:p.end], k_cache, v_cache, p, scale, scales, prefill_kernel)
        elif _tiled(p):
            out[p.start:p.end] = _attend_after_prefix(q[p.start:p.end], k_new[p.start:p.end], v_new[p.start:p.end],
                                                      k_cache, v_cache, p, scale, scales)
        else:  # a short chunk: its mask is small, one SDPA costs less
            out[p.start:p.end] = _attend_masked(q[p.start:p.end], k_cache, v_cache, p, scale, scales)
    return out


def compiled_prefill_kernel(q: torch.Tensor):
    """The compiled CPU prefill attention (csrc/prefill_attention_cpu.cpp) for q, or None where it does not run (a
    device other than the CPU, a build without vectors, a head_dim not a multiple of 16). Called as
    kernel(q [S * new, heads, hd], k, v [S * ctx, kv_heads, hd] in q's dtype, new, scale): each sequence's new
    queries causally over its ctx keys, the last new ones at the end. Against torch's SDPA (which computes a
    short prompt's whole score square): ~2x faster at 128-512 tokens on 2 cores."""
    if q.device.type != "cpu" or q.shape[-1] % 16 or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    ops = cpu_ops()
    return ops.causal_prefill_attention if ops is not None and ops.vectorized() else None


def _tiled(p: PrefillGroup) -> bool:
    """Whether a chunk after a cached prefix attends through _attend_after_prefix (else _attend_masked)."""
    return p.end - p.start >= TILED_MIN_CHUNK


def _attend_masked(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, p: PrefillGroup, scale: float,
                   scales: Scales, prefill_kernel=None) -> torch.Tensor:
    """q [new, heads, hd] over the sequence's gathered blocks with its [new, context] causal mask (or, given the
    compiled prefill kernel, through it: the same causal limits without a mask)."""
    k, v = (x[: p.context_len] for x in gather_keys_values(k_cache, v_cache, scales, p.block_ids, q.dtype))
    if prefill_kernel is not None:
        return prefill_kernel(q, k, v, q.shape[0], scale)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                       v.transpose(0, 1).unsqueeze(0), attn_mask=p.mask, scale=scale,
                                       enable_gqa=q.shape[1] != k_cache.shape[2])
    return o[0].transpose(0, 1)


def _attend_after_prefix(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, p: PrefillGroup, scale: float, scales: Scales) -> torch.Tensor:
    """A prefill chunk after a cached prefix, without a [new, context] mask or score matrix: the new queries
    q [new, heads, hd] over the prefix's keys (no mask) and, causally, over their own (k_new, v_new [new,
    kv_heads, hd]), each through a tiled (flash) attention kernel that returns its log-sum-exp; the two halves
    are merged by those. Memory: the prefix's rows once, never the square of the chunk."""
    new, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    prefix_len = p.context_len - new
    prefix_blocks = p.block_ids[: -(-prefix_len // k_cache.shape[1])]
    k, v = (x[:prefix_len] for x in gather_keys_values(k_cache, v_cache, scales, prefix_blocks, q.dtype))
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

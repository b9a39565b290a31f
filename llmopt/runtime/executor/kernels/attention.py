"""Attention over the paged KV cache (prefill over a cached prefix + new tokens, and decode), and the KV
write into slots. Plain torch: the reference every faster kernel is tested against.

Shapes: q [T, num_heads, head_dim] for the T tokens of this step (sequences concatenated);
k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim].

On CUDA tensors the Triton kernels (triton_store_kv, triton_decode_attention, triton_prefill_attention) run
instead; on CPU, decodes go to the compiled kernel (csrc/paged_attention_cpu.cpp) that reads the blocks in
place: by default for bf16/fp16 caches, and for fp32 when the caller asks (`compiled=True`: the runtime's fast
mode). These functions stay their reference (and the exact fp32 mode, which must match transformers token for
token, keeps them).

Per step the metadata is built once (`AttentionMetadata.build`) and read by every layer: sequences whose
step is a single token (decodes) are attended together in one padded batch; sequences with several new
tokens (prefill chunks) one by one, each with its causal mask over cached + new tokens; a few new tokens after a
cached prefix (speculative verification) become decode rows, each over the keys up to its own position.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops


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
    mask: torch.Tensor  # [B, 1, 1, max_blocks * block_size] bool: slot < context_len
    context_lens: torch.Tensor  # [B] int64
    contiguous: bool  # rows are 0..B-1 in order (no gather/scatter needed)


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
            mask = torch.arange(width * block_size, device=device).unsqueeze(0) < lens.unsqueeze(1)
            decode = DecodeGroup(torch.tensor(decode_rows, device=device), tables, mask[:, None, None, :], lens,
                                 decode_rows == list(range(len(decode_rows))))
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


def triton_paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode-only steps: the split-KV decode kernel; steps with prefill chunks: the prefill kernel over every
    sequence (a decode is a one-token chunk)."""
    from llmopt.runtime.executor.kernels.triton_decode_attention import decode_attention
    from llmopt.runtime.executor.kernels.triton_prefill_attention import prefill_attention

    t = meta.device_tensors
    if not meta.prefills:
        return decode_attention(q, k_cache, v_cache, t["block_tables"], t["context_lens"], scale)
    return prefill_attention(q, k_cache, v_cache, t["query_starts"], t["context_lens"], t["block_tables"], scale,
                             t["max_new_tokens"], block_m=16 if t["max_new_tokens"] <= 16 else 64)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [T, num_kv_heads, head_dim] into their slots (Triton on CUDA, the compiled copy on CPU)."""
    if k_cache.is_cuda and triton_available():
        from llmopt.runtime.executor.kernels.triton_store_kv import store_kv as triton_store_kv

        return triton_store_kv(k, v, k_cache, v_cache, slot_mapping)
    return compiled_store_kv(k, v, k_cache, v_cache, slot_mapping)


def compiled_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """The compiled CPU copy where the layouts allow it (a plain copy: the same bits as the reference)."""
    if (k_cache.device.type == "cpu" and k.dtype == k_cache.dtype == v.dtype
            and k.stride(-1) == v.stride(-1) == 1 and k.stride(1) == v.stride(1) == k.shape[2]):
        ops = cpu_ops()
        if ops is not None:
            return ops.store_kv_(k_cache, v_cache, k, v, slot_mapping)
    reference_store_kv(k, v, k_cache, v_cache, slot_mapping)


def reference_store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[slot_mapping] = v.to(v_cache.dtype)


def _attend_decodes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, decode: DecodeGroup,
                    scale: float, compiled: bool | None = None) -> torch.Tensor:
    """q [B, num_heads, head_dim] -> [B, num_heads, head_dim], each over its own cached keys. compiled: use the
    CPU kernel (None: for half-precision caches only)."""
    if compiled is None:
        compiled = k_cache.dtype != torch.float32
    if compiled and k_cache.device.type == "cpu":
        ops = cpu_ops()
        if ops is not None:
            out = ops.paged_decode_attention(q if q.dtype == k_cache.dtype else q.to(k_cache.dtype), k_cache,
                                             v_cache, decode.block_tables, decode.context_lens, scale)
            return out if out.dtype == q.dtype else out.to(q.dtype)
    num_seqs, width = decode.block_tables.shape
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    # index_select over whole blocks (rows of block_size * kv_heads * hd) is a plain memcpy per block, several
    # times faster than advanced indexing; -> [B, kv_heads, blocks * block_size, hd]
    flat = decode.block_tables.reshape(-1)
    k = k_cache.view(num_blocks, -1).index_select(0, flat).view(num_seqs, width * block_size, num_kv_heads,
                                                                 head_dim).transpose(1, 2)
    v = v_cache.view(num_blocks, -1).index_select(0, flat).view(num_seqs, width * block_size, num_kv_heads,
                                                                 head_dim).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=decode.mask,
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
                    compiled: bool | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys; returns [T, num_heads, head_dim].

    k_new, v_new [T, num_kv_heads, head_dim]: this step's keys and values (already stored): prompts with nothing
    cached before attend over them directly, equal-length ones in one batched causal SDPA (a 2048-token chunk of
    128-token prompts: one call per layer instead of 16 gathers, masks and calls). compiled: decodes through the
    CPU kernel (None: for half-precision caches only). On CUDA with Triton: the Triton kernels."""
    if meta.device_tensors is not None and triton_available():
        return triton_paged_attention(q, k_cache, v_cache, meta, scale)
    return reference_paged_attention(q, k_cache, v_cache, meta, scale, k_new, v_new, compiled)


def reference_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                              scale: float, k_new: torch.Tensor | None = None, v_new: torch.Tensor | None = None,
                              compiled: bool | None = None) -> torch.Tensor:
    """paged_attention in torch (decodes through the compiled CPU kernel when `compiled`)."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    num_heads = q.shape[1]
    if meta.decode is not None and meta.decode.contiguous and not meta.prefills:
        return _attend_decodes(q, k_cache, v_cache, meta.decode, scale, compiled)
    out = torch.empty_like(q)
    if meta.decode is not None:
        rows = meta.decode.rows
        out[rows] = _attend_decodes(q[rows], k_cache, v_cache, meta.decode, scale, compiled)
    prefills = meta.prefills
    if k_new is not None and k_new.dtype == k_cache.dtype:
        runs, prefills = _fresh_runs(prefills)
        for start, count, length in runs:
            end = start + count * length
            # [count, heads, length, head_dim] views of the flat batch
            qb, kb, vb = (t[start:end].view(count, length, t.shape[1], head_dim).transpose(1, 2)
                          for t in (q, k_new, v_new))
            o = F.scaled_dot_product_attention(qb, kb.to(q.dtype), vb.to(q.dtype), is_causal=True, scale=scale,
                                               enable_gqa=num_heads != num_kv_heads)
            out[start:end] = o.transpose(1, 2).reshape(end - start, num_heads, head_dim)
    for p in prefills:
        k = k_cache.index_select(0, p.block_ids).reshape(-1, num_kv_heads, head_dim)[: p.context_len]
        v = v_cache.index_select(0, p.block_ids).reshape(-1, num_kv_heads, head_dim)[: p.context_len]
        o = F.scaled_dot_product_attention(
            q[p.start:p.end].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0).to(q.dtype),
            v.transpose(0, 1).unsqueeze(0).to(q.dtype), attn_mask=p.mask, scale=scale,
            enable_gqa=num_heads != num_kv_heads,
        )
        out[p.start:p.end] = o[0].transpose(0, 1)
    return out

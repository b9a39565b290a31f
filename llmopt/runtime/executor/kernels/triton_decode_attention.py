"""Paged attention for decode on NVIDIA GPUs (Triton), flash-decoding style.

One program per (sequence, KV head, split of the context): it attends all the query heads of its GQA group
to its share of the sequence's KV pages with an online softmax, writing a partial output and its
log-sum-exp; a second small kernel merges the splits. Splitting the KV length keeps the GPU busy at batch 1,
where there are only num_kv_heads programs per sequence otherwise.

Shapes: q [B, H, D]; k_cache / v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks] int32;
context_lens [B] int32; out [B, H, D]. An 8-bit cache (kernels/kv_quant.py) adds its fp32 scales [num_blocks,
block_size, KVH]: codes are decoded in registers (`dequantize_codes`) and multiplied by their token's scale.
Reference: `attention.torch_sdpa.TorchAttention.decode`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dequantize_codes(raw, FP8: tl.constexpr):
    """8-bit codes -> fp32: int8 as integers; E4M3 (loaded as uint8) by rebiasing the exponent (7 -> 127) in the
    bit pattern, subnormals (exponent field 0) as mantissa x 2^-9 (csrc/simd.h's e4m3_to_float)."""
    if FP8:
        bits = raw.to(tl.int32) & 0xFF
        mag = bits & 0x7F
        normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
        value = tl.where(mag < 8, mag.to(tl.float32) * (1.0 / 512), normal)
        return tl.where((bits & 0x80) != 0, -value, value)
    return raw.to(tl.float32)


@triton.jit
def load_page(ptr, scales_ptr, kv_off, kv_mask, t_mask, block, offs_t, kv_heads, kv_head, PAGE: tl.constexpr,
              QUANT: tl.constexpr, FP8: tl.constexpr):
    """Rows [T, D] of a key or value cache at kv_off (one page, or a prefill tile of several): as stored, or
    (QUANT) its codes decoded and multiplied by their token's scale (scales [blocks, PAGE, KVH] contiguous), in
    fp32; block and offs_t give each row's block (a scalar for one page, else [T]) and its row within it."""
    # (if / else, one return each: Triton's compiler types every return of the function, an early return in a
    # constexpr branch included, and the codes' int8 / uint8 would clash with the decoded fp32)
    if QUANT:
        scale = tl.load(scales_ptr + (block * PAGE + offs_t) * kv_heads + kv_head, mask=t_mask, other=0.0)
        rows = dequantize_codes(tl.load(ptr + kv_off, mask=kv_mask, other=0), FP8) * scale[:, None]
    else:
        rows = tl.load(ptr + kv_off, mask=kv_mask, other=0.0)
    return rows


def code_operands(k_cache: torch.Tensor, v_cache: torch.Tensor, scales) -> tuple:
    """(k codes, v codes, k scales, v scales, QUANT, FP8) for the kernels: E4M3 codes travel as uint8; without
    scales the caches themselves stand in for the unused scale pointers."""
    if scales is None:
        return k_cache, v_cache, k_cache, v_cache, False, False
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if fp8:
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    return k_cache, v_cache, scales[0], scales[1], True, fp8


@triton.jit
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, tables_ptr, lens_ptr, part_out_ptr, part_lse_ptr,
    scale,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_tb,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, PAGES_PER_SPLIT: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq)
    first_page = split * PAGES_PER_SPLIT
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    offs_t = tl.arange(0, PAGE)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for p in range(PAGES_PER_SPLIT):
        page = first_page + p
        pos = page * PAGE + offs_t  # [PAGE] token positions
        t_mask = pos < ctx
        if page * PAGE < ctx:
            block = tl.load(tables_ptr + seq * stride_tb + page)
            kv_off = block * stride_kb + offs_t[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            kv_heads = stride_kt // stride_kh
            k = load_page(k_ptr, ks_ptr, kv_off, kv_mask, t_mask, block, offs_t, kv_heads, kv_head, PAGE, QUANT,
                          FP8).to(tl.float32)  # [PAGE, D]
            v = load_page(v_ptr, vs_ptr, kv_off, kv_mask, t_mask, block, offs_t, kv_heads, kv_head, PAGE, QUANT,
                          FP8).to(tl.float32)
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, PAGE]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            prob = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(prob, axis=1)
            acc = acc * alpha[:, None] + tl.sum(prob[:, :, None] * v[None, :, :], axis=1)
            m_i = m_new
    has_tokens = first_page * PAGE < ctx
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    lse = tl.where(has_tokens, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    tl.store(part_out_ptr + seq * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
             out, mask=g_mask[:, None] & d_mask[None, :])
    tl.store(part_lse_ptr + seq * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr,
                         stride_pb, stride_ph, stride_ps, stride_lb, stride_lh, stride_ob, stride_oh,
                         NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, HEAD_DIM: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    lse = tl.load(part_lse_ptr + seq * stride_lb + head * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, axis=0))
    weights = weights / tl.sum(weights, axis=0)
    parts = tl.load(part_out_ptr + seq * stride_pb + head * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    out = tl.sum(parts * weights[:, None], axis=0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < HEAD_DIM)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_splits: int | None = None, scales=None
                     ) -> torch.Tensor:
    num_seqs, num_heads, head_dim = q.shape
    _, page, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    max_pages = block_tables.shape[1]
    if num_splits is None:  # enough programs to fill the GPU at small batch, at least one page each
        num_splits = max(1, min(max_pages, 128 // max(1, num_seqs * num_kv_heads)))
    pages_per_split = triton.cdiv(max_pages, num_splits)
    num_splits = triton.cdiv(max_pages, pages_per_split)
    q = q.contiguous()
    block_tables = block_tables.to(torch.int32).contiguous()
    context_lens = context_lens.to(torch.int32).contiguous()
    part_out = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(head_dim)
    k_codes, v_codes, k_scales, v_scales, quant, fp8 = code_operands(k_cache, v_cache, scales)
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, k_codes, v_codes, k_scales, v_scales, block_tables, context_lens, part_out, part_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1),
        GROUP=group, BLOCK_G=triton.next_power_of_2(group), HEAD_DIM=head_dim, BLOCK_D=block_d,
        PAGE=page, PAGES_PER_SPLIT=pages_per_split, QUANT=quant, FP8=fp8,
    )
    out = torch.empty_like(q)
    _merge_splits_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
        NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim, BLOCK_D=block_d,
    )
    return out

"""Paged attention for prefill chunks on NVIDIA GPUs (Triton): new query tokens attend to the sequence's
cached prefix plus themselves (causal), reading K/V page by page from the paged cache (the new tokens' K/V
are stored there first, so one loop covers prefix and chunk).

One program per (sequence, query head, block of BLOCK_M new tokens); online softmax over pages.
Shapes: q [T, H, D] (sequences concatenated); query_starts [S + 1] int32; context_lens [S] int32;
block_tables [S, max_blocks] int32; caches [num_blocks, page, KVH, D]; out [T, H, D]. An 8-bit cache's codes
are decoded in registers and scaled per token (as the decode kernel does).
Reference: `attention.torch_sdpa.TorchAttention.attend` (prefill groups).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.runtime.executor.kernels.triton_decode_attention import code_operands, load_page

MIN_DOT = 16  # tl.dot's least K on the GPU: pages of fewer tokens are read several to a tile


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, starts_ptr, lens_ptr, tables_ptr,
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kt, stride_kh, stride_tb,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    PAGE: tl.constexpr, TILE: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    start = tl.load(starts_ptr + seq)
    num_new = tl.load(starts_ptr + seq + 1) - start
    if m_block * BLOCK_M < num_new:
        ctx = tl.load(lens_ptr + seq)
        kv_head = head // GROUP
        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_t = tl.arange(0, TILE)  # a tile of keys: one page, or several pages below tl.dot's 16
        m_mask = offs_m < num_new
        d_mask = offs_d < HEAD_DIM
        q_pos = ctx - num_new + offs_m  # absolute positions of these queries
        q = tl.load(q_ptr + (start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        last_pos = tl.minimum(ctx - num_new + (m_block + 1) * BLOCK_M, ctx)  # causal: later keys unseen
        num_tiles = tl.cdiv(last_pos, TILE)
        for tile in range(0, num_tiles):
            k_pos = tile * TILE + offs_t  # [TILE] key positions
            t_mask = k_pos < ctx
            block = tl.load(tables_ptr + seq * stride_tb + k_pos // PAGE, mask=t_mask, other=0)  # [TILE] each's
            slot = k_pos % PAGE  # [TILE] row within its block
            kv_off = block[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :]
            kv_mask = t_mask[:, None] & d_mask[None, :]
            kv_heads = stride_kt // stride_kh
            k = load_page(k_ptr, ks_ptr, kv_off, kv_mask, t_mask, block, slot, kv_heads, kv_head, PAGE, QUANT, FP8)
            v = load_page(v_ptr, vs_ptr, kv_off, kv_mask, t_mask, block, slot, kv_heads, kv_head, PAGE, QUANT, FP8)
            if QUANT:  # (decoded in fp32; the value product runs in q's dtype, as a cache in it would)
                v = v.to(q.dtype)
            s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision="ieee").to(tl.float32) * scale  # [M, TILE]
            visible = (k_pos[None, :] <= q_pos[:, None]) & t_mask[None, :] & m_mask[:, None]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp(m_i - m_safe)
            prob = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(prob, axis=1)
            acc = acc * alpha[:, None] + tl.dot(prob.to(v.dtype), v, input_precision="ieee").to(tl.float32)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, query_starts: torch.Tensor,
                      context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float,
                      max_new_tokens: int, block_m: int = 32, scales=None) -> torch.Tensor:
    num_heads, head_dim = q.shape[1:]
    _, page, num_kv_heads, _ = k_cache.shape
    num_seqs = context_lens.shape[0]
    q = q.contiguous()
    out = torch.empty_like(q)
    tables = block_tables.to(torch.int32).contiguous()
    k_codes, v_codes, k_scales, v_scales, quant, fp8 = code_operands(k_cache, v_cache, scales)
    _prefill_kernel[(num_seqs, num_heads, triton.cdiv(max_new_tokens, block_m))](
        q, k_codes, v_codes, k_scales, v_scales, out, query_starts.to(torch.int32).contiguous(),
        context_lens.to(torch.int32).contiguous(),
        tables, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_M=block_m, PAGE=page, TILE=max(page, MIN_DOT), QUANT=quant, FP8=fp8,
    )
    return out

"""W4A16 group-quantized matmul on NVIDIA GPUs (Triton): y = x @ dequant(W)^T, codes unpacked and
dequantized in registers, fp32 accumulation.

Layout (made at load by `pack_w4a16`): qweight [K / 8, N] int32 with code k of column n in bits
4 * (k % 8) of row k // 8; scales [K / G, N] and zeros [K / G, N] in the activation dtype (zero = code offset;
float32 for a float zero point).
Shapes: x [M, K] fp16/bf16/fp32; y [M, N]. Reference: `kernels.quant_matmul.reference_quant_matmul`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tile_offsets(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """This program's output tile of a matmul on a (M / BLOCK_M, N / BLOCK_N) grid: its row and column offsets,
    the K offsets of one step, and the masks of rows and columns inside the output."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.arange(0, BLOCK_K), offs_m < M, offs_n < N


@triton.jit
def group_rows(ptr, k, k0, stride_g, offs_n, kn_mask, n_mask, GROUP: tl.constexpr, ONE_GROUP: tl.constexpr):
    """The scales (or zeros) [G, N] of this step's columns k [BLOCK_K], in fp32: one row [1, BLOCK_N] when the
    step lies inside one group (ONE_GROUP: BLOCK_K divides GROUP), else a row per column [BLOCK_K, BLOCK_N].
    (The single row keeps the step's shared memory to x and the codes: per-column rows of fp32 scales and zeros
    at BLOCK_K = 128 took the pipelined loop past Hopper's 227 KiB.)"""
    if ONE_GROUP:
        rows = tl.load(ptr + (k0 // GROUP) * stride_g + offs_n[None, :], mask=n_mask[None, :], other=0.0)
    else:
        rows = tl.load(ptr + (k // GROUP)[:, None] * stride_g + offs_n[None, :], mask=kn_mask, other=0.0)
    return rows.to(tl.float32)


def step_columns(group_size: int, itemsize: int) -> tuple[int, bool]:
    """(BLOCK_K, ONE_GROUP) for a K step over groups of group_size columns: the largest power of two dividing the
    group (so a step never straddles two), at most 128 for 2-byte inputs and 64 for fp32 (Hopper's shared memory
    holds two pipelined stages of x and the codes at that width), at least 16 (tl.dot's least K); a group with no
    such divisor steps by 32 with a scale row per column."""
    width = min(128 if itemsize <= 2 else 64, group_size & -group_size)
    return (width, True) if width >= 16 else (32, False)


@triton.jit
def _w4a16_kernel(x_ptr, qw_ptr, scales_ptr, zeros_ptr, y_ptr, M, N, K,
                  stride_xm, stride_qk, stride_sg, stride_ym,
                  GROUP: tl.constexpr, ONE_GROUP: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, offs_k, m_mask, n_mask = tile_offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        kn_mask = k_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        packed = tl.load(qw_ptr + (k // 8)[:, None] * stride_qk + offs_n[None, :], mask=kn_mask, other=0)
        codes = (packed >> ((k % 8) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        scale = group_rows(scales_ptr, k, k0, stride_sg, offs_n, kn_mask, n_mask, GROUP, ONE_GROUP)
        zero = group_rows(zeros_ptr, k, k0, stride_sg, offs_n, kn_mask, n_mask, GROUP, ONE_GROUP)
        w = ((codes.to(tl.float32) - zero) * scale).to(x.dtype)
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def pack_code_words(q: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (K % 8 == 0, one per element) -> [K/8, N] int32, code k of column n in bits 4 (k % 8) of
    row k // 8."""
    n, k = q.shape
    codes = q.t().to(torch.int64).reshape(k // 8, 8, n)
    shifts = (torch.arange(8, dtype=torch.int64, device=q.device) * 4).view(1, 8, 1)
    words = (codes << shifts).sum(dim=1)  # [K/8, N], up to 32 bits
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pack_w4a16(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [N, K] (K % 8 == 0), scales/zeros [N, G] -> (qweight [K/8, N] int32, scales [G, N], zeros [G, N]).
    Integer zero points (codes) are exact in any activation dtype; float ones (a float minimum per group) stay
    float32, as bf16 would move them by up to 1/16 of a step."""
    zero_dtype = torch.float32 if zeros.is_floating_point() else dtype
    return pack_code_words(q), scales.t().to(dtype).contiguous(), zeros.t().to(zero_dtype).contiguous()


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    m, k = x.shape
    n = qweight.shape[1]
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_k, one_group = step_columns(group_size, x.element_size())
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _w4a16_kernel[grid](x, qweight, scales, zeros, y, m, n, k, x.stride(0), qweight.stride(0), scales.stride(0),
                        y.stride(0), GROUP=group_size, ONE_GROUP=one_group, BLOCK_M=block_m, BLOCK_N=64,
                        BLOCK_K=block_k)
    return y

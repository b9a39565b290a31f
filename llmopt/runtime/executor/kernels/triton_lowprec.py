"""Low-precision matmuls on NVIDIA GPUs (Triton), fp32 or int32 accumulation:

- `scaled_matmul`: y = (a @ b^T) * a_scale[:, None] * b_scale[None, :] for 8-bit operands both sides: int8 x int8
  into int32 (W8A8 int8: int8 tensor cores) or E4M3 x E4M3 into fp32 (W8A8 FP8: FP8 tensor cores on Hopper and
  later). a [M, K] (the inputs, quantized per token), b [N, K] (the weight, per output channel).
- `float_weight_matmul`: y = x @ W^T with W decoded in registers from FP8 (E4M3 values [N, K], scales [N, G]) or
  FP4 (E2M1 codes two a byte [N, K/2], one-byte block scales [N, G] through a 256-entry table of effective
  scales: core.contract.fp4), multiplied in the activations' dtype: weight-only FP8 / NVFP4 / MXFP4.

The references are the torch expressions each method is tested against (tests/runtime/test_triton_kernels.py,
in the interpreter on machines without a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.runtime.executor.kernels.triton_w4a16 import tile_offsets


@triton.jit
def _scaled_mm_kernel(a_ptr, b_ptr, a_scale_ptr, b_scale_ptr, y_ptr, M, N, K, stride_am, stride_bn, stride_ym,
                      INT8: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, offs_k, m_mask, n_mask = tile_offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32 if INT8 else tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        a = tl.load(a_ptr + offs_m[:, None] * stride_am + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0)
        b = tl.load(b_ptr + offs_n[None, :] * stride_bn + k[:, None], mask=k_mask[:, None] & n_mask[None, :],
                    other=0)  # [BLOCK_K, BLOCK_N]
        if not INT8:  # E4M3 operands travel as their bytes (masked lanes: 0x00 = +0.0), reinterpreted here
            a = a.to(tl.float8e4nv, bitcast=True)
            b = b.to(tl.float8e4nv, bitcast=True)
        acc += tl.dot(a, b, out_dtype=tl.int32 if INT8 else tl.float32)
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
    b_scale = tl.load(b_scale_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc.to(tl.float32) * b_scale[None, :] * a_scale[:, None]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def scaled_matmul(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K], b [N, K] (both int8, or both float8_e4m3fn), a_scale [M], b_scale [N] float32 -> y [M, N]."""
    m, k = a.shape
    n = b.shape[0]
    a, b = a.contiguous(), b.contiguous()
    if a.dtype == torch.float8_e4m3fn:
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    y = torch.empty(m, n, dtype=out_dtype, device=a.device)
    block_m = 16 if m <= 16 else 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    _scaled_mm_kernel[grid](a, b, a_scale.float().contiguous(), b_scale.float().contiguous(), y, m, n, k,
                            a.stride(0), b.stride(0), y.stride(0), INT8=a.dtype == torch.int8, BLOCK_M=block_m,
                            BLOCK_N=64, BLOCK_K=64)
    return y


@triton.jit
def _e2m1_value(code):
    """E2M1 codes (int32, 0-15) -> fp32 values: magnitude index i = 2e + m, value m / 2 for e = 0, else
    2^(e - 1) (1 + m / 2); bit 3 the sign."""
    index = code & 7
    e = index >> 1
    m = (index & 1).to(tl.float32)
    power = (1 << tl.where(e > 0, e - 1, 0)).to(tl.float32)
    value = tl.where(e == 0, 0.5 * m, power * (1.0 + 0.5 * m))
    return tl.where(code >= 8, -value, value)


@triton.jit
def _float_weight_kernel(x_ptr, w_ptr, s_ptr, table_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                         GROUP: tl.constexpr, FP4: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr):
    offs_m, offs_n, offs_k, m_mask, n_mask = tile_offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_mask = k < K
        wk_mask = k_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        group = k // GROUP
        if FP4:
            byte = tl.load(w_ptr + offs_n[None, :] * stride_wn + (k // 2)[:, None], mask=wk_mask, other=0)
            values = _e2m1_value((byte.to(tl.int32) >> ((k % 2) * 4)[:, None]) & 0xF)
            scale_byte = tl.load(s_ptr + offs_n[None, :] * stride_sn + group[:, None], mask=wk_mask, other=0)
            scale = tl.load(table_ptr + scale_byte.to(tl.int32))
        else:
            values = tl.load(w_ptr + offs_n[None, :] * stride_wn + k[:, None], mask=wk_mask, other=0)
            values = values.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            scale = tl.load(s_ptr + offs_n[None, :] * stride_sn + group[:, None], mask=wk_mask, other=0.0)
        w = (values * scale).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


def float_weight_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, group: int,
                        scale_table: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T -> [M, N] in x's dtype. FP8: weight [N, K] float8_e4m3fn, scales [N, K / group] float32.
    FP4: weight [N, K / 2] uint8 codes, scales [N, K / group] uint8 scale bytes, scale_table [256] float32."""
    m, k = x.shape
    n = weight.shape[0]
    x = x.contiguous()
    fp4 = weight.dtype == torch.uint8
    weight = weight.view(torch.uint8)  # FP8 values travel as their bytes (see _scaled_mm_kernel)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_k = min(64, group) if group % 16 == 0 else 16
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    table = scale_table if fp4 else scales  # (unread for FP8)
    _float_weight_kernel[grid](x, weight, scales, table, y, m, n, k, x.stride(0), weight.stride(0), scales.stride(0),
                               y.stride(0), GROUP=group, FP4=fp4, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k)
    return y

"""2:4 sparse matmul on NVIDIA GPUs (Triton): y = x @ W^T with W stored compressed — half its values (float, or
4-bit codes with group scales) and 2 bits of position each — read once and expanded to the dense tile in registers,
fp32 accumulation. At decode a step reads the weight at memory bandwidth, so the bytes set the time: 2:4 fp16 is
0.56x of dense fp16's, 2:4 + int4 0.75x of dense int4's codes (3 bits per weight against 4).

Layout (made at load by `pack_sparse24`), for W [N, K], K % 32 == 0, value v of a row = the v-th kept value in
column order (two per group of 4 columns: values 2g and 2g + 1 belong to group g):
- positions [K / 32, N] int32: bits 2 (v % 16) .. +1 of word v // 16 give value v's column within its group;
- values: float [K / 2, N] in the activation dtype, or (int4) codes [K / 16, N] int32 with value v's code in bits
  4 (v % 8) of word v // 8, plus scales and zeros [K / G, N] (zero = code offset; a value's group is its column's).
Shapes: x [M, K]; y [M, N]. Reference: the dense weight (core.contract.sparse24 / QuantizedWeight.dequantize).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from llmopt.runtime.executor.kernels.triton_w4a16 import group_rows, step_columns, tile_offsets

CHUNK = 32  # columns per position word


@triton.jit
def _sparse24_kernel(x_ptr, pos_ptr, val_ptr, scales_ptr, zeros_ptr, y_ptr, M, N, K,
                     stride_xm, stride_pk, stride_vk, stride_sg, stride_ym,
                     QUANTIZED: tl.constexpr, GROUP: tl.constexpr, ONE_GROUP: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m, offs_n, offs_k, m_mask, n_mask = tile_offsets(M, N, BLOCK_M, BLOCK_N, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k  # [BLOCK_K] dense columns of this step
        k_mask = k < K
        kn_mask = k_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                    other=0.0)
        first = (k // 4) * 2  # [BLOCK_K] the first of the two kept values of each column's group
        words = tl.load(pos_ptr + (first // 16)[:, None] * stride_pk + offs_n[None, :], mask=kn_mask, other=0)
        pos0 = (words >> ((first % 16) * 2)[:, None]) & 3  # [BLOCK_K, BLOCK_N]
        pos1 = (words >> ((first % 16) * 2 + 2)[:, None]) & 3
        if QUANTIZED:
            packed = tl.load(val_ptr + (first // 8)[:, None] * stride_vk + offs_n[None, :], mask=kn_mask, other=0)
            scale = group_rows(scales_ptr, k, k0, stride_sg, offs_n, kn_mask, n_mask, GROUP, ONE_GROUP)
            zero = group_rows(zeros_ptr, k, k0, stride_sg, offs_n, kn_mask, n_mask, GROUP, ONE_GROUP)
            v0 = (((packed >> ((first % 8) * 4)[:, None]) & 0xF).to(tl.float32) - zero) * scale
            v1 = (((packed >> ((first % 8) * 4 + 4)[:, None]) & 0xF).to(tl.float32) - zero) * scale
        else:
            v0 = tl.load(val_ptr + first[:, None] * stride_vk + offs_n[None, :], mask=kn_mask, other=0.0)
            v1 = tl.load(val_ptr + (first + 1)[:, None] * stride_vk + offs_n[None, :], mask=kn_mask, other=0.0)
        column = (k % 4)[:, None]
        w = tl.where(column == pos0, v0, tl.where(column == pos1, v1, 0.0)).to(x.dtype)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w, input_precision="ieee")
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


FULL_PIPELINE_SHARED = 160 * 1024  # a block's shared memory from which 3 pipelined stages of a 2:4 tile fit
HOPPER_SHARED = 232448  # 227 KiB: the most one block may take on an H100 / H200


def pipeline_stages(shared_per_block: int) -> int:
    """Triton's software-pipelining depth for the 2:4 loop on a GPU whose blocks may take `shared_per_block`
    bytes: its default 3 on the A100's and Hopper's 163-227 KiB; 2 on the 99 KiB of Ampere and Ada inference
    parts (A10, L4, RTX), where 3 stages of a 64 x 64 tile (x, position words, codes or values) take 113-160 KiB."""
    return 3 if shared_per_block >= FULL_PIPELINE_SHARED else 2


@functools.cache
def shared_per_block(device: torch.device) -> int:
    """The most shared memory one block may take on `device` (CUDA; asked once per device, not per launch), or
    Hopper's where there is no GPU."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return HOPPER_SHARED
    optin = getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", None)
    if optin:
        return optin
    from triton.runtime import driver  # (torch builds without the property: Triton's driver reads it)

    index = device.index if device.index is not None else torch.cuda.current_device()
    return driver.active.utils.get_device_properties(index)["max_shared_mem"]


def pack_positions(positions: torch.Tensor) -> torch.Tensor:
    """The runtime's 2-bit positions [N, K/32] int32 (core.contract.sparse24.positions_2of4) -> [K/32, N]."""
    return positions.t().contiguous()


def pack_values(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Kept values [N, K/2] -> [K/2, N] in the compute dtype."""
    return values.t().to(dtype).contiguous()


def sparse24_matmul(x: torch.Tensor, positions: torch.Tensor, values: torch.Tensor,
                    scales: torch.Tensor | None = None, zeros: torch.Tensor | None = None,
                    group_size: int = CHUNK) -> torch.Tensor:
    """x [M, K] @ W^T for W in the packed layout above: float values, or int4 codes when scales are given."""
    m, k = x.shape
    n = positions.shape[1]
    quantized = scales is not None
    x = x.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block_m = 16 if m <= 16 else 64
    block_k, one_group = step_columns(group_size, x.element_size()) if quantized else (64, True)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, 64))
    scales_arg = scales if quantized else values  # (unused operands: any pointer)
    zeros_arg = zeros if quantized else values
    _sparse24_kernel[grid](x, positions, values, scales_arg, zeros_arg, y, m, n, k, x.stride(0), positions.stride(0),
                           values.stride(0), scales_arg.stride(0), y.stride(0), QUANTIZED=quantized,
                           GROUP=group_size, ONE_GROUP=one_group, BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k,
                           num_stages=pipeline_stages(shared_per_block(x.device)))
    return y

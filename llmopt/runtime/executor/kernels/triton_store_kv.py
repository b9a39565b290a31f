"""KV-cache store on NVIDIA GPUs (Triton): each new token's K and V rows go to their cache slot.

Shapes: k, v [T, KVH, D] (views into the qkv projection: any token stride); k_cache / v_cache [num_blocks,
block_size, KVH, D]; slot_mapping [T] (block * block_size + offset; negative = skip, e.g. padding).
A 16-bit or fp32 cache: one program per token copies its row (cast in torch first). An 8-bit cache: one program per
token and KV head quantizes its key and value vectors and stores codes and scales in the same launch
(`_store_kv_quantized_kernel`: kv_quant.quantize_kv's numbers — amax / code max and x / scale correctly rounded,
int8 codes rounded half to even, FP8 codes E4M3's round to nearest even computed from the bits, so any GPU takes
it —, bit for bit).
Reference: `attention.torch_sdpa.store_kv`.
"""

from __future__ import annotations


import torch
import triton
import triton.language as tl

from llmopt.runtime.executor.kernels.kv_quant import CODE_MAX, quantize_kv


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slots_ptr, stride_kt, stride_vt, stride_ct,
                     ROW: tl.constexpr, BLOCK: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < ROW  # one token's [KVH, D] row is contiguous in both the input and the cache
        k = tl.load(k_ptr + token * stride_kt + offs, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + offs, mask=mask)
        tl.store(k_cache_ptr + slot * stride_ct + offs, k, mask=mask)
        tl.store(v_cache_ptr + slot * stride_ct + offs, v, mask=mask)


@triton.jit
def _round_half_even(magnitude):
    """Non-negative values below 2^23 rounded to the nearest integer, ties to even (exact: the whole part and the
    fraction are each exact in fp32)."""
    whole = tl.floor(magnitude)
    fraction = magnitude - whole
    odd = (whole - 2.0 * tl.floor(whole * 0.5)) == 1.0
    return tl.where((fraction > 0.5) | ((fraction == 0.5) & odd), whole + 1.0, whole)


@triton.jit
def _e4m3_codes(y):
    """fp32 values within +-448 -> the bytes of their E4M3 (float8_e4m3fn) rounding to nearest even, computed from
    the bits (no FP8 unit needed: any GPU, and Triton's interpreter): a normal |y| in [2^e, 2^(e+1)) has steps of
    2^(e-3) and the code 8 (e + 6) + |y| / 2^(e-3); below 2^-6 the subnormal steps of 2^-9 and the code |y| / 2^-9.
    A step rounded up into the next binade lands on that binade's first code, as the encoding runs on."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude = tl.abs(y)
    exponent = ((bits >> 23) & 0xFF) - 127  # of |y| (a subnormal fp32 is far below 2^-6)
    normal = magnitude >= 0.015625  # 2^-6, E4M3's smallest normal
    step_exponent = tl.where(normal, exponent - 3, -9)
    step = ((step_exponent + 127) << 23).to(tl.float32, bitcast=True)  # 2^step_exponent, exactly
    steps = _round_half_even(magnitude / step)  # (a power-of-two quotient: exact)
    code = tl.where(normal, 8.0 * (exponent + 6).to(tl.float32) + steps, steps)
    return (code.to(tl.int32) | (sign << 7)).to(tl.uint8)


@triton.jit
def _store_kv_quantized_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, slots_ptr,
                               stride_kt, stride_kh, stride_vt, stride_vh, KV_HEADS: tl.constexpr,
                               HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CODE_MAX: tl.constexpr,
                               FP8: tl.constexpr):
    token, head = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < HEAD_DIM
        row = slot * KV_HEADS + head  # the vector's scale; its codes at row * HEAD_DIM
        for which in tl.static_range(2):  # the key, then the value
            src = (k_ptr + token * stride_kt + head * stride_kh) if which == 0 else \
                (v_ptr + token * stride_vt + head * stride_vh)
            x = tl.load(src + offs, mask=mask, other=0.0).to(tl.float32)
            scale = tl.math.div_rn(tl.max(tl.abs(x), axis=0), CODE_MAX)
            safe = tl.where(scale > 0, scale, 1.0)
            scaled = tl.minimum(tl.maximum(tl.math.div_rn(x, safe), -CODE_MAX), CODE_MAX)
            if FP8:
                codes = _e4m3_codes(scaled)
            else:
                whole = _round_half_even(tl.abs(scaled))
                codes = tl.where(scaled < 0, -whole, whole).to(tl.int8)
            cache_ptr = k_cache_ptr if which == 0 else v_cache_ptr
            tl.store(cache_ptr + row * HEAD_DIM + offs, codes, mask=mask)
            tl.store((k_scales_ptr if which == 0 else v_scales_ptr) + row, scale)


def store_kv_quantized(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       k_scales: torch.Tensor, v_scales: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v [T, KVH, D] quantized into an 8-bit cache's codes and scales [num_blocks, block_size, KVH], one launch."""
    num_tokens, kv_heads, head_dim = k.shape
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    as_bytes = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)
    _store_kv_quantized_kernel[(num_tokens, kv_heads)](
        k, v, as_bytes(k_cache), as_bytes(v_cache), k_scales, v_scales, slot_mapping.contiguous(), k.stride(0),
        k.stride(1), v.stride(0), v.stride(1), KV_HEADS=kv_heads, HEAD_DIM=head_dim,
        BLOCK=triton.next_power_of_2(head_dim), CODE_MAX=CODE_MAX[k_cache.dtype], FP8=fp8)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales=None) -> None:
    num_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
    if scales is not None and k.stride(2) == 1 and v.stride(2) == 1:
        store_kv_quantized(k, v, k_cache, v_cache, scales[0], scales[1], slot_mapping)
        return
    if scales is not None:
        (k_codes, k_scales), (v_codes, v_scales) = (quantize_kv(x, k_cache.dtype) for x in (k, v))
        as_bytes = (lambda t: t.view(torch.uint8)) if k_cache.dtype == torch.float8_e4m3fn else (lambda t: t)
        _copy_rows(as_bytes(k_codes).reshape(num_tokens, row), as_bytes(v_codes).reshape(num_tokens, row),
                   as_bytes(k_cache), as_bytes(v_cache), slot_mapping, row)
        _copy_rows(k_scales, v_scales, scales[0], scales[1], slot_mapping, k.shape[1])
        return
    # cast in torch (round-to-nearest-even everywhere; the kernel then only copies)
    _copy_rows(k.reshape(num_tokens, row).to(k_cache.dtype), v.reshape(num_tokens, row).to(v_cache.dtype), k_cache,
               v_cache, slot_mapping, row)


def _copy_rows(k2: torch.Tensor, v2: torch.Tensor, k_dst: torch.Tensor, v_dst: torch.Tensor, slot_mapping: torch.Tensor,
               row: int) -> None:
    """Row t of k2, v2 [T, row] into row slot_mapping[t] of k_dst, v_dst (viewed as [slots, row])."""
    k2, v2 = k2.contiguous(), v2.contiguous()
    _store_kv_kernel[(k2.shape[0],)](k2, v2, k_dst, v_dst, slot_mapping.contiguous(), k2.stride(0), v2.stride(0),
                                     row, ROW=row, BLOCK=triton.next_power_of_2(row))

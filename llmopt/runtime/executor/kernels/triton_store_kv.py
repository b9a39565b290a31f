"""KV-cache store on NVIDIA GPUs (Triton): each new token's K and V rows go to their cache slot.

One program per token. Shapes: k, v [T, KVH, D]; k_cache / v_cache [num_blocks, block_size, KVH, D];
slot_mapping [T] (block * block_size + offset; negative = skip, e.g. padding).
An 8-bit cache gets the codes and scales of kv_quant.quantize_kv (computed in torch, so every device rounds
alike; the kernel then copies codes [T, KVH * D] and scales [T, KVH]).
Reference: `attention.torch_sdpa.store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmopt.runtime.executor.kernels.kv_quant import quantize_kv


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


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, scales=None) -> None:
    num_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
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

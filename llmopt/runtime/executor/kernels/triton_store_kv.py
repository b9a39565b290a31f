"""KV-cache store on NVIDIA GPUs (Triton): each new token's K and V rows go to their cache slot.

One program per token. Shapes: k, v [T, KVH, D]; k_cache / v_cache [num_blocks, block_size, KVH, D];
slot_mapping [T] (block * block_size + offset; negative = skip, e.g. padding).
Reference: `kernels.attention.store_kv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
             slot_mapping: torch.Tensor) -> None:
    num_tokens = k.shape[0]
    row = k.shape[1] * k.shape[2]
    # cast in torch (round-to-nearest-even everywhere; the kernel then only copies)
    k2 = k.reshape(num_tokens, row).to(k_cache.dtype).contiguous()
    v2 = v.reshape(num_tokens, row).to(v_cache.dtype).contiguous()
    _store_kv_kernel[(num_tokens,)](k2, v2, k_cache, v_cache, slot_mapping.contiguous(), k2.stride(0), v2.stride(0),
                                    row, ROW=row, BLOCK=triton.next_power_of_2(row))

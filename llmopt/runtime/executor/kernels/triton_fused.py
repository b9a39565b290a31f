"""The decoder layer's element-wise runs as one Triton kernel each on NVIDIA GPUs: RMSNorm (optionally after the
residual add, in place), rotary embedding in place on q and k, silu(gate) * up. The CPU's compiled ops
(csrc/fused_cpu.cpp) with the same interface and the same roundings to the storage dtype: normalize in fp32 then
round, scale by the weight; each rotary product and the sum rounded; silu rounded before the product.

Why: without them a decode step on a GPU is ~43 kernel launches a layer from Python (RMSNorm alone is 8 torch
ops, the rotary embedding 10), and at small batches the step is bound by those launches, not by the GPU
(docs/results/gpu.md); with them a layer is ~12 launches.
Shapes: x, residual, delta [T, hidden]; weight [hidden]; qkv [T, >= heads * head_dim] (rows contiguous);
cos, sin [T, head_dim]; gate_up [T, 2 * inter] -> [T, inter]."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, delta_ptr, weight_ptr, out_ptr, hidden, eps, stride_x, stride_d, stride_o,
                     ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if ADD:  # residual + delta, rounded to the storage dtype and written back (as `h = h + delta` leaves h)
        x = (x.to(tl.float32) + tl.load(delta_ptr + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32))
        x = x.to(x_ptr.dtype.element_ty)
        tl.store(x_ptr + row * stride_x + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = tl.div_rn(1.0, tl.sqrt_rn(tl.sum(xf * xf, axis=0) / hidden + eps))
    normed = (xf * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (normed * w).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, stride_x, stride_c, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0)
    head = tl.program_id(1)
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    dtype = x_ptr.dtype.element_ty
    v = x_ptr + row * stride_x + head * HEAD_DIM
    x1 = tl.load(v + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(v + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c_lo = tl.load(cos_ptr + row * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    c_hi = tl.load(cos_ptr + row * stride_c + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s_lo = tl.load(sin_ptr + row * stride_c + offs, mask=mask, other=0.0).to(tl.float32)
    s_hi = tl.load(sin_ptr + row * stride_c + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product rounded to the storage dtype as the torch ops round it
    lo = (x1 * c_lo).to(dtype).to(tl.float32) + (-x2 * s_lo).to(dtype).to(tl.float32)
    hi = (x2 * c_hi).to(dtype).to(tl.float32) + (x1 * s_hi).to(dtype).to(tl.float32)
    tl.store(v + offs, lo.to(dtype), mask=mask)
    tl.store(v + HALF + offs, hi.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_g, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(gate_up_ptr + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_g + inter + offs, mask=mask, other=0.0).to(tl.float32)
    silu = tl.div_rn(g, 1.0 + tl.exp(-g)).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


class TritonFusedOps:
    """The decoder's fused element-wise ops on CUDA tensors (the CPU's `cpu_ops()` interface, without its
    matmuls and sampling: `gemv` is absent, so the model keeps its lm_head's own method)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        out = torch.empty_like(x)
        _norm(x, x, weight, out, eps, add=False)
        return out

    @staticmethod
    def add_rms_norm_(residual: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """residual += delta (in place, rounded to its dtype); returns rms_norm(residual)."""
        out = torch.empty_like(residual)
        _norm(residual, delta.contiguous(), weight, out, eps, add=True)
        return out

    @staticmethod
    def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
        """In place on the first num_heads heads of each row of x (q and k of the fused qkv output)."""
        rows, head_dim = cos.shape
        if x.stride(1) != 1 or num_heads * head_dim > x.shape[1] or sin.shape != cos.shape:
            raise ValueError("rotary_: x [rows, columns] with contiguous rows and cos, sin [rows, head_dim] expected")
        cos, sin = cos.contiguous(), sin.contiguous()
        half = head_dim // 2
        _rotary_kernel[(rows, num_heads)](x, cos, sin, x.stride(0), cos.stride(0), HEAD_DIM=head_dim, HALF=half,
                                          BLOCK=triton.next_power_of_2(half))

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(rows, triton.cdiv(inter, block))](gate_up, out, inter, gate_up.stride(0), out.stride(0),
                                                            BLOCK=block)
        return out


def _norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, eps: float,
          add: bool) -> None:
    if x.dim() != 2 or x.stride(1) != 1 or weight.shape != (x.shape[1],):
        raise ValueError("rms_norm: x [rows, hidden] with contiguous rows and weight [hidden] expected")
    hidden = x.shape[1]
    _rms_norm_kernel[(x.shape[0],)](x, delta, weight.contiguous(), out, hidden, eps, x.stride(0), delta.stride(0),
                                    out.stride(0), ADD=add, BLOCK=triton.next_power_of_2(hidden))

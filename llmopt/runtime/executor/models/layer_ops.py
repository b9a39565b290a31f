"""The element-wise ops of a decoder layer as one op set per numerics path, so a family writes its layer loop once
and the path is a choice of op set (as vLLM's custom ops choose an implementation per platform):

- `TorchOps(fast=False)`, exact: transformers' order of operations for every op (greedy tokens match transformers
  token for token in fp32);
- `TorchOps(fast=True)`: one fused RMSNorm call, q and k rotated in one go; the same maths, another rounding order;
- `FusedOps`: each run of element-wise ops one kernel call — the compiled CPU kernels (kernels/csrc/fused_cpu.cpp)
  or Triton's on CUDA (kernels/triton_fused.py): the residual add fused with the next norm (h updated in place),
  rotary in place on q and k, silu(gate) * up. The same roundings as TorchOps(fast=True)'s ops (tests compare bit
  for bit);
- `decode_graph.GraphRecorder`: the ops recorded into a CPU decode graph instead of run.

Every tensor the loop handles passes through these ops (or a linear, or the attention backend), never through a
tensor method of the loop's own: that is what lets a recorder stand in for them. Shapes: h, x [T, hidden]; qkv
[T, (H + 2 KVH) * D]; q [T, H, D], k, v [T, KVH, D]; cos, sin as `tables` returns them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from llmopt.runtime.executor.models.layers import RMSNorm, rotate_half


class Norm(NamedTuple):
    """An RMSNorm with its weight and eps read once (the fused ops' arguments: no module lookups per call)."""

    module: RMSNorm
    weight: torch.Tensor
    eps: float

    @classmethod
    def of(cls, module: RMSNorm) -> Norm:
        return cls(module, module.weight, module.eps)


class Heads(NamedTuple):
    """The attention geometry the ops split and merge by: query heads, key/value heads, head size."""

    num_heads: int
    num_kv_heads: int
    head_dim: int


class TorchOps:
    """The ops as torch calls: exact (transformers' order) or fast (fused norm call, q and k rotated together)."""

    def __init__(self, heads: Heads, fast: bool):
        self.heads, self.fast = heads, fast

    def tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D] for positions [T]."""
        cos, sin = rotary(positions, dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)

    def norm(self, x: torch.Tensor, norm: Norm) -> torch.Tensor:
        return norm.module.fast(x) if self.fast else norm.module(x)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor, norm: Norm) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, its norm)."""
        h = h + delta
        return h, self.norm(h, norm)

    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: RMSNorm | None = None,
               k_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k rotated (after the per-head q_norm / k_norm of Qwen3-style models), and v, from qkv."""
        nq, nkv, hd = self.heads
        rows = qkv.shape[0]
        if q_norm is not None or not self.fast:
            q = qkv[:, : nq * hd].view(rows, nq, hd)
            k = qkv[:, nq * hd:(nq + nkv) * hd].view(rows, nkv, hd)
            if q_norm is not None:
                q, k = q_norm(q), k_norm(k)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
        else:  # q and k heads in one go
            qk = qkv[:, : (nq + nkv) * hd].view(rows, nq + nkv, hd)
            qk = qk * cos + rotate_half(qk) * sin
            q, k = qk[:, :nq], qk[:, nq:]
        return q, k, qkv[:, (nq + nkv) * hd:].view(rows, nkv, hd)

    def merge_heads(self, o: torch.Tensor) -> torch.Tensor:
        """[T, H, D] -> [T, H * D]."""
        return o.reshape(o.shape[0], -1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class FusedOps(TorchOps):
    """The ops as fused kernels (`kernels`: the compiled CPU ops or the Triton ones, Platform.fused_ops()); no
    per-head q / k norms (a model with them runs TorchOps)."""

    def __init__(self, heads: Heads, kernels):
        super().__init__(heads, fast=True)
        self.kernels = kernels

    def tables(self, rotary, positions, dtype):
        """cos, sin [T, D], read from the rotary tables."""
        return rotary.lookup(positions, dtype)

    def norm(self, x, norm):
        return self.kernels.rms_norm(x, norm.weight, norm.eps)

    def add_norm(self, h, delta, norm):
        """h += delta in place; its norm."""
        return h, self.kernels.add_rms_norm_(h, delta, norm.weight, norm.eps)

    def rotate(self, qkv, cos, sin, q_norm=None, k_norm=None):
        nq, nkv, hd = self.heads
        rows = qkv.shape[0]
        self.kernels.rotary_(qkv, cos, sin, nq + nkv)
        return (qkv[:, : nq * hd].view(rows, nq, hd), qkv[:, nq * hd:(nq + nkv) * hd].view(rows, nkv, hd),
                qkv[:, (nq + nkv) * hd:].view(rows, nkv, hd))

    def silu_mul(self, gate_up):
        return self.kernels.silu_mul(gate_up)

"""The runtime's own small layers, their parameters taken once from a loaded model: RMSNorm (transformers'
arithmetic, so the exact mode's logits match bit for bit) and rotary tables."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    """y = weight * normalize(x in fp32) cast back to x's dtype."""

    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.register_buffer("weight", weight.detach())  # shared with the checkpoint's tensor, not copied
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """transformers' order of operations (the exact mode)."""
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)

    def fast(self, x: torch.Tensor) -> torch.Tensor:
        """One fused kernel for the normalisation (the fast mode: ~1e-7 relative from forward in fp32)."""
        return F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype) * self.weight


class RotaryEmbedding(nn.Module):
    """cos, sin [T, rotary_dim] for positions [T]: frequencies inv_freq [rotary_dim / 2] (any rope scaling already
    applied: models/weights.rope_tables) and its attention scaling."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0):
        super().__init__()
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling
        self._tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}  # dtype -> cos, sin [P, rotary_dim]
        self._frozen: set[torch.dtype] = set()  # tables sized once for every position (freeze)

    def freeze(self, positions: int, dtype: torch.dtype) -> None:
        """Tables for positions 0..positions-1 from now on, never grown: lookup then reads no position on the host
        (a captured graph may not; executor/step_graphs.py)."""
        self.lookup(torch.tensor([positions - 1], device=self.inv_freq.device), dtype)
        self._frozen.add(dtype)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's cos, sin, read from tables forward computed for positions 0..P-1 (P doubled as positions
        grow): two row gathers instead of ~10 ops a step. The same
        values: each is one product and its cos / sin, whatever is computed beside it (tests compare)."""
        tables = self._tables.get(dtype)
        if dtype in self._frozen:
            return tables[0].index_select(0, positions), tables[1].index_select(0, positions)
        needed = int(positions.max()) + 1
        if tables is None or tables[0].shape[0] < needed:
            size = max(needed, 2 * tables[0].shape[0] if tables is not None else 256)
            tables = self._tables[dtype] = self(torch.arange(size, device=positions.device), dtype)
        return tables[0].index_select(0, positions), tables[1].index_select(0, positions)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # as transformers computes it (one product per element, then cos/sin in fp32): the same bits
        freqs = (self.inv_freq[:, None] @ positions[None, :].float()).t()  # [T, rotary_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

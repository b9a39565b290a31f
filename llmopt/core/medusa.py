"""Medusa heads (Medusa-1, Cai et al. 2024): K residual blocks on the target's last hidden state; head j,
followed by the target's own lm_head, predicts the token j + 1 places after the next one. Trained by
`llmopt distill --medusa-heads K` (distill layer), read by the runtime's Medusa proposer: this module and its
file format are the contract between the two.

File: safetensors, tensors heads.{j}.weight [hidden, hidden] and heads.{j}.bias [hidden], metadata format =
llmopt-medusa, num_heads, hidden_size. The lm_head is the target's (not copied into the file)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F

from llmopt.core.errors import ConfigError

FORMAT = "llmopt-medusa"


class MedusaHeads(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int):
        super().__init__()
        if num_heads < 1:
            raise ConfigError(f"--medusa-heads must be >= 1 (got {num_heads})")
        self.heads = nn.ModuleList(nn.Linear(hidden_size, hidden_size) for _ in range(num_heads))
        for head in self.heads:  # zero residual branch: every head starts as the lm_head's next-token guess
            nn.init.zeros_(head.weight)
            nn.init.zeros_(head.bias)

    @property
    def num_heads(self) -> int:
        return len(self.heads)

    @property
    def hidden_size(self) -> int:
        return self.heads[0].in_features

    def forward(self, hidden: torch.Tensor, num_heads: int | None = None) -> torch.Tensor:
        """hidden [..., hidden] (after the model's final norm) -> [num_heads, ..., hidden], fed to the lm_head."""
        heads = self.heads[:num_heads or len(self.heads)]
        return torch.stack([hidden + F.silu(head(hidden)) for head in heads])

    def save(self, path: Path) -> None:
        from llmopt.core.io import atomic_output_file, save_tensors

        tensors = {f"heads.{j}.{name}": p.detach().contiguous().cpu()
                   for j, head in enumerate(self.heads) for name, p in head.named_parameters()}
        with atomic_output_file(Path(path)) as tmp:
            save_tensors(tensors, tmp, metadata={"format": FORMAT, "num_heads": str(self.num_heads),
                                                 "hidden_size": str(self.hidden_size)})

    @classmethod
    def load(cls, path: Path, dtype: torch.dtype | None = None, device: torch.device | str = "cpu") -> MedusaHeads:
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"no Medusa heads at {path}: train them with `llmopt distill MODEL --medusa-heads 3 "
                              f"-o DIR` and give --speculative medusa:DIR")
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # safetensors raises its own kinds for a damaged file
            raise ConfigError(f"cannot read Medusa heads {path}: {str(e).splitlines()[0]}") from e
        if meta.get("format") != FORMAT:
            raise ConfigError(f"{path} is not an llmopt Medusa heads file (metadata format {meta.get('format')!r})")
        heads = cls(int(meta["num_heads"]), int(meta["hidden_size"]))
        heads.load_state_dict(tensors, strict=True)
        return heads.to(device=device, dtype=dtype).requires_grad_(False)

"""Training windows for distillation: fixed-length token windows from a corpus's calibration half, a held-out
slice that is never trained on, and a batch order that is a pure function of (seed, sample index), so a resumed
run reads exactly the batches the uninterrupted one would have."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmopt.core.datasets import documents, tokenize_corpus
from llmopt.core.errors import DatasetError


@dataclass
class TrainingWindows:
    train: torch.Tensor  # [num_train, seqlen] token ids
    held_out: torch.Tensor  # [num_held_out, seqlen]
    seed: int
    _orders: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def _order(self, epoch: int) -> torch.Tensor:
        if epoch not in self._orders:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._orders = {epoch: torch.randperm(self.train.shape[0], generator=generator)}
        return self._orders[epoch]

    def samples(self, start: int, count: int) -> torch.Tensor:
        """[count, seqlen]: global samples start .. start + count - 1 (each epoch a fresh seeded shuffle)."""
        n = self.train.shape[0]
        rows = [int(self._order(i // n)[i % n]) for i in range(start, start + count)]
        return self.train[rows]


def training_windows(tokenizer, data: str, seqlen: int, held_out: int, max_tokens: int, seed: int,
                     text_field: str = "text") -> TrainingWindows:
    """Windows of `seqlen` tokens from the `calib` split of `data`: read from the corpus's end and at most its
    second half, so evaluation (`llmopt eval ppl`, which reads from the start) never sees a trained-on token; the
    last `held_out` windows are kept out of training."""
    docs = documents(data, text_field)
    half = sum(len(d) for d in docs) // 2 if isinstance(docs, list) else None  # characters
    ids = tokenize_corpus(tokenizer, data, max_tokens, "calib", text_field, max_chars=half)
    num_windows = ids.numel() // seqlen
    if num_windows < held_out + 1:
        raise DatasetError(f"dataset {data!r} gives {ids.numel()} tokens: fewer than {held_out + 1} windows of "
                           f"{seqlen}; lower --seqlen or use a larger dataset")
    windows = ids[: num_windows * seqlen].view(num_windows, seqlen)
    return TrainingWindows(windows[: num_windows - held_out], windows[num_windows - held_out:], seed)

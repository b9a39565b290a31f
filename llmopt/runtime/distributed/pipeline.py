"""Pipeline parallelism: each stage (one process) holds a contiguous run of layers and its own KV cache for
them. A step's sequences are cut into micro-batches (contiguous groups of about equal tokens); stage 0 embeds and
runs its layers on each in turn, sending each micro-batch's residual stream on (torch.distributed point-to-point)
as soon as it is done, so the next stage works on micro-batch m while stage 0 works on m + 1. The last stage
applies the final norm and sends the hidden states back to stage 0, which projects the logits and samples.
Step time with S stages of equal cost T/S and M micro-batches: (M + S - 1) / (M S) x T, plus the transfers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llmopt.core.errors import ParallelError
from llmopt.runtime.distributed.sharding import ParallelGrid, StagePlan


def split_tokens(token_counts: list[int], parts: int) -> list[tuple[int, int]]:
    """Contiguous [first, stop) runs of sequences, at most `parts`, each about the same number of tokens."""
    n = len(token_counts)
    parts = max(1, min(parts, n))
    total, runs, first, acc = sum(token_counts), [], 0, 0
    for i, count in enumerate(token_counts):
        acc += count
        later, rest = parts - len(runs) - 1, n - (i + 1)  # runs still to open, sequences left for them
        # close the run once it reaches its share (or when each later run needs one of the sequences left)
        if later and rest >= later and (acc >= total * (len(runs) + 1) / parts or rest == later):
            runs.append((first, i + 1))
            first = i + 1
    runs.append((first, n))
    return runs


class PipelineStages:
    """This process's stage, and the transfers of residual streams [rows, hidden] between stages.

    With tensor parallelism inside each stage (grid.tensor > 1), tensor-parallel rank t of stage s sends to rank t
    of stage s + 1 (after the stage's all-reduces every rank of it holds the same residual stream), and only rank 0
    of the last stage sends the final hidden states back, to the engine's rank 0."""

    def __init__(self, plan: StagePlan, process_group, micro_batches: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, grid: ParallelGrid | None = None, tensor_rank: int = 0):
        """process_group: every rank of the engine (peers are its global ranks)."""
        self.plan, self.process_group = plan, process_group
        self.micro_batches = micro_batches
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.grid, self.tensor_rank = grid or ParallelGrid(1, plan.stages), tensor_rank

    @property
    def returns_finals(self) -> bool:
        """Whether this rank sends each micro-batch's final hidden states back to rank 0."""
        return self.plan.is_last and not self.plan.is_first and self.tensor_rank == 0

    @property
    def collects_finals(self) -> bool:
        """Whether this rank (the engine's rank 0) receives the final hidden states from the last stage."""
        return self.plan.is_first and not self.plan.is_last and self.tensor_rank == 0

    def send(self, hidden: torch.Tensor, stage: int):
        """Start sending [rows, hidden] to `stage`; returns the request to wait on."""
        try:
            return dist.isend(hidden.contiguous(), self._peer(stage), group=self.process_group)
        except RuntimeError as e:
            raise self._failed("send to", stage, e) from e

    def recv(self, rows: int, stage: int) -> torch.Tensor:
        buffer = torch.empty(rows, self.hidden_size, dtype=self.dtype, device=self.device)
        try:
            dist.recv(buffer, self._peer(stage), group=self.process_group)
        except RuntimeError as e:
            raise self._failed("receive from", stage, e) from e
        return buffer

    def wait(self, request) -> None:
        try:
            request.wait()
        except RuntimeError as e:
            raise self._failed("transfer with", None, e) from e

    def _peer(self, stage: int) -> int:
        """The global rank this rank exchanges residual streams with in `stage`: its own tensor-parallel rank
        there (final states go between the last stage's rank 0 and the engine's rank 0)."""
        return self.grid.rank(stage, self.tensor_rank)

    def _failed(self, what: str, stage: int | None, error: Exception) -> ParallelError:
        peer = f"stage {stage}" if stage is not None else "the next stage"
        here = self.grid.describe(self.grid.rank(self.plan.stage, self.tensor_rank))
        return ParallelError(f"{here} could not {what} {peer}: "
                             f"{str(error).splitlines()[0] if str(error) else type(error).__name__}")

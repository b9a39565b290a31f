"""Medusa proposer: the heads (core.medusa) read the hidden state that produced each sequence's newest token
(kept by the ModelRunner) and, through the target's lm_head, guess the k tokens after it: one chain of top-1
candidates (no tree), verified like any other drafts. The heads cost one [k x S, hidden] x [hidden, vocab]
matmul per step, batched over sequences and heads."""

from __future__ import annotations

from pathlib import Path

import torch

from llmopt.core.errors import ConfigError
from llmopt.core.medusa import MedusaHeads
from llmopt.runtime.engine.config import MEDUSA_HEADS_FILE, EngineConfig, SpeculativeConfig
from llmopt.runtime.engine.sequence import Sequence
from llmopt.runtime.executor.model_runner import ModelRunner
from llmopt.runtime.spec_decode.proposer import PROPOSERS


def medusa_heads_path(config: SpeculativeConfig, hf_model) -> Path:
    """--speculative medusa:PATH (a file, or a folder holding medusa_heads.safetensors), else the model's folder."""
    if config.model:
        path = Path(config.model).expanduser()
    else:
        folder = getattr(hf_model, "name_or_path", "") or getattr(hf_model.config, "_name_or_path", "")
        if not folder:
            raise ConfigError("--speculative medusa: cannot tell the model's folder; give medusa:PATH")
        path = Path(folder)
    return path / MEDUSA_HEADS_FILE if path.is_dir() else path


class MedusaProposer:
    def __init__(self, heads: MedusaHeads, runner: ModelRunner):
        self.heads = heads
        self.runner = runner
        runner.keep_last_hidden = True

    @torch.no_grad()
    def propose(self, seqs: list[Sequence], num_tokens: dict[int, int]) -> dict[int, list[int]]:
        kept = self.runner.last_hidden
        ready = [seq for seq in seqs if seq.seq_id in kept]
        if not ready:
            return {}
        k = min(self.heads.num_heads, max(num_tokens[seq.seq_id] for seq in ready))
        hidden = torch.stack([kept[seq.seq_id] for seq in ready])  # [S, hidden]
        guesses = self.heads(hidden, k)  # [k, S, hidden]
        logits = self.runner.logits(guesses.reshape(-1, hidden.shape[-1]), as_float=False)
        tokens = logits.argmax(dim=-1).view(k, len(ready)).t().tolist()  # [S][k]
        return {seq.seq_id: row[:num_tokens[seq.seq_id]] for seq, row in zip(ready, tokens)}

    def release(self, seq_id: int) -> None:
        pass  # the runner drops the kept hidden state with the request


def build_medusa(config: SpeculativeConfig, hf_model, runner: ModelRunner, engine_config: EngineConfig
                 ) -> MedusaProposer:
    param = next(hf_model.parameters())
    heads = MedusaHeads.load(medusa_heads_path(config, hf_model), dtype=param.dtype, device=param.device)
    if heads.hidden_size != hf_model.config.hidden_size:
        raise ConfigError(f"the Medusa heads are for hidden size {heads.hidden_size}, the model's is "
                          f"{hf_model.config.hidden_size}: train heads for this model")
    return MedusaProposer(heads, runner)


PROPOSERS.add("medusa", build_medusa)

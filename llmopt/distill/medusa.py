"""Training Medusa heads by self-distillation: the frozen model continues prompts greedily (its own outputs are
what the heads must guess when it serves), and head j learns the model's own next-token distribution j + 1
places further on: at position t it is trained towards softmax(lm_head(h_{t+j+1})) (forward KL), from h_t.

The data of step s is a pure function of s (prompts in a seeded order, greedy continuations), so a resumed run
continues the same batches; checkpoints (heads, optimizer, counters) go to OUT.ckpt/ like the distiller's."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.nn import functional as F

from llmopt.core.medusa import MedusaHeads
from llmopt.distill.checkpoint import load_checkpoint, save_checkpoint
from llmopt.distill.config import DistillConfig
from llmopt.distill.trainer import CHECKPOINT_DIR, Progress, TrainingLoop, learning_rate

GENERATION_STEPS = 8  # steps' worth of prompts continued in one batched generation
# (prompts [n][<= prompt_len], new tokens) -> continuations [n][new tokens], greedy
GenerateFn = Callable[[list[list[int]], int], list[list[int]]]


def medusa_prompts(tokenizer, data: str, prompt_len: int, seed: int, text_field: str = "text",
                   limit: int = 20_000) -> list[list[int]]:
    """The beginnings (<= prompt_len tokens) of the corpus's documents, in a seeded order."""
    from llmopt.core.datasets import documents

    docs = [d for d in list(documents(data, text_field))[:limit] if d and d.strip()]
    random.Random(seed).shuffle(docs)
    prompts = [tokenizer(d[: prompt_len * 8], add_special_tokens=True)["input_ids"][:prompt_len] for d in docs]
    return [p for p in prompts if len(p) >= 4]


def head_losses(heads: MedusaHeads, lm_head: nn.Module, hidden: torch.Tensor, target_logprobs: torch.Tensor
                ) -> tuple[list[torch.Tensor], list[float]]:
    """Per head: KL(model || head) averaged over positions, and the top-1 agreement with the model's argmax.

    hidden [B, T, H] (after the final norm), target_logprobs [B, T, V]: the model's log-softmax at each position."""
    losses, agreements = [], []
    for j, head in enumerate(heads.heads):
        shift = j + 1
        guess = hidden[:, :-shift] + F.silu(head(hidden[:, :-shift]))  # [B, T - shift, H]
        logprobs = F.log_softmax(lm_head(guess).float(), dim=-1)
        target = target_logprobs[:, shift:]
        losses.append(F.kl_div(logprobs.flatten(0, 1), target.flatten(0, 1), log_target=True,
                               reduction="batchmean"))
        agreements.append(float((logprobs.argmax(-1) == target.argmax(-1)).float().mean()))
    return losses, agreements


class MedusaTrainer(TrainingLoop):
    def __init__(self, config: DistillConfig, model: nn.Module, prompts: list[list[int]], generate: GenerateFn,
                 run_dir: Path, progress: Callable[[Progress], None] | None = None):
        self.config = config
        self.model = model.eval().requires_grad_(False)
        self.lm_head = model.get_output_embeddings()
        self.decoder = model.get_decoder()
        torch.manual_seed(config.seed)
        self.heads = MedusaHeads(config.medusa_heads, model.config.hidden_size)
        self.optimizer = torch.optim.AdamW(self.heads.parameters(), lr=config.lr, weight_decay=config.weight_decay)
        held = min(config.eval_windows, len(prompts) // 2)
        self.held_out, self.prompts = prompts[:held], prompts[held:]
        self.generate = generate
        self.run_dir = run_dir
        self.progress = progress
        self.step = 0
        self.elapsed = 0.0
        self._chunk: tuple[int, torch.Tensor] | None = None

    def _sequences(self, prompts: list[list[int]]) -> torch.Tensor:
        """prompt + greedy continuation, seqlen tokens each: [n, seqlen]."""
        new = [self.config.seqlen - len(p) for p in prompts]
        outs = self.generate(prompts, max(new))
        return torch.tensor([(p + o)[: self.config.seqlen] for p, o in zip(prompts, outs)])

    def batch(self, step: int) -> torch.Tensor:
        """The [batch_size, seqlen] sequences of `step`, from its chunk of GENERATION_STEPS steps."""
        chunk = step // GENERATION_STEPS
        if self._chunk is None or self._chunk[0] != chunk:
            size = self.config.batch_size * GENERATION_STEPS
            start = chunk * size
            prompts = [self.prompts[i % len(self.prompts)] for i in range(start, start + size)]
            self._chunk = (chunk, self._sequences(prompts))
        offset = (step % GENERATION_STEPS) * self.config.batch_size
        return self._chunk[1][offset: offset + self.config.batch_size]

    @torch.no_grad()
    def _targets(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.decoder(input_ids=input_ids).last_hidden_state  # [B, T, H]
        return hidden, F.log_softmax(self.lm_head(hidden).float(), dim=-1)

    def train_step(self) -> dict:
        started = time.perf_counter()
        input_ids = self.batch(self.step)
        hidden, target = self._targets(input_ids)
        lr = learning_rate(self.step, self.config, self.elapsed)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        losses, agreements = head_losses(self.heads, self.lm_head, hidden, target)
        loss = torch.stack(losses).mean()
        loss.backward()
        if self.config.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(self.heads.parameters(), self.config.max_grad_norm)
        self.optimizer.step()
        self.step += 1
        seconds = time.perf_counter() - started
        self.elapsed += seconds
        return {"step": self.step, "loss": loss.item(), "lr": lr, "head_kl": [x.item() for x in losses],
                "head_top1": agreements, "tokens_per_s": input_ids.numel() / seconds}

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Per head, on held-out prompts' greedy continuations: KL and the top-1 agreement with the model (the
        fraction of its guesses a greedy verification would accept at that position, given the earlier ones)."""
        if not self.held_out:
            return {}
        input_ids = self._sequences(self.held_out)
        hidden, target = self._targets(input_ids)
        losses, agreements = head_losses(self.heads, self.lm_head, hidden, target)
        return {"held_out_head_kl": [round(x.item(), 4) for x in losses],
                "held_out_head_top1": [round(a, 4) for a in agreements]}

    def save(self) -> None:
        save_checkpoint(self.run_dir / CHECKPOINT_DIR, dict(self.heads.state_dict()), self.optimizer,
                        {"step": self.step, "elapsed": self.elapsed}, self.config.model_dump(mode="json"))

    def resume(self) -> None:
        tensors, counters = load_checkpoint(self.run_dir / CHECKPOINT_DIR, self.optimizer)
        self.heads.load_state_dict(tensors, strict=True)
        self.step, self.elapsed = counters["step"], counters["elapsed"]

    def train(self, resume: bool = False) -> dict:
        self.begin(resume)
        before = self.evaluate() if self.step == 0 else {}
        last = self.run_steps()
        after = self.evaluate()
        self._log({"step": self.step, **after})
        return {"steps": self.step, "train_seconds": round(self.elapsed, 2), "final_loss": last.get("loss"),
                "tokens_per_s": (self.step * self.config.batch_size * self.config.seqlen / self.elapsed)
                if self.elapsed else None,
                **{f"initial_{k}": v for k, v in before.items()}, **after}

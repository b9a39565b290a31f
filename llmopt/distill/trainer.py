"""The distillation loop, on `accelerate`: one CPU, one GPU, or `accelerate launch --num_processes N` (DDP; each
process takes its slice of every global batch). The teacher is frozen (eval mode, no grad); the student trains
on the loss of losses.py; every step is one JSONL line; checkpoints go to OUT.ckpt/ and a resumed run continues
the same batches, learning rates and random draws."""

from __future__ import annotations

import json
import math
import random
import signal
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from llmopt.core.errors import LLMOptError
from llmopt.distill.checkpoint import load_checkpoint, save_checkpoint
from llmopt.distill.config import DistillConfig
from llmopt.distill.data import TrainingWindows
from llmopt.distill.losses import cross_entropy, divergence_loss, hidden_loss
from llmopt.distill.student import Student, layer_pairs

LOG_FILE = "log.jsonl"
CHECKPOINT_DIR = "checkpoint"


Generate = Callable[[nn.Module, object, list[list[int]], int, float, list[int]], list[list[int]]]


class Interrupted(LLMOptError):
    """Training stopped on SIGINT / SIGTERM after writing a checkpoint."""


def learning_rate(step: int, config: DistillConfig, elapsed: float = 0.0) -> float:
    """The learning rate of optimizer step `step` (0-based): linear warm-up over `warmup` steps, then the schedule
    decays to 0 at the run's end: `max_steps`, or with only `max_time` the time budget (progress = elapsed /
    max_time, so a slow step early on cannot end the schedule before the budget does)."""
    if step < config.warmup:
        return config.lr * (step + 1) / config.warmup
    if config.schedule == "constant":
        return config.lr
    if config.max_steps is not None:
        progress = (step - config.warmup) / max(1, config.max_steps - config.warmup)
    else:
        progress = elapsed / config.max_time
    progress = min(1.0, max(0.0, progress))
    if config.schedule == "linear":
        return config.lr * (1 - progress)
    return config.lr * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass
class Progress:
    step: int
    total: int | None
    record: dict = field(default_factory=dict)


class TrainingLoop:
    """The loop both trainers share (the distiller and the Medusa heads' trainer): train_step() until max_steps /
    max_time, a log line every log_every steps, checkpoints every save_every steps and at the end, and SIGINT /
    SIGTERM -> checkpoint, then Interrupted (a second signal stops at once). Subclasses give config, step, elapsed,
    run_dir, progress, train_step() and save()."""

    _stop_signal: int | None = None

    def _done(self) -> bool:
        config = self.config
        if config.max_steps is not None and self.step >= config.max_steps:
            return True
        return config.max_time is not None and self.elapsed >= config.max_time

    def begin(self, resume: bool) -> None:
        """A fresh run (no step log) or a resumed one: the checkpoint loaded, and the log lines of steps after it
        (written before a kill reached the next checkpoint, and about to be run again) dropped."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = self.run_dir / LOG_FILE
        if not resume:
            log.unlink(missing_ok=True)
            return
        self.resume()
        if log.is_file():
            kept = [line for line in log.read_text().splitlines() if json.loads(line).get("step", 0) <= self.step]
            log.write_text("".join(line + "\n" for line in kept))

    def run_steps(self, after_step: Callable[[dict], None] | None = None) -> dict:
        """Train to the end; after_step may add to a step's record (held-out figures). Returns the last record."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)} \
            if _main_thread() else {}
        last: dict = {}
        try:
            while not self._done():
                last = self.train_step()
                if after_step is not None:
                    after_step(last)
                if self.step % self.config.log_every == 0 or "held_out_ppl" in last:
                    self._log(last)
                if self.progress:
                    self.progress(Progress(self.step, self.config.max_steps, last))
                if self.config.save_every and self.step % self.config.save_every == 0:
                    self.save()
                if self._stop_signal is not None:
                    self.save()
                    raise Interrupted(f"stopped at step {self.step} (signal {self._stop_signal}); checkpoint in "
                                      f"{self.run_dir}: run the same command with --resume to continue")
            self.save()
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        return last

    def _on_signal(self, signum, frame) -> None:
        if self._stop_signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self._stop_signal = signum

    def _log(self, record: dict) -> None:
        with open(self.run_dir / LOG_FILE, "a") as f:
            f.write(json.dumps(record) + "\n")


class Distiller(TrainingLoop):
    """Trains `student` towards `teacher` on `windows` as `config` says; checkpoints under `run_dir`."""

    def __init__(self, config: DistillConfig, teacher: nn.Module | None, student: Student, tokenizer,
                 windows: TrainingWindows, run_dir: Path, progress: Callable[[Progress], None] | None = None,
                 generate: Generate | None = None):
        """generate(model, tokenizer, prompts, max_tokens, temperature, seeds) -> continuations: makes the
        on-policy batches (the pipeline passes the runtime engine's)."""
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState

        from llmopt.core.hardware import resolve_dtype

        self.config, self.student, self.tokenizer, self.windows = config, student, tokenizer, windows
        self.run_dir, self.progress, self.generate = Path(run_dir), progress, generate
        dtype = resolve_dtype(config.dtype, "cuda" if torch.cuda.is_available() else "cpu")
        # accelerate keeps one process-wide state; a later run in this process may want another precision
        # (the distributed part, PartialState, is kept)
        AcceleratorState._reset_state()
        self.accelerator = Accelerator(mixed_precision="bf16" if dtype == "bfloat16" else "no",
                                       cpu=not torch.cuda.is_available())
        torch.manual_seed(config.seed)
        random.seed(config.seed)
        self.teacher = teacher
        if teacher is not None:
            teacher.eval().requires_grad_(False)
            teacher.to(config.teacher_device or self.accelerator.device)
        self.pairs = layer_pairs(config, student, teacher.config.num_hidden_layers) \
            if config.hidden_loss and teacher is not None else []
        self.projection = self._projection()
        params = [p for p in student.model.parameters() if p.requires_grad]
        if self.projection is not None:
            params += list(self.projection.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay,
                                           betas=(0.9, 0.95))
        modules = [student.model] + ([self.projection] if self.projection is not None else [])
        prepared = self.accelerator.prepare(*modules, self.optimizer)
        self.model = prepared[0]
        self.projection = prepared[1] if self.projection is not None else None
        self.optimizer = prepared[-1]  # accelerate's wrapper; checkpoints hold the torch optimizer inside it
        self.torch_optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        self.step, self.samples_seen, self.elapsed = 0, 0, 0.0

    # --- setup ------------------------------------------------------------------------------------------
    def _projection(self) -> nn.Module | None:
        if not self.pairs:
            return None
        width_s, width_t = self.student.model.config.hidden_size, self.teacher.config.hidden_size
        return None if width_s == width_t else nn.Linear(width_s, width_t, bias=False)

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    def trainable_state(self) -> dict[str, torch.Tensor]:
        """Everything that trains, each storage once (tied embeddings: the first name only)."""
        state = _unique(self.accelerator.unwrap_model(self.model).state_dict(), "student.")
        if self.projection is not None:
            state.update(_unique(self.accelerator.unwrap_model(self.projection).state_dict(), "projection."))
        return state

    def resume(self) -> None:
        tensors, counters = load_checkpoint(self.run_dir / CHECKPOINT_DIR, self.torch_optimizer)
        _load_unique(self.accelerator.unwrap_model(self.model), tensors, "student.")
        if self.projection is not None:
            _load_unique(self.accelerator.unwrap_model(self.projection), tensors, "projection.")
        self.step, self.samples_seen = counters["step"], counters["samples_seen"]
        self.elapsed = counters["elapsed_s"]
        log = self.run_dir / LOG_FILE
        if log.is_file():  # lines written after the checkpoint belong to the lost tail of the old run
            kept = [line for line in log.read_text().splitlines() if json.loads(line).get("step", 0) <= self.step]
            log.write_text("".join(line + "\n" for line in kept))

    def save(self) -> None:
        if self.accelerator.is_main_process:
            save_checkpoint(self.run_dir / CHECKPOINT_DIR, self.trainable_state(), self.torch_optimizer,
                            {"step": self.step, "samples_seen": self.samples_seen, "elapsed_s": self.elapsed},
                            self.config.model_dump(mode="json"))
        self.accelerator.wait_for_everyone()

    # --- one step ---------------------------------------------------------------------------------------
    def _micro_batch(self, micro: int) -> torch.Tensor:
        """This process's [batch_size, seqlen] slice of global micro-batch `micro`."""
        b = self.config.batch_size
        start = micro * b * self.world + self.accelerator.process_index * b
        return self.windows.samples(start, b).to(self.accelerator.device)

    def _on_policy(self) -> bool:
        ratio = self.config.on_policy_ratio
        return ratio > 0 and random.Random(self.config.seed * 7919 + self.step).random() < ratio

    def _generate(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Student continuations of each window's first on_policy_prompt_len tokens, from the current weights;
        (ids [B, seqlen], prompt length)."""
        if self.generate is None:
            raise LLMOptError("on-policy batches need a generator (jobs.distill passes the runtime engine's)")
        prompt_len = min(self.config.on_policy_prompt_len, input_ids.shape[1] - 1)
        new = input_ids.shape[1] - prompt_len
        model = self.accelerator.unwrap_model(self.model)
        prompts = input_ids[:, :prompt_len].tolist()
        seeds = [self.config.seed * 1_000_003 + self.step * 1009 + i for i in range(len(prompts))]
        model.eval()
        try:
            continuations = self.generate(model, self.tokenizer, prompts, new, self.config.on_policy_temperature,
                                          seeds)
        finally:
            model.train()
        rows = [p + c[:new] for p, c in zip(prompts, continuations)]
        return torch.tensor(rows, dtype=torch.long, device=input_ids.device), prompt_len

    def _loss(self, input_ids: torch.Tensor, prompt_len: int = 0) -> tuple[torch.Tensor, dict]:
        config = self.config
        labels = input_ids[:, 1:].clone()
        if prompt_len:
            labels[:, : prompt_len - 1] = -100  # on-policy: only the generated tokens are scored
        want_hidden = bool(self.pairs)
        with self.accelerator.autocast():
            out = self.model(input_ids=input_ids, output_hidden_states=want_hidden, use_cache=False)
        vocab = out.logits.shape[-1]
        logits = out.logits[:, :-1].reshape(-1, vocab)
        flat_labels = labels.reshape(-1)
        parts = {}
        loss = torch.zeros((), device=logits.device)
        if config.alpha < 1:
            parts["ce"] = cross_entropy(logits, flat_labels)
            loss = loss + (1 - config.alpha) * parts["ce"]
        if self.teacher is not None and config.alpha > 0:
            with torch.no_grad(), self.accelerator.autocast():
                t_out = self.teacher(input_ids=input_ids.to(self.teacher.device), output_hidden_states=want_hidden,
                                     use_cache=False)
            t_logits = t_out.logits[:, :-1].reshape(-1, t_out.logits.shape[-1]).to(logits.device)
            parts["kd"] = divergence_loss(logits, t_logits[:, :vocab], flat_labels, config.loss, config.temperature,
                                          config.beta, config.teacher_topk)
            loss = loss + config.alpha * parts["kd"]
            if want_hidden:
                parts["hidden"] = self._hidden_loss(out.hidden_states, t_out.hidden_states)
                loss = loss + config.hidden_weight * parts["hidden"]
        return loss, parts

    def _hidden_loss(self, student_states, teacher_states) -> torch.Tensor:
        total = 0.0
        for t, s in self.pairs:  # hidden_states[i + 1] is layer i's output
            hs = student_states[s + 1].flatten(0, 1)
            if self.projection is not None:
                hs = self.projection(hs)
            total = total + hidden_loss(hs, teacher_states[t + 1].flatten(0, 1).to(hs.device),
                                        self.config.hidden_loss)
        return total / len(self.pairs)

    def train_step(self) -> dict:
        """One optimizer step over grad_accum micro-batches; returns its log record."""
        config, started = self.config, time.perf_counter()
        lr = learning_rate(self.step, config, self.elapsed)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        on_policy = self._on_policy()
        sums: dict[str, float] = {}
        tokens = 0
        for k in range(config.grad_accum):
            input_ids = self._micro_batch(self.step * config.grad_accum + k)
            prompt_len = 0
            if on_policy:
                input_ids, prompt_len = self._generate(input_ids)
            sync = k == config.grad_accum - 1
            context = self.accelerator.no_sync(self.model) if not sync and self.world > 1 else nullcontext()
            with context:
                loss, parts = self._loss(input_ids, prompt_len)
                self.accelerator.backward(loss / config.grad_accum)
            for name, value in {"loss": loss, **parts}.items():
                sums[name] = sums.get(name, 0.0) + float(self.accelerator.reduce(value.detach(), "mean"))
            tokens += input_ids.numel() * self.world
        if config.max_grad_norm:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            self.accelerator.clip_grad_norm_(params, config.max_grad_norm)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.student.enforce_masks()
        self.step += 1
        self.samples_seen += config.batch_size * self.world * config.grad_accum
        seconds = time.perf_counter() - started
        self.elapsed += seconds
        record = {"step": self.step, "lr": lr, **{k: v / config.grad_accum for k, v in sums.items()},
                  "tokens": tokens, "tokens_per_s": tokens / seconds, "step_s": seconds,
                  "on_policy": on_policy}
        return record

    @torch.no_grad()
    def held_out_perplexity(self) -> float:
        model = self.accelerator.unwrap_model(self.model)
        model.eval()
        try:
            nll, count = 0.0, 0
            for row in self.windows.held_out:
                ids = row[None].to(self.accelerator.device)
                with self.accelerator.autocast():
                    logits = model(input_ids=ids, use_cache=False).logits[0, :-1]
                nll += float(cross_entropy(logits, ids[0, 1:])) * (ids.shape[1] - 1)
                count += ids.shape[1] - 1
        finally:
            model.train()
        return math.exp(nll / count)

    # --- the loop ---------------------------------------------------------------------------------------
    def train(self, resume: bool = False) -> dict:
        """Run to the end (max_steps and/or max_time); returns the run's facts."""
        self.begin(resume)
        first_ppl = self.held_out_perplexity() if self.config.eval_every and self.step == 0 else None
        if first_ppl is not None:
            self._log({"step": 0, "held_out_ppl": first_ppl})

        def evaluate(record: dict) -> None:
            if self.config.eval_every and self.step % self.config.eval_every == 0:
                record["held_out_ppl"] = self.held_out_perplexity()

        last = self.run_steps(evaluate)
        final_ppl = self.held_out_perplexity() if self.config.eval_every else None
        return {"steps": self.step, "samples_seen": self.samples_seen, "train_seconds": round(self.elapsed, 2),
                "final_loss": last.get("loss"), "final_kd": last.get("kd"), "final_ce": last.get("ce"),
                "held_out_ppl": final_ppl,
                "tokens_per_s": (self.samples_seen * self.config.seqlen / self.elapsed) if self.elapsed else None}

    def _log(self, record: dict) -> None:
        if self.accelerator.is_main_process:
            super()._log(record)


def _unique(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    seen, out = set(), {}
    for key, tensor in state.items():
        if tensor.data_ptr() in seen:
            continue
        seen.add(tensor.data_ptr())
        out[prefix + key] = tensor
    return out


def _load_unique(module: nn.Module, tensors: dict[str, torch.Tensor], prefix: str) -> None:
    """Load what _unique saved; the names it left out (tied copies) are the only ones allowed to be missing."""
    expected = set(_unique(module.state_dict(), prefix))
    given = {k for k in tensors if k.startswith(prefix)}
    if given != expected:
        raise LLMOptError(f"the checkpoint does not match this student ({sorted(given ^ expected)[:3]}...): "
                          "resume with the same options, or start over with --overwrite")
    module.load_state_dict({k.removeprefix(prefix): tensors[k] for k in given}, strict=False)


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()

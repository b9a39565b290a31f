"""Healing by distillation on SmolLM2, against plain fine-tuning, and the trainer's overhead.

Rows (each written to the JSON as it finishes; --resume skips finished rows):
  teacher, mlp-25 (structured MLP pruning, 25%), mlp-25 + KD (--minutes of distillation from the teacher on c4),
  mlp-25 + CE (the same time of plain next-token fine-tuning on the same data), gptq-w4g64, gptq-w4g64 + KD
  (scales and zero points trained), sparse-24 (SparseGPT 2:4, stored compressed), sparse-24 + KD (its zeros
  fixed, written compressed again); each with wikitext2 and pystdlib perplexity; then the trainer's student
  tokens/s against a bare PyTorch loop doing the same forward/backward/step on the same student and teacher.

    python benchmarks/compress/distill.py --minutes 15 --json docs/results/data/distill.json
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from llmopt.core.datasets import tokenize_corpus
from llmopt.core.hardware import cpu_line
from llmopt.distill.config import make_distill_config
from llmopt.distill.data import training_windows
from llmopt.distill.losses import divergence_loss
from llmopt.jobs.distill_students import build_student
from llmopt.distill.trainer import Distiller
from llmopt.eval.perplexity import perplexity
from llmopt.formats.load import load_model
from llmopt.jobs.common import peak_rss_bytes
from llmopt.jobs.distill import distill_to_artifact
from llmopt.compress.api import quantize_configs
from llmopt.jobs.prune import prune_config, prune_to_artifact
from llmopt.jobs.quantize import quantize_to_artifact
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line, load_rows, save_rows

MODEL = "smollm2-135m"


def ppl_row(name: str, model_path: str, eval_tokens: int, extra: dict | None = None) -> dict:
    model, tokenizer, _ = load_model(model_path)
    row = {"name": name, "model": model_path, **(extra or {})}
    with torch.no_grad():
        for dataset in ("wikitext2", "pystdlib"):
            ids = tokenize_corpus(tokenizer, dataset, eval_tokens)
            row[f"ppl_{dataset}"] = round(perplexity(model, ids, seqlen=512).ppl, 4)
    return row


def distill_row(name: str, student: str, out: Path, minutes: float, eval_tokens: int, **options) -> dict:
    config = make_distill_config(teacher=MODEL, student=student, max_time=minutes * 60, data="c4", **options)
    facts = distill_to_artifact(config, out, overwrite=True)
    keep = ("steps", "samples_seen", "train_seconds", "final_loss", "tokens_per_s", "peak_rss_bytes")
    return ppl_row(name, str(out), eval_tokens, {"settings": config.model_dump(mode="json", exclude_none=True),
                                                 **{k: facts.get(k) for k in keep}})


def bare_loop_tokens_per_s(student_model, teacher, windows, batch_size: int, steps: int, lr: float) -> float:
    """The same work as a distillation step, written directly: forward both, forward KL, backward, AdamW."""
    params = [p for p in student_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95))
    student_model.train()
    teacher.eval()
    elapsed, tokens = 0.0, 0
    for step in range(steps + 2):
        ids = windows.samples(step * batch_size, batch_size)
        start = time.perf_counter()
        logits = student_model(input_ids=ids, use_cache=False).logits[:, :-1].flatten(0, 1)
        with torch.no_grad():
            t_logits = teacher(input_ids=ids, use_cache=False).logits[:, :-1].flatten(0, 1)
        loss = divergence_loss(logits, t_logits, ids[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= 2:  # two warm-up steps
            elapsed += time.perf_counter() - start
            tokens += ids.numel()
    return tokens / elapsed


def throughput_row(pruned: str, steps: int, batch_size: int, seqlen: int, run_dir: Path) -> dict:
    """Trainer vs bare loop, alternating (bare, trainer, bare, trainer) so drift on a noisy machine hits both."""
    teacher, tokenizer, _ = load_model(MODEL)
    config = make_distill_config(teacher=MODEL, student=pruned, max_steps=steps + 2, data="c4", seqlen=seqlen,
                                 batch_size=batch_size, warmup=0)
    windows = training_windows(tokenizer, "c4", seqlen, config.eval_windows, config.max_train_tokens, 0)
    bare, trainer = [], []
    for _ in range(2):
        student = build_student(config, teacher, tokenizer)
        bare.append(bare_loop_tokens_per_s(student.model, teacher, windows, batch_size, steps, config.lr))
        student = build_student(config, teacher, tokenizer)
        distiller = Distiller(config, teacher, student, tokenizer, windows, run_dir)
        records = [distiller.train_step() for _ in range(steps + 2)][2:]
        trainer.append(sum(r["tokens"] for r in records) / sum(r["step_s"] for r in records))
    return {"name": "throughput", "steps": steps, "batch_size": batch_size, "seqlen": seqlen,
            "bare_tokens_per_s": [round(x, 1) for x in bare], "trainer_tokens_per_s": [round(x, 1) for x in trainer],
            "ratio": round(sum(trainer) / sum(bare), 4), "peak_rss_bytes": peak_rss_bytes()}


def made(path: Path, make: Callable[[Path], object]) -> Callable[[], Path]:
    """A function giving `path`, made by make(path) the first time it is asked for (rows that need it)."""

    def get() -> Path:
        if not (path / "llmopt.json").is_file():
            make(path)
        return path

    return get


def main() -> None:
    parser = command_line(__doc__, default="docs/results/data/distill.json")
    parser.add_argument("--work", default="/tmp/llmopt-distill-bench", help="artifacts go here")
    parser.add_argument("--minutes", type=float, default=15.0)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--seqlen", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--qat-lr", type=float, default=1e-5)
    parser.add_argument("--throughput-steps", type=int, default=8)
    parser.add_argument("--only", default=None, help="comma-separated row names")
    parser.add_argument("--resume", action="store_true")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = load_rows(args.json, args.resume) or []
    done = {r["name"] for r in rows}
    pruned = made(work / "mlp-25", lambda out: prune_to_artifact(
        MODEL, out, prune_config({"structured": "mlp", "ratio": 0.25, "num_samples": 32}), overwrite=True))
    gptq = made(work / "gptq-w4g64", lambda out: quantize_to_artifact(
        MODEL, out, quantize_configs("gptq", {"bits": 4, "group_size": 64}), overwrite=True))
    sparse = made(work / "sparse-24", lambda out: prune_to_artifact(
        MODEL, out, prune_config({"method": "sparsegpt", "pattern": "2:4"}), overwrite=True))
    common = dict(seqlen=args.seqlen, batch_size=args.batch_size, eval_windows=8)
    plan = {
        "teacher": lambda: ppl_row("teacher", MODEL, args.eval_tokens),
        "mlp-25": lambda: ppl_row("mlp-25", str(pruned()), args.eval_tokens),
        "mlp-25+kd": lambda: distill_row("mlp-25+kd", str(pruned()), work / "mlp-25-kd", args.minutes,
                                         args.eval_tokens, lr=args.lr, **common),
        "mlp-25+ce": lambda: distill_row("mlp-25+ce", str(pruned()), work / "mlp-25-ce", args.minutes,
                                         args.eval_tokens, lr=args.lr, alpha=0.0, **common),
        "gptq-w4g64": lambda: ppl_row("gptq-w4g64", str(gptq()), args.eval_tokens),
        "gptq-w4g64+kd": lambda: distill_row("gptq-w4g64+kd", str(gptq()), work / "gptq-kd", args.minutes,
                                             args.eval_tokens, lr=args.qat_lr, **common),
        "sparse-24": lambda: ppl_row("sparse-24", str(sparse()), args.eval_tokens),
        "sparse-24+kd": lambda: distill_row("sparse-24+kd", str(sparse()), work / "sparse-24-kd", args.minutes,
                                            args.eval_tokens, lr=args.lr, **common),
        "throughput": lambda: throughput_row(str(pruned()), args.throughput_steps, args.batch_size, args.seqlen,
                                             work / "throughput-run"),
    }
    only = set(args.only.split(",")) if args.only else set(plan)
    for name, make in plan.items():
        if name in done or name not in only:
            continue
        print(f"--- {name}", flush=True)
        rows = [r for r in rows if r["name"] != name] + [{**make(), "cpu": cpu_line()}]
        save_rows(args.json, rows)
        print(rows[-1], flush=True)
    summarize(rows)


def summarize(rows: list[dict]) -> None:
    by = {r["name"]: r for r in rows}
    print(f"CPU: {rows[0]['cpu'] if rows else '?'}")
    print(f"{'row':<16} {'wikitext2':>10} {'pystdlib':>10} {'steps':>6}")
    for r in rows:
        if "ppl_wikitext2" in r:
            print(f"{r['name']:<16} {r['ppl_wikitext2']:>10.3f} {r['ppl_pystdlib']:>10.3f} {r.get('steps', ''):>6}")

    def recovered(student: str, start: str, reference: str = "teacher") -> float | None:
        if not {student, start, reference} <= set(by):
            return None
        gap = by[start]["ppl_wikitext2"] - by[reference]["ppl_wikitext2"]
        return (by[start]["ppl_wikitext2"] - by[student]["ppl_wikitext2"]) / gap

    for student, start in (("mlp-25+kd", "mlp-25"), ("mlp-25+ce", "mlp-25"), ("gptq-w4g64+kd", "gptq-w4g64"),
                           ("sparse-24+kd", "sparse-24")):
        value = recovered(student, start)
        if value is not None:
            print(f"{student}: recovers {value:.1%} of the wikitext2 gap of {start}")
    if "throughput" in by:
        t = by["throughput"]
        print(f"trainer / bare loop tokens/s: {t['ratio']:.3f} "
              f"({t['trainer_tokens_per_s']} vs {t['bare_tokens_per_s']})")


if __name__ == "__main__":
    main()

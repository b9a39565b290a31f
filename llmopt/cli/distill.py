"""`llmopt distill`: train a student (a smaller copy, a pruned / sparse / quantized artifact) towards a teacher."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Optional

import typer

from llmopt.cli.options import CalibDtype, JsonOpt, OutputOpt, OverwriteOpt, TrustRemoteCodeOpt
from llmopt.cli.output import print_json, print_table, stderr
from llmopt.distill.defaults import DISTILL


class LossName(str, Enum):
    forward_kl = "forward_kl"
    reverse_kl = "reverse_kl"
    jsd = "jsd"
    skew_kl = "skew_kl"
    skew_reverse_kl = "skew_reverse_kl"


class ScheduleName(str, Enum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class HiddenLossName(str, Enum):
    mse = "mse"
    cosine = "cosine"


def distill(
    teacher: Annotated[str, typer.Option("--teacher", help="The model to learn from (frozen).")],
    output: OutputOpt,
    student: Annotated[Optional[str], typer.Option(
        "--student", help="Model or artifact to train (dense, structured-pruned, sparse, GPTQ/AWQ/compressed-"
        "tensors int); default: a copy of the teacher, made smaller by --student-layers or --init.")] = None,
    student_layers: Annotated[Optional[str], typer.Option(
        "--student-layers", help="Keep only these decoder layers of the student, e.g. 0,2,4,6.")] = None,
    init: Annotated[Optional[str], typer.Option(
        "--init", help="drop-layers:N: drop the student's N least important layers (block importance).")] = None,
    data: Annotated[str, typer.Option("--data", help="c4, wikitext2, pystdlib, sharegpt or a .txt/.jsonl file."
                                      )] = DISTILL["data"],
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", help="Optimizer steps.")] = None,
    max_time: Annotated[Optional[str], typer.Option(
        "--max-time", help="Training time budget, e.g. 15m, 1h, 90s (with --max-steps: whichever ends first).")
    ] = None,
    seqlen: Annotated[int, typer.Option("--seqlen")] = DISTILL["seqlen"],
    batch_size: Annotated[int, typer.Option("--batch-size", help="Windows per process per micro-batch.")
                          ] = DISTILL["batch_size"],
    grad_accum: Annotated[int, typer.Option("--grad-accum")] = DISTILL["grad_accum"],
    lr: Annotated[float, typer.Option("--lr")] = DISTILL["lr"],
    warmup: Annotated[int, typer.Option("--warmup", help="Warm-up optimizer steps.")] = DISTILL["warmup"],
    schedule: Annotated[ScheduleName, typer.Option("--schedule")] = ScheduleName(DISTILL["schedule"]),
    weight_decay: Annotated[float, typer.Option("--weight-decay")] = DISTILL["weight_decay"],
    max_grad_norm: Annotated[Optional[float], typer.Option(
        "--max-grad-norm", help="Clip the gradient norm to this.")] = DISTILL["max_grad_norm"],
    seed: Annotated[int, typer.Option("--seed")] = 0,
    dtype: Annotated[CalibDtype, typer.Option(
        "--dtype", help="auto: bfloat16 autocast where the device computes it fast, else float32.")
    ] = CalibDtype.auto,
    loss: Annotated[LossName, typer.Option("--loss", help="Divergence to the teacher's distribution.")
                    ] = LossName(DISTILL["loss"]),
    temperature: Annotated[float, typer.Option("--temperature")] = DISTILL["temperature"],
    beta: Annotated[float, typer.Option("--beta", help="jsd: mixture weight; skew_*: skew.")] = DISTILL["beta"],
    alpha: Annotated[float, typer.Option(
        "--alpha", help="Weight of the distillation loss; the hard-label cross-entropy gets 1 - alpha "
        "(0: plain fine-tuning).")] = DISTILL["alpha"],
    teacher_topk: Annotated[Optional[int], typer.Option(
        "--teacher-topk", help="Keep only the teacher's top-k logits per position (renormalized).")] = None,
    hidden_loss: Annotated[Optional[HiddenLossName], typer.Option(
        "--hidden-loss", help="Also match hidden states (a learned projection when widths differ).")] = None,
    hidden_weight: Annotated[float, typer.Option("--hidden-weight")] = DISTILL["hidden_weight"],
    layer_map: Annotated[str, typer.Option(
        "--layer-map", help="auto, or TEACHER:STUDENT layer pairs such as 0:0,4:2.")] = "auto",
    on_policy_ratio: Annotated[float, typer.Option(
        "--on-policy-ratio", help="Fraction of batches made of the student's own generations (GKD).")] = 0.0,
    on_policy_prompt_len: Annotated[int, typer.Option(
        "--on-policy-prompt-len", help="Tokens of each window kept as the on-policy prompt.")
    ] = DISTILL["on_policy_prompt_len"],
    on_policy_temperature: Annotated[float, typer.Option(
        "--on-policy-temperature", help="Sampling temperature of the on-policy generations (0: greedy).")] = 1.0,
    eval_windows: Annotated[int, typer.Option(
        "--eval-windows", help="Windows held out of training for --eval-every.")] = DISTILL["eval_windows"],
    log_every: Annotated[int, typer.Option("--log-every", help="Write every Nth step to the log.")] = 1,
    eval_every: Annotated[Optional[int], typer.Option(
        "--eval-every", help="Held-out perplexity every N steps (windows never trained on).")] = None,
    save_every: Annotated[Optional[int], typer.Option(
        "--save-every", help="Checkpoint every N steps (always at the end and on Ctrl-C).")] = None,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from OUTPUT.ckpt/'s checkpoint (refused if a setting that changes the run "
        "differs from the checkpoint's).")] = False,
    allow_changes: Annotated[bool, typer.Option(
        "--allow-changes", help="With --resume: continue even though settings differ from the checkpoint's.")
    ] = False,
    max_train_tokens: Annotated[int, typer.Option("--max-train-tokens")] = DISTILL["max_train_tokens"],
    text_field: Annotated[str, typer.Option("--text-field", help="JSONL field holding the text.")] = "text",
    teacher_device: Annotated[Optional[str], typer.Option(
        "--teacher-device", help="Run the teacher on another device (e.g. cuda:1).")] = None,
    medusa_heads: Annotated[Optional[int], typer.Option(
        "--medusa-heads", help="Instead of a student: train this many Medusa heads on the frozen teacher (its own "
        "greedy continuations of --data's prompts) into OUTPUT/medusa_heads.safetensors, for `--speculative "
        "medusa:OUTPUT`.")] = None,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
) -> None:
    """Distill TEACHER into a student and write it to OUTPUT (checkpoints and the step log in OUTPUT.ckpt/)."""
    from llmopt.core.errors import ConfigError

    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ConfigError("llmopt distill needs the distill extra: pip install 'llmopt[distill]'") from None
    from llmopt.distill.config import make_distill_config
    from llmopt.distill.trainer import Interrupted
    from llmopt.jobs.distill import distill_to_artifact, train_medusa_heads

    config = make_distill_config(
        teacher=teacher, student=student, student_layers=student_layers, init=init, data=data,
        max_steps=max_steps, max_time=max_time, seqlen=seqlen, batch_size=batch_size, grad_accum=grad_accum,
        lr=lr, warmup=warmup, schedule=schedule.value, weight_decay=weight_decay, seed=seed, dtype=dtype.value,
        loss=loss.value, temperature=temperature, beta=beta, alpha=alpha, teacher_topk=teacher_topk,
        hidden_loss=hidden_loss.value if hidden_loss else None, hidden_weight=hidden_weight, layer_map=layer_map,
        on_policy_ratio=on_policy_ratio, on_policy_prompt_len=on_policy_prompt_len,
        on_policy_temperature=on_policy_temperature, eval_windows=eval_windows, log_every=log_every,
        max_grad_norm=max_grad_norm, eval_every=eval_every, save_every=save_every,
        max_train_tokens=max_train_tokens, text_field=text_field, teacher_device=teacher_device,
        medusa_heads=medusa_heads)
    run = train_medusa_heads if config.medusa_heads else distill_to_artifact
    with training_progress() as update:
        try:
            facts = run(config, output, resume, overwrite, trust_remote_code, update, allow_changes=allow_changes)
        except Interrupted as exc:
            stderr.print(str(exc), highlight=False, markup=False, soft_wrap=True)
            raise typer.Exit(130) from None
    if facts is None:  # not the main process of `accelerate launch`
        return
    if as_json:
        print_json(facts)
    else:
        print_table(f"distilled {teacher} -> {output}", facts)


def training_progress():
    """A rich progress bar on stderr showing loss, KL, tokens/s and the ETA."""
    from contextlib import contextmanager

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    @contextmanager
    def bar():
        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, console=stderr, transient=True) as progress:
            task = progress.add_task("distilling", total=None)

            def update(p) -> None:
                r = p.record
                parts = [f"loss {r['loss']:.4f}"] + [f"{k} {r[k]:.4f}" for k in ("kd", "ce", "hidden") if k in r]
                if "head_top1" in r:
                    parts.append("top-1 " + "/".join(f"{a:.2f}" for a in r["head_top1"]))
                parts.append(f"{r['tokens_per_s']:.0f} tok/s")
                if "held_out_ppl" in r:
                    parts.append(f"held-out ppl {r['held_out_ppl']:.2f}")
                progress.update(task, completed=p.step, total=p.total, description=" · ".join(parts))

            yield update

    return bar()

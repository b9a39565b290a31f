"""`llmopt distill`: train a student (a smaller copy, a pruned / sparse / quantized artifact) towards a teacher."""

from __future__ import annotations

from typing import Annotated

import typer

from llmopt.cli.options import JsonOpt, OutputOpt, OverwriteOpt, TrustRemoteCodeOpt, config_option, with_config_options
from llmopt.cli.output import print_json, print_table, stderr
from llmopt.distill.config import DistillConfig

# Every DistillConfig field is an option, with the field's type, default and help (cli.options.config_option);
# qat has one choice yet.
DISTILL_OPTIONS = tuple(config_option(DistillConfig, name) for name in DistillConfig.model_fields if name != "qat")
_TYPES = {name: typer_type for name, typer_type, _ in DISTILL_OPTIONS}
LossName, ScheduleName = (_TYPES[name].__origin__ for name in ("loss", "schedule"))


@with_config_options(DISTILL_OPTIONS)
def distill(
    output: OutputOpt,
    resume: Annotated[bool, typer.Option(
        "--resume", help="Continue from OUTPUT.ckpt/'s checkpoint (refused if a setting that changes the run "
        "differs from the checkpoint's).")] = False,
    allow_changes: Annotated[bool, typer.Option(
        "--allow-changes", help="With --resume: continue even though settings differ from the checkpoint's.")
    ] = False,
    overwrite: OverwriteOpt = False,
    as_json: JsonOpt = False,
    trust_remote_code: TrustRemoteCodeOpt = False,
    settings: dict | None = None,
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

    config = make_distill_config(**settings)
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
        print_table(f"distilled {settings['teacher']} -> {output}", facts)


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

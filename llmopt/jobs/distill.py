"""distill TEACHER -> STUDENT -> artifact: a Hugging Face folder (dense or sparse students) or the quantized
student's own format, with llmopt.json holding the whole configuration, the data, the steps and the final
losses. Checkpoints and the step log live in OUT.ckpt/ beside the output."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from llmopt.core.contract.sparsity import compressed_format
from llmopt.core.errors import ConfigError
from llmopt.core.io import check_output_free
from llmopt.core.models import resolve_model
from llmopt.distill.checkpoint import checkpoint_settings, has_checkpoint
from llmopt.distill.config import DistillConfig
from llmopt.distill.data import training_windows
from llmopt.distill.defaults import CHECKPOINT_SUFFIX
from llmopt.distill.student import Student
from llmopt.distill.trainer import CHECKPOINT_DIR, LOG_FILE, Distiller, Progress
from llmopt.formats.artifact import dense_state_dict, write_artifact
from llmopt.formats.load import load_model
from llmopt.formats.sparse import compress_linears
from llmopt.core.io import weights_bytes
from llmopt.jobs.common import peak_rss_bytes, prior_stages, resolve_input, source_entry
from llmopt.jobs.distill_students import build_student


def run_dir_for(output: str | Path) -> Path:
    output = Path(output)
    return output.parent / f"{output.name}{CHECKPOINT_SUFFIX}"


def fresh_output(output: str | Path, resume: bool, overwrite: bool, config: DistillConfig,
                 allow_changes: bool = False) -> tuple[Path, dict[str, tuple]]:
    """(the output path, the setting changes a resume was allowed), checked before any work (and before anything is created): free (a finished output is
    replaced only with --overwrite, resumed or not), not a model it reads, no earlier run's checkpoint beside it
    unless resuming or overwriting, and with --resume a checkpoint trained with these settings."""
    if allow_changes and not resume:
        raise ConfigError("--allow-changes applies to --resume only (it lets a resumed run change its settings)")
    output = check_output_free(output, overwrite)
    for model_name in filter(None, (config.teacher, config.student)):
        resolve_input(model_name, output)
    earlier = run_dir_for(output) / CHECKPOINT_DIR
    if resume:
        return output, check_resumable(earlier, config, allow_changes)
    if earlier.is_dir() and not overwrite:
        raise ConfigError(f"{earlier} holds an earlier run's checkpoint: pass --resume to continue it, or "
                          "--overwrite to start over")
    return output, {}


def check_resumable(checkpoint: Path, config: DistillConfig, allow_changes: bool = False) -> dict[str, tuple]:
    """Refuse --resume without a checkpoint, or from one trained with other settings (each named, with both
    values) unless allow_changes; returns the changes allowed."""
    if not has_checkpoint(checkpoint):
        raise ConfigError(f"--resume: no checkpoint in {checkpoint}; run without --resume to start the run")
    saved = checkpoint_settings(checkpoint)
    changes = config.resume_changes(saved) if saved is not None else {}
    if changes and not allow_changes:
        shown = ", ".join(f"{name} {old!r} -> {new!r}" for name, (old, new) in changes.items())
        raise ConfigError(f"--resume: the checkpoint in {checkpoint} was trained with other settings ({shown}): "
                          f"give the checkpoint's values, or add --allow-changes to continue with these",
                          param=next(iter(changes)))
    return changes


def resumes_cleanly(output: str | Path, config: DistillConfig) -> bool:
    """Whether OUTPUT's checkpoint can be resumed with `config` unchanged (a recipe re-run continues only such a
    checkpoint, and starts over otherwise)."""
    checkpoint = run_dir_for(output) / CHECKPOINT_DIR
    saved = checkpoint_settings(checkpoint)
    return has_checkpoint(checkpoint) and (saved is None or not config.resume_changes(saved))


def check_student_vocabulary(config: DistillConfig, trust_remote_code: bool = False) -> None:
    """Refuse (before loading anything) a student whose vocabulary is not the teacher's: the losses compare
    their distributions token by token."""
    from llmopt.core.models import load_config

    if config.student is None:
        return
    sizes = [getattr(load_config(resolve_model(name), trust_remote_code), "vocab_size", None)
             for name in (config.teacher, config.student)]
    if sizes[0] != sizes[1]:
        raise ConfigError(f"--student {config.student} has a vocabulary of {sizes[1]} tokens, the teacher "
                          f"{sizes[0]}: the student must share the teacher's tokenizer")


def generate_with_engine(model, tokenizer, prompts: list[list[int]], max_tokens: int, temperature: float,
                         seeds: list[int]) -> list[list[int]]:
    """On-policy continuations from llmopt's own engine, on the model's own modules (fast_path off: the packed
    fast layers would be copies of weights that are still training)."""
    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams

    engine = Engine(model, tokenizer, EngineConfig(fast_path=False, max_num_seqs=len(prompts)), record_steps=False)
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=seed)
              for seed in seeds]
    return [output.token_ids for output in engine.generate(prompts, params)]


def distill_to_artifact(config: DistillConfig, output: str | Path, resume: bool = False, overwrite: bool = False,
                        trust_remote_code: bool = False, progress: Callable[[Progress], None] | None = None,
                        allow_changes: bool = False) -> dict | None:
    """Distill as `config` says and write the student to `output`; return the facts measured (None in the other
    processes of a multi-process run)."""
    start = time.perf_counter()
    output, changes = fresh_output(output, resume, overwrite, config, allow_changes)
    check_student_vocabulary(config, trust_remote_code)
    teacher, tokenizer, teacher_source = load_model(config.teacher, "float32", trust_remote_code=trust_remote_code)
    student = build_student(config, teacher, tokenizer, trust_remote_code)
    if not config.needs_teacher:  # alpha 0: plain fine-tuning on the labels
        teacher = None
    windows = training_windows(tokenizer, config.data, config.seqlen, config.eval_windows,
                               config.max_train_tokens, config.seed, config.text_field)
    distiller = Distiller(config, teacher, student, tokenizer, windows, run_dir_for(output), progress,
                          generate_with_engine)
    facts = distiller.train(resume=resume)
    if not distiller.accelerator.is_main_process:  # the main process writes (and reports) the student
        return None
    model = distiller.accelerator.unwrap_model(distiller.model)
    model.eval()
    student_source = resolve_model(config.student) if config.student else teacher_source
    manifest = {"source": source_entry(config.student or config.teacher, student_source),
                "teacher": source_entry(config.teacher, teacher_source),
                "stages": [*(prior_stages(student_source) if config.student else []),
                           {"stage": "distill", "settings": config.model_dump(mode="json"),
                            **({"resumed_with_changes": changes} if changes else {})}],
                "distill": {**facts, **student.facts, "student_kind": student.kind,
                            "train_windows": int(windows.train.shape[0]), "log": str(distiller.run_dir / LOG_FILE)}}
    _write_student(output, student, model, tokenizer, manifest, overwrite)
    return {"output": str(output), "student_kind": student.kind, **facts, **student.facts,
            "num_parameters": sum(p.numel() for p in model.parameters()),
            "total_wall_s": round(time.perf_counter() - start, 2), "peak_rss_bytes": peak_rss_bytes(),
            "artifact_weights_bytes": weights_bytes(output)}


def train_medusa_heads(config: DistillConfig, output: str | Path, resume: bool = False, overwrite: bool = False,
                       trust_remote_code: bool = False, progress: Callable[[Progress], None] | None = None,
                       allow_changes: bool = False) -> dict:
    """Train config.medusa_heads Medusa heads on the frozen teacher and write OUTPUT/medusa_heads.safetensors
    (with llmopt.json); `--speculative medusa:OUTPUT` serves with them."""
    from llmopt.core.io import atomic_output_dir, write_json
    from llmopt.distill.medusa import GENERATION_STEPS, MedusaTrainer, medusa_prompts
    from llmopt.runtime.engine.config import MEDUSA_HEADS_FILE, EngineConfig
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams

    start = time.perf_counter()
    output, changes = fresh_output(output, resume, overwrite, config, allow_changes)
    model, tokenizer, source = load_model(config.teacher, "float32", trust_remote_code=trust_remote_code)
    prompts = medusa_prompts(tokenizer, config.data, min(config.on_policy_prompt_len, config.seqlen - 1),
                             config.seed, config.text_field)
    if len(prompts) < 2:
        raise ConfigError(f"--data {config.data} gave {len(prompts)} usable prompts: Medusa heads need more")
    generations = config.batch_size * GENERATION_STEPS
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=generations), record_steps=False)

    def generate(batch: list[list[int]], new_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, detokenize=False)
        return [o.token_ids for o in engine.generate(batch, params)]

    trainer = MedusaTrainer(config, model, prompts, generate, run_dir_for(output), progress)
    facts = trainer.train(resume=resume)
    manifest = {"source": source_entry(config.teacher, source),  # (Medusa heads train on the teacher: no student)
                "stages": [{"stage": "distill", "settings": config.model_dump(mode="json"),
                            **({"resumed_with_changes": changes} if changes else {})}],
                "medusa": {**facts, "num_heads": config.medusa_heads, "prompts": len(prompts),
                           "log": str(trainer.run_dir / LOG_FILE)}}
    with atomic_output_dir(output, overwrite=overwrite) as tmp:
        trainer.heads.save(tmp / MEDUSA_HEADS_FILE)
        write_json(tmp / "llmopt.json", manifest)
    return {"output": str(output), "heads": str(output / MEDUSA_HEADS_FILE), **facts,
            "total_wall_s": round(time.perf_counter() - start, 2), "peak_rss_bytes": peak_rss_bytes()}


def _write_student(output: Path, student: Student, model, tokenizer, manifest: dict, overwrite: bool) -> None:
    config_dict = model.config.to_dict()
    if student.kind == "quantized":
        layers = student.fake_quant_layers()
        qweights = {name: layer.to_quantized() for name, layer in layers.items()}
        skip = {f"{name}.{suffix}" for name in layers for suffix in ("q", "g_idx", "scales", "zeros", "bias")}
        dense = dense_state_dict(model, skip, torch.float16)
        write_artifact(output, dense, config_dict, tokenizer, qweights, student.format_name, None, manifest,
                       generation_config=getattr(model, "generation_config", None), overwrite=overwrite,
                       quantization_config=student.quantization_config)
        return
    config_dict.pop("quantization_config", None)
    tensors = dense_state_dict(model, set(), torch.float32)
    if student.compressed_pattern is not None:  # the masks held: the linears are as sparse as they were stored
        tensors = compress_linears(tensors, [name.removesuffix(".weight") for name in student.masks],
                                   student.compressed_pattern)
        config_dict["sparsity_config"] = {**config_dict["sparsity_config"],
                                          "format": compressed_format(student.compressed_pattern)}
    write_artifact(output, tensors, config_dict, tokenizer, {}, None, None, manifest,
                   generation_config=getattr(model, "generation_config", None), overwrite=overwrite,
                   quantization_config=student.quantization_config)  # (a compressed student's, else None)

"""Loading distillation students (distill.student.Student): a copy of the teacher, a dense / structured-pruned /
sparse / int-quantized artifact, optionally cut to some of its layers (kept by index, or the least important
dropped as the structured pruner scores blocks)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from llmopt.core.errors import ConfigError
from llmopt.core.models import resolve_model
from llmopt.distill.config import DistillConfig
from llmopt.distill.fake_quant import FakeQuantLinear
from llmopt.distill.student import Student, sparse_masks


def _load_source(name: str, dtype: str, trust_remote_code: bool) -> Student:
    from llmopt.formats.load import load_model
    from llmopt.formats.read import model_from_contents, read_artifact

    source = resolve_model(name)
    if source.kind == "artifact":
        contents = read_artifact(source.path)
        structured = contents.manifest.get("structured") or {}
        teacher_layers = structured.get("keep_layers") or None
        if contents.qweights:
            if contents.scheme.type != "int" or any(q.input_activations for q in contents.qweights.values()):
                raise ConfigError(f"{name} holds {contents.scheme.type} weights or quantized inputs: distillation "
                                  "trains integer weight-only students; distill the unquantized model, then quantize")
            model = model_from_contents(contents, torch.float32, "cpu",
                                        linear_factory=lambda qweight: FakeQuantLinear(qweight))
            return Student(model, "quantized", name, teacher_layers,
                           quantization_config=contents.config["quantization_config"], format_name=contents.fmt.name)
        model, _, _ = load_model(source, dtype, trust_remote_code=trust_remote_code)
        if contents.config.get("sparsity_config"):
            pattern = next((w.pattern for w in contents.sparse.values()), None)
            return Student(model, "sparse", name, teacher_layers, masks=sparse_masks(model),
                           quantization_config=contents.config.get("quantization_config") if pattern else None,
                           compressed_pattern=pattern)
        return Student(model, "dense", name, teacher_layers)
    model, _, _ = load_model(source, dtype, trust_remote_code=trust_remote_code)
    return Student(model, "dense", name, None)


def _drop_layers_plan(model, tokenizer, config: DistillConfig):
    from llmopt.compress.config import CalibrationConfig, StructuredConfig
    from llmopt.compress.structured import collect_importance, plan_pruning

    num_layers = model.config.num_hidden_layers
    drop = config.drop_layers
    if not 0 < drop < num_layers:
        raise ConfigError(f"--init drop-layers:{drop}: the student has {num_layers} layers; drop 1..{num_layers - 1}")
    structured = StructuredConfig(structured="layers", ratio=drop / num_layers,
                                  calibration=CalibrationConfig(calib=config.data, num_samples=16,
                                                                seqlen=min(config.seqlen, 512), seed=config.seed))
    scores = collect_importance(model, tokenizer, structured)
    return plan_pruning(model.config, "layers", drop / num_layers, scores)  # removes round(ratio * L) = drop


def build_student(config: DistillConfig, teacher: nn.Module, tokenizer, trust_remote_code: bool = False
                  ) -> Student:
    """The student the config names, trainable, in float32 (mixed precision is the trainer's autocast)."""
    from llmopt.compress.structured import apply_plan, layers_plan

    if config.student is None:
        student = Student(copy.deepcopy(teacher), "dense", config.teacher,
                          list(range(teacher.config.num_hidden_layers)))
    else:
        student = _load_source(config.student, "float32", trust_remote_code)
    if config.student_layers is not None or config.init is not None:
        if student.kind != "dense":
            raise ConfigError(f"--student-layers / --init work on dense students; {config.student} is "
                              f"{student.kind}: drop layers before sparsifying or quantizing")
        plan = (layers_plan(student.model.config, config.student_layers) if config.student_layers is not None
                else _drop_layers_plan(student.model, tokenizer, config))
        student.model = apply_plan(student.model, plan)
        base = student.teacher_layers
        student.teacher_layers = [base[i] for i in plan.keep_layers] if base else list(plan.keep_layers)
        student.facts["kept_layers"] = list(plan.keep_layers)
    student.model.float().train()
    if student.kind == "quantized":  # only the scales and zero points train
        for name, param in student.model.named_parameters():
            param.requires_grad_(".scales" in name or name.endswith(".zeros"))
    else:
        student.model.requires_grad_(True)
    return student



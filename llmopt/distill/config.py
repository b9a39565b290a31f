"""The typed configuration of a distillation run (the CLI's options and a recipe's `distill` stage)."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmopt.distill.defaults import DISTILL


def parse_duration(text: str | float | int | None) -> float | None:
    """Seconds from '15m', '90s', '1h', '1h30m' or a plain number of seconds."""
    if text is None or isinstance(text, (int, float)):
        return None if text is None else float(text)
    value = text.strip().lower()
    if re.fullmatch(r"\d+(\.\d+)?", value):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([hms])", value)
    if not parts or "".join(f"{n}{u}" for n, u in parts) != value.replace(" ", ""):
        raise ValueError(f"cannot read the duration {text!r}: write e.g. 15m, 90s, 1h30m")
    return sum(float(n) * {"h": 3600, "m": 60, "s": 1}[u] for n, u in parts)


def parse_layer_map(text: str) -> dict[int, int] | None:
    """'auto' -> None; '0:0,4:2' -> {teacher layer: student layer}."""
    if text == "auto":
        return None
    try:
        pairs = [item.split(":") for item in text.split(",") if item.strip()]
        return {int(t): int(s) for t, s in pairs}
    except ValueError:
        raise ValueError(f"cannot read --layer-map {text!r}: write auto or TEACHER:STUDENT pairs, e.g. 0:0,4:2") \
            from None


class DistillConfig(BaseModel):
    """Everything that decides a distillation run; stored whole in the output's llmopt.json."""

    model_config = ConfigDict(extra="forbid")

    teacher: str = Field(description="the model to learn from (frozen)")
    student: str | None = Field(None, description="model or artifact to train (dense, structured-pruned, sparse, "
                                "GPTQ/AWQ/compressed-tensors int); default: a copy of the teacher, made smaller by "
                                "--student-layers or --init")
    student_layers: list[int] | None = Field(None, description="keep only these decoder layers of the student, e.g. "
                                             "0,2,4,6", json_schema_extra={"text": True})
    init: str | None = Field(None, description="drop-layers:N: drop the student's N least important layers (block "
                             "importance, as the structured pruner scores it)")
    data: str = Field(DISTILL["data"], description="c4, wikitext2, pystdlib, sharegpt or a .txt/.jsonl file")
    text_field: str = Field("text", description="JSONL field holding the text")
    max_steps: int | None = Field(None, ge=1, description="optimizer steps")
    max_time: float | None = Field(None, gt=0, description="training time budget in seconds, or as 15m, 1h, 90s "
                                   "(with --max-steps: whichever ends first)", json_schema_extra={"text": True})
    seqlen: int = Field(DISTILL["seqlen"], ge=8, description="tokens per training window")
    batch_size: int = Field(DISTILL["batch_size"], ge=1, description="windows per process per micro-batch")
    grad_accum: int = Field(DISTILL["grad_accum"], ge=1, description="micro-batches per optimizer step")
    lr: float = Field(DISTILL["lr"], gt=0, description="peak learning rate")
    warmup: int = Field(DISTILL["warmup"], ge=0, description="optimizer steps of linear warm-up")
    schedule: Literal["cosine", "linear", "constant"] = Field(DISTILL["schedule"],
                                                              description="learning-rate schedule after warm-up")
    weight_decay: float = Field(DISTILL["weight_decay"], ge=0, description="AdamW's weight decay")
    max_grad_norm: float | None = Field(DISTILL["max_grad_norm"], gt=0, description="clip the gradient norm to this")
    seed: int = Field(0, description="random seed")
    dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="auto: bfloat16 autocast where the device computes it fast, else float32")
    loss: Literal["forward_kl", "reverse_kl", "jsd", "skew_kl", "skew_reverse_kl"] = Field(
        DISTILL["loss"], description="divergence to the teacher's distribution")
    temperature: float = Field(DISTILL["temperature"], gt=0, description="softmax temperature of both models' logits")
    beta: float = Field(DISTILL["beta"], ge=0, le=1, description="jsd: mixture weight; skew_*: skew")
    alpha: float = Field(DISTILL["alpha"], ge=0, le=1,
                         description="weight of the distillation loss; the hard-label cross-entropy gets 1 - alpha "
                         "(0: plain fine-tuning)")
    teacher_topk: int | None = Field(None, ge=1, description="keep only the teacher's top-k logits per position "
                                     "(renormalized)")
    hidden_loss: Literal["mse", "cosine"] | None = Field(None, description="also match hidden states (a learned "
                                                         "projection when widths differ)")
    hidden_weight: float = Field(DISTILL["hidden_weight"], ge=0, description="weight of the hidden-state loss")
    layer_map: str = Field("auto", description="auto, or TEACHER:STUDENT layer pairs such as 0:0,4:2")
    on_policy_ratio: float = Field(0.0, ge=0, le=1, description="fraction of batches made of the student's own "
                                   "generations (GKD)")
    on_policy_prompt_len: int = Field(DISTILL["on_policy_prompt_len"], ge=1,
                                      description="tokens of each window kept as the on-policy prompt")
    on_policy_temperature: float = Field(1.0, ge=0, description="sampling temperature of the on-policy generations "
                                         "(0: greedy)")
    qat: Literal["scales"] = Field("scales", description="quantized students: what trains (scales and zero "
                                                         "points; the integer codes stay fixed)")
    eval_every: int | None = Field(None, ge=1, description="held-out perplexity every N steps (windows never "
                                   "trained on)")
    eval_windows: int = Field(DISTILL["eval_windows"], ge=1, description="windows held out of training for "
                              "--eval-every")
    save_every: int | None = Field(None, ge=1, description="checkpoint every N steps (always at the end and on "
                                   "Ctrl-C)")
    max_train_tokens: int = Field(DISTILL["max_train_tokens"], ge=1, description="training tokens read from --data "
                                  "at most")
    teacher_device: str | None = Field(None, description="run the teacher on another device (e.g. cuda:1)")
    log_every: int = Field(1, ge=1, description="write every Nth step to the log")
    medusa_heads: int | None = Field(None, ge=1, description="instead of a student: train this many Medusa heads on "
                                     "the frozen teacher (its own greedy continuations of --data's prompts) into "
                                     "OUTPUT/medusa_heads.safetensors, for `--speculative medusa:OUTPUT`")

    @field_validator("layer_map")
    @classmethod
    def _check_layer_map(cls, value: str) -> str:
        parse_layer_map(value)
        return value

    @field_validator("init")
    @classmethod
    def _check_init(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"drop-layers:\d+", value):
            raise ValueError(f"--init {value!r}: the only initializer is drop-layers:N")
        return value

    @model_validator(mode="after")
    def _check(self):
        if self.max_steps is None and self.max_time is None:
            raise ValueError("give --max-steps and/or --max-time: the run needs an end")
        if self.student_layers is not None and self.init is not None:
            raise ValueError("give --student-layers or --init drop-layers:N, not both")
        if self.medusa_heads is not None:
            clash = [name for name in ("student", "student_layers", "init", "hidden_loss") if getattr(self, name)]
            if clash or self.on_policy_ratio:
                raise ValueError(f"--medusa-heads trains heads on the teacher itself: drop "
                                 f"{', '.join('--' + n.replace('_', '-') for n in clash) or '--on-policy-ratio'}")
        if self.alpha == 0 and (self.hidden_loss or self.on_policy_ratio):
            raise ValueError("alpha 0 trains on the labels alone: hidden-state loss and on-policy batches need "
                             "the teacher (raise --alpha)")
        return self

    def resume_changes(self, saved: dict) -> dict[str, tuple]:
        """{field: (checkpoint's value, this config's)} for every setting that changes the run's trajectory and
        differs from `saved` (the settings a checkpoint was trained with). The end of the run (max_steps,
        max_time) changes it only through the learning-rate schedule, so not under a constant one."""
        free = set(RESUME_FREE_FIELDS)
        if self.schedule == "constant" and saved.get("schedule") == "constant":
            free |= {"max_steps", "max_time"}
        current = self.model_dump(mode="json")
        return {name: (saved.get(name), value) for name, value in current.items()
                if name not in free and saved.get(name) != value}

    @property
    def needs_teacher(self) -> bool:
        return self.alpha > 0

    @property
    def drop_layers(self) -> int | None:
        return int(self.init.split(":")[1]) if self.init else None


# settings that only say when to log, evaluate and checkpoint, or where the teacher runs: a resumed run may change
# them freely (every other one changes the weights it trains)
RESUME_FREE_FIELDS = ("log_every", "eval_every", "save_every", "teacher_device")


def make_distill_config(**settings) -> DistillConfig:
    """A DistillConfig from flat settings (CLI options, a recipe stage); max_time may be '15m'; a validation
    error becomes one ConfigError line naming the setting."""
    from pydantic import ValidationError

    from llmopt.core.errors import ConfigError, invalid_settings

    settings = {k: v for k, v in settings.items() if v is not None}
    try:
        if "max_time" in settings:
            settings["max_time"] = parse_duration(settings["max_time"])
        if isinstance(settings.get("student_layers"), str):
            settings["student_layers"] = [int(i) for i in settings["student_layers"].split(",") if i.strip()]
        return DistillConfig(**settings)
    except ValidationError as e:
        raise invalid_settings(e, "distill") from None
    except ValueError as e:
        raise ConfigError(str(e)) from None

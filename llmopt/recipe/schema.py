"""The recipe file: pydantic models (unknown keys rejected) and a loader whose errors name file:line.

    name: smollm2-quantization
    model: smollm2-135m
    defaults: {calib: c4, num_samples: 128, seqlen: 512, seed: 0}
    variants:
      fp32: []
      gptq-w4g64:
        - quantize: {method: gptq, bits: 4, group_size: 64}
    evaluate:
      ppl: {datasets: [wikitext2, pystdlib], seqlen: 512, max_tokens: 32768}
      tasks: {names: [arc_easy, piqa], limit: 200}
    bench: {dataset: random, num_requests: 16, input_len: 128, output_len: 64}
    baseline: fp32
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from llmopt.core.io import check_unique_keys
from llmopt.core.errors import ConfigError, LLMOptError
from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig, engine_field_types


# --dtype's choices (core.hardware.DTYPE_CHOICES, which imports torch: recipe validation does not)
Dtype = Literal["auto", "float32", "bfloat16", "float16"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _CheckedByEngineConfig(_Strict):
    @model_validator(mode="after")
    def _engine_checks(self):
        try:
            EngineConfig(**self.model_dump())
        except ConfigError as e:
            raise ValueError(str(e)) from None
        return self


def _engine_section() -> type[BaseModel]:
    """The recipe's `bench.engine` mapping, generated from EngineConfig's fields (types, defaults, help): each
    engine setting is declared once, and checked once (EngineConfig's own checks, at validation)."""
    from pydantic import create_model

    fields = {f.name: (hint, Field(f.default, description=f.metadata["help"])) for f, hint in engine_field_types()}
    return create_model("EngineSection", __base__=_CheckedByEngineConfig, **fields)


EngineSection = _engine_section()


class Defaults(_Strict):
    data_dir: Optional[str] = None
    calib: str = "c4"
    num_samples: int = Field(128, ge=1)
    seqlen: int = Field(512, ge=2)
    seed: int = 0
    dtype: Dtype = "float32"  # evaluation dtype


class PplEval(_Strict):
    datasets: list[str] = Field(default_factory=lambda: ["wikitext2"])
    seqlen: int = Field(512, ge=2)
    max_tokens: Optional[int] = Field(32768, ge=2)
    batch_size: int = Field(4, ge=1)


class TasksEval(_Strict):
    names: list[str]
    limit: Optional[int] = Field(None, ge=1)
    batch_size: int = Field(16, ge=1)

    @field_validator("names")
    @classmethod
    def _known(cls, names):
        from llmopt.eval.tasks import TASKS

        for name in names:
            if name not in TASKS:
                raise ValueError(f"unknown task {name!r}; allowed: {', '.join(TASKS.names())}")
        return names


class Evaluate(_Strict):
    ppl: Optional[PplEval] = None
    tasks: Optional[TasksEval] = None


class BenchSpec(_Strict):
    dataset: str = "random"
    num_requests: int = Field(16, ge=1)
    input_len: int = Field(128, ge=1)
    output_len: int = Field(64, ge=1)
    range_ratio: float = Field(0.0, ge=0, lt=1)
    request_rate: float = Field(float("inf"), gt=0)
    # bfloat16 where the CPU multiplies it natively, else float32 (core.hardware)
    dtype: Dtype = "auto"
    engine: EngineSection = Field(default_factory=EngineSection)  # any EngineConfig field: max_num_seqs, ...
    slo: Optional[str] = None
    serve: bool = False  # bench each variant served over HTTP (llmopt serve on loopback), not the engine directly
    # also run the workload one request at a time (its first runner.BATCH1_REQUESTS requests): batch-1 speed beside the
    # batched figures, since a quantized model can win at one and lose at the other
    batch1: bool = False
    # speculative decoding as `--speculative` takes it (ngram, draft:MODEL, medusa[:PATH]), and its draft length
    speculative: Optional[str] = None
    # variants are benched in an order shuffled by defaults.seed (the first measurement of a process can pay
    # one-off costs); `recipe` keeps the file's order
    order: Literal["shuffled", "recipe"] = "shuffled"
    num_speculative_tokens: Optional[int] = Field(None, ge=1)  # default: SpeculativeConfig's; needs speculative

    @model_validator(mode="after")
    def _draft_length_needs_a_method(self):
        if self.num_speculative_tokens is not None and self.speculative is None:
            raise ValueError("num_speculative_tokens needs speculative (ngram, draft:MODEL or medusa)")
        return self

    @field_validator("speculative")
    @classmethod
    def _method(cls, text):
        if text is not None:
            try:
                SpeculativeConfig.parse(text)
            except ConfigError as e:
                raise ValueError(str(e)) from None
        return text

    def engine_config(self) -> EngineConfig:
        return EngineConfig(**self.engine.model_dump(), speculative=self.speculative_config())

    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative is None:
            return None
        given = {} if self.num_speculative_tokens is None else {"num_speculative_tokens": self.num_speculative_tokens}
        return SpeculativeConfig.parse(self.speculative, **given)

    @field_validator("dataset")
    @classmethod
    def _known(cls, name):
        from llmopt.eval.workloads import WORKLOADS

        if name not in WORKLOADS:
            raise ValueError(f"unknown dataset {name!r}; allowed: {', '.join(WORKLOADS.names())}")
        return name


# stages that leave a quantized model, and the stages that refuse one as input (jobs.common)
QUANTIZING_STAGES = {"quantize", "bnb"}
QUANTIZED_INPUT_REFUSED = {"quantize", "prune", "cast"}


class Recipe(_Strict):
    name: str
    model: str
    defaults: Defaults = Field(default_factory=Defaults)
    variants: dict[str, list[dict[str, dict[str, Any]]]]
    evaluate: Evaluate = Field(default_factory=Evaluate)
    bench: Optional[BenchSpec] = None
    baseline: Optional[str] = None

    @field_validator("variants")
    @classmethod
    def _stages(cls, variants):
        from llmopt.recipe.stages import STAGES

        if not variants:
            raise ValueError("a recipe needs at least one variant")
        for name, stages in variants.items():
            for i, stage in enumerate(stages):
                if len(stage) != 1:
                    raise ValueError(f"variant {name!r} stage {i}: one stage name per list item")
                (stage_name,) = stage
                if stage_name not in STAGES:
                    raise ValueError(f"variant {name!r}: unknown stage {stage_name!r}; "
                                     f"allowed: {', '.join(STAGES.names())}")
                quantizing = [next(iter(s)) for s in stages[:i] if next(iter(s)) in QUANTIZING_STAGES]
                if stage_name in QUANTIZED_INPUT_REFUSED and quantizing:
                    raise ValueError(f"variant {name!r} stage {i}: {stage_name} after {quantizing[-1]}: the model "
                                     "is already quantized there (quantize or prune the unquantized model once)")
        return variants

    @model_validator(mode="after")
    def _baseline(self):
        if self.baseline is not None and self.baseline not in self.variants:
            raise ValueError(f"baseline {self.baseline!r} is not a variant; allowed: {', '.join(self.variants)}")
        return self

    def stage_options(self, stage_name: str, options: dict) -> dict:
        """A stage's options with the recipe's defaults it takes filled in (the calibration settings; a distill
        stage's teacher is the recipe's model)."""
        from llmopt.recipe.stages import STAGES

        filled = {k: (self.model if k == "teacher" else getattr(self.defaults, k))
                  for k in STAGES.get(stage_name).defaulted}
        return {**filled, **options}


def _line_of(node, loc: tuple) -> int | None:
    """1-based line of the YAML node at `loc` (the deepest node that exists on the path)."""
    line = node.start_mark.line + 1
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            match = [v for k, v in node.value if k.value == str(key)]
            if not match:
                key_nodes = [k for k, _ in node.value if k.value == str(key)]
                return key_nodes[0].start_mark.line + 1 if key_nodes else line
            node = match[0]
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    return line


def load_recipe(path: str | Path, check_inputs: bool = False) -> Recipe:
    """The recipe in `path`, validated (schema, stage options); check_inputs also makes every check its run makes
    before work (recipe.preflight: the model exists, stage options fit it), reading configs only. Errors name
    the file and line."""
    path = Path(path)
    if path.is_dir():
        raise ConfigError(f"recipe {path} is a folder: give a recipe .yaml file")
    if not path.is_file():
        raise ConfigError(f"recipe {path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"recipe {path} is not a UTF-8 text file (byte {e.start}): give a YAML recipe") from None
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        if node is not None:
            check_unique_keys(node, path)
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML ({getattr(e, 'problem', e)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}:1: a recipe is a mapping with name, model and variants")
    try:
        recipe = Recipe(**data)
    except ValidationError as e:
        err = e.errors()[0]
        loc = tuple(p for p in err["loc"] if p != "__root__")
        line = _line_of(node, loc)
        key = ".".join(str(p) for p in loc) or "(top level)"
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            model = _model_at(Recipe, loc[:-1])
            allowed = f"; allowed: {', '.join(model.model_fields)}" if model else ""
            message = f"unknown key{allowed}"
        raise ConfigError(f"{path}:{line}: {key}: {message}") from None
    for variant, stages in recipe.variants.items():
        for i, stage in enumerate(stages):
            ((stage_name, options),) = stage.items()
            try:
                from llmopt.recipe.stages import STAGES

                STAGES.get(stage_name).validate(recipe.stage_options(stage_name, options or {}))
            except ConfigError as e:
                line = _line_of(node, ("variants", variant, i, stage_name))
                raise ConfigError(f"{path}:{line}: variants.{variant}[{i}].{stage_name}: {e}") from None
    if check_inputs:
        _check_inputs(recipe, node, path)
    return recipe


def _check_inputs(recipe: Recipe, node, path: Path) -> None:
    from llmopt.core.datasets import check_dataset_name
    from llmopt.recipe.preflight import StageError, check_variant, skeleton_of

    try:
        model = skeleton_of(recipe.model)
    except LLMOptError as e:
        raise ConfigError(f"{path}:{_line_of(node, ('model',))}: model: {e}") from None
    for variant, stages in recipe.variants.items():
        named = [next(iter(stage.items())) for stage in stages]
        try:
            check_variant([(name, recipe.stage_options(name, options or {})) for name, options in named], model)
        except StageError as e:
            name = named[e.index][0]
            line = _line_of(node, ("variants", variant, e.index, name))
            raise ConfigError(f"{path}:{line}: variants.{variant}[{e.index}].{name}: {e}") from None
    if recipe.evaluate.ppl is not None:
        for i, name in enumerate(recipe.evaluate.ppl.datasets):
            try:
                check_dataset_name(name)
            except LLMOptError as e:
                line = _line_of(node, ("evaluate", "ppl", "datasets", i))
                raise ConfigError(f"{path}:{line}: evaluate.ppl.datasets[{i}]: {e}") from None


def _model_at(model, loc: tuple):
    """The pydantic model class that owns the field at loc (to list its allowed keys)."""
    for key in loc:
        field = model.model_fields.get(str(key)) if isinstance(key, str) else None
        if field is None:
            return None
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        candidates = [annotation, *(inner or [])]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return None
    return model

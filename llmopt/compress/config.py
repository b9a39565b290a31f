"""One typed config per compression method (quantization, sparsity, structured pruning); the CLI, the recipes
and the artifacts share them."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from llmopt.compress.defaults import (
    CALIBRATION, QUANTIZE, ROTATION_SEED, SCORES_FILE, SEARCH_FILE, SPARSEGPT_DAMP, STRUCTURED_NUM_SAMPLES,
)
from llmopt.core.contract import PRESETS, QUANTIZE_PRESETS, SUPPORTED_BITS, QuantRecord, QuantScheme, parse_nm
from llmopt.core.contract.grid import weight_grid


def calibration_dtype(name: str, device: str) -> str:
    """The calibration forwards' dtype: 'auto' -> bfloat16 where the device computes bf16 fast
    (core.hardware.resolve_dtype), else float32 (calibration has no fp16 path); other names pass through."""
    from llmopt.core.hardware import check_device, resolve_dtype

    check_device(device)
    if name != "auto":
        return name

    return "bfloat16" if resolve_dtype("auto", device) == "bfloat16" else "float32"


def saved_tensors_file(value: str | None, file_name: str, option: str, required_key: str | None = None):
    """The path of tensors saved in an artifact (the file, or the artifact folder holding `file_name`), checked
    now rather than after the model has loaded."""
    if value is None:
        return None
    from llmopt.core.models import read_safetensors_header

    path = Path(value).expanduser()
    if path.is_dir():
        if not (path / file_name).is_file():
            raise ValueError(f"{option} {value}: the folder has no {file_name} (give the artifact that saved it)")
        path = path / file_name
    if not path.is_file():
        raise ValueError(f"{option} {value} does not exist: give an artifact folder or its {file_name}")
    try:
        header = read_safetensors_header(path)
    except Exception as e:
        raise ValueError(f"{option} {value}: {e}") from None
    if required_key is not None and required_key not in header:
        raise ValueError(f"{option} {value} holds no {required_key!r} tensor: give the {file_name} of a "
                         "structured-pruning artifact")
    return str(path)


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    calib: str = Field(CALIBRATION["calib"], description="dataset name(s), comma-separated to mix evenly")
    num_samples: int = Field(CALIBRATION["num_samples"], ge=1)
    seqlen: int = Field(CALIBRATION["seqlen"], ge=2)
    seed: int = CALIBRATION["seed"]
    batch_size: int = Field(CALIBRATION["batch_size"], ge=1)
    device: str = CALIBRATION["device"]
    text_field: str = Field(CALIBRATION["text_field"], description="field holding the text in .jsonl/.json files")
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        CALIBRATION["compute_dtype"],
        description="dtype of the calibration forwards (weights and statistics stay fp32); auto: bfloat16 "
        "where the device multiplies it natively, else float32 (resolved when the config is made)")

    @field_validator("calib")
    @classmethod
    def _known_datasets(cls, calib: str) -> str:
        from llmopt.core.datasets import check_dataset_name

        names = [name.strip() for name in calib.split(",") if name.strip()]
        if not names:
            raise ValueError("no calibration dataset given: pass --calib NAME[,NAME...]")
        for name in names:
            check_dataset_name(name)
        return calib

    @model_validator(mode="after")
    def _resolve_auto_dtype(self):
        self.compute_dtype = calibration_dtype(self.compute_dtype, self.device)
        return self


def yields_group_size(scheme: str) -> bool:
    """Whether a preset's group size gives way to an explicit one: weight-only integer presets (w4a16, w8a16)."""
    preset = PRESETS[scheme]
    return preset.weights.type == "int" and preset.input_activations is None


class QuantizeConfig(BaseModel):
    """Settings common to every integer quantization method. `scheme` names a preset (core.contract.PRESETS:
    w4a16, w8a16, w8a8-int8) that sets bits, group size and symmetry, and for W8A8 the input activations the
    checkpoint asks the runtime for; a bits / group_size / sym given beside it must agree with it."""

    model_config = ConfigDict(extra="forbid")

    method: str
    scheme: Optional[str] = None
    bits: int = Field(QUANTIZE["bits"], description="2, 3, 4 or 8")
    group_size: int = Field(QUANTIZE["group_size"], description="input columns per scale; -1 = per channel")
    sym: bool = Field(QUANTIZE["sym"], description="symmetric (zero point fixed) or asymmetric",
                      json_schema_extra={"flag": "--sym/--asym"})
    mse: bool = Field(False, description="choose each group's range by minimising the weight error")
    zero_point: Literal["int", "float"] = Field(
        "int", description="with --asym: int (codes; GPTQ, AWQ, compressed-tensors pack-quantized) or float (a float "
        "minimum per group, as GGUF Q4_1; written as compressed-tensors naive-quantized, exported to Q4_1 to fp32 "
        "rounding)")
    ignore: list[str] = Field(default_factory=list, description="glob patterns of linears to leave dense")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data):
        """The preset's bits, group size and symmetry, for those not given; a given one that differs is refused."""
        if not isinstance(data, dict) or data.get("scheme") is None:
            return data
        name = data["scheme"]
        if name not in QUANTIZE_PRESETS:
            raise ValueError(f"unknown scheme {name!r}: choose one of {', '.join(QUANTIZE_PRESETS)}")
        weights = PRESETS[name].weights
        implied = {"bits": weights.bits, "group_size": weights.group_size, "sym": weights.sym}
        if yields_group_size(name) and data.get("group_size") is not None:
            # a weight-only integer preset's group size yields to the one given (the preset's may not divide a
            # model's widths: 128 and SmolLM2's 576); the artifact records the one used. FP4's blocks are the
            # format's, and W8A8's per-channel scales what its integer products take.
            implied["group_size"] = data["group_size"]
        for key, value in implied.items():
            if data.get(key) is not None and data[key] != value:
                raise ValueError(f"{key} {data[key]} contradicts scheme {name} ({key} {value}): drop one")
        if weights.type == "float" and data.get("mse") is None:
            implied["mse"] = False  # float grids take their ranges from amax unless --mse asks for the search
        return {**data, **implied}

    @model_validator(mode="after")
    def _grid_methods(self):
        """The methods that round onto the preset's grid (core.contract.grid): AWQ searches integer grids only."""
        if self.scheme:
            weights = PRESETS[self.scheme].weights
            methods = weight_grid(weights.type).methods
            if self.method not in methods:
                raise ValueError(f"scheme {self.scheme} ({weights.type} weights) needs method {' or '.join(methods)}, "
                                 f"not {self.method}")
        return self

    @model_validator(mode="after")
    def _float_zero_point(self):
        if self.zero_point == "float":
            if self.sym:
                raise ValueError("zero_point float needs an asymmetric scheme: add --asym")
            if self.method not in ("rtn", "gptq"):
                raise ValueError(f"zero_point float needs method rtn or gptq, not {self.method}: AWQ's format stores "
                                 "integer zero points")
        return self

    @model_validator(mode="after")
    def _check_bits(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError("group_size must be -1 (per channel) or positive")
        return self

    @property
    def weight_scheme(self) -> QuantScheme:
        observer = "mse" if self.mse else "minmax"
        if self.scheme:  # the preset's (its type: int or float)
            weights = PRESETS[self.scheme].weights
            if self.group_size != weights.group_size:  # (a weight-only integer preset's, given: yields_group_size)
                return dataclasses.replace(weights, observer=observer, group_size=self.group_size, strategy=None)
            return dataclasses.replace(weights, observer=observer)
        return QuantScheme(self.bits, self.group_size, self.sym, observer=observer, zero_point=self.zero_point)

    @property
    def input_activations(self) -> QuantScheme | None:
        """The input activations' scheme the preset names (W8A8), else None (weight-only)."""
        return PRESETS[self.scheme].input_activations if self.scheme else None

    def record(self) -> QuantRecord:
        """What a checkpoint records of this config (formats read nothing else of it)."""
        return QuantRecord.from_config(self.weight_scheme, self.model_dump(), self.input_activations)

    @property
    def needs_calibration(self) -> bool:
        return True


class RTNConfig(QuantizeConfig):
    method: Literal["rtn"] = "rtn"

    @property
    def needs_calibration(self) -> bool:
        """Only for a checkpoint that stores statistics of its inputs (NVFP4 inputs' global scale)."""
        acts = self.input_activations
        return acts is not None and acts.scale_format == "e4m3"


class GPTQConfig(QuantizeConfig):
    """Defaults chosen on SmolLM2 (docs/results/quantization.md): act-order, MSE-chosen group ranges and
    10% dampening keep GPTQ from over-fitting its calibration text; with the classic settings (no act-order,
    min/max ranges, 1% dampening) it loses more than RTN, even on text like its calibration data. GPTAQ
    (matching the full-precision outputs) then cuts the remaining loss further."""

    method: Literal["gptq"] = "gptq"
    mse: bool = True
    damp: float = Field(0.1, gt=0, description="dampening, as a fraction of the Hessian's mean diagonal")
    block_size: int = Field(128, ge=1)
    act_order: bool = Field(True, description="quantize columns by decreasing Hessian diagonal (desc_act)")
    static_groups: bool = Field(True, description="with act-order: group parameters fixed up front, so g_idx stays "
                                "k // group_size")
    true_sequential: bool = True
    gptaq: bool = Field(True, description="match the full-precision model's outputs, not the quantized "
                        "model's own (GPTAQ asymmetric calibration; one more forward per stage)")
    gptaq_alpha: float = Field(1.0, gt=0, description="GPTAQ: weight of the drift correction (the paper's code "
                               "uses 0.25; 1.0, the exact correction, measured better on SmolLM2)")


class AWQConfig(QuantizeConfig):
    method: Literal["awq"] = "awq"
    grid: int = Field(20, ge=2, description="ratios tried in the scale search")
    clip: bool = True
    clip_grid: int = Field(20, ge=2)
    max_clip_shrink: float = Field(0.5, gt=0, lt=1)
    search_tokens: int = Field(4096, ge=16, description="calibration tokens kept per linear for the searches")
    search_file: str | None = Field(None, description="re-apply scales/clips saved in an artifact instead of "
                                    "searching", json_schema_extra={"flag": "awq-search"})

    @field_validator("search_file")
    @classmethod
    def _search_file(cls, value):
        return saved_tensors_file(value, SEARCH_FILE, "--awq-search")

    @property
    def needs_calibration(self) -> bool:
        return self.search_file is None


class SmoothQuantConfig(BaseModel):
    """SmoothQuant (Xiao et al. 2023): before quantizing, divide each smoothing group's input channels by
    s = max|X|^alpha / max|W|^(1-alpha) and multiply the weights by s (exact in full precision), moving activation
    outliers into the weights, where per-channel scales absorb them. alpha "search": per group, the grid value
    whose W8A8 fake-quantized output is closest to full precision on the calibration inputs."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["smoothquant"] = "smoothquant"
    alpha: float | Literal["search"] = 0.5
    scheme: str = Field("w8a8-int8", description="the preset whose quantization error the search minimises")
    grid: int = Field(20, ge=2, description="alphas tried by the search: 0, 1/grid, ..., 1")
    search_tokens: int = Field(1024, ge=16, description="calibration tokens kept per group for the search")
    ignore: list[str] = Field(default_factory=list, description="linears whose groups are left unsmoothed")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)

    @field_validator("alpha")
    @classmethod
    def _alpha(cls, value):
        if value != "search" and not 0 <= value <= 1:
            raise ValueError("smoothquant alpha must be in [0, 1] or 'search'")
        return value

    @field_validator("scheme")
    @classmethod
    def _scheme(cls, value):
        if value not in PRESETS or PRESETS[value].input_activations is None:
            raise ValueError(f"SmoothQuant needs a scheme with quantized input activations, not {value!r}")
        return value

    @property
    def needs_calibration(self) -> bool:
        return True


class RotationConfig(BaseModel):
    """Random orthogonal rotations folded into the weights before quantizing (compress.rotation): R1 the residual
    stream, R2 each attention head's values. Exact in full precision; no calibration."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["rotation"] = "rotation"
    rotations: list[Literal["R1", "R2"]] = Field(min_length=1)
    # (a torch generator takes seeds in [-2^63, 2^64 - 1]; R2's seed + 1 must stay inside)
    seed: int = Field(ROTATION_SEED, ge=0, le=2 ** 64 - 2,
                      description="seeds the random orthogonal matrices (R2 uses seed + 1)")

    @field_validator("rotations")
    @classmethod
    def _unique(cls, value):
        return sorted(set(value))

    @property
    def needs_calibration(self) -> bool:
        return False


class SparsityConfig(BaseModel):
    """Weights set to zero in place: a fraction (`sparsity`) or an N:M pattern along the input dim."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["magnitude", "wanda", "sparsegpt"] = Field(description="sparsity method")
    sparsity: float | None = Field(None, gt=0, lt=1, description="fraction of weights to zero")
    pattern: str | None = Field(None, description="N:M, at most N non-zeros in every M consecutive inputs: e.g. 2:4 "
                                "or 4:8")
    ignore: list[str] = Field(default_factory=list, description="glob patterns of linears to leave dense")
    damp: float = Field(SPARSEGPT_DAMP, gt=0, description="SparseGPT dampening, fraction of the Hessian's mean "
                        "diagonal")
    block_size: int = Field(128, ge=1)
    save_compressed: bool = Field(True, description="store the kept values and a bitmask (compressed-tensors' "
                                  "sparse-24-bitmask for 2:4 and 4:8, sparse-bitmask for unstructured), or the dense "
                                  "weights with zeros in place", json_schema_extra={"flag": "--save-compressed/--save-dense"})
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)

    @model_validator(mode="after")
    def _one_target(self):
        if (self.sparsity is None) == (self.pattern is None):
            raise ValueError("give exactly one of --sparsity F or --pattern N:M")
        if self.pattern is not None:
            self.nm  # validates
        return self

    @property
    def nm(self) -> tuple[int, int] | None:
        return None if self.pattern is None else parse_nm(self.pattern)

    @property
    def target_sparsity(self) -> float:
        if self.nm is not None:
            n, m = self.nm
            return 1 - n / m
        return float(self.sparsity)

    @property
    def structure(self) -> str:
        return self.pattern if self.pattern is not None else "unstructured"

    @property
    def needs_calibration(self) -> bool:
        return self.method != "magnitude"


class StructuredConfig(BaseModel):
    """Remove MLP channels, attention heads or whole decoder layers, giving a smaller dense model."""

    model_config = ConfigDict(extra="forbid")

    structured: Literal["mlp", "heads", "layers"] = Field(description="remove MLP channels, attention heads or "
                                                          "decoder layers")
    ratio: float = Field(gt=0, lt=1, description="structured: fraction of channels / heads / layers to remove")
    channel_multiple: int = Field(
        32, ge=1, description="keep a multiple of this many MLP channels, so group quantization still divides")
    scores_file: str | None = Field(None, description="structured: replay the importance scores saved in an "
                                    "artifact", json_schema_extra={"flag": "scores"})
    calibration: CalibrationConfig = Field(
        default_factory=lambda: CalibrationConfig(num_samples=STRUCTURED_NUM_SAMPLES))

    @field_validator("scores_file")
    @classmethod
    def _scores_file(cls, value):
        return saved_tensors_file(value, SCORES_FILE, "--scores", required_key="scores")


def build_config(config_cls: type[BaseModel], what: str, **settings) -> BaseModel:
    """A method config from flat settings (CLI options or a recipe stage): the calibration keys go into its
    `calibration`; a validation error becomes one ConfigError line."""
    from pydantic import ValidationError

    from llmopt.core.errors import invalid_settings

    calibration = {k: settings.pop(k) for k in list(settings) if k in CalibrationConfig.model_fields}
    try:
        return config_cls(calibration=CalibrationConfig(**calibration), **settings)
    except ValidationError as e:
        raise invalid_settings(e, what) from None

"""One typed config per quantization method; the CLI, the recipes and the artifacts share them."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.compress.quant import SUPPORTED_BITS, QuantScheme


def calibration_dtype(name: str, device: str) -> str:
    """The calibration forwards' dtype: 'auto' -> bfloat16 where the device computes bf16 fast
    (core.hardware.resolve_dtype), else float32 (calibration has no fp16 path); other names pass through."""
    if name != "auto":
        return name
    from llmopt.core.hardware import resolve_dtype

    return "bfloat16" if resolve_dtype("auto", device) == "bfloat16" else "float32"


class CalibrationConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    calib: str = Field("c4", description="dataset name(s), comma-separated to mix evenly")
    num_samples: int = Field(128, ge=1)
    seqlen: int = Field(512, ge=2)
    seed: int = 0
    batch_size: int = Field(8, ge=1)
    device: str = "cpu"
    compute_dtype: Literal["auto", "float32", "bfloat16"] = Field(
        "auto", description="dtype of the calibration forwards (weights and statistics stay fp32); auto: bfloat16 "
        "where the device multiplies it natively, else float32 (resolved when the config is made)")

    @model_validator(mode="after")
    def _resolve_auto_dtype(self):
        self.compute_dtype = calibration_dtype(self.compute_dtype, self.device)
        return self


class QuantizeConfig(BaseModel):
    """Settings common to every weight-only integer quantization method."""

    model_config = ConfigDict(extra="forbid")

    method: str
    bits: int = 4
    group_size: int = 128
    sym: bool = True
    mse: bool = Field(False, description="choose each group's clip ratio by minimising the weight error")
    ignore: list[str] = Field(default_factory=list, description="glob patterns of linears to leave dense")
    calibration: CalibrationConfig = Field(default_factory=CalibrationConfig)

    @model_validator(mode="after")
    def _check_bits(self):
        if self.bits not in SUPPORTED_BITS:
            raise ValueError(f"bits must be one of {SUPPORTED_BITS}")
        if self.group_size != -1 and self.group_size < 1:
            raise ValueError("group_size must be -1 (per channel) or positive")
        return self

    @property
    def scheme(self) -> QuantScheme:
        return QuantScheme(self.bits, self.group_size, self.sym)

    @property
    def needs_calibration(self) -> bool:
        return True


class RTNConfig(QuantizeConfig):
    method: Literal["rtn"] = "rtn"

    @property
    def needs_calibration(self) -> bool:
        return False


class GPTQConfig(QuantizeConfig):
    """Defaults chosen on SmolLM2 (docs/results/quantization.md): act-order, MSE-chosen group ranges and
    10% dampening keep GPTQ from over-fitting its calibration text; with the classic settings (no act-order,
    min/max ranges, 1% dampening) it loses more than RTN, even on text like its calibration data. GPTAQ
    (matching the full-precision outputs) then cuts the remaining loss further."""

    method: Literal["gptq"] = "gptq"
    mse: bool = True
    damp: float = Field(0.1, gt=0, description="dampening, as a fraction of the Hessian's mean diagonal")
    block_size: int = Field(128, ge=1)
    act_order: bool = True
    static_groups: bool = True
    true_sequential: bool = True
    gptaq: bool = Field(True, description="match the full-precision model's outputs, not the quantized "
                        "model's own (GPTAQ asymmetric calibration; one more forward per stage)")
    gptaq_alpha: float = Field(1.0, gt=0, description="GPTAQ: weight of the drift correction (the paper's code "
                               "uses 0.25; 1.0, the exact correction, measured better on SmolLM2)")
    prune_pattern: str | None = Field(
        None, description="N:M: SparseGPT-prune each linear, then quantize it, in the same pass; needs sym")
    prune_damp: float = Field(0.01, gt=0, description="SparseGPT's dampening when prune_pattern is set")

    @model_validator(mode="after")
    def _check_prune(self):
        if self.prune_pattern is not None:
            self.prune_nm  # validates
            if not self.sym:
                raise ValueError("prune_pattern needs sym quantization (zero must be representable)")
        return self

    @property
    def prune_nm(self) -> tuple[int, int] | None:
        from llmopt.prune.masks import parse_nm

        return None if self.prune_pattern is None else parse_nm(self.prune_pattern)


class AWQConfig(QuantizeConfig):
    method: Literal["awq"] = "awq"
    grid: int = Field(20, ge=2, description="ratios tried in the scale search")
    clip: bool = True
    clip_grid: int = Field(20, ge=2)
    max_clip_shrink: float = Field(0.5, gt=0, lt=1)
    search_tokens: int = Field(4096, ge=16, description="calibration tokens kept per linear for the searches")
    search_file: str | None = Field(None, description="re-apply saved scales/clips instead of searching")

    @property
    def needs_calibration(self) -> bool:
        return self.search_file is None


def build_config(config_cls: type[BaseModel], what: str, **settings) -> BaseModel:
    """A method config from flat settings (CLI options or a recipe stage): the calibration keys go into its
    `calibration`; a validation error becomes one ConfigError line."""
    from pydantic import ValidationError

    from llmopt.core.errors import ConfigError

    calibration = {k: settings.pop(k) for k in list(settings) if k in CalibrationConfig.model_fields}
    try:
        return config_cls(calibration=CalibrationConfig(**calibration), **settings)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigError(f"invalid {what} setting{' ' + where if where else ''}: {message}") from None

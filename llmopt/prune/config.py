"""Typed configs for pruning: unstructured / N:M sparsity, and structured pruning to a smaller model."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from llmopt.compress.config import CalibrationConfig
from llmopt.prune.masks import parse_nm


class SparsityConfig(BaseModel):
    """Weights set to zero in place: a fraction (`sparsity`) or an N:M pattern along the input dim."""

    model_config = ConfigDict(extra="forbid")

    method: Literal["magnitude", "wanda", "sparsegpt"]
    sparsity: float | None = Field(None, gt=0, lt=1)
    pattern: str | None = Field(None, description="N:M: at most N non-zeros in every M consecutive inputs")
    ignore: list[str] = Field(default_factory=list, description="glob patterns of linears to leave dense")
    damp: float = Field(0.01, gt=0, description="SparseGPT dampening, fraction of the Hessian's mean diagonal")
    block_size: int = Field(128, ge=1)
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

    structured: Literal["mlp", "heads", "layers"]
    ratio: float = Field(gt=0, lt=1, description="fraction of channels / heads / layers to remove")
    channel_multiple: int = Field(
        32, ge=1, description="keep a multiple of this many MLP channels, so group quantization still divides")
    scores_file: str | None = Field(None, description="replay the importance scores saved in an artifact")
    calibration: CalibrationConfig = Field(default_factory=lambda: CalibrationConfig(num_samples=32))

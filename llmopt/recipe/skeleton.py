"""What a recipe stage's input is known to be before anything runs (a Skeleton: its config, and its modules on
the meta device, with no weights), for the stages' preflight checks (recipe.preflight)."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from llmopt.core.contract.sparsity import quantizes
from llmopt.core.errors import ConfigError

FLOAT32_BYTES = 4  # the stages load their input in float32


@dataclass
class Skeleton:
    """What a stage's input is known to be before anything runs: its config, and its modules on the meta device."""

    name: str
    config: object
    quantized: bool = False
    changed: dict = field(default_factory=dict)  # config updates applied by earlier stages

    @cached_property
    def model(self):
        import torch
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.config)

    def updated(self, updates: dict, quantized: bool | None = None) -> Skeleton:
        """The skeleton of this model after a stage changed its config (`updates`) or quantized it."""
        from transformers import AutoConfig

        config = AutoConfig.for_model(**{**self.config.to_dict(), **updates}) if updates else self.config
        return Skeleton(self.name, config, self.quantized if quantized is None else quantized,
                        {**self.changed, **updates})


def skeleton_of(model_name: str, trust_remote_code: bool = False) -> Skeleton:
    """The skeleton of MODEL: it exists, its family is supported and its config can be built in this memory."""
    from llmopt.core.adapters import adapter_for
    from llmopt.core.config_checks import check_config
    from llmopt.core.models import load_config, resolve_model

    source = resolve_model(model_name)
    config = load_config(source, trust_remote_code)
    reason = adapter_for(config).unsupported(config)
    if reason:
        raise ConfigError(f"{model_name}: {reason}")
    check_config(config, FLOAT32_BYTES, model_name)
    return Skeleton(model_name, config, quantized=quantizes(getattr(config, "quantization_config", None)))



"""Every check a recipe's run makes before work, made without running it: the model (and each distill teacher)
exists and its config can be built, and each stage's options fit the model that stage will get (group sizes
dividing its linears, layer indices within its layers, pruning ratios that remove something and not everything),
following the shapes stage by stage (a structured prune or a layer-dropping distill changes them for the stages
after it). Only configs are read: the model's modules are built on the meta device, with no weights."""

from __future__ import annotations

from llmopt.core.errors import ConfigError, LLMOptError
from llmopt.recipe.skeleton import Skeleton, skeleton_of

__all__ = ["StageError", "check_variant", "skeleton_of"]


def check_variant(stages: list[tuple[str, dict]], model: Skeleton) -> Skeleton:
    """Each stage's preflight in order on the skeleton its input will be; the first error is raised with the
    index of its stage (StageError)."""
    from llmopt.recipe.stages import STAGES

    for index, (name, options) in enumerate(stages):
        try:
            model = STAGES.get(name).preflight(options, model)
        except LLMOptError as e:  # an option that does not fit, a teacher or data file that does not exist
            raise StageError(index, e) from None
    return model


class StageError(ConfigError):
    """A stage's preflight failed: which stage (its index in the variant) and why."""

    def __init__(self, index: int, cause: LLMOptError):
        super().__init__(str(cause))
        self.index = index

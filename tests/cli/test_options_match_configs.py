"""CLI options are checked against the configs and registries they feed, so a default or a choice lives in one
place: a new method, format or default shows up here if the CLI falls out of step."""

import typing

import pytest
import typer

from llmopt.cli.main import app
from llmopt.compress.api import load_methods
from llmopt.compress.base import PRUNE_METHODS, QUANT_METHODS
from llmopt.compress.config import CalibrationConfig, GPTQConfig, SparsityConfig, StructuredConfig
from llmopt.core.models import DTYPES
from llmopt.export.formats import FORMATS
from llmopt.runtime.engine.config import EngineConfig

load_methods()
COMMANDS = typer.main.get_command(app).commands


def option(command: str, name: str):
    params = {p.name: p for p in COMMANDS[command].params}
    return params[name]


def choices(command: str, name: str) -> set[str]:
    """The values of the option's enum (its default's class, or the enum named in the command's signature)."""
    import inspect

    from llmopt.cli import distill, export, generate, prune, quantize

    module = {"quantize": quantize, "prune": prune, "export": export, "generate": generate,
              "distill": distill}[command]
    annotation = inspect.signature(getattr(module, command), eval_str=True).parameters[name].annotation
    enum = next(a for a in typing.get_args(annotation)[:1] for a in [a, *typing.get_args(a)] if isinstance(a, type))
    return {member.value for member in enum}


def literal(model, field: str) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


def test_choices_are_the_registries():
    assert choices("quantize", "method") == set(QUANT_METHODS.names())
    assert choices("quantize", "fmt") == set(FORMATS.names()) == choices("export", "fmt")
    assert choices("prune", "method") == set(PRUNE_METHODS.names()) == literal(SparsityConfig, "method")
    assert choices("prune", "structured") == literal(StructuredConfig, "structured")
    assert choices("quantize", "calib_dtype") == literal(CalibrationConfig, "compute_dtype")
    assert choices("generate", "dtype") == {"auto", *DTYPES}


@pytest.mark.parametrize("command", ["quantize", "prune"])
def test_calibration_defaults_are_the_configs(command):
    for name in ("calib", "seqlen", "batch_size", "device", "seed"):
        assert option(command, name).default == CalibrationConfig.model_fields[name].default, name
    assert option(command, "calib_dtype").default.value == CalibrationConfig.model_fields["compute_dtype"].default
    assert option("quantize", "num_samples").default == CalibrationConfig.model_fields["num_samples"].default


def test_method_defaults_are_the_configs():
    for name in ("bits", "group_size", "sym"):
        assert option("quantize", name).default == GPTQConfig.model_fields[name].default, name
    assert option("prune", "damp").default == SparsityConfig.model_fields["damp"].default
    # GPTQ-only options default to None: the config's own default applies
    for name in ("damp", "act_order", "static_groups", "gptaq", "mse"):
        assert option("quantize", name).default is None, name


def test_engine_defaults_are_the_engine_config():
    defaults = EngineConfig()
    for cli_name, field in [("max_num_seqs", "max_num_seqs"), ("max_num_batched_tokens", "max_num_batched_tokens"),
                            ("block_size", "block_size"), ("kv_cache_memory_fraction", "kv_cache_memory_fraction"),
                            ("batching", "policy")]:
        assert option("bench", cli_name).default == getattr(defaults, field), cli_name
    from llmopt.recipe.schema import BenchSpec

    assert BenchSpec().max_num_seqs == defaults.max_num_seqs


def test_distill_options_are_the_config():
    import inspect

    from llmopt.cli import distill
    from llmopt.distill.config import DistillConfig
    from llmopt.distill.losses import DIVERGENCES

    params = inspect.signature(distill.distill, eval_str=True).parameters
    cli_only = {"output", "resume", "overwrite", "as_json", "trust_remote_code"}
    # every config field is an option and every option (but the run's own) a field
    assert set(params) - cli_only == set(DistillConfig.model_fields) - {"qat"}  # qat has one choice yet
    for name, field in DistillConfig.model_fields.items():
        if name in params and field.default is not None and not field.is_required():
            default = params[name].default
            assert getattr(default, "value", default) == field.default, name
    assert {m.value for m in distill.LossName} == literal(DistillConfig, "loss") == set(DIVERGENCES.names())
    assert {m.value for m in distill.ScheduleName} == literal(DistillConfig, "schedule")
    assert choices("distill", "dtype") == literal(DistillConfig, "dtype")


def test_recipe_dtypes_are_the_dtype_choices():
    from llmopt.core.hardware import DTYPE_CHOICES
    from llmopt.recipe.schema import BenchSpec, Defaults

    assert literal(Defaults, "dtype") == literal(BenchSpec, "dtype") == set(DTYPE_CHOICES)

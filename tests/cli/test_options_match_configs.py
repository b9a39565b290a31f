"""CLI options are checked against the configs and registries they feed, so a default or a choice lives in one
place: a new method, format or default shows up here if the CLI falls out of step."""

import typing

import pytest
import typer

from llmopt.cli.main import app
from llmopt.compress.api import load_methods
from llmopt.compress.base import PRUNE_METHODS, QUANT_METHODS
from llmopt.compress.config import CalibrationConfig, SparsityConfig, StructuredConfig
from llmopt.core.models import DTYPES
from llmopt.formats.layouts import FORMATS
from llmopt.cli.options import SPECULATIVE_OPTIONS
from llmopt.runtime.engine.config import EngineConfig, engine_fields, engine_flag

load_methods()
COMMANDS = typer.main.get_command(app).commands
SPECULATIVE_NAMES = {name for name, _, _ in SPECULATIVE_OPTIONS}


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
    # export also writes one GGUF file (not a checkpoint-folder format)
    assert choices("quantize", "fmt") == set(FORMATS.names()) == choices("export", "fmt") - {"gguf"}
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
    assert option("prune", "damp").default == SparsityConfig.model_fields["damp"].default
    assert option("prune", "save_compressed").default == SparsityConfig.model_fields["save_compressed"].default
    # options default to None where the config's own default (or --scheme's) applies
    for name in ("bits", "group_size", "sym", "scheme", "damp", "act_order", "static_groups", "gptaq", "mse"):
        assert option("quantize", name).default is None, name


ENGINE_COMMANDS = ("generate", "bench", "serve")


def engine_params(command: str) -> dict:
    return {p.name: p for p in COMMANDS[command].params
            if p.name in {f.name for f in engine_fields()} | SPECULATIVE_NAMES}


@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_engine_options_are_the_engine_config(command):
    """Every EngineConfig field is an option of each engine command, with the field's default, flag and help."""
    params = engine_params(command)
    defaults = EngineConfig()
    for f in engine_fields():
        param = params[f.name]
        default = getattr(param.default, "value", param.default)
        assert default == getattr(defaults, f.name), f.name
        assert f"--{engine_flag(f.name)}" in param.opts, (f.name, param.opts)
        assert param.help == f.metadata["help"], f.name
    assert set(params) == {f.name for f in engine_fields()} | SPECULATIVE_NAMES


def test_engine_commands_list_the_same_engine_options():
    shown = {c: {(p.name, tuple(p.opts), tuple(p.secondary_opts), str(p.default), p.help)
                 for p in engine_params(c).values()} for c in ENGINE_COMMANDS}
    assert shown["generate"] == shown["bench"] == shown["serve"]


def test_a_field_added_to_engine_config_becomes_an_option(monkeypatch):
    """The options are generated: a new field appears with its type, default and help."""
    import dataclasses

    from llmopt.cli import options
    from llmopt.runtime.engine import config

    @dataclasses.dataclass(frozen=True)
    class Wider(EngineConfig):
        max_loras: int = config.option(3, "LoRA adapters at most.")

    monkeypatch.setattr(options, "EngineConfig", Wider)
    monkeypatch.setattr(config, "EngineConfig", Wider)
    generated = {name: (default, kind) for name, kind, default in options._engine_options()}
    assert generated["max_loras"][0] == 3
    received = {}
    command = options.with_engine_options(lambda engine=None: received.setdefault("engine", engine))
    app_ = typer.Typer()
    app_.command()(command)
    from typer.testing import CliRunner

    assert CliRunner().invoke(app_, ["--max-loras", "5", "--no-prefix-cache"]).exit_code == 0
    assert received["engine"].max_loras == 5 and received["engine"].enable_prefix_cache is False


def test_recipe_engine_section_is_the_engine_config():
    from llmopt.recipe.schema import BenchSpec

    section = BenchSpec.model_fields["engine"].annotation
    assert set(section.model_fields) == {f.name for f in engine_fields()}
    assert BenchSpec().engine_config() == EngineConfig()
    assert BenchSpec(engine={"max_num_seqs": 3}).engine_config().max_num_seqs == 3


def test_distill_options_are_the_config():
    import inspect

    from llmopt.cli import distill
    from llmopt.distill.config import DistillConfig
    from llmopt.distill.losses import DIVERGENCES

    params = inspect.signature(distill.distill, eval_str=True).parameters
    cli_only = {"output", "resume", "allow_changes", "overwrite", "as_json", "trust_remote_code"}
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


def test_method_options_are_the_configs_fields():
    """quantize's and prune's method options are generated from the configs: flag, help and the methods each
    applies to come from the fields."""
    from llmopt.cli import prune, quantize
    from llmopt.compress.config import AWQConfig, GPTQConfig

    assert option("quantize", "search_file").opts == ["--awq-search"]
    assert option("quantize", "sym").opts == ["--sym"] and option("quantize", "sym").secondary_opts == ["--asym"]
    assert option("quantize", "damp").help == f"GPTQ: {GPTQConfig.model_fields['damp'].description} (default 0.1)."
    assert option("quantize", "mse").help.endswith("(default: rtn false, gptq true, awq false).")
    assert quantize.METHOD_ONLY["damp"] == ("gptq",) and quantize.METHOD_ONLY["search_file"] == ("awq",)
    assert quantize.METHOD_ONLY["bits"] == ("rtn", "gptq", "awq") and "grid" in AWQConfig.model_fields
    assert option("prune", "scores_file").opts == ["--scores"] and option("prune", "method").default is None
    assert option("prune", "sparsity").help == "Fraction of weights to zero."
    assert {name for name, _, _ in prune.PRUNE_OPTIONS} <= set(SparsityConfig.model_fields) | set(
        StructuredConfig.model_fields)


def test_a_field_added_to_a_method_config_becomes_an_option():
    """A new field is an option with its flag, help and type, given to the command by name, refused where its
    method's config lacks it."""
    from pydantic import Field
    from typer.testing import CliRunner

    from llmopt.cli.options import config_option, with_config_options
    from llmopt.compress.config import GPTQConfig, RTNConfig

    class Wider(GPTQConfig):
        damp_floor: float = Field(0.5, description="a new setting")

    generated = config_option({"rtn": RTNConfig, "gptq": Wider}, "damp_floor", given=True)
    name, kind, default = generated
    assert (name, default, kind.__metadata__[0].help) == ("damp_floor", None, "GPTQ: a new setting (default 0.5).")
    received = {}
    command = with_config_options((generated,))(lambda settings=None: received.update(settings))
    app_ = typer.Typer()
    app_.command()(command)
    assert CliRunner().invoke(app_, ["--damp-floor", "0.25"]).exit_code == 0
    assert received == {"damp_floor": 0.25}
    received.clear()
    received["called"] = True
    assert CliRunner().invoke(app_, []).exit_code == 0 and received == {"called": True}  # (not given: absent)

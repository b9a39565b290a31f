"""Option types shared by every command, so the same option reads the same everywhere."""

from __future__ import annotations

from enum import Enum
from typing import Annotated, Literal, Optional, get_args, get_origin

import functools
import inspect

import typer

from llmopt.compress.defaults import CALIBRATION
from llmopt.core.contract.scheme import QUANTIZE_PRESETS
from llmopt.core.errors import ConfigError
from llmopt.core.registry import declared_names
from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig, engine_field_types, engine_flag

SPECULATIVE_DEFAULTS = SpeculativeConfig()


class Backend(str, Enum):
    """What computes a command's numbers: llmopt's runtime (paged KV cache, its kernels) or transformers."""

    runtime = "runtime"
    hf = "hf"


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


ModelArg = Annotated[str, typer.Argument(
    help="An alias (smollm2-135m, tiny-random-llama), a model or llmopt artifact folder, a .gguf file, or a hub id.",
    show_default=False,
)]
DtypeOpt = Annotated[Dtype, typer.Option(
    "--dtype", help="Weights and compute dtype; auto: bfloat16 on CUDA and on CPUs with bf16 units "
    "(AVX512_BF16, AMX, Arm BF16), else float32.")]
DEFAULT_DEVICE = "cpu"  # the engine's device when --device is not given (every command's)
DeviceOpt = Annotated[str, typer.Option("--device", help="cpu, cuda or cuda:N.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON object on stdout.")]
SeedOpt = Annotated[int, typer.Option("--seed", help="Random seed.")]
TrustRemoteCodeOpt = Annotated[bool, typer.Option(
    "--trust-remote-code", help="Run model code shipped with the checkpoint (off by default: it is arbitrary code).",
)]
DatasetOpt = Annotated[str, typer.Option(
    "--dataset", help="pystdlib, wikitext2, c4, sharegpt, or a .txt/.jsonl/.json file.",
)]
TextFieldOpt = Annotated[str, typer.Option("--text-field", help="Field holding the text in .jsonl/.json files.")]
SeqlenOpt = Annotated[int, typer.Option("--seqlen", help="Tokens per window / sample.")]
MaxTokensOpt = Annotated[Optional[int], typer.Option("--max-tokens", help="Use at most this many tokens of the text.")]
OutputOpt = Annotated[str, typer.Option("-o", "--output", help="Output folder (written atomically).")]
MaxMemoryOpt = Annotated[Optional[str], typer.Option(
    "--max-memory", help="Compress a model larger than memory: read one decoder layer at a time from its "
    "safetensors files and write the artifact in shards as layers finish, within this much memory beyond the "
    "process's fixed cost (e.g. 600MB, 8GB).")]
OverwriteOpt = Annotated[bool, typer.Option("--overwrite", help="Replace an existing output folder.")]


def choices(name: str, values: list[str]) -> type[Enum]:
    """A str Enum for a Typer option from its allowed values ("compressed-tensors" -> member compressed_tensors)."""
    return Enum(name, {value.replace("-", "_"): value for value in values}, type=str)


# Choices read from the registries' declarations in their packages' source (core.registry.declared_names), so
# that `--help` does not import torch and a new method's module appears here by itself.
QuantMethod = choices("QuantMethod", declared_names("llmopt.compress", "QUANT_METHODS"))
FormatName = choices("FormatName", declared_names("llmopt.formats", "FORMATS"))
# `llmopt export` also writes one GGUF file (llama.cpp's format), which is not a checkpoint-folder format
ExportFormatName = choices("ExportFormatName", [*declared_names("llmopt.formats", "FORMATS"), "gguf"])
SchemeName = choices("SchemeName", list(QUANTIZE_PRESETS))


class CalibDtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


# Calibration options of quantize and prune, declared once (defaults: compress.defaults.CALIBRATION) and
# added to both commands by `with_calibration_options`.
CALIBRATION_OPTIONS = (  # (parameter, option type, default)
    ("calib", Annotated[str, typer.Option("--calib", help="Calibration dataset(s), comma-separated to mix.")],
     CALIBRATION["calib"]),
    ("seqlen", Annotated[int, typer.Option("--seqlen", help="Tokens per calibration sample.")], CALIBRATION["seqlen"]),
    ("batch_size", Annotated[int, typer.Option("--batch-size", help="Calibration samples per forward.")],
     CALIBRATION["batch_size"]),
    ("calib_dtype", Annotated[CalibDtype, typer.Option(
        "--calib-dtype", help="dtype of the calibration forwards; weights and statistics stay fp32.")],
     CalibDtype(CALIBRATION["compute_dtype"])),
    ("device", Annotated[str, typer.Option("--device", help="Where layers are calibrated: cpu, cuda.")],
     CALIBRATION["device"]),
    ("seed", Annotated[int, typer.Option("--seed", help="Random seed (calibration sample choice).")],
     CALIBRATION["seed"]),
    ("text_field", Annotated[str, typer.Option(
        "--text-field", help="Field holding the text in --calib .jsonl/.json files.")], CALIBRATION["text_field"]),
)


def _with_options(command, param: str, options: tuple, collect):
    """Add `options` ((parameter, option type, default)) to a command; it receives collect({name: value}) as
    its parameter `param` instead of the separate values."""
    signature = inspect.signature(command, eval_str=True)
    own = [p for p in signature.parameters.values() if p.name != param]
    added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
             for name, annotation, default in options]

    @functools.wraps(command)
    def run(*args, **kwargs):
        values = {name: kwargs.pop(name) for name, _, _ in options}
        return command(*args, **{param: collect(values)}, **kwargs)

    run.__signature__ = signature.replace(parameters=[
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added)
    run.__annotations__ = {**{p.name: p.annotation for p in own},
                           **{name: annotation for name, annotation, _ in options}}
    return run


def sentence(text: str | None) -> str | None:
    """A config field's description as option help: capitalised when it starts with a plain word (not a name such
    as c4 or drop-layers:N), ending in a full stop."""
    if not text:
        return None
    first = text.split(" ", 1)[0]
    if first.isalpha() and first.islower():
        text = text[0].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def config_option(models: type | dict[str, type], name: str, given: bool = False, panel: str | None = None) -> tuple:
    """(parameter, option type, default) of one field of a pydantic config, as `_engine_option` makes them of
    EngineConfig's: the flag is the field's name in kebab case (or its json_schema_extra `flag`: a name, or a
    '--ON/--OFF' pair for a boolean), the help its description, a Literal a choice, a boolean a --FLAG/--no-FLAG
    pair, an optional type its inner type; a field the CLI takes as text (json_schema_extra `text`: the config's
    maker parses it) a string. given: the option's default is None, i.e. not given, so the config (or a preset)
    decides; the help then states the config's default. models: one config, or {method: config} of the methods
    one option serves (the field is the first's that has it; the help names the methods that have it, when not all,
    and each one's default where they differ)."""
    models = models if isinstance(models, dict) else {"": models}
    having = {method: model for method, model in models.items() if name in model.model_fields}
    fields = [model.model_fields[name] for model in having.values()]
    field = next((f for f in fields if f.description), fields[0])  # (a subclass may override a default only)
    extra = field.json_schema_extra or {}
    kinds = [a for a in get_args(field.annotation) if a is not type(None)]
    optional = type(None) in get_args(field.annotation)
    kind = str if extra.get("text") else (kinds[0] if optional and len(kinds) == 1 else field.annotation)
    default = _field_default(field)
    help_text = field.description or ""
    if len(having) < len(models):
        help_text = f"{', '.join(method.upper() for method in having)}: {help_text}"
    help_text = sentence(help_text) or ""
    if given:
        help_text = f"{help_text[:-1]} ({_defaults_text(having, name)}).".lstrip(" ").replace(" ().", ".")
    flag = extra.get("flag", name.replace("_", "-"))
    if get_origin(kind) is Literal:
        kind = choices(f"{next(iter(having.values())).__name__}_{name}", list(get_args(kind)))
        default = None if default is None else kind(default)
    names = ((flag if flag.startswith("--") else f"--{flag}/--no-{flag}",) if kind is bool else (f"--{flag}",))
    if given or default in (None, []):
        kind, default = Optional[kind], None
    option = typer.Option(*names, help=help_text or None, show_default=not given, rich_help_panel=panel)
    return name, Annotated[kind, option], inspect.Parameter.empty if field.is_required() and not given else default


def _field_default(field):
    """A pydantic field's default (its factory's value), None for a required field."""
    return None if field.is_required() else field.get_default(call_default_factory=True)


def _defaults_text(having: dict[str, type], name: str) -> str:
    """'default X', or each method's where they differ ('default: gptq true, rtn false'); '' for none."""
    shown = {}
    for method, model in having.items():
        value = _field_default(model.model_fields[name])
        shown[method] = str(value).lower() if isinstance(value, bool) else value
    if all(value in (None, []) for value in shown.values()):
        return ""
    if len(set(map(str, shown.values()))) == 1:
        return f"default {next(iter(shown.values()))}"
    return "default: " + ", ".join(f"{method} {value}" for method, value in shown.items())


def option_flag(kind) -> str:
    """The flag an option type (Annotated[type, typer.Option]) declares first: '--sym' of '--sym/--asym'."""
    info = kind.__metadata__[0]  # (in Annotated, typer takes the first declaration as the default's place)
    return (info.param_decls or (info.default,))[0].split("/")[0]


def given_settings(values: dict) -> dict:
    """The options' values by field, those not given (None) left out, a choice as its value."""
    return {name: getattr(value, "value", value) for name, value in values.items() if value is not None}


def with_config_options(options: tuple, param: str = "settings"):
    """Decorator: add options made by `config_option` to a command; it receives the given ones as one dict,
    `param`, of field name -> value (given_settings)."""
    return lambda command: _with_options(command, param, options, given_settings)


def _calibration(values: dict) -> dict:
    values["compute_dtype"] = values.pop("calib_dtype").value
    return values


def with_calibration_options(command):
    """Add the calibration options to a command; it receives them as one dict, `calibration` (the calibration
    keys of a method's settings)."""
    return _with_options(command, "calibration", CALIBRATION_OPTIONS, _calibration)


# Speculative decoding options of generate, bench and serve (defaults: runtime.engine.config.SpeculativeConfig)
SPECULATIVE_OPTIONS = (
    ("speculative", Annotated[Optional[str], typer.Option(
        "--speculative", help="Speculative decoding: ngram (prompt lookup), draft:MODEL (a smaller model with the "
        "same tokenizer) or medusa[:PATH] (heads from `llmopt distill --medusa-heads`; default: the model's "
        "folder).")], None),
    # None = not given (each needs --speculative; defaults from SpeculativeConfig)
    ("num_speculative_tokens", Annotated[Optional[int], typer.Option(
        "--num-speculative-tokens", show_default=False,
        help=f"Draft tokens verified per step at most (default {SPECULATIVE_DEFAULTS.num_speculative_tokens}).")],
     None),
    ("ngram_min", Annotated[Optional[int], typer.Option(
        "--ngram-min", show_default=False,
        help=f"ngram: shortest suffix looked up (default {SPECULATIVE_DEFAULTS.ngram_min}).")], None),
    ("ngram_max", Annotated[Optional[int], typer.Option(
        "--ngram-max", show_default=False,
        help=f"ngram: longest suffix looked up (default {SPECULATIVE_DEFAULTS.ngram_max}).")], None),
    ("no_adaptive_speculation", Annotated[bool, typer.Option(
        "--no-adaptive-speculation", help="Always draft --num-speculative-tokens (default: per sequence, as many "
        "as its acceptance pays for at the measured step cost).")], False),
)
NGRAM_ONLY = ("ngram_min", "ngram_max")


def _flag(name: str) -> str:
    return "--" + ("no-adaptive-speculation" if name == "no_adaptive_speculation" else name.replace("_", "-"))


def _speculative(values: dict) -> SpeculativeConfig | None:
    """The SpeculativeConfig the options give; an option that would change nothing (no --speculative, or an
    ngram option with another method) is refused by name rather than ignored."""
    spec = values.pop("speculative")
    given = [name for name, value in values.items() if value not in (None, False)]
    if spec is None:
        if given:
            raise ConfigError(f"{_flag(given[0])} needs --speculative (ngram, draft:MODEL or medusa): add it or "
                              f"drop {_flag(given[0])}", param=given[0])
        return None
    adaptive = not values.pop("no_adaptive_speculation")
    config = SpeculativeConfig.parse(spec, adaptive=adaptive,
                                     **{k: v for k, v in values.items() if v is not None})
    misplaced = [name for name in NGRAM_ONLY if name in given]
    if misplaced and config.method != "ngram":
        raise ConfigError(f"{_flag(misplaced[0])} applies to --speculative ngram only (not {config.method})",
                          param=misplaced[0])
    return config


ENGINE_PANEL = "Engine (EngineConfig)"


def _engine_option(field, hint) -> tuple:
    """(parameter, option type, default) of one EngineConfig field: the type, default and help are the
    field's; a Literal becomes a choice, a boolean (or optional boolean) a --FLAG/--no-FLAG pair."""
    flag, help_text = engine_flag(field.name), field.metadata["help"]
    aliases = tuple(f"--{alias}" for alias in field.metadata.get("aliases", ()))
    if get_origin(hint) is Literal:
        kind = choices(f"Engine_{field.name}", list(get_args(hint)))
        option = typer.Option(f"--{flag}", *aliases, help=help_text, rich_help_panel=ENGINE_PANEL)
        return field.name, Annotated[kind, option], kind(field.default)
    base = [a for a in get_args(hint) if a is not type(None)] or [hint]
    names = (f"--{flag}/--no-{flag}",) if base[0] is bool else (f"--{flag}", *aliases)
    option = typer.Option(*names, help=help_text, rich_help_panel=ENGINE_PANEL)
    return field.name, Annotated[hint, option], field.default


def _engine_options() -> tuple:
    return tuple(_engine_option(f, hint) for f, hint in engine_field_types())


def _engine(values: dict) -> EngineConfig:
    speculative = _speculative({name: values.pop(name) for name, _, _ in SPECULATIVE_OPTIONS})
    engine = {name: getattr(value, "value", value) for name, value in values.items()}
    return EngineConfig(**engine, speculative=speculative)


def with_engine_options(command):
    """Add every engine option to a command, generated from EngineConfig's fields (so each exists once, with one
    check: EngineConfig's), and the speculative options; it receives them as one EngineConfig, `engine`."""
    return _with_options(command, "engine", _engine_options() + SPECULATIVE_OPTIONS, _engine)


def resolve_dtype_option(dtype: Dtype | str, device: str) -> str:
    """The concrete dtype for --dtype / --calib-dtype; prints once (stderr) what auto chose, or that an explicit
    half precision will be slow on this CPU."""
    from llmopt.cli.output import stderr
    from llmopt.core.hardware import dtype_note, resolve_dtype

    name = dtype.value if isinstance(dtype, Enum) else dtype
    note = dtype_note(name, device)
    if note:
        stderr.print(note, highlight=False, markup=False, soft_wrap=True)
    return resolve_dtype(name, device)


def calib_dtype_label(calibration: dict) -> str:
    """The calibration forwards' dtype as the progress bar names it: 'float32 (auto)', or the explicit choice with
    the warning when it will be slow on this CPU. (Calibration configs resolve 'auto' the same way.)"""
    from llmopt.compress.config import calibration_dtype
    from llmopt.core.hardware import dtype_note

    name, device = calibration["compute_dtype"], calibration["device"]
    if name == "auto":
        return f"{calibration_dtype(name, device)} (auto)"
    note = dtype_note(name, device)
    return f"{name}, slow here: no native units" if note else name

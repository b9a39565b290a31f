"""Recipe stages: each turns an input MODEL into an artifact. A stage's options are exactly the library
settings the CLI builds (same keys as the CLI options, with underscores), validated by the same configs.

Adding a stage is adding an entry to STAGES.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from llmopt.core.contract.sparsity import quantizes
from llmopt.core.errors import ConfigError
from llmopt.core.registry import Registry

# The recipe's `defaults` filled into a stage's options (Recipe.stage_options); stages that take no
# calibration accept and ignore them.
DEFAULTED_KEYS = ("calib", "num_samples", "seqlen", "seed")


def _unchanged(options: dict, model):
    return model


@dataclass(frozen=True)
class Stage:
    name: str
    validate: Callable[[dict], None]  # raises ConfigError naming the bad option
    run: Callable[[str, Path, dict], dict]  # (input MODEL, output folder, options) -> facts
    defaulted: tuple[str, ...] = DEFAULTED_KEYS  # keys the recipe fills in ("teacher": the recipe's model)
    # (options, the input's recipe.preflight.Skeleton) -> the output's: every check `run` makes before work,
    # on configs and meta-device modules only; raises ConfigError naming the option
    preflight: Callable[[dict, object], object] = _unchanged


def _refuse_quantized(model, stage: str) -> None:
    if model.quantized:
        raise ConfigError(f"{stage} needs a dense input; {model.name} is quantized by then")


def _check_calibration(options: dict) -> None:
    from llmopt.core.datasets import check_dataset_name

    calib = options.get("calib")
    for name in ([calib] if isinstance(calib, str) else calib or []):
        check_dataset_name(name)


STAGES: Registry[Stage] = Registry("stage")


def _split_quantize(options: dict) -> tuple[str, dict, str | None, int | None]:
    """(method, the config's settings (with the scheme's default pre-passes), format or None for the method's own,
    max_memory in bytes or None)."""
    from llmopt.compress.api import with_scheme_prepasses

    settings = dict(options)
    method = settings.pop("method", None)
    if method is None:
        raise ConfigError("quantize needs method: rtn, gptq or awq")
    fmt = settings.pop("format", None)
    max_memory = _pop_max_memory(settings)
    return method, with_scheme_prepasses(settings), fmt, max_memory


def _pop_max_memory(settings: dict) -> int | None:
    """A stage's `max_memory` (e.g. 600MB: compress a model larger than memory, one layer at a time), in bytes."""
    from llmopt.core.offload import parse_memory

    value = settings.pop("max_memory", None)
    return None if value is None else parse_memory(str(value), "max_memory")


def _split_prune(options: dict) -> tuple[dict, int | None]:
    settings = dict(options)
    return settings, _pop_max_memory(settings)


def _validate_quantize(options: dict) -> None:
    from llmopt.compress.api import quantize_configs
    from llmopt.formats.layouts import FORMATS

    method, settings, fmt, _ = _split_quantize(options)
    quantize_configs(method, settings)
    if fmt is not None and fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}: choose one of {', '.join(FORMATS.names())}")


def _run_quantize(model: str, output: Path, options: dict) -> dict:
    from llmopt.compress.api import quantize_configs
    from llmopt.jobs.quantize import quantize_to_artifact

    method, settings, fmt, max_memory = _split_quantize(options)
    return quantize_to_artifact(model, output, quantize_configs(method, settings), fmt, overwrite=True,
                                max_memory=max_memory)


def _validate_prune(options: dict) -> None:
    from llmopt.jobs.prune import prune_config

    prune_config(_split_prune(options)[0])


def _run_prune(model: str, output: Path, options: dict) -> dict:
    from llmopt.jobs.prune import prune_config, prune_to_artifact

    settings, max_memory = _split_prune(options)
    return prune_to_artifact(model, output, prune_config(settings), overwrite=True, max_memory=max_memory)


def _preflight_quantize(options: dict, model):
    from llmopt.compress.api import quantize_configs
    from llmopt.jobs.quantize import check_quantizable, default_format

    _refuse_quantized(model, "quantize")
    _check_calibration(options)
    method, settings, fmt, _ = _split_quantize(options)
    configs = quantize_configs(method, settings)
    check_quantizable(model.model, configs, fmt or default_format(method, configs[-1]))
    return model.updated({}, quantized=True)


def _preflight_prune(options: dict, model):
    import torch

    from llmopt.compress.api import check_model_fits
    from llmopt.compress.config import StructuredConfig
    from llmopt.compress.structured import attention_geometry, plan_pruning
    from llmopt.jobs.prune import prune_config

    _refuse_quantized(model, "prune")
    _check_calibration(options)
    config = prune_config(_split_prune(options)[0])
    if not isinstance(config, StructuredConfig):
        check_model_fits(model.model, [config])
        return model
    layers = model.config.num_hidden_layers
    width = {"mlp": model.config.intermediate_size, "heads": attention_geometry(model.config).num_heads,
             "layers": 1}[config.structured]
    # the plan's counts (and its refusals) do not depend on the importance scores: any scores give them
    plan = plan_pruning(model.config, config.structured, config.ratio, torch.zeros(layers, width))
    return model.updated(plan.config_updates)


STAGES.add("quantize", Stage("quantize", _validate_quantize, _run_quantize, preflight=_preflight_quantize))
STAGES.add("prune", Stage("prune", _validate_prune, _run_prune, preflight=_preflight_prune))


# --- bitsandbytes: a baseline from outside llmopt (transformers' own quantizer) ---------------------
BNB_TYPES = ("nf4", "fp4", "int8")


def _validate_bnb(options: dict) -> None:
    unknown = set(options) - {"quant_type", "compute_dtype", *DEFAULTED_KEYS}
    if unknown:
        raise ConfigError(f"unknown bnb option {sorted(unknown)[0]!r}; allowed: quant_type, compute_dtype")
    if options.get("quant_type", "nf4") not in BNB_TYPES:
        raise ConfigError(f"bnb quant_type {options.get('quant_type')!r}; allowed: {', '.join(BNB_TYPES)}")


def _run_bnb(model: str, output: Path, options: dict) -> dict:
    """Quantize with bitsandbytes through transformers and save the HF checkpoint (loadable as a MODEL)."""
    import time

    import torch

    from llmopt.core.io import atomic_output_dir
    from llmopt.core.models import check_loading_info, check_safetensors, load_error, load_tokenizer, resolve_model

    try:
        import bitsandbytes  # noqa: F401
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    except ImportError:
        raise ConfigError("the bnb stage needs bitsandbytes: pip install 'llmopt[bnb]'") from None
    quant_type = options.get("quant_type", "nf4")
    compute_dtype = getattr(torch, options.get("compute_dtype", "float32"))
    config = (BitsAndBytesConfig(load_in_8bit=True) if quant_type == "int8" else
              BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type,
                                 bnb_4bit_compute_dtype=compute_dtype))
    start = time.perf_counter()
    source = resolve_model(model)
    if source.path is not None:
        check_safetensors(source.path)  # safetensors only, never a pickle checkpoint
    try:
        lm, info = AutoModelForCausalLM.from_pretrained(
            source.load_path, quantization_config=config, device_map="cpu", dtype=compute_dtype,
            use_safetensors=True, trust_remote_code=False, output_loading_info=True)
    except Exception as e:  # transformers raises many kinds; one line that says what to do
        raise load_error(source, e) from e
    check_loading_info(source, info)
    with atomic_output_dir(output, overwrite=True) as tmp:
        lm.save_pretrained(tmp)
        load_tokenizer(source).save_pretrained(tmp)
    return {"method": f"bnb-{quant_type}", "wall_s": round(time.perf_counter() - start, 2),
            "note": "bitsandbytes through transformers; its speed is measured through transformers' generate"}


STAGES.add("bnb", Stage("bnb", _validate_bnb, _run_bnb))


# --- cast: the same dense model stored (and evaluated) in another dtype -------------------------------
CAST_DTYPES = ("bfloat16", "float16", "float32")


def _validate_cast(options: dict) -> None:
    unknown = set(options) - {"dtype", *DEFAULTED_KEYS}
    if unknown:
        raise ConfigError(f"unknown cast option {sorted(unknown)[0]!r}; allowed: dtype")
    if options.get("dtype") not in CAST_DTYPES:
        raise ConfigError(f"cast dtype {options.get('dtype')!r}; allowed: {', '.join(CAST_DTYPES)}")


def _run_cast(model: str, output: Path, options: dict) -> dict:
    """Save a dense MODEL's weights in `dtype`; the recipe evaluates the variant in that dtype too."""
    import time

    import torch

    from llmopt.core.io import atomic_output_dir
    from llmopt.formats.load import load_model

    start = time.perf_counter()
    lm, tokenizer, _ = load_model(model, dtype=options["dtype"])
    if quantizes(getattr(lm.config, "quantization_config", None)):
        raise ConfigError(f"cast needs a dense model; {model} is quantized")
    with atomic_output_dir(output, overwrite=True) as tmp:
        lm.to(getattr(torch, options["dtype"])).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return {"dtype": options["dtype"], "wall_s": round(time.perf_counter() - start, 2)}


def _preflight_cast(options: dict, model):
    _refuse_quantized(model, "cast")
    return model


STAGES.add("cast", Stage("cast", _validate_cast, _run_cast, preflight=_preflight_cast))


# --- distill: the input MODEL is the student; the teacher defaults to the recipe's model ---------------------
def _distill_config(options: dict, student: str = "STUDENT"):
    from llmopt.distill.config import make_distill_config

    options = dict(options)
    if "student" in options:
        raise ConfigError("distill: the student is the previous stage's output (or the recipe's model): drop "
                          "`student`")
    return make_distill_config(student=student, **options)


def _validate_distill(options: dict) -> None:
    _distill_config(options)


def _run_distill(model: str, output: Path, options: dict) -> dict:
    from llmopt.jobs.distill import distill_to_artifact, resumes_cleanly

    config = _distill_config(options, model)
    # an interrupted recipe run continues its distill stage from the last checkpoint, if that was trained with
    # these settings (else the stage starts over)
    return distill_to_artifact(config, output, resume=resumes_cleanly(output, config), overwrite=True)


def _preflight_distill(options: dict, model):
    from llmopt.compress.structured import layers_plan
    from llmopt.core.datasets import check_dataset_name
    from llmopt.recipe.skeleton import skeleton_of

    config = _distill_config(options, model.name)
    teacher = skeleton_of(config.teacher)
    if teacher.config.vocab_size != model.config.vocab_size:
        raise ConfigError(f"the student ({model.name}) has a vocabulary of {model.config.vocab_size} tokens, the "
                          f"teacher {config.teacher} {teacher.config.vocab_size}: the student must share the "
                          f"teacher's tokenizer")
    check_dataset_name(config.data)
    layers = model.config.num_hidden_layers
    if config.student_layers is not None:
        try:
            return model.updated(layers_plan(model.config, config.student_layers).config_updates)
        except ConfigError as e:
            raise ConfigError(f"student_layers: {e} (the student has {layers} layers)") from None
    if config.drop_layers is not None:
        if not 0 < config.drop_layers < layers:
            raise ConfigError(f"init drop-layers:{config.drop_layers}: the student has {layers} layers; drop "
                              f"1..{layers - 1}")
        return model.updated({"num_hidden_layers": layers - config.drop_layers})
    return model


STAGES.add("distill", Stage("distill", _validate_distill, _run_distill, defaulted=("teacher", "seed"),
                            preflight=_preflight_distill))

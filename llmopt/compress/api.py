"""The verbs of compression on a loaded model: build configs from flat settings, check them against the model,
and apply one or more methods in one calibration pass (`compress_model`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from pydantic import BaseModel, ValidationError

from llmopt.compress.base import (
    PRUNE_METHODS, QUANT_METHODS, MethodSpec, Pruner, Quantizer, ignore_matches, quantizable_linears,
)
from llmopt.compress.config import (
    RotationConfig, SmoothQuantConfig, SparsityConfig, StructuredConfig, build_config,
)
from llmopt.compress.defaults import SCHEME_PREPASSES, SPARSEGPT_DAMP
from llmopt.compress.masks import check_nm_fits
from llmopt.compress.modifier_list import ModifierList
from llmopt.core.adapters import modules_beside_layers
from llmopt.core.contract import QuantizedWeight, sparsity_entry
from llmopt.core.errors import ConfigError, invalid_settings
from llmopt.core.registry import import_submodules


def load_methods() -> None:
    """Every module of the package is imported, and a method's module registers it: a new method is a new
    module."""
    import_submodules("llmopt.compress")


def method_spec(method: str) -> MethodSpec:
    load_methods()
    return QUANT_METHODS.get(method) if method in QUANT_METHODS else PRUNE_METHODS.get(method)


def make_config(method: str, **settings) -> BaseModel:
    """The typed config of a quantization `method` from flat settings (CLI options or a recipe stage)."""
    load_methods()
    return build_config(QUANT_METHODS.get(method).config_cls, method, method=method, **settings)


def make_sparsity_config(**settings) -> SparsityConfig:
    return build_config(SparsityConfig, "pruning", **settings)


def make_structured_config(**settings) -> StructuredConfig:
    return build_config(StructuredConfig, "structured-pruning", **settings)


def quantize_configs(method: str, settings: dict) -> list[BaseModel]:
    """The modifiers' configs a quantize command asks for. `prune_pattern` (with `prune_damp`) puts a SparseGPT
    N:M pruner before the quantizer, in the same calibration pass; `smoothquant_alpha` (a number in [0, 1] or
    "search") puts SmoothQuant first, in a pass of its own; `rotate` ("R1", "R1,R2" or a list; `rotate_seed`) folds
    random rotations into the weights before anything else."""
    settings = dict(settings)
    pattern, prune_damp = settings.pop("prune_pattern", None), settings.pop("prune_damp", SPARSEGPT_DAMP)
    alpha = settings.pop("smoothquant_alpha", None)
    rotate, rotate_seed = settings.pop("rotate", None), settings.pop("rotate_seed", None)
    quantizer = make_config(method, **settings)
    before = [*rotation_config(rotate, rotate_seed), *([] if alpha is None else [smoothquant_config(alpha, quantizer)])]
    if pattern is None:
        return [*before, quantizer]
    if method != "gptq":
        raise ConfigError(f"--prune-pattern applies to gptq only, not {method}")
    calibration = quantizer.calibration.model_dump()
    pruner = make_sparsity_config(method="sparsegpt", pattern=pattern, damp=prune_damp, ignore=quantizer.ignore,
                                  **calibration)
    if not quantizer.sym:
        raise ConfigError("--prune-pattern needs sym quantization (zero must be representable)")
    return [*before, pruner, quantizer]


def with_scheme_prepasses(settings: dict) -> dict:
    """Quantize settings (the CLI's, a recipe stage's) with their scheme's pre-passes (SCHEME_PREPASSES) when the user
    named none (neither smoothquant_alpha nor rotate); a pre-pass given as "none" is off."""
    given = {k: settings.get(k) for k in ("smoothquant_alpha", "rotate")}
    settings = dict(settings)
    if all(v is None for v in given.values()):
        settings.update(SCHEME_PREPASSES.get(settings.get("scheme"), {}))
    for key, value in given.items():
        if isinstance(value, str) and value.strip().lower() == "none":
            settings[key] = None
    return settings


def rotation_config(rotate, seed) -> list[RotationConfig]:
    """[] for no rotation, else the rotations named by `rotate` ("R1,R2" or a list, any case)."""
    if rotate is None:
        if seed is not None:
            raise ConfigError("--rotate-seed seeds a rotation: give --rotate R1 (or R1,R2) too")
        return []
    names = rotate.split(",") if isinstance(rotate, str) else list(rotate)
    names = [str(name).strip().upper() for name in names if str(name).strip()]
    try:
        return [RotationConfig(rotations=names, **({} if seed is None else {"seed": seed}))]
    except ValidationError as e:
        raise invalid_settings(e, "rotation") from None


def smoothquant_config(alpha, quantizer) -> SmoothQuantConfig:
    """SmoothQuant for `quantizer`'s scheme, ignore patterns and calibration; alpha a number or "search"."""
    if quantizer.input_activations is None:
        raise ConfigError("--smoothquant-alpha smooths activations for their quantization: it needs a scheme with "
                          "quantized inputs (--scheme w8a8-int8)")
    if isinstance(alpha, str) and alpha != "search":
        try:
            alpha = float(alpha)
        except ValueError:
            raise ConfigError(f"--smoothquant-alpha {alpha!r}: give a number in [0, 1] or 'search'") from None
    return build_config(SmoothQuantConfig, "smoothquant", alpha=alpha, scheme=quantizer.scheme,
                        ignore=quantizer.ignore, **quantizer.calibration.model_dump())


@dataclass
class Streaming:
    """Compress a model larger than memory: `model` is on the meta device; each decoder layer is read from
    `weights` when it is reached, and when it is final its results go to `sink` and the layer is dropped.

    sink(layer index, layer (compressed; quantized linears hold their dequantized weights), the layer's
    QuantizedWeights by full linear name, its pruning masks by full linear name)."""

    weights: object  # core.offload.SafetensorsWeights
    sink: Callable[[int, torch.nn.Module, dict[str, QuantizedWeight], dict[str, torch.Tensor]], None]
    activation_budget: int | None = None  # bytes of calibration activations kept in memory; more go to disk
    observe_loaded: Callable[[int, torch.nn.Module], None] | None = None  # sees each layer as read, unchanged


class _StreamedLayers:
    """The calibration pipeline's LayerIO for `Streaming`: onloads each layer, pops its results from the
    modifiers when it is final, counts what the facts need, and hands it all to the sink."""

    def __init__(self, model, streaming: Streaming, quantizers: list[Quantizer], pruners: list[Pruner]):
        from llmopt.core.adapters import adapter_for

        self.model, self.streaming = model, streaming
        self.adapter = adapter_for(model)
        self.quantizers, self.pruners = quantizers, pruners
        self.zeros = self.total = self.num_quantized = self.num_pruned = 0
        self.suffixes: set[str] = set()  # the quantized linears' paths inside a layer

    def onload_outer(self) -> None:
        from llmopt.core.offload import onload

        for path, module in modules_beside_layers(self.model):
            onload(module, path, self.streaming.weights)

    def inputs_captured(self) -> None:
        from llmopt.core.offload import offload

        for _, module in modules_beside_layers(self.model):
            offload(module)

    def onload(self, index: int, layer: torch.nn.Module) -> None:
        from llmopt.core.offload import onload

        onload(layer, f"{self.adapter.layers}.{index}", self.streaming.weights)
        if self.streaming.observe_loaded is not None:
            self.streaming.observe_loaded(index, layer)

    def offload(self, index: int, layer: torch.nn.Module) -> None:
        from llmopt.core.offload import offload

        prefix = f"{self.adapter.layers}.{index}."
        qweights = {}
        for quantizer in self.quantizers:
            qweights.update({k: quantizer.results.pop(k) for k in list(quantizer.results) if k.startswith(prefix)})
        masks = {}
        for pruner in self.pruners:  # pruners of one pass share their masks (ModifierList): pop once
            masks.update({k: pruner.masks.pop(k) for k in list(pruner.masks) if k.startswith(prefix)})
        if self.pruners:  # pruned and quantized: the zero codes make the recorded sparsity
            zeros, total = zero_counts(qweights)
            self.zeros, self.total = self.zeros + zeros, self.total + total
        self.num_quantized += len(qweights)
        self.suffixes.update(name.split(".", 3)[-1] for name in qweights)
        self.num_pruned += len(masks)
        self.streaming.sink(index, layer, qweights, masks)
        offload(layer)


@dataclass
class CompressResult:
    qweights: dict[str, QuantizedWeight]
    masks: dict[str, torch.Tensor]
    extra_tensors: dict[str, torch.Tensor]
    facts: dict = field(default_factory=dict)


def check_model_fits(model, configs: list[BaseModel]) -> None:
    """Fail before any work if a method cannot apply to some linear (group size or N:M not dividing K) or an
    --ignore pattern matches none (a typo would otherwise compress what was meant to stay dense)."""
    linears = quantizable_linears(model)
    for config in configs:
        for pattern in getattr(config, "ignore", None) or []:
            if not any(ignore_matches(pattern, name) for name in linears):
                example = next(iter(linears), "")
                raise ConfigError(f"--ignore {pattern!r} matches no linear (names look like {example!r} or "
                                  f"{example.split('.', 3)[-1]!r}): fix the pattern")
        if isinstance(config, RotationConfig):
            from llmopt.compress.rotation import check_rotatable

            check_rotatable(model, config.rotations)
            continue
        if isinstance(config, SmoothQuantConfig):
            continue
        if isinstance(config, SparsityConfig):
            if config.nm is not None:
                check_nm_fits(linears, config.nm)
        else:
            for name, linear in linears.items():
                config.weight_scheme.check(linear.in_features, name)


def compress_model(model, tokenizer, configs: list[BaseModel],
                   progress: Callable[[int, int], None] | None = None,
                   streaming: Streaming | None = None) -> CompressResult:
    """Apply the methods of `configs` in order, in one pass over the layers; `model` is changed in place (its
    quantized linears hold the dequantized weights, pruned weights are zero). With `streaming` (a model larger
    than memory, on the meta device) each layer's results go to its sink instead, and the result holds none.

    >>> result = compress_model(model, tok, quantize_configs("gptq", dict(bits=4, group_size=64)))  # doctest: +SKIP
    """
    from llmopt.core.calibration import apply_algorithm

    check_model_fits(model, configs)
    start = time.perf_counter()
    rotation = next((c for c in configs if isinstance(c, RotationConfig)), None)
    smoothing = [c for c in configs if isinstance(c, SmoothQuantConfig)]
    configs = [c for c in configs if not isinstance(c, (SmoothQuantConfig, RotationConfig))]
    if smoothing and streaming is not None:
        raise ConfigError("--smoothquant-alpha needs a pass of its own over the whole model, which --max-memory "
                          "does not make: quantize without --max-memory, or without SmoothQuant")
    if rotation is not None and streaming is not None:
        raise ConfigError("--rotate changes the embedding and every layer before the first calibration forward, "
                          "which --max-memory (one layer in memory) cannot: quantize without one of them")
    rotated = {} if rotation is None else rotate(model, rotation)
    smoothed = smooth_model(model, tokenizer, smoothing[0], progress) if smoothing else None
    modifiers = [method_spec(c.method).modifier_cls(c, model) for c in configs]
    algorithm = modifiers[0] if len(modifiers) == 1 else ModifierList(modifiers)
    calibration = next((c.calibration for c in configs if c.needs_calibration), None)
    quantizers = [m for m in modifiers if isinstance(m, Quantizer)]
    pruners = [m for m in modifiers if isinstance(m, Pruner)]
    streamed = None if streaming is None else _StreamedLayers(model, streaming, quantizers, pruners)
    if streamed is not None:
        streamed.onload_outer()
    facts = apply_algorithm(model, tokenizer, algorithm, calibration, progress, streamed,
                            None if streaming is None else streaming.activation_budget)
    facts["wall_s"] = time.perf_counter() - start
    qweights = quantizers[0].results if quantizers else {}
    masks = pruners[-1].masks if pruners else {}
    streamed_linears = 0 if streamed is None else streamed.num_quantized or streamed.num_pruned
    if not qweights and not masks and not streamed_linears:
        raise ConfigError(f"nothing was {'quantized' if quantizers else 'pruned'}: every linear matched --ignore")
    if quantizers and pruners:  # pruned too: record it as a pruned model would
        pruner = pruners[-1].config
        if streamed is None:
            zeros, total = zero_counts(qweights)
            suffixes = sorted({name.split(".", 3)[-1] for name in qweights})
        else:  # the results went to the sink, layer by layer: counted there
            zeros, total, suffixes = streamed.zeros, streamed.total, sorted(streamed.suffixes)
        measured = zeros / total
        model.config.sparsity_config = sparsity_entry(pruner.structure, algorithm.name, pruner.target_sparsity,
                                                      pruner.ignore, measured, suffixes)
        facts["measured_sparsity"] = measured
    extra = algorithm.extra_tensors()
    facts.update(rotated)
    if smoothed is not None:
        facts.update(smoothed.facts())
        extra.update(smoothed.extra_tensors())
    return CompressResult(qweights, masks, extra, facts)


def rotate(model, config: RotationConfig) -> dict:
    """The rotations of `config` folded into `model` in place; the facts to record."""
    from llmopt.compress.rotation import rotate_model

    return rotate_model(model, config.rotations, config.seed)


def smooth_model(model, tokenizer, config: SmoothQuantConfig, progress=None):
    """SmoothQuant in place, in a calibration pass of its own (the outputs stay those of the original model);
    returns the smoother (its scales and facts)."""
    from llmopt.compress.smoothquant import SmoothQuantSmoother
    from llmopt.core.calibration import apply_algorithm

    smoother = SmoothQuantSmoother(config, model)
    apply_algorithm(model, tokenizer, smoother, config.calibration, progress)
    return smoother


def quantize_model(model, tokenizer, config: BaseModel,
                   progress: Callable[[int, int], None] | None = None) -> CompressResult:
    """One quantization method alone (`compress_model` with one config)."""
    result = compress_model(model, tokenizer, [config], progress)
    result.facts["quantize_wall_s"] = result.facts.pop("wall_s")
    result.facts["num_quantized_linears"] = len(result.qweights)
    return result


def sparsify_model(model, tokenizer, config: SparsityConfig,
                   progress: Callable[[int, int], None] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """Zero weights of every decoder linear in place; returns (masks by linear name, facts)."""
    result = compress_model(model, tokenizer, [config], progress)
    result.facts["prune_wall_s"] = result.facts.pop("wall_s")
    return result.masks, result.facts


def zero_counts(qweights: dict[str, QuantizedWeight]) -> tuple[int, int]:
    """(quantized weights that dequantize to exactly zero (code == zero point), quantized weights)."""
    zeros = total = 0
    for qw in qweights.values():
        zero_points = qw.zeros[:, qw.g_idx.long()]  # [N, K]
        zeros += int((qw.q.to(torch.int32) == zero_points).sum())
        total += qw.q.numel()
    return zeros, total


def measure_sparsity(model) -> dict:
    """Parameter and zero counts over the decoder linears and the whole model."""
    linears = quantizable_linears(model)
    linear_params = sum(m.weight.numel() for m in linears.values())
    linear_zeros = sum(int((m.weight == 0).sum()) for m in linears.values())
    total = sum(p.numel() for p in model.parameters())
    nonzero = sum(int((p != 0).sum()) for p in model.parameters())
    return {"num_parameters": total, "num_nonzero": nonzero, "linear_parameters": linear_params,
            "linear_sparsity": linear_zeros / linear_params if linear_params else 0.0}


def sparsity_config_entry(config: SparsityConfig, measured: float, targets: list[str],
                          storage: str = "dense") -> dict:
    """What config.json records about a model pruned by `config` (storage: "dense" or the compressed format)."""
    return sparsity_entry(config.structure, config.method, config.target_sparsity, config.ignore, measured,
                          targets, storage)

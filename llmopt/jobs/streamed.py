"""quantize or prune a model larger than memory (`--max-memory`): the model is built on the meta device, each
decoder layer is read from the safetensors files when the calibration pipeline reaches it, and its tensors
(packed codes, or pruned weights) are written into the artifact's shards as soon as it is final. The artifact equals, tensor for tensor, what the
in-memory pipeline writes from the same model and settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from llmopt.compress.api import CompressResult, Streaming, compress_model
from llmopt.core.adapters import adapter_for
from llmopt.core.errors import ConfigError
from llmopt.core.io import atomic_output_dir
from llmopt.core.offload import (
    ACTIVATION_SHARE, SafetensorsWeights, format_bytes, limit_heap_retention, meta_model,
)
from llmopt.compress.defaults import SEARCH_FILE
from llmopt.formats.artifact import ShardWriter, write_artifact_files
from llmopt.formats.layouts import FORMATS
from llmopt.formats.sparse import kept_codes_records, mark_kept_codes

DENSE_DTYPE = torch.float16  # what the quantized artifact stores its dense tensors in (as write_model_artifact)
PRUNED_DTYPE = torch.float32  # what a pruned artifact stores every tensor in (as jobs.prune)
SHARD_SHARE = 8  # a shard holds at most --max-memory / 8 before it is written
MIN_SHARD_BYTES = 2**20


@dataclass
class StreamedModel:
    """What the streamed pipeline needs of MODEL without its weights."""

    model: torch.nn.Module  # on the meta device
    tokenizer: object
    weights: SafetensorsWeights
    generation_config: object


def load_streamed(source, trust_remote_code: bool = False) -> StreamedModel:
    from transformers import GenerationConfig

    from llmopt.core.contract.sparsity import held_dense
    from llmopt.core.models import check_tensor_shapes, load_config, load_tokenizer

    if source.path is None:
        raise ConfigError(f"--max-memory reads {source.name}'s safetensors files one layer at a time: download it "
                          "to a local folder and give that folder", param="--max-memory")
    config = load_config(source, trust_remote_code)
    held_dense(config)  # SafetensorsWeights decompresses compressed linears as it reads them
    adapter_for(config)
    check_tensor_shapes(config, source.path, source.name)
    model = meta_model(config)
    try:
        generation_config = GenerationConfig.from_pretrained(source.load_path, trust_remote_code=trust_remote_code)
    except OSError:  # none saved: the one the model's config implies, as a loaded model would have
        generation_config = model.generation_config
    return StreamedModel(model, load_tokenizer(source, trust_remote_code), SafetensorsWeights(source.path),
                         generation_config)


def working_set_bytes(model: torch.nn.Module, streams: int = 3) -> int:
    """Memory the compression of the largest decoder layer takes besides activations: the layer in fp32 and its
    copies (the reference stream's, a lower-precision runner: `streams` in all), and the algorithm's work on its
    largest linear [N, K] (GPTQ with act-order, GPTAQ and the range search: ~6 [K, K] fp32 matrices and ~4 [N, K]
    ones at its peak, measured); or the embeddings, in memory while the
    first layer's inputs are captured, if larger."""
    adapter = adapter_for(model)
    largest = 0
    for layer in model.get_submodule(adapter.layers):
        weights = sum(p.numel() * 4 for p in layer.parameters())
        linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        work = max((6 * m.in_features ** 2 + 4 * m.in_features * m.out_features) * 4 for m in linears)
        largest = max(largest, streams * weights + work)
    embeddings = sum(p.numel() * 4 for p in model.get_input_embeddings().parameters())
    return max(largest, embeddings)


def check_fits(model: torch.nn.Module, max_memory: int) -> None:
    need = working_set_bytes(model)
    if need > (1 - ACTIVATION_SHARE) * max_memory:
        least = need / (1 - ACTIVATION_SHARE)
        raise ConfigError(f"--max-memory {format_bytes(max_memory)} is less than compressing one layer of this "
                          f"model takes (~{format_bytes(need)} for its weights, copies and statistics, plus "
                          f"{ACTIVATION_SHARE:.0%} for activations): give at least {format_bytes(int(least))}",
                          param="--max-memory")


@dataclass
class ArtifactMeta:
    """Everything of an artifact but its weights (formats.artifact.write_artifact_files' arguments)."""

    config: dict
    fmt_name: str | None
    record: object
    manifest: dict
    extra_tensors: dict | None = None
    extra_file: str = SEARCH_FILE
    quantization_config: dict | None = None  # written verbatim (compressed sparsity's record)


# layer index, the final layer, its QuantizedWeights and masks by full linear name -> the tensors to write
LayerTensors = Callable[[int, torch.nn.Module, dict, dict], dict[str, torch.Tensor]]


def compress_streamed(
    streamed: StreamedModel,
    output: Path,
    configs: list,
    max_memory: int,
    dense_dtype: torch.dtype,
    layer_tensors: LayerTensors,
    make_meta: Callable[[CompressResult], ArtifactMeta],
    observe_loaded: Callable[[int, torch.nn.Module], None] | None = None,
    observe_outer: Callable[[str, torch.Tensor], None] | None = None,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> CompressResult:
    """Compress the streamed model with `configs` into `output`, never holding more than one layer's weights:
    each final layer's tensors (layer_tensors) go to the shards as it finishes, the tensors outside the layers
    are copied from the files in `dense_dtype` (observe_outer sees each), and make_meta(result) gives the rest of
    the artifact. observe_loaded sees each layer as read, before any change."""
    model, weights = streamed.model, streamed.weights
    check_fits(model, max_memory)
    limit_heap_retention()
    layers_prefix = adapter_for(model).layers + "."
    with atomic_output_dir(output, overwrite) as tmp:
        shards = ShardWriter(tmp, max(max_memory // SHARD_SHARE, MIN_SHARD_BYTES))

        def sink(index: int, layer: torch.nn.Module, qweights: dict, masks: dict) -> None:
            shards.add(layer_tensors(index, layer, qweights, masks))

        streaming = Streaming(weights, sink, int(max_memory * ACTIVATION_SHARE), observe_loaded)
        result = compress_model(model, streamed.tokenizer, configs, progress, streaming)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        outer = {key: t for key, t in model.state_dict().items()
                 if not key.startswith(layers_prefix) and not (tied and key == "lm_head.weight")}
        if shards.pending_bytes + sum(t.numel() * dense_dtype.itemsize for t in outer.values()) > shards.shard_bytes:
            shards.flush()  # the layers' shard written before the large tensors outside them are read
        for key in outer:  # the tensors outside the layers, one at a time from the files
            tensor = weights.get(key, dense_dtype)
            if observe_outer is not None:
                observe_outer(key, tensor)
            shards.add({key: tensor})
        shards.finish()
        meta = make_meta(result)
        write_artifact_files(tmp, meta.config, streamed.tokenizer, meta.fmt_name, meta.record, meta.manifest,
                             {dense_dtype}, meta.extra_tensors, streamed.generation_config, meta.extra_file,
                             meta.quantization_config)
    return result


def dense_layer_tensors(index: int, layer: torch.nn.Module, prefix: str, dtype: torch.dtype,
                        skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """The layer's tensors by full name, floats in `dtype`, without `skip` (full names)."""
    return {f"{prefix}{index}.{key}": tensor.to(dtype) if tensor.is_floating_point() else tensor
            for key, tensor in layer.state_dict().items() if f"{prefix}{index}.{key}" not in skip}


@dataclass
class StreamedTally:
    num_quantized: int = 0
    packed_bytes: int = 0
    fp16_bytes: int = 0


def quantize_streamed(
    streamed: StreamedModel,
    output: Path,
    configs: list,
    fmt_name: str,
    max_memory: int,
    make_manifest: Callable[[CompressResult, int], dict],
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[CompressResult, StreamedTally]:
    """Quantize the streamed model with `configs` into `output` in format `fmt_name`; make_manifest(result,
    number of quantized linears) gives llmopt.json once the facts are known."""
    config, fmt = configs[-1], FORMATS.get(fmt_name)
    layers_prefix = adapter_for(streamed.model).layers + "."
    tally = StreamedTally()
    sparsity_record = getattr(streamed.model.config, "sparsity_config", None)
    marked = []  # the linears whose 2:4 codes are stored compressed

    def layer_tensors(index: int, layer: torch.nn.Module, qweights: dict, masks: dict) -> dict:
        tensors = {}
        for qweight in qweights.values():
            qweight.input_activations = config.input_activations
        marked.extend(mark_kept_codes(qweights, sparsity_record, fmt_name))
        for name, qweight in qweights.items():
            packed = fmt.pack(qweight)
            tensors.update({f"{name}.{suffix}": t for suffix, t in packed.items()})
            tally.packed_bytes += sum(t.numel() * t.element_size() for t in packed.values())
            tally.fp16_bytes += qweight.q.numel() * 2
        tally.num_quantized += len(qweights)
        quantized = {f"{name}.{kind}" for name in qweights for kind in ("weight", "bias")}
        return {**tensors, **dense_layer_tensors(index, layer, layers_prefix, DENSE_DTYPE, quantized)}

    def make_meta(result: CompressResult) -> ArtifactMeta:
        config_dict, qcfg = kept_codes_records(streamed.model.config.to_dict(), marked,
                                               fmt.quantization_config(config.record()))
        return ArtifactMeta(config_dict, fmt_name, config.record(), make_manifest(result, tally.num_quantized),
                            result.extra_tensors, quantization_config=qcfg)

    result = compress_streamed(streamed, output, configs, max_memory, DENSE_DTYPE, layer_tensors, make_meta,
                               overwrite=overwrite, progress=progress)
    return result, tally


@dataclass
class SparsityTally:
    """What the facts of a pruned model count, gathered layer by layer (compress.api.measure_sparsity's
    numbers, without the whole model in memory)."""

    num_parameters: int = 0
    nonzero_before: int = 0
    nonzero_after: int = 0
    linear_parameters: int = 0
    linear_zeros: int = 0
    pruned: int = 0  # weights the masks zero
    masked: int = 0  # weights the masks cover
    suffixes: set = field(default_factory=set)

    def facts(self) -> tuple[dict, dict]:
        """(measure_sparsity before, after)."""
        linear = self.linear_zeros / self.linear_parameters if self.linear_parameters else 0.0
        before = {"num_parameters": self.num_parameters, "num_nonzero": self.nonzero_before}
        return before, {"num_parameters": self.num_parameters, "num_nonzero": self.nonzero_after,
                        "linear_parameters": self.linear_parameters, "linear_sparsity": linear}


def prune_streamed(
    streamed: StreamedModel,
    output: Path,
    config,
    max_memory: int,
    make_meta: Callable[[CompressResult, SparsityTally], ArtifactMeta],
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
    store: Callable[[dict, list], dict] | None = None,
) -> tuple[CompressResult, SparsityTally]:
    """Prune the streamed model (unstructured or N:M sparsity) into `output`, its tensors in fp32 as the
    in-memory pipeline writes them; make_meta(result, tally) gives the rest of the artifact; store(tensors, pruned
    linear names) the layer's tensors as written (the pruned linears compressed), default as they are."""
    model = streamed.model
    adapter = adapter_for(model)
    layers_prefix = adapter.layers + "."
    tally = SparsityTally(num_parameters=sum(p.numel() for p in model.parameters()))

    def nonzero(tensors) -> int:
        return sum(int(t.count_nonzero()) for t in tensors)

    def observe_loaded(index: int, layer: torch.nn.Module) -> None:
        tally.nonzero_before += nonzero(layer.parameters())

    def observe_outer(key: str, tensor: torch.Tensor) -> None:
        tally.nonzero_before += nonzero([tensor])
        tally.nonzero_after += nonzero([tensor])

    def layer_tensors(index: int, layer: torch.nn.Module, qweights: dict, masks: dict) -> dict:
        tally.nonzero_after += nonzero(layer.parameters())
        for name in adapter.linears:
            weight = layer.get_submodule(name).weight
            tally.linear_parameters += weight.numel()
            tally.linear_zeros += weight.numel() - int(weight.count_nonzero())
        tally.pruned += sum(int(m.sum()) for m in masks.values())
        tally.masked += sum(m.numel() for m in masks.values())
        tally.suffixes.update(name.split(".", 3)[-1] for name in masks)
        tensors = dense_layer_tensors(index, layer, layers_prefix, PRUNED_DTYPE)
        return tensors if store is None else store(tensors, list(masks))

    result = compress_streamed(streamed, output, [config], max_memory, PRUNED_DTYPE, layer_tensors,
                               lambda result: make_meta(result, tally), observe_loaded, observe_outer,
                               overwrite, progress)
    return result, tally

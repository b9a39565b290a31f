"""quantize a model larger than memory (`--max-memory`): the model is built on the meta device, each decoder
layer is read from the safetensors files when the calibration pipeline reaches it, and its packed codes are
written into the artifact's shards as soon as it is final. The artifact equals, tensor for tensor, what the
in-memory pipeline writes from the same model and settings."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from llmopt.compress.api import CompressResult, Streaming, compress_model
from llmopt.core.adapters import adapter_for
from llmopt.core.errors import ConfigError
from llmopt.core.io import atomic_output_dir
from llmopt.core.offload import (
    ACTIVATION_SHARE, SafetensorsWeights, format_bytes, limit_heap_retention, meta_model,
)
from llmopt.export.artifact import ShardWriter, write_artifact_files
from llmopt.export.formats import FORMATS

DENSE_DTYPE = torch.float16  # what the quantized artifact stores its dense tensors in (as write_model_artifact)
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

    from llmopt.core.models import check_tensor_shapes, load_config, load_tokenizer

    if source.path is None:
        raise ConfigError(f"--max-memory reads {source.name}'s safetensors files one layer at a time: download it "
                          "to a local folder and give that folder", param="--max-memory")
    config = load_config(source, trust_remote_code)
    adapter_for(config)
    check_tensor_shapes(config, source.path, source.name)
    model = meta_model(config)
    try:
        generation_config = GenerationConfig.from_pretrained(source.load_path)
    except OSError:  # none saved: the one the model's config implies, as a loaded model would have
        generation_config = model.generation_config
    return StreamedModel(model, load_tokenizer(source, trust_remote_code), SafetensorsWeights(source.path),
                         generation_config)


def working_set_bytes(model: torch.nn.Module, streams: int = 3) -> int:
    """Memory the compression of the largest decoder layer takes besides activations: the layer in fp32 and its
    copies (the reference stream's, a lower-precision runner: `streams` in all), and the algorithm's work on its
    largest linear [N, K] (GPTQ with act-order, GPTAQ and the range search: ~8 [K, K] fp32 matrices and ~4 [N, K]
    ones at its peak, measured); or the embeddings, in memory while the
    first layer's inputs are captured, if larger."""
    adapter = adapter_for(model)
    largest = 0
    for layer in model.get_submodule(adapter.layers):
        weights = sum(p.numel() * 4 for p in layer.parameters())
        linears = [m for m in layer.modules() if isinstance(m, torch.nn.Linear)]
        work = max((8 * m.in_features ** 2 + 4 * m.in_features * m.out_features) * 4 for m in linears)
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
    """Quantize the streamed model with `configs` into `output` in format `fmt_name`, never holding more than
    one layer's weights; make_manifest(result, number of quantized linears) gives llmopt.json once the facts are known."""
    model, weights = streamed.model, streamed.weights
    check_fits(model, max_memory)
    limit_heap_retention()
    config, fmt = configs[-1], FORMATS.get(fmt_name)
    layers_prefix = adapter_for(model).layers + "."
    tally = StreamedTally()
    with atomic_output_dir(output, overwrite) as tmp:
        shards = ShardWriter(tmp, max(max_memory // SHARD_SHARE, MIN_SHARD_BYTES))

        def sink(index: int, layer: torch.nn.Module, qweights: dict, masks: dict) -> None:
            prefix = f"{layers_prefix}{index}."
            tensors = {}
            for name, qweight in qweights.items():
                qweight.input_activations = config.input_activations
                packed = fmt.pack(qweight)
                tensors.update({f"{name}.{suffix}": t for suffix, t in packed.items()})
                tally.packed_bytes += sum(t.numel() * t.element_size() for t in packed.values())
                tally.fp16_bytes += qweight.q.numel() * 2
            tally.num_quantized += len(qweights)
            quantized = {f"{name}.{kind}" for name in qweights for kind in ("weight", "bias")}
            for key, tensor in layer.state_dict().items():
                if prefix + key not in quantized:
                    tensors[prefix + key] = tensor.to(DENSE_DTYPE) if tensor.is_floating_point() else tensor
            shards.add(tensors)

        budget = int(max_memory * ACTIVATION_SHARE)
        result = compress_model(model, streamed.tokenizer, configs, progress, Streaming(weights, sink, budget))
        shards.flush()  # the layers' shards written before the large tensors outside them are read
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        for key in model.state_dict():  # the tensors outside the layers, one at a time from the files
            if key.startswith(layers_prefix) or (tied and key == "lm_head.weight"):
                continue
            shards.add({key: weights.get(key, DENSE_DTYPE)})
        shards.finish()
        write_artifact_files(tmp, model.config.to_dict(), streamed.tokenizer, fmt_name, config.record(),
                             make_manifest(result, tally.num_quantized), {DENSE_DTYPE}, result.extra_tensors,
                             streamed.generation_config)
    return result, tally

"""quantize MODEL -> artifact: load, check everything that can fail early, compress, write, report."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

import torch

from llmopt.compress.api import check_model_fits, compress_model
from llmopt.compress.base import QUANT_METHODS, quantizable_linears
from llmopt.compress.config import RotationConfig, SmoothQuantConfig, SparsityConfig
from llmopt.core.adapters import get_module
from llmopt.core.contract import QuantizedWeight
from llmopt.core.io import check_output_free
from llmopt.formats.artifact import write_model_artifact
from llmopt.formats.layouts import FORMATS
from llmopt.formats.load import load_model
from llmopt.core.io import weights_bytes
from llmopt.jobs.common import (
    peak_rss_bytes, prior_stages, refuse_quantized_input, resolve_input, source_entry,
)
from llmopt.jobs.streamed import load_streamed, quantize_streamed


# the one format that records quantized input activations (compressed-tensors' int-quantized), float weights and
# float zero points
INPUT_ACTIVATIONS_FORMAT = "compressed-tensors"


def default_format(method: str, config=None) -> str:
    """The checkpoint format a quantization method writes unless told otherwise (its registry entry), or for a
    scheme with quantized input activations (W8A8), float weights (FP8, FP4) or float zero points the format that
    can record them."""
    from llmopt.compress.api import load_methods

    weights = getattr(config, "weight_scheme", None)
    if getattr(config, "input_activations", None) is not None or (
            weights is not None and (weights.type == "float" or weights.float_zero_point)):
        return INPUT_ACTIVATIONS_FORMAT
    load_methods()
    return QUANT_METHODS.get(method).default_format


def stage_of(config) -> str:
    """The llmopt.json stage a config is recorded as."""
    if isinstance(config, SparsityConfig):
        return "prune"
    if isinstance(config, RotationConfig):
        return "rotate"
    return "smooth" if isinstance(config, SmoothQuantConfig) else "quantize"


def check_quantizable(model, configs: list, fmt_name: str) -> None:
    """Every check quantizing `model` (real, or on the meta device: shapes only) with `configs` into format
    `fmt_name` makes before any work: group sizes and N:M patterns dividing each linear, --ignore patterns that
    match, and what the format can store."""
    check_model_fits(model, configs)
    config, fmt = configs[-1], FORMATS.get(fmt_name)
    record = config.record()
    fmt.check_record(record)
    trivial = not (record.act_order and not record.static_groups)
    for name, linear in quantizable_linears(model).items():
        fmt.check(name, (linear.out_features, linear.in_features), config.weight_scheme, trivial)


def quantize_to_artifact(
    model_name: str,
    output: str | Path,
    configs: list,
    fmt_name: str | None = None,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    progress: Callable[[int, int], None] | None = None,
    max_memory: int | None = None,
) -> dict:
    """Quantize MODEL with the typed `configs` (compress.api.quantize_configs: the quantizer last, after a pruner
    in the same pass) and write it to `output` in `fmt_name` (default: the method's format); return the facts
    measured. `max_memory` (bytes): never hold more than one decoder layer's weights (jobs.streamed)."""
    start = time.perf_counter()
    output = check_output_free(output, overwrite)
    config = configs[-1]
    method = config.method
    fmt_name = fmt_name or default_format(method, config)
    FORMATS.get(fmt_name)  # an unknown format fails before the model loads
    source = resolve_input(model_name, output)
    refuse_quantized_input(source, "quantize", trust_remote_code)

    def make_manifest(result, num_quantized: int) -> dict:
        """llmopt.json, once the facts are known (after the quantized linears are counted)."""
        result.facts["quantize_wall_s"] = result.facts.pop("wall_s")
        result.facts["num_quantized_linears"] = num_quantized
        return {
            "source": source_entry(model_name, source),
            "stages": prior_stages(source) + [
                {"stage": stage_of(c), "method": c.method,
                 "settings": c.model_dump(mode="json")} for c in configs],
            "calibration": ({"datasets": config.calibration.calib, "num_samples": config.calibration.num_samples,
                             "seqlen": config.calibration.seqlen, "seed": config.calibration.seed}
                            if config.needs_calibration else None),
            "facts": result.facts,
        }

    if max_memory is not None:  # larger than memory: one layer at a time from the files, shards as they are done
        streamed = load_streamed(source, trust_remote_code)
        check_quantizable(streamed.model, configs, fmt_name)
        result, tally = quantize_streamed(streamed, output, configs, fmt_name, max_memory, make_manifest,
                                          overwrite, progress)
        num_quantized, packed, fp16 = tally.num_quantized, tally.packed_bytes, tally.fp16_bytes
    else:
        model, tokenizer, source = load_model(source, trust_remote_code=trust_remote_code)
        check_quantizable(model, configs, fmt_name)  # fail before the expensive part
        result = compress_model(model, tokenizer, configs, progress)
        for qweight in result.qweights.values():  # what the checkpoint asks the runtime to do with the inputs
            qweight.input_activations = config.input_activations
        num_quantized = len(result.qweights)
        _drop_quantized_weights(model, result.qweights)
        write_model_artifact(output, model, tokenizer, result.qweights, fmt_name, config.record(),
                             make_manifest(result, num_quantized), result.extra_tensors, overwrite=overwrite)
        packed, fp16 = quantized_bytes(result.qweights, fmt_name)  # (as written: 2:4 codes marked compressed)
    return {
        "output": str(output), "method": method, "format": fmt_name, "bits": config.bits,
        "group_size": config.group_size, "sym": config.sym,
        "num_quantized_linears": num_quantized,
        "quantize_wall_s": round(result.facts["quantize_wall_s"], 2),
        **{k: v for k, v in result.facts.items() if k.startswith(("smoothquant_", "rotation"))},
        "total_wall_s": round(time.perf_counter() - start, 2),
        "peak_rss_bytes": peak_rss_bytes(), "max_memory_bytes": max_memory,
        "artifact_weights_bytes": weights_bytes(output),
        "quantized_linear_bytes": packed, "quantized_linear_fp16_bytes": fp16,
        "quantized_linear_ratio": round(packed / fp16, 4),
    }


def quantized_bytes(qweights: dict[str, QuantizedWeight], fmt_name: str) -> tuple[int, int]:
    """(bytes of the packed quantized linears, bytes the same linears take in fp16)."""
    fmt = FORMATS.get(fmt_name)
    packed = sum(t.numel() * t.element_size() for qw in qweights.values() for t in fmt.pack(qw).values())
    fp16 = sum(qw.q.numel() * 2 for qw in qweights.values())
    return packed, fp16


def _drop_quantized_weights(model, qweights) -> None:
    """The fp32 weights of the quantized linears are not written (their codes are): free them before the
    writer makes its copies, so peak memory is the calibration's, not calibration + writing."""
    for name in qweights:
        get_module(model, name).weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

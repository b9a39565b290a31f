"""quantize MODEL -> artifact: load, check everything that can fail early, quantize, write, report."""

from __future__ import annotations

import resource
import time
from pathlib import Path
from typing import Callable

from llmopt.compress.api import make_config, quantize_model, quantized_bytes
from llmopt.core.io import check_output_free


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def quantize_to_artifact(
    model_name: str,
    output: str | Path,
    method: str,
    settings: dict,
    fmt_name: str,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> dict:
    """Quantize MODEL with `method` and write it to `output` in `fmt_name`; return the facts measured."""
    from llmopt.compress.base import quantizable_linears
    from llmopt.core.models import load_model
    from llmopt.export.artifact import write_model_artifact
    from llmopt.export.formats import FORMATS

    start = time.perf_counter()
    output = check_output_free(output, overwrite)
    config = make_config(method, **settings)
    fmt = FORMATS.get(fmt_name)
    model, tokenizer, source = load_model(model_name, trust_remote_code=trust_remote_code)
    from llmopt.compress.api import check_model_fits

    check_model_fits(model, config)
    trivial = not (getattr(config, "act_order", False) and not getattr(config, "static_groups", True))
    for name, linear in quantizable_linears(model).items():  # fail before the expensive part
        fmt.check(name, (linear.out_features, linear.in_features), config.scheme, trivial)
    result = quantize_model(model, tokenizer, config, progress)
    _drop_quantized_weights(model, result.qweights)
    packed, fp16 = quantized_bytes(result.qweights, fmt_name)
    manifest = {
        "source": {"model": model_name, "kind": source.kind, "path": str(source.path or source.hub_id)},
        "stages": [{"stage": "quantize", "method": method, "settings": config.model_dump(mode="json")}],
        "calibration": ({"datasets": config.calibration.calib, "num_samples": config.calibration.num_samples,
                         "seqlen": config.calibration.seqlen, "seed": config.calibration.seed}
                        if config.needs_calibration else None),
        "facts": result.facts,
    }
    settings_for_format = config.model_dump()
    write_model_artifact(output, model, tokenizer, result.qweights, fmt_name, settings_for_format, manifest,
                   result.extra_tensors, overwrite=overwrite)
    weights_bytes = sum(f.stat().st_size for f in output.glob("*.safetensors"))
    return {
        "output": str(output), "method": method, "format": fmt_name, "bits": config.bits,
        "group_size": config.group_size, "sym": config.sym,
        "num_quantized_linears": len(result.qweights),
        "quantize_wall_s": round(result.facts["quantize_wall_s"], 2),
        "total_wall_s": round(time.perf_counter() - start, 2),
        "peak_rss_bytes": peak_rss_bytes(),
        "artifact_weights_bytes": weights_bytes,
        "quantized_linear_bytes": packed, "quantized_linear_fp16_bytes": fp16,
        "quantized_linear_ratio": round(packed / fp16, 4),
    }


def _drop_quantized_weights(model, qweights) -> None:
    """The fp32 weights of the quantized linears are not written (their codes are): free them before the
    writer makes its copies, so peak memory is the calibration's, not calibration + writing."""
    import torch

    from llmopt.core.adapters import get_module

    for name in qweights:
        get_module(model, name).weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)

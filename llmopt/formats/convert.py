"""Convert an artifact between checkpoint formats, where the target can express it."""

from __future__ import annotations

import time
from pathlib import Path

from llmopt.core.contract import QuantRecord
from llmopt.core.errors import ArtifactError
from llmopt.core.io import check_not_inside, check_output_free, weights_bytes
from llmopt.formats.read import read_artifact


def record_from_artifact(contents) -> QuantRecord:
    """How the artifact's weights were quantized: from llmopt.json's quantize stage, or else from the source's
    quantization_config."""
    first = next(iter(contents.qweights.values()))
    scheme, acts = first.scheme, first.input_activations
    for stage in reversed(contents.manifest.get("stages", [])):
        if stage.get("stage") == "quantize":
            return QuantRecord.from_config(scheme, stage["settings"], acts)
    qcfg = contents.config.get("quantization_config", {})
    groups = qcfg.get("config_groups") or {}
    weights = next(iter(groups.values()), {}).get("weights", {}) if groups else {}
    actorder = weights.get("actorder")
    act_order = bool(qcfg.get("desc_act")) or actorder in ("weight", "static", "group", "dynamic")
    static_groups = bool(qcfg.get("static_groups")) or actorder in ("weight", "static") or not act_order
    return QuantRecord(scheme, qcfg.get("quant_method", "unknown"), act_order, static_groups,
                       qcfg.get("damp_percent"), qcfg.get("true_sequential", True), acts)


def export_artifact(source: str | Path, output: str | Path, fmt_name: str, overwrite: bool = False,
                    trust_remote_code: bool = False) -> dict:
    from llmopt.core.models import load_tokenizer, resolve_model
    from llmopt.formats.artifact import write_artifact

    start = time.perf_counter()
    source = Path(source)
    if not (source / "config.json").exists():
        raise ArtifactError(f"{source} is not a model folder (no config.json)")
    output = check_output_free(output, overwrite)
    check_not_inside(output, source, "input artifact")
    contents = read_artifact(source)
    if not contents.qweights:
        raise ArtifactError(f"{source} holds no quantized weights: quantize it first (llmopt quantize)")
    # never the folder's own tokenizer code unless asked (transformers would prompt, then run it)
    tokenizer = load_tokenizer(resolve_model(str(source)), trust_remote_code=trust_remote_code)
    manifest = dict(contents.manifest)
    manifest["stages"] = [*manifest.get("stages", []),
                          {"stage": "export", "from_format": contents.fmt.name, "to_format": fmt_name}]
    write_artifact(output, contents.dense, contents.config, tokenizer, contents.qweights, fmt_name,
                   record_from_artifact(contents), manifest, overwrite=overwrite)
    return {"output": str(output), "from_format": contents.fmt.name, "format": fmt_name,
            "num_quantized_linears": len(contents.qweights), "wall_s": round(time.perf_counter() - start, 2),
            "artifact_weights_bytes": weights_bytes(output)}

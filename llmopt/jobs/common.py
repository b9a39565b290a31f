"""What every MODEL -> artifact pipeline shares: loading, the manifest's source entry, the facts' sizes."""

from __future__ import annotations

import resource
from pathlib import Path


def peak_rss_bytes() -> int:
    """The process's peak resident set: Linux's VmHWM, which starts afresh in a new program (ru_maxrss keeps the
    peak of the process that started it, a test runner's or a shell's, across exec)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def source_entry(model_name: str, source) -> dict:
    """llmopt.json's `source`: what MODEL was given and what it resolved to."""
    return {"model": model_name, "kind": source.kind, "path": str(source.path or source.hub_id)}


def resolve_input(model_name: str, output: str | Path):
    """MODEL resolved (cheap: no weights read) and checked against the output: writing into the input folder
    would replace what is being read."""
    from llmopt.core.io import check_not_inside
    from llmopt.core.models import resolve_model

    source = resolve_model(model_name)
    check_not_inside(output, source.path)
    return source


def refuse_quantized_input(source, action: str, trust_remote_code: bool = False) -> None:
    """Quantizing or pruning an already quantized model would dequantize and re-quantize it silently (its codes
    rounded twice, its first stage lost from the record): refuse, naming the model it came from."""
    from llmopt.core.contract.sparsity import quantizes
    from llmopt.core.errors import ArtifactError
    from llmopt.core.models import load_config

    quantization = getattr(load_config(source, trust_remote_code), "quantization_config", None)
    if not quantizes(quantization):  # (compressed 2:4 weights alone are not quantized)
        return
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method = quantization.get("quant_method") or quantization.get("format") or "quantized"
    bits = quantization.get("bits")
    origin = prior_manifest(source).get("source", {}).get("model")
    instead = f" ({origin})" if origin else ""
    raise ArtifactError(f"{source.name} is already quantized ({method}{f', {bits}-bit' if bits else ''}): "
                        f"{action} its unquantized source model{instead} instead")


def prior_manifest(source) -> dict:
    """The llmopt.json of an llmopt artifact given as MODEL ({} for anything else)."""
    from llmopt.core.io import read_json

    if source.kind != "artifact":
        return {}
    manifest = read_json(source.path / "llmopt.json")
    return manifest if isinstance(manifest, dict) else {}


def prior_stages(source) -> list[dict]:
    """The stages an input artifact went through (a pruned model that is then quantized keeps the whole
    chain in its manifest)."""
    return list(prior_manifest(source).get("stages") or [])


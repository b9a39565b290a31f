"""Writing an llmopt artifact: safetensors + config.json (with quantization_config) + tokenizer +
llmopt.json (how it was made), into a temporary folder renamed into place."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from llmopt.compress.defaults import SEARCH_FILE
from llmopt.core.contract import QuantizedWeight, QuantRecord
from llmopt.core.environment import package_versions
from llmopt.core.io import atomic_output_dir, save_tensors, write_json
from llmopt.export.formats import FORMATS

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "llmopt.json"


def check_format(fmt_name: str, qweights: dict[str, QuantizedWeight], record: QuantRecord | None = None) -> None:
    """Raise ArtifactError if the format cannot hold every quantized linear, or what the record states beyond
    the weights (before any work is written)."""
    fmt = FORMATS.get(fmt_name)
    if record is not None:
        fmt.check_record(record)
    for name, qweight in qweights.items():
        fmt.check(name, qweight.shape, qweight.scheme, qweight.has_trivial_g_idx)


def dense_state_dict(model, skip: set[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The model's tensors except `skip`, in `dtype` (floats only), without tied duplicates."""
    state = {}
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for key, tensor in model.state_dict().items():
        if key in skip or (tied and key == "lm_head.weight"):
            continue
        tensor = tensor.detach().to("cpu")
        state[key] = (tensor.to(dtype) if tensor.is_floating_point() else tensor).contiguous()
    return state


def write_artifact(
    out: str | Path,
    dense: dict[str, torch.Tensor],
    config: dict,
    tokenizer,
    qweights: dict[str, QuantizedWeight],
    fmt_name: str | None,
    record: QuantRecord | None,
    manifest: dict,
    extra_tensors: dict[str, torch.Tensor] | None = None,
    generation_config=None,
    overwrite: bool = False,
    extra_file: str = SEARCH_FILE,
    quantization_config: dict | None = None,
) -> Path:
    """Write dense tensors + `qweights` packed in format `fmt_name` (None: a dense artifact) to `out`, and
    `extra_tensors` (search results, importance scores) as `extra_file`; all of it appears at once or not at all.

    `record` says how `qweights` were quantized (None when there are none). `config` is the model's config.json
    dict; its quantization_config is replaced by the format's entry for `record`, or by
    `quantization_config` verbatim (a re-written artifact keeps the entry it was read with).
    """
    start = time.perf_counter()
    if fmt_name is not None:
        check_format(fmt_name, qweights, record)
    with atomic_output_dir(out, overwrite) as tmp:
        tensors = dict(dense)
        config = {k: v for k, v in config.items() if k != "quantization_config"}
        float_dtypes = {t.dtype for t in dense.values() if t.is_floating_point()}
        if len(float_dtypes) == 1:
            config["dtype"] = str(float_dtypes.pop()).removeprefix("torch.")
        if fmt_name is not None:
            fmt = FORMATS.get(fmt_name)
            for name, qweight in qweights.items():
                for suffix, tensor in fmt.pack(qweight).items():
                    tensors[f"{name}.{suffix}"] = tensor.contiguous()
            config["quantization_config"] = quantization_config or fmt.quantization_config(record)
        save_tensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        write_json(tmp / "config.json", config)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if extra_tensors:
            save_tensors(extra_tensors, tmp / extra_file)
        manifest = {
            **manifest, "format": fmt_name, "versions": package_versions(),
            "write_wall_s": round(time.perf_counter() - start, 3),
            "weights_bytes": (tmp / WEIGHTS_FILE).stat().st_size,
        }
        write_json(tmp / MANIFEST_FILE, manifest)
    return Path(out)


def write_model_artifact(out, model, tokenizer, qweights, fmt_name, record, manifest, extra_tensors=None,
                         dense_dtype: torch.dtype = torch.float16, overwrite: bool = False) -> Path:
    """write_artifact for an in-memory model whose quantized linears are described by `qweights`."""
    skip = {f"{name}.weight" for name in qweights} | {f"{name}.bias" for name in qweights}
    dense = dense_state_dict(model, skip, dense_dtype)
    return write_artifact(out, dense, model.config.to_dict(), tokenizer, qweights, fmt_name, record, manifest,
                          extra_tensors, getattr(model, "generation_config", None), overwrite)

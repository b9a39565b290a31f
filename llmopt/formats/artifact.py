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
from llmopt.formats.layouts import FORMATS
from llmopt.formats.sparse import kept_codes_records, mark_kept_codes

WEIGHTS_FILE = "model.safetensors"
MANIFEST_FILE = "llmopt.json"
INDEX_FILE = "model.safetensors.index.json"


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
    """Write dense tensors + `qweights` packed in format `fmt_name` (None: a dense artifact) to `out` (one
    model.safetensors), and `extra_tensors` (search results, importance scores) as `extra_file`; all of it
    appears at once or not at all.

    `record` says how `qweights` were quantized (None when there are none). `config` is the model's config.json
    dict; its quantization_config is replaced by the format's entry for `record`, or by
    `quantization_config` verbatim (a re-written artifact keeps the entry it was read with).
    """
    start = time.perf_counter()
    if fmt_name is not None:
        check_format(fmt_name, qweights, record)
    with atomic_output_dir(out, overwrite) as tmp:
        tensors = dict(dense)
        if fmt_name is not None:
            fmt = FORMATS.get(fmt_name)
            for name, qweight in qweights.items():
                for suffix, tensor in fmt.pack(qweight).items():
                    tensors[f"{name}.{suffix}"] = tensor.contiguous()
        save_tensors(tensors, tmp / WEIGHTS_FILE, metadata={"format": "pt"})
        dense_dtypes = {t.dtype for t in dense.values() if t.is_floating_point()}
        write_artifact_files(tmp, config, tokenizer, fmt_name, record, manifest, dense_dtypes, extra_tensors,
                             generation_config, extra_file, quantization_config, start)
    return Path(out)


def write_artifact_files(
    tmp: Path,
    config: dict,
    tokenizer,
    fmt_name: str | None,
    record: QuantRecord | None,
    manifest: dict,
    dense_dtypes: set[torch.dtype],
    extra_tensors: dict[str, torch.Tensor] | None = None,
    generation_config=None,
    extra_file: str = SEARCH_FILE,
    quantization_config: dict | None = None,
    start: float | None = None,
) -> None:
    """Everything of an artifact but its weights, written into `tmp` where the weights already are:
    config.json (with the format's quantization_config; `dtype` when the dense tensors share one), generation
    config, tokenizer, `extra_tensors` as `extra_file`, and llmopt.json."""
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    if len(dense_dtypes) == 1:
        config["dtype"] = str(next(iter(dense_dtypes))).removeprefix("torch.")
    if fmt_name is not None:
        config["quantization_config"] = quantization_config or FORMATS.get(fmt_name).quantization_config(record)
    elif quantization_config is not None:  # compressed sparsity without quantization (formats.sparse)
        config["quantization_config"] = quantization_config
    write_json(tmp / "config.json", config)
    if generation_config is not None:
        generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    weights = sum(f.stat().st_size for f in tmp.glob("model*.safetensors"))
    if extra_tensors:
        save_tensors(extra_tensors, tmp / extra_file)
    manifest = {
        **manifest, "format": fmt_name, "versions": package_versions(),
        "write_wall_s": round(time.perf_counter() - start, 3) if start is not None else None,
        "weights_bytes": weights,
    }
    write_json(tmp / MANIFEST_FILE, manifest)


class ShardWriter:
    """Writes a model's tensors as they become final (a model compressed layer by layer) into safetensors
    shards of about `shard_bytes` each, named and indexed as transformers writes them
    (model-00001-of-00003.safetensors + model.safetensors.index.json; one shard is model.safetensors)."""

    def __init__(self, folder: Path, shard_bytes: int):
        self.folder, self.shard_bytes = Path(folder), shard_bytes
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.parts: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, tensor in tensors.items():
            self.pending[key] = tensor.contiguous()
            self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= self.shard_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        part = self.folder / f"part-{len(self.parts):05d}.safetensors.tmp"
        save_tensors(self.pending, part, metadata={"format": "pt"})
        self.parts.append((part, sorted(self.pending)))
        self.total_bytes += self.pending_bytes
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Write what is pending, give the shards their final names and write the index."""
        self.flush()
        if len(self.parts) == 1:
            self.parts[0][0].rename(self.folder / WEIGHTS_FILE)
            return
        weight_map = {}
        for number, (part, keys) in enumerate(self.parts, 1):
            name = f"model-{number:05d}-of-{len(self.parts):05d}.safetensors"
            part.rename(self.folder / name)
            weight_map.update(dict.fromkeys(keys, name))
        write_json(self.folder / INDEX_FILE, {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map})


def write_model_artifact(out, model, tokenizer, qweights, fmt_name, record, manifest, extra_tensors=None,
                         dense_dtype: torch.dtype = torch.float16, overwrite: bool = False) -> Path:
    """write_artifact for an in-memory model whose quantized linears are described by `qweights` (those of a 2:4
    model stored compressed where the format can: formats.sparse.mark_kept_codes)."""
    skip = {f"{name}.weight" for name in qweights} | {f"{name}.bias" for name in qweights}
    dense = dense_state_dict(model, skip, dense_dtype)
    config, qcfg = model.config.to_dict(), None
    if fmt_name is not None:
        marked = mark_kept_codes(qweights, config.get("sparsity_config"), fmt_name)
        config, qcfg = kept_codes_records(config, marked, FORMATS.get(fmt_name).quantization_config(record))
    return write_artifact(out, dense, config, tokenizer, qweights, fmt_name, record, manifest,
                          extra_tensors, getattr(model, "generation_config", None), overwrite,
                          quantization_config=qcfg)

"""prune MODEL -> artifact: sparse models with a sparsity_config, their pruned linears stored compressed
(formats.sparse: compressed-tensors' sparse-24-bitmask for 2:4 and 4:8, sparse-bitmask for unstructured; other N:M
patterns, or --save-dense, dense with zeros in place); structured ones as ordinary smaller checkpoints. All carry
llmopt.json."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from llmopt.compress.api import (
    make_sparsity_config, make_structured_config, measure_sparsity, sparsify_model, sparsity_config_entry,
)
from llmopt.compress.config import StructuredConfig
from llmopt.compress.defaults import SCORES_FILE
from llmopt.compress.structured import prune_structured
from llmopt.core.contract.sparsity import compressed_format
from llmopt.core.io import check_output_free
from llmopt.formats.artifact import dense_state_dict, write_artifact
from llmopt.formats.load import load_model
from llmopt.formats.sparse import compress_linears, sparsity_quantization_config, stores_compressed
from llmopt.core.errors import ConfigError
from llmopt.core.io import weights_bytes
from llmopt.jobs.common import (
    peak_rss_bytes, prior_stages, refuse_quantized_input, resolve_input, source_entry,
)
from llmopt.jobs.streamed import ArtifactMeta, load_streamed, prune_streamed


def prune_config(settings: dict):
    """The typed config of a prune command: structured (`structured` + `ratio`) or sparsity (`method` +
    `sparsity` / `pattern`), plus calibration settings."""
    if settings.get("structured") is not None:
        return make_structured_config(**settings)
    return make_sparsity_config(**settings)


def prune_to_artifact(
    model_name: str,
    output: str | Path,
    config,
    overwrite: bool = False,
    trust_remote_code: bool = False,
    progress: Callable[[int, int], None] | None = None,
    max_memory: int | None = None,
) -> dict:
    """Prune MODEL as the typed `config` says (prune_config builds it: a SparsityConfig or a StructuredConfig) and
    write the artifact; return the facts measured. `max_memory` (bytes): never hold more than one decoder
    layer's weights (jobs.streamed; sparsity only)."""
    start = time.perf_counter()
    output = check_output_free(output, overwrite)
    structured = isinstance(config, StructuredConfig)
    if structured and max_memory is not None:
        raise ConfigError("--max-memory prunes to sparsity (--method/--sparsity/--pattern); structured pruning "
                          "scores and reshapes the whole model at once: run it without --max-memory",
                          param="--max-memory")
    source = resolve_input(model_name, output)
    refuse_quantized_input(source, "prune", trust_remote_code)
    if max_memory is not None:
        return _prune_streamed(model_name, source, output, config, max_memory, overwrite, trust_remote_code,
                               progress, start)
    model, tokenizer, source = load_model(source, trust_remote_code=trust_remote_code)
    before = measure_sparsity(model)
    manifest = {"source": source_entry(model_name, source),
                "stages": prior_stages(source) + [{"stage": "prune", "settings": config.model_dump(mode="json")}]}
    extra = sparse_storage = sparse_qcfg = None
    config_dict = model.config.to_dict()
    if structured:
        small, plan, facts = prune_structured(model, tokenizer, config, progress)
        extra = {"scores": plan.scores.contiguous()}
        manifest["structured"] = {"kind": plan.kind, "config_updates": plan.config_updates,
                                  "keep": {str(k): v for k, v in plan.keep.items()},
                                  "keep_kv": {str(k): v for k, v in plan.keep_kv.items()},
                                  "keep_layers": plan.keep_layers, "scores_file": SCORES_FILE}
        model = small
        config_dict = {**config_dict, **plan.config_updates}
    else:
        masks, facts = sparsify_model(model, tokenizer, config, progress)
        measured = sum(int(m.sum()) for m in masks.values()) / sum(m.numel() for m in masks.values())
        suffixes = sorted({name.split(".", 3)[-1] for name in masks})
        sparse_storage = SparseStorage.of(config)
        config_dict["sparsity_config"] = sparsity_config_entry(config, measured, suffixes, sparse_storage.format)
        sparse_qcfg = sparse_storage.quantization_config(config, measured, suffixes)
        facts["measured_sparsity"] = measured
    after = measure_sparsity(model)
    manifest["facts"] = facts
    # Pruned weights keep the source dtype: zeros are exact, and a later quantize reads them back as-is.
    dense = dense_state_dict(model, set(), torch.float32)
    config_dict.pop("quantization_config", None)
    if sparse_storage is not None:
        dense = sparse_storage.compress(dense, masks)
    write_artifact(output, dense, config_dict, tokenizer, {}, None, None, manifest, extra,
                   getattr(model, "generation_config", None), overwrite, extra_file=SCORES_FILE,
                   quantization_config=sparse_qcfg)
    return _facts(output, "structured" if structured else "sparse",
                  config.structured if structured else config.method, before, after, facts, start, None)


@dataclass
class SparseStorage:
    """How a sparsity-pruned model's linears are stored: compressed (2:4 / 4:8 / unstructured, unless asked for
    dense weights) or dense, zeros in place."""

    pattern: str | None = None  # the structure they are compressed for; None: dense

    @classmethod
    def of(cls, config) -> SparseStorage:
        return cls(config.structure if config.save_compressed and stores_compressed(config.structure) else None)

    @property
    def format(self) -> str:
        return "dense" if self.pattern is None else compressed_format(self.pattern)

    def compress(self, tensors: dict[str, torch.Tensor], linears) -> dict[str, torch.Tensor]:
        """`tensors` with the pruned `linears` (names) compressed, when this storage compresses."""
        return tensors if self.pattern is None else compress_linears(tensors, linears, self.pattern)

    def quantization_config(self, config, measured: float, suffixes: list[str]) -> dict | None:
        """config.json's record of the compressed storage (None for dense weights)."""
        if self.pattern is None:
            return None
        return sparsity_quantization_config(self.pattern, suffixes, config.ignore, measured)


def _facts(output, kind: str, method: str, before: dict, after: dict, facts: dict, start: float,
           max_memory: int | None) -> dict:
    """What a prune command reports (measure_sparsity before and after, wall times, memory, size)."""
    return {
        "output": str(output), "kind": kind, "method": method,
        "num_parameters_before": before["num_parameters"], "num_parameters_after": after["num_parameters"],
        "num_nonzero_before": before["num_nonzero"], "num_nonzero_after": after["num_nonzero"],
        "linear_sparsity": round(after["linear_sparsity"], 6),
        "prune_wall_s": round(facts["prune_wall_s"], 2), "total_wall_s": round(time.perf_counter() - start, 2),
        "peak_rss_bytes": peak_rss_bytes(), "max_memory_bytes": max_memory,
        "artifact_weights_bytes": weights_bytes(output),
    }


def _prune_streamed(model_name, source, output, config, max_memory, overwrite, trust_remote_code, progress,
                    start) -> dict:
    """prune_to_artifact for a model larger than memory: the same artifact, one layer in memory at a time."""
    streamed = load_streamed(source, trust_remote_code)
    manifest = {"source": source_entry(model_name, source),
                "stages": prior_stages(source) + [{"stage": "prune", "settings": config.model_dump(mode="json")}]}
    storage = SparseStorage.of(config)

    def make_meta(result, tally) -> ArtifactMeta:
        facts = result.facts
        facts["prune_wall_s"] = facts.pop("wall_s")
        facts["measured_sparsity"] = tally.pruned / tally.masked
        config_dict = streamed.model.config.to_dict()
        config_dict.pop("quantization_config", None)
        suffixes = sorted(tally.suffixes)
        config_dict["sparsity_config"] = sparsity_config_entry(config, facts["measured_sparsity"], suffixes,
                                                               storage.format)
        return ArtifactMeta(config_dict, None, None, {**manifest, "facts": facts}, None, SCORES_FILE,
                            storage.quantization_config(config, facts["measured_sparsity"], suffixes))

    result, tally = prune_streamed(streamed, Path(output), config, max_memory, make_meta, overwrite, progress,
                                   storage.compress)
    before, after = tally.facts()
    return _facts(output, "sparse", config.method, before, after, result.facts, start, max_memory)

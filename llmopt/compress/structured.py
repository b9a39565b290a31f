"""Structured pruning to a smaller dense model that transformers loads as-is (Minitron-style importance).

Importance comes from calibration activations, collected by the shared layer-wise pipeline:
- mlp:    mean |activation| of each intermediate channel (the down projection's input);
- heads:  mean L2 norm of each attention head's output (its slice of the output projection's input);
- layers: block importance 1 - cos(layer input, layer output), averaged over tokens (how much a layer
          changes its input; ShortGPT).
The smaller model is built from a rewritten config and a sliced state dict. Scores are saved in the
artifact, and `scores_file` replays them without calibration.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

from llmopt.core.adapters import ArchAdapter, adapter_for, attention_geometry
from llmopt.core.errors import ConfigError
from llmopt.compress.config import StructuredConfig


class ImportanceCollector:
    """A LayerwiseAlgorithm that only observes: per-layer channel, head or block importance."""

    def __init__(self, kind: str, adapter: ArchAdapter, num_heads: int, head_dim: int):
        self.kind, self.adapter = kind, adapter
        self.num_heads, self.head_dim = num_heads, head_dim
        self.sums: dict[int, torch.Tensor] = {}
        self.counts: dict[int, int] = {}

    def stages(self, adapter):
        if self.kind == "mlp":
            return [(adapter.sequential[-1][0],)]  # the down projection
        if self.kind == "heads":
            return [(adapter.sequential[1][0],)]  # the attention output projection
        return []

    def _add(self, layer_index: int, values: torch.Tensor, count: int) -> None:
        self.sums[layer_index] = self.sums.get(layer_index, 0) + values.double().cpu()
        self.counts[layer_index] = self.counts.get(layer_index, 0) + count

    def add_batch(self, layer_index, name, module, inputs):
        x = inputs.reshape(-1, inputs.shape[-1]).float()
        if self.kind == "mlp":
            self._add(layer_index, x.abs().sum(0), x.shape[0])
        else:  # [tokens, heads * head_dim] -> per-head output norms
            per_head = x.view(x.shape[0], self.num_heads, self.head_dim).norm(dim=-1)
            self._add(layer_index, per_head.sum(0), x.shape[0])

    def process(self, layer_index, layer, names):
        pass

    def observe_layer(self, layer_index: int, inputs: torch.Tensor, outputs: torch.Tensor) -> None:
        if self.kind == "layers":
            cos = F.cosine_similarity(inputs.float().flatten(0, -2), outputs.float().flatten(0, -2), dim=-1)
            self._add(layer_index, (1 - cos).sum().reshape(1), cos.numel())

    def scores(self) -> torch.Tensor:
        """[num_layers, channels | heads | 1] mean importance."""
        return torch.stack([self.sums[i] / self.counts[i] for i in sorted(self.sums)]).float()


@dataclass
class StructuredPlan:
    kind: str
    scores: torch.Tensor
    keep: dict[int, list[int]] = field(default_factory=dict)  # layer -> kept channels / heads
    keep_kv: dict[int, list[int]] = field(default_factory=dict)  # layer -> kept kv heads (heads kind)
    keep_layers: list[int] = field(default_factory=list)
    config_updates: dict = field(default_factory=dict)


def head_dim_of(config) -> int:
    return attention_geometry(config).head_dim


def plan_pruning(config, kind: str, ratio: float, scores: torch.Tensor, channel_multiple: int = 32) -> StructuredPlan:
    """Decide what to keep from importance scores; uniform counts across layers keep the config uniform."""
    plan = StructuredPlan(kind, scores)
    num_layers = config.num_hidden_layers
    if kind == "mlp":
        size = config.intermediate_size
        keep_count = int(round(size * (1 - ratio) / channel_multiple)) * channel_multiple
        keep_count = min(max(keep_count, channel_multiple), size)
        if keep_count >= size:
            raise ConfigError(f"--ratio {ratio} removes no MLP channel (keeping multiples of {channel_multiple})")
        for layer in range(num_layers):
            plan.keep[layer] = sorted(torch.topk(scores[layer], keep_count).indices.tolist())
        plan.config_updates = {"intermediate_size": keep_count}
    elif kind == "heads":
        geometry = attention_geometry(config)
        heads, kv = geometry.num_heads, geometry.num_kv_heads
        group = heads // kv
        remove_per_group = int(round(group * ratio))
        if 0 < remove_per_group < group:  # remove query heads evenly in every KV group
            for layer in range(num_layers):
                per_group = scores[layer].view(kv, group)
                kept = [g * group + int(i) for g in range(kv)
                        for i in sorted(torch.topk(per_group[g], group - remove_per_group).indices.tolist())]
                plan.keep[layer], plan.keep_kv[layer] = kept, list(range(kv))
            plan.config_updates = {"num_attention_heads": kv * (group - remove_per_group), "num_key_value_heads": kv}
        else:  # remove whole KV groups (a KV head with its query heads)
            remove_groups = int(round(kv * ratio))
            if remove_groups == 0:
                raise ConfigError(f"--ratio {ratio} removes no attention head ({heads} heads in {kv} KV groups)")
            if remove_groups >= kv:
                raise ConfigError(f"--ratio {ratio} would remove every attention head: use a smaller ratio")
            for layer in range(num_layers):
                group_scores = scores[layer].view(kv, group).sum(1)
                kept_groups = sorted(torch.topk(group_scores, kv - remove_groups).indices.tolist())
                plan.keep_kv[layer] = kept_groups
                plan.keep[layer] = [g * group + i for g in kept_groups for i in range(group)]
            plan.config_updates = {"num_attention_heads": (kv - remove_groups) * group,
                                   "num_key_value_heads": kv - remove_groups}
        plan.config_updates["head_dim"] = head_dim_of(config)
    else:
        remove = int(round(num_layers * ratio))
        if remove == 0:
            raise ConfigError(f"--ratio {ratio} removes no layer of {num_layers}")
        if remove >= num_layers:
            raise ConfigError(f"--ratio {ratio} would remove every layer: use a smaller ratio")
        plan.keep_layers = sorted(torch.topk(scores[:, 0], num_layers - remove).indices.tolist())
        plan.config_updates = {"num_hidden_layers": num_layers - remove}
        if getattr(config, "layer_types", None):
            plan.config_updates["layer_types"] = [config.layer_types[i] for i in plan.keep_layers]
    return plan


def _rows(keep: list[int], width: int) -> torch.Tensor:
    """Row indices of kept blocks of `width` rows (heads of head_dim rows)."""
    return torch.tensor([b * width + j for b in keep for j in range(width)], dtype=torch.long)


def slice_state_dict(state: dict[str, torch.Tensor], config, adapter: ArchAdapter, plan: StructuredPlan) -> dict:
    """The state dict of the smaller model."""
    layers_prefix = adapter.layers + "."
    pattern = re.compile(re.escape(layers_prefix) + r"(\d+)\.(.+)")
    out = {}
    geometry = attention_geometry(config)
    head_dim, heads, kv = geometry.head_dim, geometry.num_heads, geometry.num_kv_heads
    for key, tensor in state.items():
        match = pattern.fullmatch(key)
        if not match:
            out[key] = tensor
            continue
        layer, rest = int(match.group(1)), match.group(2)
        if plan.kind == "layers":
            if layer in plan.keep_layers:
                out[f"{layers_prefix}{plan.keep_layers.index(layer)}.{rest}"] = tensor
            continue
        out[key] = _slice_param(rest, tensor, plan, layer, head_dim, heads, kv, config)
    return out


def _slice_param(rest, tensor, plan, layer, head_dim, heads, kv, config):
    keep = plan.keep[layer]
    if plan.kind == "mlp":
        idx = torch.tensor(keep)
        if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
            return tensor[idx]
        if rest == "mlp.gate_up_proj.weight":  # Phi-3: [gate; up] stacked
            return tensor[torch.cat([idx, idx + config.intermediate_size])]
        if rest == "mlp.down_proj.weight":
            return tensor[:, idx]
        return tensor
    q_rows, kv_rows = _rows(keep, head_dim), _rows(plan.keep_kv[layer], head_dim)
    if rest.startswith("self_attn.q_proj."):
        return tensor[q_rows]
    if rest.startswith(("self_attn.k_proj.", "self_attn.v_proj.")):
        return tensor[kv_rows]
    if rest.startswith("self_attn.qkv_proj."):  # Phi-3: [q; k; v] stacked
        q_size, kv_size = heads * head_dim, kv * head_dim
        return tensor[torch.cat([q_rows, q_size + kv_rows, q_size + kv_size + kv_rows])]
    if rest == "self_attn.o_proj.weight":
        return tensor[:, q_rows]
    return tensor


def collect_importance(model, tokenizer, config: StructuredConfig,
                       progress: Callable[[int, int], None] | None = None) -> torch.Tensor:
    from llmopt.core.calibration import run_layerwise
    from llmopt.core.datasets import calibration_samples
    from llmopt.core.models import check_within_context

    cal = config.calibration
    check_within_context(cal.seqlen, model.config, "--seqlen")
    calib_ids = calibration_samples(tokenizer, cal.calib, cal.num_samples, cal.seqlen, cal.seed, cal.text_field)
    collector = ImportanceCollector(config.structured, adapter_for(model), model.config.num_attention_heads,
                                    head_dim_of(model.config))
    run_layerwise(model, calib_ids, collector, cal.device, cal.batch_size, progress, getattr(torch, cal.compute_dtype))
    return collector.scores()


def layers_plan(config, keep_layers: list[int]) -> StructuredPlan:
    """The plan that keeps exactly these decoder layers (in order)."""
    num_layers = config.num_hidden_layers
    if not keep_layers or sorted(set(keep_layers)) != list(keep_layers) or keep_layers[-1] >= num_layers \
            or keep_layers[0] < 0:
        raise ConfigError(f"layers {keep_layers}: give distinct increasing indices in 0..{num_layers - 1}")
    plan = StructuredPlan("layers", torch.zeros(num_layers, 1), keep_layers=list(keep_layers))
    plan.config_updates = {"num_hidden_layers": len(keep_layers)}
    if getattr(config, "layer_types", None):
        plan.config_updates["layer_types"] = [config.layer_types[i] for i in keep_layers]
    return plan


def apply_plan(model, plan: StructuredPlan):
    """A new, smaller model holding `model`'s kept channels / heads / layers (the input model is unchanged)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmopt.core.models import rebuild_meta_buffers

    state = slice_state_dict(model.state_dict(), model.config, adapter_for(model), plan)
    new_config = AutoConfig.for_model(**{**model.config.to_dict(), **plan.config_updates})
    with torch.device("meta"):
        small = AutoModelForCausalLM.from_config(new_config, dtype=next(model.parameters()).dtype)
    small.load_state_dict(state, strict=False, assign=True)
    small.tie_weights()
    rebuild_meta_buffers(small)
    return small.eval()


def prune_structured(model, tokenizer, config: StructuredConfig,
                     progress: Callable[[int, int], None] | None = None):
    """Return (the smaller model, its plan, facts). The input model is left unchanged."""
    start = time.perf_counter()
    if config.scores_file:
        from safetensors.torch import load_file

        scores = load_file(config.scores_file)["scores"]
    else:
        scores = collect_importance(model, tokenizer, config, progress)
    plan = plan_pruning(model.config, config.structured, config.ratio, scores, config.channel_multiple)
    small = apply_plan(model, plan)
    facts = {"prune_wall_s": time.perf_counter() - start,
             "num_parameters_before": sum(p.numel() for p in model.parameters()),
             "num_parameters_after": sum(p.numel() for p in small.parameters())}
    return small, plan, facts

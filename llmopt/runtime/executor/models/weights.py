"""How a runtime model class receives its weights: as (checkpoint name, value) pairs handed one by one to the
per-parameter weight loader registered for that name (`WeightLoaders`).

A value is a tensor (`model.layers.0.input_layernorm.weight`, a dense linear's `...q_proj.weight` / `.bias`) or
a built linear (`model.layers.0.self_attn.q_proj`: a quantized weight already turned into its linear method, or an
nn.Linear). Two sources give the same names:
- `checkpoint_weights`: a checkpoint folder read directly (safetensors; an artifact's quantized linears through
  the format readers and the linear-method registry) — no transformers model is built;
- `module_weights`: a loaded transformers model (tests, distillation's in-memory models), its tensors shared, not
  copied.
Names nobody registered a loader for, and required names never loaded, are refused with one line.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterator

import torch
from torch import nn

from llmopt.core.errors import ModelLoadError, UnsupportedArchitectureError
from llmopt.runtime.executor.linear import LinearMethod
from llmopt.runtime.executor.models.layers import RMSNorm


class WeightLoaders:
    """name -> loader. Each loader meets a requirement (its own name, or a linear's: the module or its weight);
    `load` refuses names without a loader and requirements left unmet."""

    def __init__(self, what: str, ignored_suffixes: tuple[str, ...] = ()):
        self.what = what
        self.loaders: dict[str, tuple[Callable, str]] = {}
        self.required: set[str] = set()
        self.ignored_suffixes = ignored_suffixes

    def add(self, name: str, loader: Callable, required: bool = True, meets: str | None = None) -> None:
        self.loaders[name] = (loader, meets or name)
        if required:
            self.required.add(meets or name)

    def add_linear(self, name: str, slot: LinearSlot, required: bool = True) -> None:
        """A linear arrives whole (name -> module) or as tensors (name.weight, name.bias): either fills `slot`."""
        self.add(name, slot.take_module, required, meets=name)
        self.add(f"{name}.weight", slot.take_weight, required, meets=name)
        self.add(f"{name}.bias", slot.take_bias, required=False)

    def load(self, weights) -> None:
        met, unexpected = set(), []
        for name, value in weights:
            if name.endswith(self.ignored_suffixes):
                continue
            entry = self.loaders.get(name)
            if entry is None:
                unexpected.append(name)
                continue
            loader, meets = entry
            loader(value)
            met.add(meets)
        for kind, names in (("lacks tensors", sorted(self.required - met)), ("has unexpected tensors",
                                                                            sorted(unexpected))):
            if names:
                shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
                raise ModelLoadError(f"{self.what} {kind} for its config ({shown}): the checkpoint is incomplete "
                                     "or belongs to another model; re-create or re-download it")


def method_name(linear: nn.Module) -> str:
    """A linear's method as the bench JSON names it ("dense" for a plain nn.Linear)."""
    return linear.name if isinstance(linear, LinearMethod) else "dense"


def module_weights(model: nn.Module) -> Iterator[tuple[str, object]]:
    """A transformers model's weights by checkpoint name: its linears (nn.Linear or a linear method) whole, every
    other leaf module's parameters and buffers as tensors (the rotary tables among them)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, LinearMethod)):
            yield name, module
            continue
        if list(module.children()):
            continue
        for kind in (module.named_parameters(recurse=False), module.named_buffers(recurse=False)):
            for tensor_name, tensor in kind:
                yield f"{name}.{tensor_name}", tensor.detach()


def checkpoint_weights(path, dtype: torch.dtype, device: torch.device | str, make_linear_for,
                       shard=None) -> Iterator:
    """A checkpoint folder's weights by name, read without transformers: dense tensors cast to `dtype`; an
    artifact's quantized linears built by `make_linear_for(qweight)`. shard(name, value): a tensor-parallel
    rank's share of each (distributed.sharding.ShardPlan.shard; None: the rank holds none of it), taken before any
    cast or packing."""
    from llmopt.formats.read import read_artifact

    contents = read_artifact(path)
    for name, tensor in contents.dense.items():
        if shard is not None and (tensor := shard(name, tensor)) is None:
            continue
        yield name, (tensor.to(dtype) if tensor.is_floating_point() else tensor).to(device).contiguous()
    for name, qweight in contents.linears().items():
        if shard is not None and (qweight := shard(name, qweight)) is None:
            continue
        yield name, make_linear_for(qweight)


def rope_tables(config) -> tuple[torch.Tensor, float]:
    """(inv_freq [rotary_dim / 2], attention scaling) as transformers computes them from the config."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    rope_type = params.get("rope_type", "default")
    if rope_type in ("dynamic", "longrope"):
        raise UnsupportedArchitectureError(
            f"rope type {rope_type!r} changes its frequencies with the sequence length; the runtime supports "
            "static ones: run this model with --backend hf")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitectureError("a partial rotary factor is not supported by the runtime: run this model "
                                           "with --backend hf")
    if rope_type != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None)
        return inv_freq.float(), float(scaling)
    base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def checkpoint_label(config) -> str:
    """How errors name a checkpoint: its folder, else its model type."""
    return getattr(config, "_name_or_path", "") or f"the {config.model_type} checkpoint"


def embedding(weight: torch.Tensor) -> nn.Embedding:
    """An nn.Embedding over the given [vocab, hidden] table (shared, not copied)."""
    embed = nn.Embedding(weight.shape[0], weight.shape[1], device="meta")
    embed.weight = nn.Parameter(weight, requires_grad=False)
    return embed


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Linear:
    """An nn.Linear over the given tensors (shared, not copied)."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias, requires_grad=False)
    return linear


class LinearSlot:
    """One linear of a layer, filled whole or from its weight and bias."""

    def __init__(self):
        self.module: nn.Module | None = None
        self.weight: torch.Tensor | None = None
        self.bias: torch.Tensor | None = None

    def take_module(self, module: nn.Module) -> None:
        self.module = module

    def take_weight(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def take_bias(self, bias: torch.Tensor) -> None:
        self.bias = bias

    def build(self) -> nn.Module:
        return self.module if self.module is not None else dense_linear(self.weight, self.bias)


class DecoderWeights:
    """The loaders of a decoder-only family: the embedding, the final norm and the lm_head (absent when tied to the
    embedding) for every family, and the layer tensors (`keep`) and linears (`linear`) the family asks for; `load`
    runs them all, then `norm` and `build` make the modules, `linear_methods` counting the methods built."""

    def __init__(self, config):
        self.eps = getattr(config, "rms_norm_eps", 1e-6)
        self.tied = config.tie_word_embeddings
        self.loaders = WeightLoaders(checkpoint_label(config),
                                     ignored_suffixes=("rotary_emb.inv_freq", "rotary_emb.original_inv_freq"))
        self.tensors: dict[str, torch.Tensor] = {}
        self.linear_methods: Counter = Counter()
        self.keep("model.embed_tokens.weight")
        self.keep("model.norm.weight")
        self.head = self.linear("lm_head", required=not self.tied)

    def keep(self, name: str, required: bool = True) -> None:
        self.loaders.add(name, lambda tensor: self.tensors.__setitem__(name, tensor), required)

    def linear(self, name: str, required: bool = True) -> LinearSlot:
        """The slot the checkpoint's linear `name` fills (whole, or as weight + bias)."""
        slot = LinearSlot()
        self.loaders.add_linear(name, slot, required)
        return slot

    def load(self, weights) -> tuple[nn.Embedding, RMSNorm, nn.Module]:
        """Run the loaders; (embedding, final norm, lm_head)."""
        self.loaders.load(weights)
        embed = embedding(self.tensors["model.embed_tokens.weight"])
        tied = self.head.module is None and self.head.weight is None
        lm_head = dense_linear(embed.weight, None) if tied else self.head.build()
        return embed, self.norm("model.norm"), lm_head

    def norm(self, name: str) -> RMSNorm:
        """The RMSNorm whose weight was loaded as `name`.weight."""
        return RMSNorm(self.tensors[f"{name}.weight"], self.eps)

    def build(self, slot: LinearSlot) -> nn.Module:
        """A layer's linear from its filled slot, counted by its method."""
        linear = slot.build()
        self.linear_methods[method_name(linear)] += 1
        return linear

"""Architecture adapters: for each model family, where its parts are. Data, not code per family.

Paths are dotted attribute paths; linear and norm paths inside a decoder layer are relative to the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from llmopt.core.errors import UnsupportedArchitectureError


@dataclass(frozen=True)
class ArchAdapter:
    family: str
    model_types: tuple[str, ...]
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    attention: str = "self_attn"
    # The attention module's last op: its output is attention_output(its input) (the calibration pipeline
    # replays it from cached inputs once the other attention linears are final).
    attention_output: str = "self_attn.o_proj"
    mlp: str = "mlp"
    # Linears of one decoder layer, in GPTQ's "true sequential" order: each inner list is quantized
    # together and the later lists see the already-quantized earlier ones.
    sequential: tuple[tuple[str, ...], ...] = (
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("self_attn.o_proj",),
        ("mlp.gate_proj", "mlp.up_proj"),
        ("mlp.down_proj",),
    )
    # AWQ smoothing groups: (the op whose output feeds the linears, the linears). Scaling the op's output
    # channels down by s and the linears' input channels up by s leaves the function unchanged.
    smooth_groups: tuple[tuple[str, tuple[str, ...]], ...] = (
        ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
        ("self_attn.v_proj", ("self_attn.o_proj",)),  # only where v's outputs map 1:1 onto o's inputs
        ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
        ("mlp.up_proj", ("mlp.down_proj",)),
    )
    notes: str = ""

    @property
    def linears(self) -> tuple[str, ...]:
        return tuple(name for group in self.sequential for name in group)

    @property
    def fed_same_input(self) -> dict[str, tuple[str, ...]]:
        """Linear -> the linears fed the very same tensor (a norm's output: q/k/v, gate/up), itself included.
        The calibration pipeline hands them one input when the first of them is reached."""
        norms = (self.input_norm, self.post_attention_norm)
        return {name: group for source, group in self.smooth_groups if source in norms for name in group}


@dataclass(frozen=True)
class AttentionGeometry:
    num_heads: int
    num_kv_heads: int  # < num_heads with grouped-query attention
    head_dim: int


def attention_geometry(config) -> AttentionGeometry:
    """Heads, KV heads and head size from a transformers config (head_dim may be given or implied)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return AttentionGeometry(heads, kv_heads, head_dim)


ADAPTERS: tuple[ArchAdapter, ...] = (
    ArchAdapter("llama", ("llama",)),
    ArchAdapter("mistral", ("mistral",)),
    ArchAdapter("qwen2", ("qwen2",)),
    ArchAdapter("qwen3", ("qwen3",), notes="per-head q_norm/k_norm inside attention"),
    ArchAdapter(
        "phi3",
        ("phi3",),
        sequential=(("self_attn.qkv_proj",), ("self_attn.o_proj",), ("mlp.gate_up_proj",), ("mlp.down_proj",)),
        smooth_groups=(
            ("input_layernorm", ("self_attn.qkv_proj",)),
            ("post_attention_layernorm", ("mlp.gate_up_proj",)),
        ),
        notes="fused qkv_proj and gate_up_proj",
    ),
)

_BY_MODEL_TYPE = {model_type: a for a in ADAPTERS for model_type in a.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def adapter_for(model_or_config) -> ArchAdapter:
    """The adapter for a model (or its config), by `config.model_type`."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    try:
        return _BY_MODEL_TYPE[model_type]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"model family {model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        ) from None


def get_module(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split("."):
        module = getattr(module, part)
    return module


def set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = get_module(root, parent_path) if parent_path else root
    setattr(parent, name, new)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    return get_module(model, adapter_for(model).layers)


def layer_linears(layer: nn.Module, adapter: ArchAdapter) -> dict[str, nn.Linear]:
    """The adapter's linears present in one decoder layer, by relative path."""
    return {name: get_module(layer, name) for name in adapter.linears}

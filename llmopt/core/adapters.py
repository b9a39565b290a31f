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
    # The linears whose outputs are added to the residual stream (a rotation of the stream rotates their rows)
    residual_writers: tuple[str, ...] = ("self_attn.o_proj", "mlp.down_proj")
    notes: str = ""
    # (config attribute, whether it must be set): for families whose layers differ with the config (DeepSeek's
    # q_lora_rank: low-rank queries or one q_proj); adapter_for takes the first adapter whose test passes
    when: tuple[str, bool] | None = None

    def fits(self, config) -> bool:
        if self.when is None:
            return True
        name, must_be_set = self.when
        return (getattr(config, name, None) is not None) == must_be_set

    def unsupported(self, config) -> str | None:
        """Why compression cannot handle this model, or None: mixture-of-experts layers (DeepSeek's
        `first_k_dense_replace` dense layers, then routed experts) are not supported yet."""
        experts, dense = getattr(config, "n_routed_experts", None), getattr(config, "first_k_dense_replace", None)
        if experts and dense is not None and dense < config.num_hidden_layers:
            return (f"layers {dense}-{config.num_hidden_layers - 1} of this {self.family} model are mixtures of "
                    f"{experts} experts, which llmopt cannot compress or run yet; only dense-MLP layers are supported")
        return None

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
    ArchAdapter(
        "deepseek",
        ("deepseek_v2", "deepseek_v3"),
        # MLA: q through its low-rank pair (q_a -> norm -> q_b; q_proj when q_lora_rank is null), keys and values
        # from the latent kv_a_proj_with_mqa -> norm -> kv_b_proj
        sequential=(("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"), ("self_attn.q_b_proj",),
                    ("self_attn.kv_b_proj",), ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"),
                    ("mlp.down_proj",)),
        smooth_groups=(
            ("input_layernorm", ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")),
            ("self_attn.q_a_layernorm", ("self_attn.q_b_proj",)),
            ("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.up_proj", ("mlp.down_proj",)),
        ),
        notes="multi-head latent attention; dense-MLP layers only (mixtures of experts are refused)",
        when=("q_lora_rank", True),
    ),
    ArchAdapter(  # DeepSeek-V2-Lite and kin: full-rank queries (q_lora_rank null)
        "deepseek",
        ("deepseek_v2", "deepseek_v3"),
        sequential=(("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa"), ("self_attn.kv_b_proj",),
                    ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",)),
        smooth_groups=(
            ("input_layernorm", ("self_attn.q_proj", "self_attn.kv_a_proj_with_mqa")),
            ("self_attn.kv_a_layernorm", ("self_attn.kv_b_proj",)),
            ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
            ("mlp.up_proj", ("mlp.down_proj",)),
        ),
        notes="multi-head latent attention with full-rank queries; dense-MLP layers only",
        when=("q_lora_rank", False),
    ),
)

_BY_MODEL_TYPE: dict[str, list[ArchAdapter]] = {}
for _adapter in ADAPTERS:
    for _model_type in _adapter.model_types:
        _BY_MODEL_TYPE.setdefault(_model_type, []).append(_adapter)


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def adapter_for(model_or_config) -> ArchAdapter:
    """The adapter for a model (or its config), by `config.model_type`."""
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    for adapter in _BY_MODEL_TYPE.get(model_type, ()):
        if adapter.fits(config):
            return adapter
    raise UnsupportedArchitectureError(
        f"model family {model_type!r} is not supported; supported: {', '.join(supported_model_types())}")


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


def modules_beside_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The base model's modules other than its decoder layers (embeddings, rotary, final norm), by full path."""
    base, _, layers = adapter_for(model).layers.rpartition(".")
    return [(f"{base}.{name}", module) for name, module in get_module(model, base).named_children()
            if name != layers]



"""What the planner needs of a model, from its config.json alone (no weights): the parameters each step reads, the
FLOPs per token, and the KV cache's bytes per token; and what each weight scheme and KV dtype costs per value."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from llmopt.core.errors import ConfigError
from llmopt.core.io import read_mapping_file
from llmopt.core.registry import Registry


class WeightScheme(BaseModel):
    """How a scheme stores the decoder's linear weights and where their products run."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bits: float = Field(gt=0)  # per weight value
    group_size: int = 0  # values sharing one scale (0: per channel or none)
    scale_bits: float = 0  # per group: scale (+ zero point)
    # the dtype the products run in (a hardware rate); "activations": weight-only, the weights are widened to the
    # activations' dtype (HardwareSpec.activation_dtype)
    compute: str = "activations"

    @property
    def dense_bytes(self) -> float:
        """Bytes per value of the tensors a scheme leaves unquantized (lm_head, embedding): 16 bits, as artifacts
        store them, 32 under fp32."""
        return 4.0 if self.name == "fp32" else 2.0

    @property
    def bytes_per_weight(self) -> float:
        per_group = self.scale_bits / self.group_size if self.group_size else 0.0
        return (self.bits + per_group) / 8


WEIGHT_SCHEMES: Registry = Registry("weight scheme")
for _scheme in (
    WeightScheme(name="fp32", bits=32, compute="fp32"),
    WeightScheme(name="bf16", bits=16, compute="bf16"),
    WeightScheme(name="fp16", bits=16, compute="bf16"),
    # W8A8 (SmoothQuant) and FP8: integer / fp8 products where the device has them
    WeightScheme(name="int8", bits=8, compute="int8"),
    WeightScheme(name="fp8", bits=8, compute="fp8"),
    # int4 weight-only, groups of 128 (or 64) with an fp16 scale and a 4-bit zero point (GPTQ / AWQ / RTN)
    WeightScheme(name="int4", bits=4, group_size=128, scale_bits=20),
    WeightScheme(name="int4-g64", bits=4, group_size=64, scale_bits=20),
    # NVFP4: E2M1 values, an E4M3 scale per 16
    WeightScheme(name="fp4", bits=4, group_size=16, scale_bits=8, compute="fp4"),
):
    WEIGHT_SCHEMES.add(_scheme.name, _scheme)

# KV cache dtype -> bytes per cached value, and the per-(token, head) scale bytes of the 8-bit caches (fp32 each)
KV_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}
KV_SCALE_BYTES = {"int8": 4, "fp8": 4}


def weight_scheme(name: str) -> WeightScheme:
    if name not in WEIGHT_SCHEMES:
        raise ConfigError(f"unknown weight scheme {name!r}: choose one of {', '.join(WEIGHT_SCHEMES.names())}",
                          param="schemes")
    return WEIGHT_SCHEMES.get(name)


# the config.json fields the planner reads as sizes (each a whole number >= 1 where given)
SIZE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "head_dim",
               "intermediate_size", "vocab_size", "max_position_embeddings")


def _has_expert_layers(config: dict) -> bool:
    """Whether some decoder layer is a mixture of experts. A config may name expert fields and still be dense in
    every layer: DeepSeek's first `first_k_dense_replace` layers are dense, Qwen-MoE's `mlp_only_layers` too."""
    layers = config.get("num_hidden_layers") or 0
    if config.get("n_routed_experts"):
        return (config.get("first_k_dense_replace") or 0) < layers
    if config.get("num_experts"):
        return len(set(config.get("mlp_only_layers") or [])) < layers
    return bool(config.get("num_local_experts"))


@dataclass(frozen=True)
class ModelShape:
    """A dense decoder-only transformer (Llama family: GQA attention, gated MLP)."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    max_context: int

    @classmethod
    def from_config(cls, config: dict, name: str = "model") -> ModelShape:
        """From a config.json's fields (any hub config of a dense Llama-like model)."""
        text = {**(config.get("text_config") or {}), **config}
        missing = [k for k in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size",
                               "vocab_size") if k not in text]
        if missing:
            raise ConfigError(f"{name}: config.json has no {missing[0]!r}: give a decoder-only model's config",
                              param="model")
        sizes = {k: text[k] for k in SIZE_FIELDS if text.get(k) is not None}
        for key, value in sizes.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name}: config.json's {key} is {value!r}: a size is a whole number of at least 1",
                                  param="model")
        hidden, heads = sizes["hidden_size"], sizes["num_attention_heads"]
        kv_heads = sizes.get("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ConfigError(f"{name}: num_attention_heads {heads} is not a multiple of num_key_value_heads "
                              f"{kv_heads}: each KV head serves a whole group of query heads", param="model")
        if "head_dim" not in sizes and hidden % heads:
            raise ConfigError(f"{name}: hidden_size {hidden} does not divide into num_attention_heads {heads} (and "
                              f"no head_dim is given)", param="model")
        if _has_expert_layers(text):
            raise ConfigError(f"{name}: mixture-of-experts models are not modelled by the planner yet", param="model")
        return cls(name, hidden, sizes["num_hidden_layers"], heads, kv_heads, sizes.get("head_dim", hidden // heads),
                   sizes["intermediate_size"], sizes["vocab_size"], bool(text.get("tie_word_embeddings", False)),
                   sizes.get("max_position_embeddings", 4096))

    @classmethod
    def from_path(cls, path: str | Path) -> ModelShape:
        """A config.json, or a folder holding one."""
        path = Path(path)
        file = path / "config.json" if path.is_dir() else path
        if not file.is_file():
            raise ConfigError(f"{path}: no config.json there: give a model folder or its config.json", param="model")
        config = read_mapping_file(file, str(file), "a model's config.json (a JSON mapping)")
        name = path.name if path.is_dir() else path.parent.name if path.stem == "config" else path.stem
        return cls.from_config(config, name)

    @property
    def layer_params(self) -> int:
        """Linear weights of one decoder layer: q, k, v, o and gate, up, down."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return self.hidden * (2 * q + 2 * kv) + 3 * self.hidden * self.intermediate

    @property
    def decoder_params(self) -> int:
        return self.layers * self.layer_params

    @property
    def head_params(self) -> int:
        """The lm_head: every step reads it whole (a tied embedding too)."""
        return self.vocab * self.hidden

    @property
    def params(self) -> int:
        """Every parameter (norms left out: < 0.01%)."""
        return self.decoder_params + self.head_params * (1 if self.tied_embeddings else 2)

    def linear_flops_per_token(self) -> float:
        """2 FLOPs per weight of every linear a token passes through (the lm_head for tokens that sample)."""
        return 2.0 * self.decoder_params

    def head_flops_per_token(self) -> float:
        return 2.0 * self.head_params

    def attention_flops_per_token(self, context: float) -> float:
        """QK^T and PV over `context` cached tokens, every layer: 4 x heads x head_dim per context token."""
        return 4.0 * self.layers * self.heads * self.head_dim * context

    def weight_bytes(self, scheme: WeightScheme) -> float:
        """Decoder linears in the scheme, the lm_head unquantized (scheme.dense_bytes), the embedding not counted (a
        step reads only its rows)."""
        return self.decoder_params * scheme.bytes_per_weight + self.head_params * scheme.dense_bytes

    def stored_bytes(self, scheme: WeightScheme) -> float:
        """Memory the weights take: the step's bytes plus an untied embedding."""
        embed = 0 if self.tied_embeddings else self.head_params * scheme.dense_bytes
        return self.weight_bytes(scheme) + embed

    def kv_bytes_per_token(self, kv_dtype: str) -> float:
        """Keys and values of one token over every layer and KV head (8-bit caches add a scale per head)."""
        if kv_dtype not in KV_BYTES:
            raise ConfigError(f"unknown KV cache dtype {kv_dtype!r}: choose one of {', '.join(KV_BYTES)}",
                              param="kv_dtypes")
        per_head = self.head_dim * KV_BYTES[kv_dtype] + KV_SCALE_BYTES.get(kv_dtype, 0)
        return 2.0 * self.layers * self.kv_heads * per_head


def model_shape(name: str) -> ModelShape:
    """MODEL for the planner: a config.json, a folder holding one, or anything `llmopt` resolves (an alias, an
    artifact); only the config is read."""
    path = Path(name).expanduser()
    if path.exists():
        return ModelShape.from_path(path)
    from llmopt.core.models import resolve_model

    source = resolve_model(name)
    if source.path is None:
        raise ConfigError(f"{name}: give a config.json or a local folder (the planner reads no hub model)",
                          param="model")
    shape = ModelShape.from_path(source.path)
    return ModelShape(**{**shape.__dict__, "name": name})

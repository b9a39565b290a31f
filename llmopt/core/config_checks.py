"""A model's config checked before anything is allocated: every size a positive integer, the sizes consistent
with each other (heads divide the hidden size, KV heads divide the heads), and the weights within the memory this
machine has. Without it an absurd config fails deep inside torch ("Storage size calculation overflowed") or
transformers, never naming the field."""

from __future__ import annotations

from llmopt.core.errors import ConfigError

# sizes a decoder config must give (when the family uses them), each a positive integer
REQUIRED_SIZES = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
OPTIONAL_SIZES = ("intermediate_size", "num_key_value_heads", "head_dim", "max_position_embeddings")
GIB = 2 ** 30


def size_problem(config) -> tuple[str, str] | None:
    """(field, what is wrong) for the first size that is missing, not a positive integer or inconsistent."""
    for name in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = getattr(config, name, None)
        if value is None:
            if name in REQUIRED_SIZES:
                return name, f"{name} is missing from the config"
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            return name, f"{name} is {value!r}: it must be a positive integer"
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % kv:
        return "num_key_value_heads", (f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads "
                                       f"({kv})")
    if getattr(config, "head_dim", None) is None and hidden % heads:
        return "num_attention_heads", (f"hidden_size ({hidden}) is not a multiple of num_attention_heads ({heads}) "
                                       f"and the config gives no head_dim")
    return None


def weight_parts(config) -> dict[str, tuple[int, str]]:
    """Parameters of a dense decoder by part: {part: (count, the fields that size it)} (an estimate for families
    with extra projections; exact for Llama-style models)."""
    hidden, layers, heads = config.hidden_size, config.num_hidden_layers, config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    intermediate = getattr(config, "intermediate_size", None) or 4 * hidden
    tied = getattr(config, "tie_word_embeddings", False)
    return {
        "embeddings": (config.vocab_size * hidden * (1 if tied else 2), "vocab_size x hidden_size"),
        "attention": (layers * hidden * head_dim * (2 * heads + 2 * kv),
                      "num_hidden_layers x hidden_size x num_attention_heads x head_dim"),
        "mlp": (layers * 3 * hidden * intermediate, "num_hidden_layers x hidden_size x intermediate_size"),
    }


def memory_problem(config, bytes_per_weight: int, available: int) -> str | None:
    """Why the weights cannot fit in `available` bytes, naming the fields of the largest part; None if they fit."""
    parts = weight_parts(config)
    total = sum(count for count, _ in parts.values()) * bytes_per_weight
    if total <= available:
        return None
    part, (count, fields) = max(parts.items(), key=lambda kv: kv[1][0])
    return (f"its weights need about {total / GIB:,.1f} GiB at {bytes_per_weight} bytes each, more than the "
            f"{available / GIB:,.1f} GiB of memory available (the {part}, {fields}, hold {count:,} parameters)")


def config_problem(config, bytes_per_weight: int | None = None, available: int | None = None) -> str | None:
    """The first reason this config cannot be built here, or None. The memory check needs bytes_per_weight
    (default: available host memory)."""
    sizes = size_problem(config)
    if sizes is not None:
        return sizes[1]
    if bytes_per_weight is None:
        return None
    if available is None:
        import psutil

        available = psutil.virtual_memory().available
    return memory_problem(config, bytes_per_weight, available)


def check_config(config, bytes_per_weight: int | None = None, what: str = "the model") -> None:
    """Raise a ConfigError naming the field (see config_problem) before any allocation."""
    problem = config_problem(config, bytes_per_weight)
    if problem is not None:
        field = size_problem(config)
        raise ConfigError(f"the config of {what} cannot be built: {problem}", param=field[0] if field else None)


def unsupported_reason(config, bytes_per_weight: int = 2) -> str | None:
    """Why llmopt cannot load this config here (an unknown family, mixture-of-experts layers, a size problem,
    weights beyond memory at `bytes_per_weight`, default bf16's 2), or None: what `llmopt models info` reports."""
    from llmopt.core.adapters import adapter_for
    from llmopt.core.errors import LLMOptError

    try:
        adapter = adapter_for(config)
    except LLMOptError as e:
        return str(e)
    return adapter.unsupported(config) or config_problem(config, bytes_per_weight)

"""Tiny random models with a byte-level tokenizer: built from a config in seconds, on any machine.

Used by the unit tests, the `tiny-random-*` aliases and the CI smoke recipe.
"""

from __future__ import annotations

from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True,
    ),
    # DeepSeek-V2's multi-head latent attention at toy size: queries through a rank-128 bottleneck, keys and values
    # from a 128-value latent plus a 16-value rope key shared by the heads; dense MLPs in every layer
    # (first_k_dense_replace = the layer count: no mixture of experts). Every in_features is a multiple of 128,
    # so `llmopt quantize` runs with its default group size.
    "deepseek": dict(
        model_type="deepseek_v2", hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024, rms_norm_eps=1e-6,
        rope_theta=10000.0, tie_word_embeddings=False, q_lora_rank=128, kv_lora_rank=128, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, first_k_dense_replace=2, n_routed_experts=4, n_shared_experts=1,
        num_experts_per_tok=2, moe_intermediate_size=64,
    ),
}


def byte_tokenizer():
    """A byte-level BPE tokenizer with no merges (one token per byte) plus ChatML specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=SPECIAL_TOKENS[0], eos_token=SPECIAL_TOKENS[2], pad_token=SPECIAL_TOKENS[0],
        additional_special_tokens=list(SPECIAL_TOKENS[1:2]),
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised model of `family` (deterministic for a seed) and its tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = byte_tokenizer()
    settings = {**TINY_CONFIGS[family], **overrides}
    model_type = settings.pop("model_type")
    # a vocab larger than the byte tokenizer's is allowed (speed tests at a real model's shape)
    settings.setdefault("vocab_size", len(tokenizer))
    config = AutoConfig.for_model(
        model_type, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **settings,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Random init leaves norms at 1 and small weights; widen the spread so quantization has work to do.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    model.eval()
    return model, tokenizer


def save_tiny_model(path: str | Path, family: str = "llama", seed: int = 0, max_shard_size: str | None = None,
                    **overrides) -> Path:
    """build_tiny_model saved as a Hugging Face folder (in safetensors shards of `max_shard_size`, e.g. "200MB")."""
    model, tokenizer = build_tiny_model(family, seed, **overrides)
    path = Path(path)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    tokenizer.save_pretrained(path)
    return path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmopt.core.adapters import ADAPTERS, adapter_for, decoder_layers, get_module
from llmopt.core.errors import UnsupportedArchitectureError

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, pad_token_id=0)


# DeepSeek's multi-head latent attention at toy size, dense MLPs; q_lora_rank set or not picks the adapter
MLA = dict(kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=2,
           n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def family_config(adapter):
    extra = {}
    if adapter.when is not None:
        extra = {**MLA, adapter.when[0]: 16 if adapter.when[1] else None}
    return AutoConfig.for_model(adapter.model_types[0], **TINY, **extra)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.family + ("" if a.when is None else f"-{a.when}"))
def test_every_path_in_the_table_exists_in_a_real_model_of_that_family(adapter):
    config = family_config(adapter)
    model = AutoModelForCausalLM.from_config(config)
    assert adapter_for(model) is adapter
    for path in (adapter.embed, adapter.final_norm, adapter.lm_head):
        get_module(model, path)
    layers = decoder_layers(model)
    assert len(layers) == 2
    for layer in layers:
        for linear in (get_module(layer, name) for name in adapter.linears):
            assert isinstance(linear, torch.nn.Linear)
        for prev, linears in adapter.smooth_groups:
            get_module(layer, prev)
            assert set(linears) <= set(adapter.linears)
        get_module(layer, adapter.input_norm)
        get_module(layer, adapter.post_attention_norm)


def test_unsupported_family_names_the_supported_ones():
    config = AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2.*llama.*mistral.*phi3.*qwen2.*qwen3"):
        adapter_for(config)


def test_mixtures_of_experts_are_refused_by_compression_in_one_line():
    from llmopt.compress.base import quantizable_linears

    config = AutoConfig.for_model("deepseek_v2", **{**TINY, **MLA, "first_k_dense_replace": 1, "q_lora_rank": 16})
    model = AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedArchitectureError, match="layers 1-1 .* mixtures of 4 experts"):
        quantizable_linears(model)

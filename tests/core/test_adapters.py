import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmopt.core.adapters import ADAPTERS, adapter_for, decoder_layers, get_module, layer_linears
from llmopt.core.errors import UnsupportedArchitectureError

TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64, pad_token_id=0)


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda a: a.family)
def test_every_path_in_the_table_exists_in_a_real_model_of_that_family(adapter):
    config = AutoConfig.for_model(adapter.model_types[0], **TINY)
    model = AutoModelForCausalLM.from_config(config)
    assert adapter_for(model) is adapter
    for path in (adapter.embed, adapter.final_norm, adapter.lm_head):
        get_module(model, path)
    layers = decoder_layers(model)
    assert len(layers) == 2
    for layer in layers:
        for linear in layer_linears(layer, adapter).values():
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

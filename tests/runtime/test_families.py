"""Every family the runtime's Llama-family class registers runs greedy = transformers in fp32 (exact and fast),
loaded from its checkpoint folder by the runtime's own weight loaders or from a loaded transformers model."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmopt.core.tiny import byte_tokenizer
from llmopt.eval.hf_baseline import hf_generate
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.executor.models import MODEL_FAMILIES, RuntimeCheckpoint

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def tiny_family(model_type):
    tok = byte_tokenizer()
    extra = {"head_dim": 16} if model_type == "qwen3" else {}
    config = AutoConfig.for_model(model_type, vocab_size=len(tok), pad_token_id=tok.pad_token_id,
                                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **TINY, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    return model, tok


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
def test_family_greedy_equals_transformers_from_the_checkpoint_and_from_the_model(model_type, tmp_path):
    """The runtime's class loads the checkpoint folder by itself (per-parameter loaders, no transformers model) and
    a loaded transformers model alike; both give transformers' greedy tokens, exact and fast."""
    assert MODEL_FAMILIES.get(model_type).__name__ == "LlamaFamilyDecoder"
    model, tok = tiny_family(model_type)
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    checkpoint, _, _ = load_runtime_model(str(tmp_path), dtype="float32")
    assert isinstance(checkpoint, RuntimeCheckpoint)
    prompts = [tok.encode("def f(x):\n    return"), tok.encode("hello")]
    expected = [list(e) for e in hf_generate(model, tok, prompts, GREEDY)]
    for source in (checkpoint, model):
        for fast in (False, True):
            engine = Engine(source, tok, EngineConfig(block_size=4, fast_path=fast))
            assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected, (type(source), fast)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "deepseek_v2"])
def test_rope_tables_from_the_config_are_transformers_bits(model_type):
    from llmopt.runtime.executor.models.weights import rope_tables

    if model_type == "deepseek_v2":
        from llmopt.core.tiny import build_tiny_model

        model, _ = build_tiny_model("deepseek")
    else:
        model, _ = tiny_family(model_type)
    inv_freq, scaling = rope_tables(model.config)
    rotary = model.model.rotary_emb
    assert torch.equal(inv_freq, rotary.inv_freq) and scaling == rotary.attention_scaling


def test_a_checkpoint_missing_or_adding_a_tensor_is_refused_naming_it(tmp_path):
    from safetensors.torch import load_file, save_file

    from llmopt.core.errors import ModelLoadError

    model, tok = tiny_family("llama")
    for case, change in (("missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")),
                         ("extra", lambda t: t.__setitem__("model.layers.1.mlp.extra.weight", torch.zeros(2)))):
        folder = tmp_path / case
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        tensors = load_file(folder / "model.safetensors")
        change(tensors)
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        checkpoint, _, _ = load_runtime_model(str(folder), dtype="float32")
        word = "lacks" if case == "missing" else "has unexpected"
        with pytest.raises(ModelLoadError, match=f"{word} tensors .*model.layers.1.mlp.(up_proj|extra)"):
            Engine(checkpoint, tok, EngineConfig(block_size=4))

"""Every family the runtime's Llama-family class registers runs greedy = transformers in fp32 (exact and fast)."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from llmopt.core.tiny import byte_tokenizer
from llmopt.eval.hf_baseline import hf_generate
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.models import MODEL_FAMILIES

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False)
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3"])
@pytest.mark.parametrize("fast", [False, True])
def test_family_greedy_equals_transformers(model_type, fast):
    assert MODEL_FAMILIES.get(model_type).__name__ == "LlamaFamilyDecoder"
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
    prompts = [tok.encode("def f(x):\n    return"), tok.encode("hello")]
    expected = hf_generate(model, tok, prompts, GREEDY)
    engine = Engine(model, tok, EngineConfig(block_size=4, fast_path=fast))
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [list(e) for e in expected]

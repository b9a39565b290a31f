"""Tests on the real default model, SmolLM2-135M-Instruct (installed by the Makefile)."""

import pytest
import torch

from tests.eval.test_perplexity import plain_loop_ppl

pytestmark = pytest.mark.real_model


def test_smollm2_loads_with_gqa_and_tied_embeddings(smollm2):
    model, tokenizer, source = smollm2
    assert source.kind == "alias"
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008


def test_smollm2_ppl_matches_a_plain_transformers_loop(smollm2):
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.eval.perplexity import perplexity

    model, tokenizer, _ = smollm2
    ids = tokenize_corpus(tokenizer, "pystdlib", 1024)  # two windows: one batch of 2
    ours = perplexity(model, ids, seqlen=512, batch_size=2)
    expected, count = plain_loop_ppl(model, ids, 512)
    assert ours.num_tokens == count
    assert ours.ppl == pytest.approx(expected, rel=1e-3)
    assert 2 < ours.ppl < 30  # a working model on Python source


def test_smollm2_chat_answer_is_coherent(smollm2):
    from llmopt.eval.hf_baseline import encode_prompts, hf_generate
    from llmopt.runtime.engine.sampling import SamplingParams

    model, tokenizer, _ = smollm2
    ids = encode_prompts(tokenizer, ["What is the capital of France?"], chat=True)
    out = hf_generate(model, tokenizer, ids, SamplingParams(max_tokens=20))
    assert "Paris" in tokenizer.decode(out[0], skip_special_tokens=True)


def test_smollm2_rtn_artifact_round_trip_and_transformers_load(smollm2, tmp_path):
    """RTN w4 g64 on the real model: the artifact reads back, transformers loads it, and it still works."""
    import copy

    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    from llmopt.compress.api import make_config, quantize_model
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.eval.perplexity import perplexity
    from llmopt.formats.artifact import write_model_artifact
    from llmopt.formats.read import load_artifact_model

    model, tokenizer, _ = smollm2
    quantized = copy.deepcopy(model)
    config = make_config("rtn", bits=4, group_size=64)
    result = quantize_model(quantized, tokenizer, config)
    out = write_model_artifact(tmp_path / "rtn", quantized, tokenizer, result.qweights, "compressed-tensors",
                               config.record(), {})
    ours = load_artifact_model(out)
    ids = tokenize_corpus(tokenizer, "pystdlib", 1024)
    fp_ppl = perplexity(model, ids, 512).ppl
    q_ppl = perplexity(ours, ids, 512).ppl
    assert fp_ppl < q_ppl < 1.6 * fp_ppl  # 4-bit costs something, but the model still works
    theirs = AutoModelForCausalLM.from_pretrained(
        out, quantization_config=CompressedTensorsConfig(dequantize=True), dtype=torch.float32).eval()
    with torch.no_grad():
        a = ours(input_ids=ids[:64].unsqueeze(0)).logits
        b = theirs(input_ids=ids[:64].unsqueeze(0)).logits
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.95
    torch.testing.assert_close(a, b, rtol=0.05, atol=0.05)


def test_smollm2_runtime_greedy_equals_transformers(smollm2):
    """8 prompts of different lengths, 24 new tokens, batched through the runtime vs one by one in HF. HF's
    one-prompt-at-a-time generation dominates this test's time (64 tokens took 107 s on a 2-core AVX2 EPYC, 24
    tokens ~4.5 s per prompt), so 5 of the 8 are checked (every length class, the longest split by chunked prefill);
    all 8 share the runtime's batches."""
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.runtime.engine.engine import Engine, EngineConfig
    from llmopt.eval.hf_baseline import hf_generate
    from llmopt.runtime.engine.sampling import SamplingParams

    model, tokenizer, _ = smollm2
    text = tokenize_corpus(tokenizer, "pystdlib", 4000).tolist()
    prompts = [text[i * 300: i * 300 + n] for i, n in enumerate((5, 17, 33, 64, 100, 128, 200, 250))]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    checked = (0, 3, 5, 6, 7)  # 5, 64, 128, 200 and 250 tokens
    expected = [hf_generate(model, tokenizer, [prompts[i]], params)[0] for i in checked]
    # exact mode (the model's own modules), chunked prefill too
    engine = Engine(model, tokenizer, EngineConfig(max_num_batched_tokens=256, fast_path=False))
    outputs = engine.generate(prompts, params)
    assert [outputs[i].token_ids for i in checked] == expected


def test_smollm2_served_over_http_answers_as_the_engine_does(smollm2):
    """The server on SmolLM2: greedy text over HTTP equals the engine's offline text; the chat answer is right."""
    import openai

    from llmopt.runtime.engine.engine import Engine, EngineConfig
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.serve.launch import in_thread, server_for

    model, tokenizer, _ = smollm2
    with in_thread(server_for(model, tokenizer, "smollm2-135m", EngineConfig(fast_path=False))) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        prompt = "def fibonacci(n):"
        served = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=32, temperature=0)
        ids = tokenizer(prompt)["input_ids"]
        offline = Engine(model, tokenizer, EngineConfig(fast_path=False)).generate([ids], SamplingParams(max_tokens=32))
        assert served.choices[0].text == offline[0].text
        chat = client.chat.completions.create(
            model="smollm2-135m", messages=[{"role": "user", "content": "What is the capital of France?"}],
            max_tokens=20, temperature=0)
        assert "Paris" in chat.choices[0].message.content


@pytest.fixture(scope="module")
def smollm2_runtime_plain():
    """SmolLM2 as the runtime loads it, a code prompt that prompt lookup copies from and a chat prompt, and their
    greedy tokens without speculation (computed once for the three proposers' tests)."""
    from llmopt.eval.hf_baseline import encode_prompts
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.runtime.executor.loader import load_runtime_model

    model, tokenizer, _ = load_runtime_model("smollm2-135m")
    code = "def area(x, z):\n    s = x * z\n    return s + x\n\nRepeat the code above, renaming s to t:\n"
    prompts = [tokenizer(code)["input_ids"], *encode_prompts(tokenizer, ["Name three colours."], chat=True)]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = [o.token_ids for o in Engine(model, tokenizer).generate(prompts, params)]
    return model, tokenizer, prompts, params, plain


@pytest.mark.parametrize("method", ["ngram", "draft", "medusa"])
def test_smollm2_speculative_greedy_equals_plain_greedy(smollm2_runtime_plain, tmp_path, method):
    """Every proposer on the real model (the draft: SmolLM2 itself; Medusa: random heads), batched with a code
    prompt that prompt lookup copies from and a chat prompt."""
    from llmopt.core.medusa import MedusaHeads
    from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
    from llmopt.runtime.engine.engine import Engine

    model, tokenizer, prompts, params, plain = smollm2_runtime_plain
    target = None
    if method == "draft":
        target = "smollm2-135m"
    elif method == "medusa":
        heads = MedusaHeads(3, model.config.hidden_size)
        torch.manual_seed(0)
        for head in heads.heads:
            head.weight.data.normal_(0, 0.01)
        heads.save(tmp_path / "medusa_heads.safetensors")
        target = str(tmp_path)
    engine = Engine(model, tokenizer, EngineConfig(speculative=SpeculativeConfig(method, target, adaptive=False)))
    assert [o.token_ids for o in engine.generate(prompts, params)] == plain
    assert engine.stats().spec_decode.num_accepted_tokens > 0


def test_smollm2_two_tensor_parallel_ranks_give_the_one_process_tokens():
    """SmolLM2 (9 heads, 3 KV heads: split 6 + 3 query heads over whole KV heads) in fp32, offline and served over
    HTTP with 2 ranks: the tokens of one process. (Quantized weights under TP — GPTQ's packed kernels, group
    boundaries, TP x PP — and pipeline stages are the tiny-model tests': each engine of 2 processes costs ~20 s of
    CI time on a 2-core EPYC.)"""
    import openai

    from llmopt.runtime.engine.config import EngineConfig
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams
    from llmopt.runtime.executor.loader import load_for_engine
    from llmopt.serve.launch import in_thread, start_server

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    outputs = []
    for parallel in ({}, {"tensor_parallel_size": 2}):
        config = EngineConfig(**parallel, max_num_batched_tokens=64)
        model, tokenizer, _ = load_for_engine("smollm2-135m", config)
        prompts = [tokenizer(p)["input_ids"] for p in ("def fibonacci(n):", "The capital of France is",
                                                       "import numpy as np\n" * 8)]
        engine = Engine(model, tokenizer, config)
        outputs.append(engine.generate(prompts, params))
        engine.close()
    one, two = ([o.token_ids for o in finished] for finished in outputs)
    assert two == one
    app, server = start_server("smollm2-135m", EngineConfig(tensor_parallel_size=2), "float32")
    with in_thread(server) as url:
        client = openai.OpenAI(base_url=url, api_key="none", max_retries=0)
        served = client.completions.create(model="smollm2-135m", prompt="def fibonacci(n):", max_tokens=16,
                                           temperature=0, extra_body={"ignore_eos": True})
    server.engine.engine.close()
    assert served.choices[0].text == outputs[0][0].text

"""DeepSeek-V2's multi-head latent attention in the runtime: greedy tokens and prompt log-probabilities equal
transformers' (fp32) with and without the prefix cache, batched and chunked; the cache holds the latent and the
rope key only; GPTQ on the model writes an artifact transformers loads and the runtime serves."""

import pytest
import torch

from llmopt.core.tiny import TINY_CONFIGS, build_tiny_model
from llmopt.eval.hf_baseline import hf_generate
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("deepseek", seed=3)


def prompts(tok):
    texts = ["def main():\n    return 1", "import os\nos.path.join(", "x", "class A:\n    pass\n" * 3]
    return [tok.encode(t) for t in texts]


@pytest.mark.parametrize("config", [
    dict(block_size=4),  # batched, prefix cache on
    dict(block_size=4, enable_prefix_cache=False),
    dict(block_size=4, max_num_batched_tokens=7),  # chunked prefill: prompts split over steps
    dict(block_size=8, max_num_seqs=1),  # one at a time
    dict(block_size=4, fast_path=False),
], ids=["batched", "no-prefix-cache", "chunked", "one-at-a-time", "exact"])
def test_greedy_tokens_equal_transformers(tiny, config):
    model, tok = tiny
    ps = prompts(tok)
    expected = hf_generate(model, tok, ps, GREEDY)
    engine = Engine(model, tok, EngineConfig(**config))
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [list(e) for e in expected]
    assert engine.runner.kv_cache_spec.layout == "latent"
    assert engine.runner.decoder.attention.name == "latent-torch"


def test_a_cached_prefix_gives_the_same_tokens_and_is_hit(tiny):
    model, tok = tiny
    shared = tok.encode("# a shared preamble of several blocks\n" * 2)
    ps = [shared + tok.encode("first"), shared + tok.encode("second one")]
    expected = hf_generate(model, tok, ps, GREEDY)
    engine = Engine(model, tok, EngineConfig(block_size=4))
    engine.generate([shared + tok.encode("warm")], GREEDY)
    engine.reset_stats()
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [list(e) for e in expected]
    assert engine.stats().prefix_cache_hit_rate > 0.5


def test_prompt_logprobs_equal_transformers(tiny):
    """Every prompt position's log-probabilities (a stronger check than greedy tokens on a random model)."""
    model, tok = tiny
    prompt = prompts(tok)[3]
    with torch.no_grad():
        reference = torch.log_softmax(model(input_ids=torch.tensor([prompt])).logits[0].float(), dim=-1)
    engine = Engine(model, tok, EngineConfig(block_size=4, max_num_batched_tokens=9))
    out = engine.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    for p in range(1, len(prompt)):
        assert abs(out.prompt_logprobs[p][prompt[p]] - float(reference[p - 1, prompt[p]])) < 1e-4, p


def test_the_cache_holds_the_latent_and_the_rope_key_only(tiny):
    model, tok = tiny
    settings = TINY_CONFIGS["deepseek"]
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_bytes=1 << 20))
    spec = engine.runner.kv_cache_spec
    layers, element = settings["num_hidden_layers"], 4  # fp32
    latent = (settings["kv_lora_rank"] + settings["qk_rope_head_dim"]) * layers * element
    assert spec.bytes_per_token == latent
    # standard multi-head attention on the same model: a key (nope + rope) and a value per head
    heads = settings["num_attention_heads"]
    mha = (heads * (settings["qk_nope_head_dim"] + settings["qk_rope_head_dim"]) + heads * settings["v_head_dim"])
    assert latent / (mha * layers * element) < 0.5
    assert engine.runner.kv_cache[0][0].shape[1:] == (4, 1, settings["kv_lora_rank"] + settings["qk_rope_head_dim"])
    assert engine.kv_cache_info()["bytes"] == engine.runner.num_blocks * 4 * latent


def test_gptq_artifact_loads_in_transformers_and_runs_on_int4_methods(tmp_path):
    pytest.importorskip("compressed_tensors")
    from transformers import AutoModelForCausalLM
    from typer.testing import CliRunner

    from llmopt.cli.main import app
    from llmopt.core.tiny import save_tiny_model
    from llmopt.runtime.executor.loader import load_runtime_model

    source = save_tiny_model(tmp_path / "ds", "deepseek", seed=3)
    out = tmp_path / "gptq"
    result = CliRunner().invoke(app, ["quantize", str(source), "--method", "gptq", "--format", "compressed-tensors",
                                      "--calib", "pystdlib", "--num-samples", "8", "--seqlen", "64",
                                      "--calib-dtype", "float32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)  # compressed-tensors decompresses
    model, tok, _ = load_runtime_model(str(out), dtype="float32")
    engine = Engine(model, tok, EngineConfig(block_size=4))
    methods = engine.numerics()["linear_methods"]
    # q_a, q_b, kv_a, kv_b, o, gate, up, down per layer: packed int4 (kv_b's weight read back for absorption)
    assert methods.get("int4-cpu", 0) == 8 * 2, methods
    ps = prompts(tok)
    expected = hf_generate(theirs, tok, ps, GREEDY)
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == [list(e) for e in expected]


def test_mixtures_of_experts_are_refused_by_the_runtime():
    from llmopt.core.errors import UnsupportedArchitectureError

    model, tok = build_tiny_model("deepseek", seed=0, first_k_dense_replace=1)
    with pytest.raises(UnsupportedArchitectureError, match="mixtures of 4 experts"):
        Engine(model, tok, EngineConfig(block_size=4))


@pytest.mark.parametrize("args", [
    ["quantize", "--method", "awq"], ["quantize", "--method", "rtn", "--bits", "8", "--group-size", "-1"],
    ["prune", "--method", "wanda", "--pattern", "2:4"], ["prune", "--structured", "mlp", "--ratio", "0.25"],
], ids=["awq", "rtn-w8", "wanda-2:4", "structured-mlp"])
def test_every_method_on_mla_writes_an_artifact_the_runtime_runs_as_transformers_does(tmp_path, args):
    from typer.testing import CliRunner

    from llmopt.cli.main import app
    from llmopt.core.tiny import save_tiny_model
    from llmopt.formats.load import load_model
    from llmopt.runtime.executor.loader import load_runtime_model

    source = save_tiny_model(tmp_path / "ds", "deepseek", seed=3)
    out = tmp_path / "out"
    result = CliRunner().invoke(app, [args[0], str(source), *args[1:], "--calib", "pystdlib", "--num-samples", "8",
                                      "--seqlen", "64", "--calib-dtype", "float32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    reference, tok, _ = load_model(str(out), dtype="float32")  # transformers over the dequantized weights
    checkpoint, _, _ = load_runtime_model(str(out), dtype="float32")
    ps = prompts(tok)
    expected = [list(e) for e in hf_generate(reference, tok, ps, GREEDY)]
    engine = Engine(checkpoint, tok, EngineConfig(block_size=4, fast_path=False))
    assert [o.token_ids for o in engine.generate(ps, GREEDY)] == expected

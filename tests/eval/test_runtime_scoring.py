"""`eval ppl|tasks --backend runtime`: scoring through the engine's kernels and paged KV cache equals
transformers' forward (fp32 weights, fp32 cache), and an 8-bit cache stays close."""

import json

import pytest
import torch

from llmopt.core.tiny import build_tiny_model
from llmopt.eval.perplexity import perplexity
from llmopt.eval.runtime_scoring import runtime_loglikelihoods, runtime_perplexity
from llmopt.eval.tasks import loglikelihoods
from llmopt.runtime.engine.engine import Engine, EngineConfig
from tests.cli.test_cli import assert_one_line_error, run
from tests.eval.test_tasks import winogrande_data


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", seed=0)


def corpus(n=600, seed=0):
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("chunk", [2048, 24, 150], ids=["one-shot", "short-chunks", "tiled-chunks"])
def test_runtime_perplexity_equals_transformers_in_fp32(tiny, chunk):
    """One-shot windows; chunks short enough for the masked path; chunks after a prefix long enough for the tiled
    path (attention.torch_sdpa.TILED_MIN_CHUNK)."""
    model, tok = tiny
    ids = corpus(1200)
    want = perplexity(model, ids, seqlen=400, batch_size=2)
    engine = Engine(model, tok, EngineConfig(block_size=4, kv_cache_dtype="float32", max_num_batched_tokens=chunk))
    got = runtime_perplexity(engine, ids, seqlen=400)
    assert got.num_tokens == want.num_tokens == 3 * 399
    assert abs(got.ppl / want.ppl - 1) < 1e-4
    int8 = runtime_perplexity(Engine(model, tok, EngineConfig(block_size=4, kv_cache_dtype="int8",
                                                              max_num_batched_tokens=chunk)), ids, seqlen=400)
    assert int8.ppl != got.ppl and abs(int8.ppl / want.ppl - 1) < 3e-3


def test_runtime_loglikelihoods_equal_transformers_and_share_contexts(tiny):
    model, tok = tiny
    context = "the same question, long enough to fill a few blocks of the cache: answer"
    pairs = [(context, " yes"), (context, " no"), ("another context", " maybe"), (context, " perhaps")]
    want = loglikelihoods(model, tok, pairs)
    engine = Engine(model, tok, EngineConfig(block_size=4))
    got = runtime_loglikelihoods(engine, tok, pairs)
    for (a, greedy_a), (b, greedy_b) in zip(got, want):
        assert abs(a - b) < 1e-3 and greedy_a == greedy_b
    assert engine.stats().prefix_cache_hits > 0  # the context's later pairs came from the cache


def test_eval_cli_backend_runtime(tiny_llama_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    common = ["eval", "ppl", tiny_llama_dir, "--dataset", text, "--seqlen", 64, "--max-tokens", 512, "--json"]
    hf = json.loads(run(*common).stdout)
    result = run(*common, "--backend", "runtime", "--kv-cache-dtype", "fp32", "--max-num-batched-tokens", 40)
    assert result.exit_code == 0, result.output
    rt = json.loads(result.stdout)
    assert rt["backend"] == "runtime" and rt["kv_cache_dtype"] == "float32" and rt["num_tokens"] == hf["num_tokens"]
    assert abs(rt["ppl"] / hf["ppl"] - 1) < 1e-4
    int8 = json.loads(run(*common, "--backend", "runtime", "--kv-cache-dtype", "int8").stdout)
    assert int8["kv_cache_dtype"] == "int8" and abs(int8["ppl"] / hf["ppl"] - 1) < 3e-3
    assert_one_line_error(run(*common, "--kv-cache-dtype", "int8"), "--kv-cache-dtype configures the runtime")
    assert_one_line_error(run(*common, "--backend", "runtime", "--kv-cache-dtype", "int3"),
                          "--kv-cache-dtype must be one of")


def test_eval_tasks_cli_backend_runtime_equals_hf(tiny_llama_dir, tmp_path, monkeypatch):
    winogrande_data(tmp_path, 6)
    monkeypatch.setenv("LLMOPT_DATA_DIR", str(tmp_path))
    common = ["eval", "tasks", tiny_llama_dir, "--tasks", "winogrande", "--dtype", "float32", "--json"]
    hf = json.loads(run(*common).stdout)
    result = run(*common, "--backend", "runtime", "--kv-cache-dtype", "fp32")
    assert result.exit_code == 0, result.output
    rt = json.loads(result.stdout)  # (fp32 weights and cache: the same log-likelihoods to ~1e-6)
    assert rt["backend"] == "runtime" and rt["tasks"]["winogrande"]["num_docs"] == 6
    assert rt["tasks"]["winogrande"]["acc"] == hf["tasks"]["winogrande"]["acc"]

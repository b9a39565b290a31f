"""--speculative through the CLI (generate, bench), the server (OpenAI client, /metrics), recipes, and the grounded
bench workload."""

import json

import openai
import pytest

from llmopt.core.tiny import build_tiny_model
from llmopt.eval.workloads import WorkloadSpec, build_workload
from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
from llmopt.serve.launch import in_thread, server_for

from tests.cli.test_cli import assert_one_line_error, run

PROMPT = "def add(x, z):\n    x = x + z\n    return x * 2 + x\n\nRepeat the code above, renaming x to y:\n"


def test_generate_prints_the_same_text_with_and_without_speculation(tiny_llama_dir):
    plain = run("generate", tiny_llama_dir, "-p", PROMPT, "--max-tokens", 24, "--json")
    assert plain.exit_code == 0, plain.output
    for spec in (["--speculative", "ngram"], ["--speculative", f"draft:{tiny_llama_dir}",
                                              "--num-speculative-tokens", "3"]):
        result = run("generate", tiny_llama_dir, "-p", PROMPT, "--max-tokens", 24, "--json", *spec)
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout) == json.loads(plain.stdout)


def test_generate_bad_speculative_options(tiny_llama_dir, tmp_path):
    assert_one_line_error(run("generate", tiny_llama_dir, "-p", "x", "--speculative", "eagle"), "ngram, draft:MODEL")
    assert_one_line_error(run("generate", tiny_llama_dir, "-p", "x", "--speculative", "ngram",
                              "--num-speculative-tokens", 0), "num-speculative-tokens")
    assert_one_line_error(run("generate", tiny_llama_dir, "-p", "x", "--speculative", "ngram", "--backend", "hf"),
                          "runtime backend")
    assert_one_line_error(run("generate", tiny_llama_dir, "-p", "x", "--dtype", "float32", "--speculative",
                              f"medusa:{tmp_path / 'none.safetensors'}"), "no Medusa heads")


def test_bench_puts_speculation_beside_its_baseline(tiny_llama_dir, tmp_path):
    out = tmp_path / "s.json"
    result = run("bench", tiny_llama_dir, "--dataset", "grounded", "--num-requests", 3, "--input-len", 24,
                 "--output-len", 12, "--max-concurrency", 1, "--speculative", "ngram", "--no-adaptive-speculation",
                 "--baseline", tiny_llama_dir,
                 "--dtype", "float32", "--json", out)
    assert result.exit_code == 0, result.output
    assert "spec acceptance" in result.stdout and "decode speedup" in result.stdout
    spec, base = json.loads(out.read_text())["runs"]
    assert spec["config"]["engine"]["speculative"]["method"] == "ngram"
    assert base["config"]["engine"]["speculative"] is None
    metrics = spec["metrics"]
    assert metrics["spec_num_draft_tokens"] > 0 and 0 <= metrics["spec_acceptance_rate"] <= 1
    assert metrics["spec_mean_accepted_length"] >= 1 and metrics["decode_speedup"] > 0
    assert len(metrics["spec_acceptance_per_position"]) <= 5
    assert "spec_acceptance_rate" not in base["metrics"]
    assert metrics["total_output_tokens"] == base["metrics"]["total_output_tokens"]


def test_grounded_workload_is_deterministic_and_asks_to_repeat():
    _, tok = build_tiny_model("llama")
    spec = WorkloadSpec("grounded", num_requests=4, input_len=64, output_len=32)
    a, b = build_workload(spec, tok, len(tok)), build_workload(spec, tok, len(tok))
    assert [r.prompt_token_ids for r in a] == [r.prompt_token_ids for r in b]
    texts = [tok.decode(r.prompt_token_ids) for r in a]
    assert all("Repeat the" in t for t in texts)
    assert all(r.max_tokens == 32 for r in a)


def test_server_speculates_and_counts_drafts_in_metrics():
    import httpx

    model, tok = build_tiny_model("llama", seed=0)
    config = EngineConfig(block_size=4, speculative=SpeculativeConfig("ngram", num_speculative_tokens=3,
                                                                      adaptive=False))
    server = server_for(model, tok, "tiny", config)
    with in_thread(server) as base:
        client = openai.OpenAI(base_url=base, api_key="none", max_retries=0)
        prompt = "abcabcabcabcabc"
        got = client.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        metrics = httpx.get(base.removesuffix("/v1") + "/metrics").text
    plain_model, plain_tok = build_tiny_model("llama", seed=0)
    from llmopt.runtime.engine.engine import Engine
    from llmopt.runtime.engine.sampling import SamplingParams

    [want] = Engine(plain_model, plain_tok, EngineConfig(block_size=4)).generate(
        [plain_tok(prompt)["input_ids"]], SamplingParams(max_tokens=20))
    assert got.choices[0].text == want.text
    drafted = [line for line in metrics.splitlines() if line.startswith("llmopt:spec_decode_num_draft_tokens_total")]
    assert drafted and float(drafted[0].split()[-1]) > 0


@pytest.mark.parametrize("bench, ok", [({"speculative": "ngram", "num_speculative_tokens": 3}, True),
                                       ({"speculative": "eagle"}, False)])
def test_recipe_bench_section_takes_speculative(tmp_path, bench, ok):
    import yaml

    recipe = {"name": "r", "model": "tiny-random-llama", "variants": {"fp32": []},
              "bench": {"num_requests": 2, **bench}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    result = run("recipe", "validate", path)
    if ok:
        assert result.exit_code == 0, result.output
    else:
        assert_one_line_error(result, "speculative")

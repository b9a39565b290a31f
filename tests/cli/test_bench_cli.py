"""`llmopt bench` end to end on a tiny model: JSON with vLLM's keys and ours, baseline side by side."""

import json

from tests.cli.test_cli import assert_one_line_error, run

VLLM_KEYS = ["request_throughput", "output_throughput", "total_token_throughput", "request_goodput"] + [
    f"{s}_{m}_ms" for s in ("mean", "median", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")]
OURS = ["prefill_throughput", "decode_throughput", "mbu", "mfu", "num_preemptions", "prefix_cache_hit_rate"]


def test_bench_with_hf_baseline_writes_json(tiny_llama_dir, tmp_path):
    out = tmp_path / "b.json"
    result = run("bench", tiny_llama_dir, "--num-requests", 6, "--input-len", 12, "--output-len", 5,
                 "--baseline", "hf", "--hf-batch-size", 4, "--slo", "ttft=5000,tpot=5000", "--dtype", "float32",
                 "--json", out)
    assert result.exit_code == 0, result.output
    assert "ratio" in result.stdout and "output tok/s" in result.stdout
    runs = json.loads(out.read_text())["runs"]
    assert [r["name"] for r in runs][1] == "baseline" and runs[1]["config"]["backend"] == "hf"
    ours = runs[0]["metrics"]
    for key in VLLM_KEYS + OURS:
        assert key in ours, key
    assert ours["total_output_tokens"] == 6 * 5 and len(runs[0]["requests"]) == 6
    assert runs[1]["metrics"]["total_output_tokens"] == 6 * 5
    assert ours["request_goodput"] == ours["request_throughput"]  # generous SLOs: every request is good
    assert 0 < ours["mbu"] and 0 < ours["mfu"]
    numerics = runs[0]["config"]["numerics"]  # every setting that changes the numbers, recorded with the figures
    assert numerics["kv_cache_dtype"] == "auto" and numerics["kv_cache_dtype_resolved"] == "float32"
    assert numerics["activations"] == "float" and numerics["attention_backend_resolved"] == "cpu"


def test_bench_engine_options_reach_the_engine(tiny_llama_dir, tmp_path):
    out = tmp_path / "e.json"
    result = run("bench", tiny_llama_dir, "--num-requests", 2, "--input-len", 8, "--output-len", 3, "--dtype",
                 "float32", "--kv-cache-dtype", "bfloat16", "--attention-backend", "torch", "--no-fast-path",
                 "--block-size", 8, "--json", out)
    assert result.exit_code == 0, result.output
    config = json.loads(out.read_text())["runs"][0]["config"]
    assert config["engine"]["block_size"] == 8 and config["engine"]["fast_path"] is False
    assert config["numerics"]["kv_cache_dtype_resolved"] == "bfloat16"
    assert config["numerics"]["attention_backend_resolved"] == "torch" and "in bfloat16" in config["kv_cache"]


def test_bench_prefix_repetition_hits_the_cache_and_static_mode_runs(tiny_llama_dir, tmp_path):
    out = tmp_path / "p.json"
    result = run("bench", tiny_llama_dir, "--dataset", "prefix-repetition", "--num-requests", 6, "--prefix-len", 32,
                 "--num-prefixes", 2, "--input-len", 4, "--output-len", 3, "--max-num-seqs", 1,
                 "--batching", "static", "--dtype", "float32", "--json", out)
    assert result.exit_code == 0, result.output
    metrics = json.loads(out.read_text())["runs"][0]["metrics"]
    assert metrics["prefix_cache_hit_rate"] > 0.5  # 4 of 6 requests find their 32-token prefix cached
    assert metrics["max_batch_size"] == 1
    # the TTFT of those 4 requests, in ms (the 2 cold ones are left out)
    assert 0 < metrics["mean_ttft_prefix_hit_ms"] < 1000 * metrics["duration"]


def test_bench_bad_input(tiny_llama_dir, tmp_path):
    assert_one_line_error(run("bench", tiny_llama_dir, "--slo", "ttft"), "KEY=MS")
    assert_one_line_error(run("bench", tiny_llama_dir, "--request-rate", 0), "request-rate must be > 0")
    assert_one_line_error(run("bench", tiny_llama_dir, "--dataset", "sharegpt", "--dataset-path",
                              tmp_path / "missing.json"), "does not exist")
    usage = run("bench", tiny_llama_dir, "--batching", "dynamic")  # a choice of the option: a usage error
    assert usage.exit_code == 2 and "'dynamic' is not one of 'continuous', 'static'" in usage.output

"""`llmopt bench` end to end on a tiny model: JSON with vLLM's keys and ours, baseline side by side."""

import json

import pytest

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
    # the tiny model's linears are dense: int8 inputs resolved, but no int4 linear to use them
    assert numerics["activations"] == "auto" and numerics["activations_resolved"] == "int8"
    assert numerics["attention_backend_resolved"] == "cpu"
    assert runs[0]["config"]["weights_in_huge_pages_bytes"] == 0  # (a tiny model: less than one huge page)


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


def test_speculative_options_without_speculative_are_refused(tiny_llama_dir):
    # they were ignored: a run without speculation that looked configured
    assert_one_line_error(run("bench", tiny_llama_dir, "--num-speculative-tokens", 3), "needs --speculative")
    assert_one_line_error(run("bench", tiny_llama_dir, "--ngram-max", 3), "--ngram-max needs --speculative")
    assert_one_line_error(run("generate", tiny_llama_dir, "-p", "x", "--no-adaptive-speculation"),
                          "--no-adaptive-speculation needs --speculative")
    assert_one_line_error(run("bench", tiny_llama_dir, "--speculative", f"draft:{tiny_llama_dir}", "--ngram-min", 2),
                          "applies to --speculative ngram only")


class PlainWebsite:
    """An HTTP server that is not an OpenAI API: an HTML page for every path (404 for POSTs under /v1 except one,
    which answers 200 with HTML)."""

    def __enter__(self):
        import http.server
        import threading

        page = b"<html><body>" + b"<p>not an API</p>" * 400 + b"</body></html>"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                self.rfile.read(int(self.headers.get("content-length", 0)))
                self.send_response(200 if self.path.startswith("/ok") else 404)
                self.send_header("content-type", "text/html")
                self.send_header("content-length", str(len(page)))
                self.end_headers()
                self.wfile.write(page)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def __exit__(self, *exc):
        self.httpd.shutdown()


@pytest.mark.parametrize("path, status", [("/v1", "answered 404 with text/html"),
                                          ("/ok/v1", "answered 200 with text/html")])
def test_bench_base_url_at_a_server_that_is_not_openai_is_one_line(tiny_llama_dir, path, status):
    with PlainWebsite() as url:
        result = run("bench", tiny_llama_dir, "--base-url", url + path, "--num-requests", 1, "--input-len", 4,
                     "--output-len", 2)
    assert result.exit_code == 1 and "Traceback" not in result.output, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and status in errors[0] and "OpenAI-compatible" in errors[0], result.output
    assert "<html>" not in result.output and "not an API" not in result.output

import json
import shutil

from typer.testing import CliRunner

from llmopt.cli.main import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, pattern):
    import re

    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), result.output
    assert re.search(pattern, lines[0]), lines[0]


def test_help_lists_every_group_and_version():
    result = run("--help")
    assert result.exit_code == 0
    for group in ("models", "generate", "eval", "env"):
        assert group in result.output
    for sub in (["models", "--help"], ["eval", "ppl", "--help"], ["generate", "--help"], ["env", "--help"]):
        assert run(*sub).exit_code == 0
    version = run("--version")
    assert version.exit_code == 0 and version.output.startswith("llmopt ")


def test_models_list_and_info_json(tiny_llama_dir):
    listed = json.loads(run("models", "list", "--json").stdout)
    assert {a["alias"] for a in listed["aliases"]} >= {"smollm2-135m", "tiny-random-llama"}
    info = json.loads(run("models", "info", tiny_llama_dir, "--json").stdout)
    assert info["family"] == "llama" and info["num_parameters"] > 0


def test_env_json():
    facts = json.loads(run("env", "--json").stdout)
    assert {"torch", "transformers", "llmopt_home", "data_dir", "torch_threads"} <= set(facts)
    # the runtime's plug-ins, and the backend an engine starts with here
    assert {"cpu", "torch", "triton", "latent-torch"} <= set(facts["attention_backends"])
    assert {"dense", "int4-cpu", "int4-q8-cpu", "int8-cpu", "w8a8-int8-cpu", "fp4-cpu", "w8a8-triton",
            "float-weight-triton"} <= set(facts["linear_methods"])
    assert facts["attention_backend_cpu"].endswith("torch (--no-fast-path)")
    amx = "amx_int8" in facts["usable_features"]  # the W8A8 GEMM the CPU gets
    from llmopt.runtime.executor.linear.w8a8_cpu import int_mm_exact

    beyond = ("oneDNN, prepacked (AMX-INT8)" if amx else "torch._int_mm" if int_mm_exact()
              else "a float64 matmul (torch._int_mm's sums are not exact here)")
    assert facts["w8a8_int8_gemm_cpu"].endswith(beyond)


def test_eval_ppl_json_is_one_object(tiny_llama_dir, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    result = run("eval", "ppl", tiny_llama_dir, "--dataset", text, "--seqlen", 64, "--max-tokens", 512, "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["num_tokens"] == 8 * 63 and facts["ppl"] > 1


def test_generate_prints_text_and_json(tiny_llama_dir):
    result = run("generate", tiny_llama_dir, "--prompt", "hello", "--prompt", "a longer prompt", "--max-tokens", 5,
                 "--json")
    assert result.exit_code == 0, result.output
    outputs = json.loads(result.stdout)["outputs"]
    assert [o["prompt"] for o in outputs] == ["hello", "a longer prompt"]
    assert all(0 < o["num_output_tokens"] <= 5 for o in outputs)
    chat = run("generate", tiny_llama_dir, "--prompt", "hi", "--chat", "--max-tokens", 3)
    assert chat.exit_code == 0, chat.output
    # The runtime (default) and transformers agree on greedy tokens in fp32 (the runtime's fast path stays within
    # ~1e-5 of transformers' logits).
    both = [json.loads(run("generate", tiny_llama_dir, "--prompt", "hello world", "--max-tokens", 8, "--backend", b,
                           "--dtype", "float32", "--json").stdout)["outputs"][0]["text"] for b in ("runtime", "hf")]
    assert both[0] == both[1]
    # --stop ends the text before the stop string
    stop = both[0][2:4]
    stopped = json.loads(run("generate", tiny_llama_dir, "--prompt", "hello world", "--max-tokens", 8, "--stop", stop,
                             "--dtype", "float32", "--json").stdout)["outputs"][0]["text"]
    assert stopped == both[0][: both[0].find(stop)]


def test_bad_input_is_one_line_exit_1(tiny_llama_dir, tmp_path):
    assert_one_line_error(run("eval", "ppl", "no-such-model"), "unknown model 'no-such-model'")
    assert_one_line_error(run("eval", "ppl", tiny_llama_dir, "--dataset", tmp_path / "missing.txt"), "does not exist")
    assert_one_line_error(run("eval", "ppl", tiny_llama_dir, "--dataset", "nosuchset"), "unknown dataset")
    assert_one_line_error(run("eval", "ppl", tiny_llama_dir, "--seqlen", 1), "--seqlen must be at least 2")
    assert_one_line_error(run("eval", "tasks", tiny_llama_dir, "--tasks", "arc_easy,mmlu"), "unknown task 'mmlu'")
    assert_one_line_error(run("eval", "tasks", tiny_llama_dir, "--limit", 0), "--limit must be at least 1")
    assert_one_line_error(run("generate", tiny_llama_dir, "--prompt", "x", "--max-tokens", 0), "max_tokens")
    assert_one_line_error(run("generate", tiny_llama_dir, "--prompt", "x", "--temperature", 1, "--top-p", 0),
                          "top_p")
    assert_one_line_error(run("generate", tiny_llama_dir, "--prompt", "x", "--stop", "a", "--backend", "hf"),
                          "--stop needs the runtime")
    corrupt = tmp_path / "corrupt"
    shutil.copytree(tiny_llama_dir, corrupt)
    (corrupt / "model.safetensors").write_bytes(b"garbage")
    assert_one_line_error(run("eval", "ppl", corrupt), "is not a safetensors file")


def test_debug_shows_the_traceback(monkeypatch):
    monkeypatch.setenv("LLMOPT_DEBUG", "1")
    result = run("eval", "ppl", "no-such-model")
    assert result.exit_code == 1
    assert result.exception is not None and "unknown model" in str(result.exception)

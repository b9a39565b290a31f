import json

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app
from tests.cli.test_cli import assert_one_line_error

runner = CliRunner()
CALIB = ["--calib", "pystdlib", "--num-samples", "4", "--seqlen", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("method,fmt", [("rtn", "compressed-tensors"), ("gptq", "gptq"), ("awq", "awq")])
def test_quantize_then_eval_through_the_cli(tiny_llama_dir, tmp_path, method, fmt):
    out = tmp_path / f"{method}-out"
    result = run("quantize", tiny_llama_dir, "--method", method, "--bits", 4, "--group-size", 32, *CALIB,
                 "-o", out, "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["format"] == fmt and facts["num_quantized_linears"] == 14
    assert facts["quantized_linear_ratio"] < 0.35 and facts["peak_rss_bytes"] > 0
    manifest = json.loads((out / "llmopt.json").read_text())
    assert manifest["stages"][0]["method"] == method and manifest["versions"]["torch"]
    info = json.loads(run("models", "info", out, "--json").stdout)
    assert info["kind"] == "artifact" and info["quantization_config"]["quant_method"] == fmt
    ppl = run("eval", "ppl", out, "--dataset", "pystdlib", "--seqlen", 64, "--max-tokens", 512, "--json")
    assert ppl.exit_code == 0, ppl.output
    assert json.loads(ppl.stdout)["ppl"] > 1
    gen = run("generate", out, "--prompt", "def", "--max-tokens", 4)
    assert gen.exit_code == 0, gen.output


def test_export_command(tiny_llama_dir, tmp_path):
    src = tmp_path / "src"
    assert run("quantize", tiny_llama_dir, "--method", "rtn", "--group-size", 32, "-o", src).exit_code == 0
    result = run("export", src, "--format", "gptq", "-o", tmp_path / "gptq", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["from_format"] == "compressed-tensors"


def no_partial_output(tmp_path):
    return [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_bad_input_is_one_line_and_leaves_nothing(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "awq", "--bits", 3, "--group-size", 32,
                              *CALIB, "-o", out), "awq cannot hold .*4-bit only")
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "rtn", "--group-size", 48, "-o", out),
                          "--group-size 48 does not divide")
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "gptq", "--group-size", 32, "--act-order",
                              "--no-static-groups", "--format", "awq", *CALIB, "-o", out), "act-order")
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "rtn", "--act-order", "-o", out),
                          "--act-order applies to gptq only")
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "rtn", "--bits", 5, "-o", out), "bits")
    tiny_text = tmp_path / "tiny.txt"
    tiny_text.write_text("too short")
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "gptq", "--group-size", 32,
                              "--calib", tiny_text, "--num-samples", 8, "--seqlen", 64, "-o", out),
                          "fewer than 8 x 64")
    assert not out.exists() and no_partial_output(tmp_path)
    out.mkdir()
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "rtn", "--group-size", 32, "-o", out),
                          "already exists.*--overwrite")
    assert run("quantize", tiny_llama_dir, "--method", "rtn", "--group-size", 32, "-o", out,
               "--overwrite").exit_code == 0
    assert (out / "llmopt.json").exists() and no_partial_output(tmp_path)

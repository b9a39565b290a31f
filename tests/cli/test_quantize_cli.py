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


def test_a_weight_only_preset_takes_the_group_size_given(tiny_llama_dir, tmp_path):
    """`--scheme w4a16` (groups of 128) on a model whose widths 128 does not divide (the tiny Llama's 64, SmolLM2's
    576): the message names a group size that works, and that --group-size beside the preset is taken (recorded
    in the artifact) instead of refused as a contradiction. Presets whose grid is the format's stay fixed."""
    from llmopt.compress.api import quantize_configs
    from llmopt.core.errors import ConfigError

    out = tmp_path / "q"
    base = ["quantize", str(tiny_llama_dir), "-o", str(out), "--scheme", "w4a16", "--method", "rtn"]
    refused = CliRunner().invoke(app, base)
    assert_one_line_error(refused, r"--group-size 128 does not divide .*\(64\): give --group-size 64")
    result = CliRunner().invoke(app, [*base, "--group-size", "64", "--json"])
    assert result.exit_code == 0, result.output
    settings = json.loads((out / "llmopt.json").read_text())["stages"][-1]["settings"]
    assert (settings["scheme"], settings["group_size"]) == ("w4a16", 64)
    weights = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert (weights["weights"]["group_size"], weights["weights"]["strategy"]) == (64, "group")
    [config] = quantize_configs("rtn", {"scheme": "w8a16", "group_size": 32})
    assert (config.weight_scheme.group_size, config.weight_scheme.strategy) == (32, "group")
    for scheme in ("w8a8-int8", "nvfp4"):
        with pytest.raises(ConfigError, match=f"group_size 64 contradicts scheme {scheme}"):
            quantize_configs("rtn", {"scheme": scheme, "group_size": 64})


@pytest.mark.parametrize("extra, stages", [
    ([], ["rotate", "smooth", "quantize"]),  # w8a8-int8's best measured pre-passes, by default
    (["--smoothquant-alpha", "none"], ["quantize"]),
    (["--smoothquant-alpha", "0.5"], ["smooth", "quantize"]),  # given: only what was given
    (["--rotate", "R1"], ["rotate", "quantize"]),
])
def test_a_scheme_runs_its_best_measured_pre_passes_unless_told(tiny_llama_dir, tmp_path, extra, stages):
    out = tmp_path / "w8a8"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--scheme", "w8a8-int8", "--method", "rtn",
                                      "--num-samples", "4", "--seqlen", "32", "--calib-dtype", "float32", "-o",
                                      str(out), *extra])
    assert result.exit_code == 0, result.output
    recorded = json.loads((out / "llmopt.json").read_text())["stages"]
    assert [s["stage"] for s in recorded] == stages
    if not extra:
        assert recorded[1]["settings"]["alpha"] == "search" and recorded[0]["settings"]["rotations"] == ["R1", "R2"]

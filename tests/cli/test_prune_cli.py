import json

import pytest
from typer.testing import CliRunner

from llmopt.cli.main import app
from tests.cli.test_cli import assert_one_line_error

runner = CliRunner()
CALIB = ["--calib", "pystdlib", "--num-samples", "4", "--seqlen", "32"]


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("args,kind", [
    (["--method", "magnitude", "--sparsity", "0.5"], "sparse"),
    (["--method", "wanda", "--pattern", "4:8"], "sparse"),
    (["--method", "sparsegpt", "--pattern", "2:4"], "sparse"),
    (["--structured", "mlp", "--ratio", "0.25"], "structured"),
    (["--structured", "layers", "--ratio", "0.5"], "structured"),
])
def test_prune_then_eval(tiny_llama_dir, tmp_path, args, kind):
    out = tmp_path / "p"
    result = run("prune", tiny_llama_dir, *args, *CALIB, "-o", out, "--json")
    assert result.exit_code == 0, result.output
    facts = json.loads(result.stdout)
    assert facts["kind"] == kind
    config = json.loads((out / "config.json").read_text())
    manifest = json.loads((out / "llmopt.json").read_text())
    assert manifest["stages"][0]["stage"] == "prune"
    if kind == "sparse":
        assert abs(facts["linear_sparsity"] - 0.5) < 0.001
        assert config["sparsity_config"]["sparsity_structure"] == (args[3] if args[2] == "--pattern" else "unstructured")
        assert facts["num_nonzero_after"] < facts["num_nonzero_before"]
    else:
        assert facts["num_parameters_after"] < facts["num_parameters_before"]
        assert (out / "llmopt_scores.safetensors.bin").exists()
        info = json.loads(run("models", "info", out, "--json").stdout)
        assert info["num_parameters"] == facts["num_parameters_after"]
    ppl = run("eval", "ppl", out, "--dataset", "pystdlib", "--seqlen", 64, "--max-tokens", 512, "--json")
    assert ppl.exit_code == 0, ppl.output


def test_sparse_then_gptq_artifact_carries_both(tiny_llama_dir, tmp_path):
    assert run("prune", tiny_llama_dir, "--method", "sparsegpt", "--pattern", "2:4", *CALIB,
               "-o", tmp_path / "p").exit_code == 0
    result = run("quantize", tmp_path / "p", "--method", "gptq", "--group-size", 32, *CALIB, "-o", tmp_path / "q")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    assert config["sparsity_config"]["sparsity_structure"] == "2:4"
    assert config["quantization_config"]["quant_method"] == "gptq"
    from llmopt.formats.read import read_artifact
    from tests.compress.nm import check_nm

    for qw in read_artifact(tmp_path / "q").qweights.values():
        assert check_nm(qw.dequantize(), 2, 4)


def test_prune_and_quantize_in_one_gptq_run(tiny_llama_dir, tmp_path):
    result = run("quantize", tiny_llama_dir, "--method", "gptq", "--group-size", 32, "--prune-pattern", "2:4",
                 *CALIB, "-o", tmp_path / "q", "--json")
    assert result.exit_code == 0, result.output
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    sparsity = config["sparsity_config"]
    assert sparsity["sparsity_structure"] == "2:4" and sparsity["method"] == "sparsegpt+gptq"
    assert 0.5 <= sparsity["global_sparsity"] < 0.6
    from llmopt.formats.read import read_artifact
    from tests.compress.nm import check_nm

    for qw in read_artifact(tmp_path / "q").qweights.values():
        assert check_nm(qw.dequantize(), 2, 4)
    ppl = run("eval", "ppl", tmp_path / "q", "--dataset", "pystdlib", "--seqlen", 64, "--max-tokens", 512, "--json")
    assert ppl.exit_code == 0, ppl.output
    out = tmp_path / "bad"
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "gptq", "--group-size", 32, "--asym",
                              "--prune-pattern", "2:4", *CALIB, "-o", out), "--prune-pattern needs sym")
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "rtn", "--prune-pattern", "2:4", "-o", out),
                          "--prune-pattern applies to gptq only")
    assert_one_line_error(run("quantize", tiny_llama_dir, "--method", "gptq", "--group-size", 32,
                              "--prune-pattern", "4:2", *CALIB, "-o", out), "0 < N < M")
    assert not out.exists()


def test_bad_input_is_one_line(tiny_llama_dir, tmp_path):
    out = tmp_path / "out"
    assert_one_line_error(run("prune", tiny_llama_dir, "--structured", "mlp", "--ratio", 1.5, "-o", out), "ratio")
    assert_one_line_error(run("prune", tiny_llama_dir, "--structured", "mlp", "--ratio", 0, "-o", out), "ratio")
    assert_one_line_error(run("prune", tiny_llama_dir, "--method", "wanda", "--pattern", "4:4", "-o", out),
                          "0 < N < M")
    assert_one_line_error(run("prune", tiny_llama_dir, "--method", "magnitude", "--pattern", "2:3", "-o", out),
                          "divisible by 3")
    assert_one_line_error(run("prune", tiny_llama_dir, "--structured", "layers", "--ratio", 0.9, *CALIB, "-o", out),
                          "every layer")
    assert_one_line_error(run("prune", tiny_llama_dir, "--method", "magnitude", "-o", out), "exactly one of")
    assert_one_line_error(run("prune", tiny_llama_dir, "-o", out), "--method")
    assert not out.exists()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_removing_every_head_is_refused(tmp_path):
    from llmopt.core.tiny import save_tiny_model

    mha = save_tiny_model(tmp_path / "mha", "llama", num_attention_heads=4, num_key_value_heads=4)
    assert_one_line_error(run("prune", mha, "--structured", "heads", "--ratio", 0.9, *CALIB, "-o", tmp_path / "o"),
                          "every attention head")

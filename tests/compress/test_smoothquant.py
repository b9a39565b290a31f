"""SmoothQuant: the smoothed full-precision model computes what the original does; the scales follow the paper's
formula; the alpha search never does worse than its grid's fixed points; the CLI records the stage."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.compress.api import quantize_configs, smooth_model
from llmopt.compress.smoothquant import search_alpha, smoothed_error, smoothing_scales
from llmopt.core.contract import PRESETS
from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model

W8A8 = PRESETS["w8a8-int8"]


def test_scales_are_the_papers_formula():
    act, weight = torch.tensor([4.0, 0.25, 9.0]), torch.tensor([1.0, 2.0, 0.5])
    s = smoothing_scales(act, weight, 0.5)
    assert torch.allclose(s, act.sqrt() / weight.sqrt())
    assert torch.allclose(smoothing_scales(act, weight, 1.0), act)
    assert torch.allclose(smoothing_scales(act, weight, 0.0), 1 / weight)


@pytest.mark.parametrize("alpha, scheme", [(0.5, "w8a8-int8"), ("search", "w8a8-int8"), ("search", "w8a8-fp8")])
def test_the_smoothed_model_computes_what_the_original_does(alpha, scheme):
    model, tokenizer = build_tiny_model("llama", seed=0)
    ids = torch.tensor([[1, 5, 9, 100, 42, 7, 3, 11, 60, 2]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    weights_before = model.model.layers[0].self_attn.q_proj.weight.clone()
    [smoother, _] = quantize_configs("rtn", {"scheme": scheme, "smoothquant_alpha": alpha, "num_samples": 4,
                                             "seqlen": 32, "calib": "pystdlib", "compute_dtype": "float32"})
    done = smooth_model(model, tokenizer, smoother)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert not torch.equal(weights_before, model.model.layers[0].self_attn.q_proj.weight)  # it did smooth
    assert torch.allclose(after, before, rtol=1e-5, atol=1e-5 * before.abs().max())
    assert done.facts()["smoothquant_groups"] > 0 and len(done.extra_tensors()) == done.facts()["smoothquant_groups"]


def test_the_search_picks_the_best_grid_point():
    torch.manual_seed(0)
    x = torch.randn(256, 64)
    x[:, 3] *= 40  # an outlier channel, as in LLM activations
    w = torch.randn(32, 64) * 0.05
    act_max = x.abs().amax(0)
    alpha, s = search_alpha(x, act_max, w, W8A8, grid=10)
    best = smoothed_error(x, w, s, W8A8)
    for fixed in (0.0, 0.5, 1.0):
        assert best <= smoothed_error(x, w, smoothing_scales(act_max, w.abs().amax(0), fixed), W8A8) + 1e-12
    assert best < smoothed_error(x, w, torch.ones(64), W8A8)  # smoothing helps with the outlier


def test_smoothquant_needs_quantized_inputs_and_a_valid_alpha():
    with pytest.raises(ConfigError, match="needs a scheme with quantized inputs"):
        quantize_configs("rtn", {"bits": 8, "group_size": -1, "smoothquant_alpha": 0.5})
    with pytest.raises(ConfigError, match="alpha"):
        quantize_configs("rtn", {"scheme": "w8a8-int8", "smoothquant_alpha": "strong"})
    with pytest.raises(ConfigError, match="alpha"):
        quantize_configs("rtn", {"scheme": "w8a8-int8", "smoothquant_alpha": 1.5})


def test_the_cli_smooths_then_quantizes_and_records_both(tiny_llama_dir, tmp_path):
    out = tmp_path / "sq"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--scheme", "w8a8-int8", "--method", "rtn",
                                      "--smoothquant-alpha", "0.5", "--num-samples", "4", "--seqlen", "32",
                                      "--calib-dtype", "float32", "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    facts = json.loads(result.output)
    stages = json.loads((out / "llmopt.json").read_text())["stages"]
    assert [s["stage"] for s in stages] == ["smooth", "quantize"] and stages[0]["settings"]["alpha"] == 0.5
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "int-quantized"
    assert facts["num_quantized_linears"] > 0

"""FP8 (E4M3) schemes, `--scheme w8a16-fp8` and `w8a8-fp8` (llm-compressor's FP8_DYNAMIC): weights and activations
against compressed-tensors' own formulas (saturation at 448, round-to-nearest-even), the float-quantized format by
round trip and by transformers + compressed-tensors' loader, the runtime's FP8 linear against the reference."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.compress.api import quantize_configs
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract import FP8_CHANNEL_WEIGHTS, FP8_TOKEN_ACTIVATIONS, QuantRecord, fake_quantize_activations
from llmopt.core.errors import ConfigError
from tests.formats.runtime_check import assert_runtime_matches_reader


def compressed_tensors_fake_quant(x, scheme, reduce_dim):
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(**scheme.to_args())
    scale, zero = calculate_qparams(x.amin(reduce_dim, keepdim=True), x.amax(reduce_dim, keepdim=True), args)
    return fake_quantize(x, scale, zero, args)


def test_fp8_weights_and_activations_are_compressed_tensors_formulas():
    torch.manual_seed(0)
    w = torch.randn(24, 64) * torch.logspace(-3, 1, 64)
    qweight = quantize_rtn(w, FP8_CHANNEL_WEIGHTS)
    assert torch.equal(qweight.dequantize(), compressed_tensors_fake_quant(w, FP8_CHANNEL_WEIGHTS, 1))
    assert float(qweight.q.view(torch.float8_e4m3fn).float().abs().max()) == 448.0  # each row's peak saturates
    x = torch.randn(5, 64) * 50
    assert torch.equal(fake_quantize_activations(x, FP8_TOKEN_ACTIVATIONS),
                       compressed_tensors_fake_quant(x, FP8_TOKEN_ACTIVATIONS, -1))


def test_presets_and_their_limits():
    [config] = quantize_configs("rtn", {"scheme": "w8a8-fp8"})
    assert config.weight_scheme == FP8_CHANNEL_WEIGHTS and config.input_activations == FP8_TOKEN_ACTIVATIONS
    [weight_only] = quantize_configs("rtn", {"scheme": "w8a16-fp8"})
    assert weight_only.input_activations is None
    [gptq] = quantize_configs("gptq", {"scheme": "w8a8-fp8"})  # GPTQ rounds on the E4M3 grid
    assert gptq.weight_scheme == FP8_CHANNEL_WEIGHTS
    with pytest.raises(ConfigError, match="needs method rtn or gptq"):
        quantize_configs("awq", {"scheme": "w8a8-fp8"})


def test_float_quantized_round_trip():
    from llmopt.formats.layouts import FORMATS

    fmt = FORMATS.get("compressed-tensors")
    qweight = quantize_rtn(torch.randn(16, 32), FP8_CHANNEL_WEIGHTS, bias=torch.randn(16))
    qweight.input_activations = FP8_TOKEN_ACTIVATIONS
    packed = fmt.pack(qweight)
    assert packed["weight"].dtype == torch.float8_e4m3fn
    qcfg = fmt.quantization_config(QuantRecord(FP8_CHANNEL_WEIGHTS, "rtn", input_activations=FP8_TOKEN_ACTIVATIONS))
    assert qcfg["format"] == "float-quantized"
    back = fmt.unpack(packed, fmt.scheme_from_config(qcfg))
    assert torch.equal(back.scales, qweight.scales.half().float())  # the scales are stored in fp16
    assert torch.equal(back.q, qweight.q) and fmt.input_activations_from_config(qcfg) == FP8_TOKEN_ACTIVATIONS
    with pytest.raises(Exception, match="GPTQ stores integer codes"):
        FORMATS.get("gptq").check("x", (16, 32), FP8_CHANNEL_WEIGHTS)


@pytest.mark.parametrize("scheme", ["w8a8-fp8", "w8a16-fp8"])
def test_artifacts_load_in_transformers_and_run_in_the_runtime(tiny_llama_dir, tmp_path, scheme):
    from transformers import AutoModelForCausalLM

    from llmopt.formats.read import load_artifact_model

    out = tmp_path / scheme
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--scheme", scheme, "--method", "rtn",
                                      "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "float-quantized"
    ids = [1, 5, 9, 100, 42, 7, 3, 11]
    ours = load_artifact_model(out, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        a, b = ours(input_ids=torch.tensor([ids])).logits, theirs(input_ids=torch.tensor([ids])).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert_runtime_matches_reader(out, {"fp8-weight"}, ids, max_tokens=6)

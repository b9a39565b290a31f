"""Float zero points (`--zero-point float`, a float minimum per group as GGUF Q4_1 has it): the range maths, RTN and
GPTQ finding weights that lie on such a grid exactly where integer zero points cannot, the artifact
(compressed-tensors naive-quantized with a float32 zero point) read by our reader, by transformers +
compressed-tensors' own loader and by the runtime's kernels, the GGUF Q4_1 export, distillation keeping the zero
points real, and the refusals."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.compress.gptq import gptq_quantize_weight
from llmopt.core.contract.int_grid import float_zero_qparams
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract import QuantScheme
from llmopt.core.errors import ConfigError
from tests.formats.runtime_check import assert_runtime_matches_reader

FLOAT_ZERO = QuantScheme(4, 32, False, zero_point="float")
IDS = [1, 5, 9, 100, 42, 7, 3, 11]


def q4_1_grid_weight(n: int = 16, k: int = 128, seed: int = 0) -> torch.Tensor:
    """[N, K] weights as a dequantized Q4_1 file holds them: per block of 32, d q + m with fp16 d and m, q in 0..15
    using both ends (llama.cpp's Q4_1 quantizer maps the block's min to 0 and its max to 15); mostly away from 0."""
    g = torch.Generator().manual_seed(seed)
    blocks = n * k // 32
    q = torch.randint(0, 16, (blocks, 32), generator=g)
    q[:, 0], q[:, 1] = 0, 15
    d = (torch.rand(blocks, 1, generator=g) * 0.02 + 0.001).half().float()
    m = (torch.rand(blocks, 1, generator=g) * 0.2 - 0.05).half().float()  # some blocks entirely above 0
    return (d * q + m).view(n, k)


def test_the_scheme_states_it_and_refuses_it_where_it_means_nothing():
    args = FLOAT_ZERO.to_args()
    assert args["zp_dtype"] == "torch.float32" and not args["symmetric"]
    assert QuantScheme.from_args(args) == FLOAT_ZERO
    assert QuantScheme.from_args(QuantScheme(4, 32, False).to_args()).zero_point == "int"
    assert FLOAT_ZERO != QuantScheme(4, 32, False)  # what the numbers are: compared
    with pytest.raises(ConfigError, match="--asym"):
        QuantScheme(4, 32, True, zero_point="float")


def test_the_range_is_the_group_s_own_with_fp16_scale_and_minimum():
    w = torch.tensor([[0.30, 0.31, 0.45, 0.60], [-1.0, -0.5, -0.25, -0.2]])
    scale, zero = float_zero_qparams(w.amin(1), w.amax(1), FLOAT_ZERO)
    # the range need not hold 0: the first row spans [0.30, 0.60], the second [-1.0, -0.2]
    assert torch.equal(scale, ((w.amax(1) - w.amin(1)) / 15).half().float())
    assert torch.allclose(-zero * scale, w.amin(1).half().float(), rtol=1e-6, atol=0)


def test_the_mse_search_shrinks_a_float_range_toward_its_middle():
    # groups far from 0 with one outlier each: shrinking toward 0 would slide the window off the bulk, so only a
    # window shrunk about its middle can trade the outlier's error for a finer step
    g = torch.Generator().manual_seed(2)
    w = 10 + torch.rand(8, 32, generator=g) * 0.3
    w[:, 0] = 10.6
    minmax = quantize_rtn(w, FLOAT_ZERO).dequantize()
    searched = quantize_rtn(w, FLOAT_ZERO, mse=True).dequantize()

    def error(dq):
        return float((dq - w).abs().pow(2.4).sum())

    assert error(searched) < 0.9 * error(minmax)


def test_rtn_recovers_a_q4_1_grid_that_integer_zero_points_miss():
    w = q4_1_grid_weight()
    floating = quantize_rtn(w, FLOAT_ZERO)
    assert floating.zeros.dtype == torch.float32
    assert (floating.dequantize() - w).abs().max() < 1e-6  # the grid itself, to fp32 rounding
    integer = quantize_rtn(w, QuantScheme(4, 32, False))
    assert integer.zeros.dtype == torch.int32
    assert (integer.dequantize() - w).abs().max() > 1e-3


@pytest.mark.parametrize("mse", [False, True])
def test_gptq_keeps_a_q4_1_grid_and_beats_rtn_off_it(mse):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 128, generator=g) * torch.linspace(0.2, 3, 128)
    hessian = 2 * x.t() @ x / x.shape[0]
    on_grid = q4_1_grid_weight()
    qw = gptq_quantize_weight(on_grid, hessian, FLOAT_ZERO, mse=mse)
    assert (qw.dequantize() - on_grid).abs().max() < 1e-6 and qw.zeros.dtype == torch.float32
    w = torch.randn(16, 128, generator=g) * 0.05 + 0.02
    gptq = gptq_quantize_weight(w, hessian, FLOAT_ZERO, act_order=True, mse=mse).dequantize()
    rtn = quantize_rtn(w, QuantScheme(4, 32, False, zero_point="float")).dequantize()

    def output_error(dq):
        return float(((dq - w) @ x.t()).pow(2).sum())

    assert output_error(gptq) < output_error(rtn)


@pytest.fixture(scope="module")
def float_zero_artifact(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("fzp") / "gptq-fzp"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--method", "gptq", "--asym", "--group-size",
                                      "32", "--zero-point", "float", "--num-samples", "4", "--seqlen", "32",
                                      "--calib-dtype", "float32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return out


def test_the_artifact_is_compressed_tensors_naive_quantized_with_a_float_zero_point(float_zero_artifact):
    from safetensors import safe_open

    qcfg = json.loads((float_zero_artifact / "config.json").read_text())["quantization_config"]
    weights = qcfg["config_groups"]["group_0"]["weights"]
    assert qcfg["format"] == "naive-quantized" and weights["zp_dtype"] == "torch.float32"
    with safe_open(str(float_zero_artifact / "model.safetensors"), "pt") as f:
        zp = f.get_tensor("model.layers.0.self_attn.q_proj.weight_zero_point")
        assert zp.dtype == torch.float32 and f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.int8
    assert not torch.equal(zp, zp.round())  # real values, not codes


def test_transformers_loads_it_to_our_readers_logits(float_zero_artifact):
    from transformers import AutoModelForCausalLM

    from llmopt.formats.read import load_artifact_model

    ids = torch.tensor([IDS])
    ours = load_artifact_model(float_zero_artifact, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(float_zero_artifact, dtype=torch.float32)
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()


def test_the_runtime_runs_it_on_the_int4_kernels(float_zero_artifact):
    assert_runtime_matches_reader(float_zero_artifact, {"int4-cpu"}, IDS, max_tokens=8)


def test_it_exports_to_gguf_q4_1_to_fp32_rounding(float_zero_artifact, tmp_path):
    from transformers import AutoModelForCausalLM

    from llmopt.formats.gguf import export_gguf
    from llmopt.formats.read import load_artifact_model

    facts = export_gguf(float_zero_artifact, tmp_path / "m.gguf")
    # llama.cpp computes d q + m, we s (q - z): the same fp16 d and m, so only fp32 rounding parts them
    assert facts["block_types"] == {"Q4_1": 14} and facts["max_abs_error"] < 1e-6
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    ours = load_artifact_model(float_zero_artifact, dtype=torch.float32)
    ids = torch.tensor([IDS])
    with torch.no_grad():
        assert torch.allclose(theirs(input_ids=ids).logits, ours(input_ids=ids).logits, atol=1e-4)


def test_distillation_trains_the_zero_points_as_real_numbers():
    from llmopt.distill.fake_quant import FakeQuantLinear

    qw = quantize_rtn(q4_1_grid_weight() + 0.003, FLOAT_ZERO)
    layer = FakeQuantLinear(qw)
    assert torch.allclose(layer.weight_now(), qw.dequantize())
    with torch.no_grad():
        layer.zeros.add_(0.25)
    back = layer.to_quantized()
    assert back.zeros.dtype == torch.float32 and torch.allclose(back.zeros, qw.zeros + 0.25)


@pytest.mark.parametrize("extra, why", [
    ([], "--asym"),
    (["--asym", "--method", "awq"], "rtn or gptq"),
    (["--asym", "--format", "gptq"], "float zero points"),
])
def test_refusals_name_the_fix_before_any_work(tiny_llama_dir, tmp_path, extra, why):
    args = ["quantize", str(tiny_llama_dir), "--zero-point", "float", "--group-size", "32", "-o", str(tmp_path / "o")]
    result = CliRunner().invoke(app, args + extra)
    assert result.exit_code == 1 and why in result.output, result.output
    assert not (tmp_path / "o").exists()

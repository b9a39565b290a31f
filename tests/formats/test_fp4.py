"""FP4 (E2M1) schemes, `--scheme nvfp4` and `mxfp4`: the values, block scales and global scale against
compressed-tensors' own formulas (ties to even, saturation at 6, E4M3 and E8M0 scales), packing round trips, the
nvfp4- / mxfp4-pack-quantized formats by round trip and by transformers + compressed-tensors' loader, GPTQ over the
FP4 grid, and the runtime's fp4-cpu linear (every kernel build) against the dequantized reference."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.compress.api import quantize_configs
from llmopt.core.contract.float_grid import fp4_global_scale
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract import PRESETS, QuantRecord
from llmopt.core.contract.fp4 import e2m1_codes, e2m1_values, e8m0_decode, e8m0_encode, pack_nibbles, unpack_nibbles
from llmopt.core.errors import ConfigError
from llmopt.core.hardware import supported_kernel_isas
from tests.formats.runtime_check import assert_runtime_matches_reader

NVFP4, MXFP4 = PRESETS["nvfp4"].weights, PRESETS["mxfp4"].weights


def test_e2m1_rounds_to_nearest_even_and_saturates():
    x = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 2.6, 3.5, 5.0, 5.01, 7.0, 100.0, -0.1, -0.75, -9.0])
    expected = [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.0, -1.0, -6.0]
    assert e2m1_values(e2m1_codes(x)).tolist() == expected
    assert bool(torch.signbit(e2m1_values(e2m1_codes(torch.tensor([-0.1])))))  # the sign bit kept, as packed
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    y = torch.randn(4096) * 4
    assert torch.equal(e2m1_values(e2m1_codes(y.clamp(-6, 6))), cast_to_fp4(y.clamp(-6, 6).clone()))


def test_packing_round_trips_and_matches_compressed_tensors():
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8

    codes = torch.randint(0, 16, (6, 32), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    values = e2m1_values(codes)
    assert torch.equal(pack_nibbles(e2m1_codes(values)), pack_fp4_to_uint8(values))
    exps = torch.arange(0, 255, dtype=torch.uint8)
    assert torch.equal(e8m0_encode(e8m0_decode(exps)), exps)


@pytest.mark.parametrize("name,preset", [("nvfp4", "NVFP4A16"), ("mxfp4", "MXFP4A16")])
def test_scales_and_values_are_compressed_tensors_formulas(name, preset):
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward_helpers import _dequantize, _quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams, calculate_range, generate_gparam

    scheme = PRESETS[name].weights
    torch.manual_seed(0)
    w = torch.randn(48, 128) * torch.logspace(-3, 0, 128)
    w[3, :32] = 0  # an all-zero block
    qweight = quantize_rtn(w, scheme)
    args = preset_name_to_scheme(preset, ["Linear"]).weights
    assert QuantRecord(scheme, "rtn").scheme.to_args()["scale_dtype"] == str(args.scale_dtype)
    g = generate_gparam(w.amin(), w.amax()) if name == "nvfp4" else None
    blocks = w.reshape(48, -1, scheme.group_size)
    scales, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), args, global_scale=g)
    assert torch.equal(scales.float(), qweight.scales)
    if g is not None:
        assert torch.equal(g, qweight.global_scale)
    expanded = scales.float().repeat_interleave(scheme.group_size, 1)
    q_min, q_max = calculate_range(args, "cpu")
    reference = _dequantize(_quantize(w, expanded, None, q_min, q_max, args, global_scale=g), expanded,
                            global_scale=g)
    assert torch.equal(qweight.dequantize(), reference)


def test_presets_checks_and_methods():
    [nv] = quantize_configs("gptq", {"scheme": "nvfp4"})
    assert nv.weight_scheme == NVFP4 and not nv.mse and nv.input_activations is None  # GPTQ's mse default is off
    with pytest.raises(ConfigError, match="needs method rtn or gptq"):
        quantize_configs("awq", {"scheme": "mxfp4"})
    with pytest.raises(ConfigError, match="contradicts scheme"):
        quantize_configs("rtn", {"scheme": "mxfp4", "group_size": 16})
    with pytest.raises(ConfigError, match="blocks of 16 do not divide layer's in_features"):
        NVFP4.check(72)


@pytest.mark.parametrize("name", ["nvfp4", "mxfp4", "w8a16-fp8"])
def test_mse_ranges_lower_the_weight_error_and_stay_storable(name):
    scheme = PRESETS[name].weights
    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-2, 0, 256)
    w[:, ::37] *= 8  # outliers that a shrunk range trades off
    minmax, mse = quantize_rtn(w, scheme), quantize_rtn(w, scheme, mse=True)
    errors = [((q.dequantize() - w).abs() ** 2.4).sum() for q in (minmax, mse)]
    assert errors[1] < errors[0] and not torch.equal(mse.scales, minmax.scales)
    if scheme.scale_format == "e4m3":
        assert torch.equal(mse.scales.to(torch.float8_e4m3fn).float(), mse.scales)
    elif scheme.scale_format == "e8m0":
        assert torch.equal(e8m0_decode(e8m0_encode(mse.scales)), mse.scales)


def test_gptq_on_the_fp4_grid_beats_rtn_on_the_layer_output():
    from llmopt.compress.gptq import gptq_quantize_weight

    torch.manual_seed(0)
    x = torch.randn(512, 64) @ torch.randn(64, 64)  # correlated inputs: GPTQ's error feedback has work to do
    w = torch.randn(32, 64)
    h = 2 * x.t() @ x / x.shape[0]
    for scheme in (NVFP4, MXFP4, PRESETS["w8a16-fp8"].weights):
        rtn, gptq = quantize_rtn(w, scheme), gptq_quantize_weight(w, h, scheme, damp=0.01)
        assert torch.equal(gptq.scales, rtn.scales)  # fixed block ranges, only the values move
        assert scheme.bits == 8 or int(gptq.q.max()) < 16  # E2M1 codes
        err = [((x @ (w - q.dequantize()).t()) ** 2).mean() for q in (rtn, gptq)]
        assert err[1] < 0.9 * err[0], (scheme, err)


def test_nvfp4_pack_quantized_round_trip_and_shared_global_scale():
    from llmopt.formats.layouts import FORMATS

    fmt = FORMATS.get("compressed-tensors")
    w = torch.randn(16, 64)
    shared = fp4_global_scale(torch.cat([w, 2 * w]))
    qweight = quantize_rtn(w, NVFP4, bias=torch.randn(16), global_scale=shared)
    packed = fmt.pack(qweight)
    assert packed["weight_packed"].shape == (16, 32) and packed["weight_scale"].dtype == torch.float8_e4m3fn
    assert torch.equal(packed["weight_global_scale"], shared)
    qcfg = fmt.quantization_config(QuantRecord(NVFP4, "rtn"))
    assert qcfg["format"] == "nvfp4-pack-quantized"
    back = fmt.unpack(packed, fmt.scheme_from_config(qcfg))
    assert torch.equal(back.dequantize(), qweight.dequantize())
    mx = quantize_rtn(w, MXFP4)
    packed = fmt.pack(mx)
    assert packed["weight_scale"].dtype == torch.uint8 and "weight_global_scale" not in packed
    qcfg = fmt.quantization_config(QuantRecord(MXFP4, "rtn"))
    assert qcfg["format"] == "mxfp4-pack-quantized"
    assert torch.equal(fmt.unpack(packed, fmt.scheme_from_config(qcfg)).dequantize(), mx.dequantize())
    with pytest.raises(Exception, match="GPTQ stores integer codes"):
        FORMATS.get("gptq").check("x", (16, 64), NVFP4)


@pytest.mark.parametrize("isa", supported_kernel_isas())
@pytest.mark.parametrize("scheme", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_linear_matches_the_dequantized_reference(monkeypatch, isa, scheme, dtype):
    # 1, 3, 8 rows from the codes (pairs, a single, 4/2/1 outputs at a time); 512 through the decoded weight
    from llmopt.runtime.executor.kernels import cpu_ops as cpu_ops_module
    from llmopt.runtime.executor.linear.fp4_cpu import Fp4WeightLinear

    ops = cpu_ops_module.cpu_ops(isa)
    assert ops is not None, f"the {isa} kernels failed to build"
    monkeypatch.setattr("llmopt.runtime.executor.linear.fp4_cpu.cpu_ops", lambda: ops)
    torch.manual_seed(1)
    w = torch.randn(38, 192) * 0.1
    qweight = quantize_rtn(w, scheme, bias=torch.randn(38))
    layer = Fp4WeightLinear(qweight, dtype)
    assert torch.equal(layer.dequantize(), qweight.dequantize(dtype))
    for rows in (1, 3, 8, 512):
        x = torch.randn(rows, 192).to(dtype)
        expected = x.float() @ qweight.dequantize().t() + qweight.bias
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(x).float(), expected, rtol=tol, atol=tol * expected.abs().max().item())
    if isa == supported_kernel_isas()[-1]:  # and the torch path, once
        monkeypatch.setattr("llmopt.runtime.executor.linear.fp4_cpu.cpu_ops", lambda: None)
        x = torch.randn(3, 192).to(dtype)
        torch.testing.assert_close(layer(x).float(), x.float() @ qweight.dequantize(dtype).float().t() + qweight.bias,
                                   rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_inputs_are_compressed_tensors_fake_quantization(dtype):
    from compressed_tensors.quantization import preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    from llmopt.core.contract import fake_quantize_activations

    args = preset_name_to_scheme("NVFP4", ["Linear"]).input_activations
    assert PRESETS["nvfp4-a4"].input_activations.to_args()["dynamic"] == "local"
    torch.manual_seed(0)
    x = (torch.randn(3, 7, 256) * torch.logspace(-1, 1, 256)).to(dtype)
    g = fp4_global_scale(x.float() * 1.2)
    scale, zero = compute_dynamic_scales_and_zp(x, args, None, global_scale=g)
    expected = fake_quantize(x, scale, zero, args, global_scale=g)
    assert torch.equal(fake_quantize_activations(x, PRESETS["nvfp4-a4"].input_activations, g), expected)
    with pytest.raises(ConfigError, match="calibrated global scale"):
        fake_quantize_activations(x, PRESETS["nvfp4-a4"].input_activations)


@pytest.mark.parametrize("scheme,method", [("nvfp4", "rtn"), ("mxfp4", "gptq"), ("nvfp4-a4", "rtn")])
def test_artifacts_load_in_transformers_and_run_in_the_runtime(tiny_llama_dir, tmp_path, scheme, method):
    from transformers import AutoModelForCausalLM

    from llmopt.formats.read import load_artifact_model

    out = tmp_path / scheme
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--scheme", scheme, "--method", method,
                                      "--num-samples", "4", "--seqlen", "32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == f"{scheme.split('-')[0]}-pack-quantized"
    if scheme == "nvfp4-a4":  # the inputs' global scale, calibrated per linear and stored beside the weight
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), "pt") as f:
            scales = [f.get_tensor(k) for k in f.keys() if k.endswith(".input_global_scale")]
        assert len(scales) == 14 and all(float(s) > 0 for s in scales)
    for target in ("gptq", "awq"):  # formats of integer codes say why they cannot hold it
        refused = CliRunner().invoke(app, ["export", str(out), "--format", target, "-o", str(tmp_path / target)])
        why = "input activations" if scheme == "nvfp4-a4" else "float weights"
        assert refused.exit_code == 1 and why in refused.output and not (tmp_path / target).exists()
    refused = CliRunner().invoke(app, ["distill", "--teacher", str(tiny_llama_dir), "--student", str(out),
                                       "--max-steps", "1", "-o", str(tmp_path / "distilled")])
    assert refused.exit_code == 1 and "distill the unquantized model" in refused.output, refused.output
    ids = [1, 5, 9, 100, 42, 7, 3, 11]
    # compressed-tensors decompresses FP4 into bf16 whatever dtype is asked: compare in bf16, where both are exact
    ours = load_artifact_model(out, dtype=torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    with torch.no_grad():
        a, b = ours(input_ids=torch.tensor([ids])).logits, theirs(input_ids=torch.tensor([ids])).logits
    assert torch.equal(a, b), (a.float() - b.float()).abs().max()
    assert_runtime_matches_reader(out, {"fp4-cpu"}, ids, max_tokens=6)


def test_joint_2_4_pruning_keeps_its_zeros_on_the_fp4_grid_and_calibrates_input_scales(tiny_llama_dir, tmp_path):
    # one pass of SparseGPT 2:4 and GPTQ (a ModifierList sharing Hessians): the pruned weights stay exactly zero as
    # E2M1 code 0, and NVFP4 inputs still get their calibrated global scale through the list
    from llmopt.formats.read import read_artifact

    out = tmp_path / "nvfp4-a4-24"
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--scheme", "nvfp4-a4", "--method", "gptq",
                                      "--prune-pattern", "2:4", "--num-samples", "4", "--seqlen", "32", "-o", str(out)])
    assert result.exit_code == 0, result.output
    contents = read_artifact(out)
    assert contents.config["sparsity_config"]["sparsity_structure"] == "2:4"
    for qweight in contents.qweights.values():
        groups = (qweight.dequantize() == 0).reshape(qweight.shape[0], -1, 4)
        assert bool((groups.sum(-1) >= 2).all())  # at least two zeros in every group of four
        assert qweight.input_global_scale is not None and float(qweight.input_global_scale) > 0

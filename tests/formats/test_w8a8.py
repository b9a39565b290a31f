"""W8A8 int8 (`--scheme w8a8-int8`): the activation formula against compressed-tensors' own, the int-quantized
format by round trip and by transformers + compressed-tensors' loader (same logits as our reader), the runtime's
integer linear against the dequantized reference, and the CLI end to end (quantize, eval, generate)."""

import json

import pytest
import torch
from typer.testing import CliRunner

from llmopt.cli.main import app
from llmopt.core.contract import (
    INT8_TOKEN_ACTIVATIONS, PRESETS, QuantizedWeight, QuantRecord, QuantScheme, fake_quantize_activations,
    quantize_activations,
)
from llmopt.core.errors import ArtifactError, ConfigError
from tests.formats.runtime_check import assert_runtime_matches_reader

W8 = QuantScheme(8, -1, True)


def test_activation_quantization_is_compressed_tensors_formula():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(7, 96) * torch.linspace(0.1, 20, 96)  # outlier columns
    x[2, 5] = -x[2].abs().max() * 1.5  # the row's largest magnitude negative: code -128
    args = QuantizationArgs(**INT8_TOKEN_ACTIVATIONS.to_args())
    scale, zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), args)
    expected = fake_quantize(x, scale, zero, args)
    assert torch.equal(fake_quantize_activations(x, INT8_TOKEN_ACTIVATIONS), expected)
    codes, _ = quantize_activations(x, INT8_TOKEN_ACTIVATIONS)
    assert codes.dtype == torch.int8 and int(codes.min()) == -128 and int(codes.max()) <= 127
    with pytest.raises(ConfigError, match="only dynamic symmetric int8"):
        quantize_activations(x, QuantScheme(4, -1, True, strategy="token", dynamic=True))


def test_preset_and_config():
    from llmopt.compress.api import quantize_configs

    [config] = quantize_configs("rtn", {"scheme": "w8a8-int8"})
    assert (config.bits, config.group_size, config.sym) == (8, -1, True)
    assert config.input_activations == INT8_TOKEN_ACTIVATIONS == PRESETS["w8a8-int8"].input_activations
    assert config.record().input_activations == INT8_TOKEN_ACTIVATIONS
    with pytest.raises(ConfigError, match="bits 4 contradicts scheme w8a8-int8"):
        quantize_configs("rtn", {"scheme": "w8a8-int8", "bits": 4})
    with pytest.raises(ConfigError, match="unknown scheme"):
        quantize_configs("rtn", {"scheme": "w9a9"})


def random_qweight(n=48, k=64, bias=True, seed=0) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, 1, generator=g) * 0.02 + 1e-3
    return QuantizedWeight(q, scales.half().float(), torch.full((n, 1), 128, dtype=torch.int32),
                           torch.zeros(k, dtype=torch.int32), W8, torch.randn(n, generator=g) if bias else None,
                           INT8_TOKEN_ACTIVATIONS)


def test_int_quantized_round_trip():
    from llmopt.formats.layouts import FORMATS

    fmt = FORMATS.get("compressed-tensors")
    qweight = random_qweight()
    packed = fmt.pack(qweight)
    assert packed["weight"].dtype == torch.int8 and set(packed) == {"weight", "weight_scale", "bias"}
    record = QuantRecord(W8, "rtn", input_activations=INT8_TOKEN_ACTIVATIONS)
    qcfg = fmt.quantization_config(record)
    assert qcfg["format"] == "int-quantized" and fmt.marker_for(qcfg) == "weight_scale"
    back = fmt.unpack(packed, fmt.scheme_from_config(qcfg))
    assert torch.equal(back.q, qweight.q) and torch.equal(back.zeros, qweight.zeros)
    assert torch.equal(back.scales, qweight.scales)
    assert fmt.input_activations_from_config(qcfg) == INT8_TOKEN_ACTIVATIONS
    # the formats that cannot say how inputs are quantized refuse rather than drop it
    with pytest.raises(ArtifactError, match="cannot record quantized input activations"):
        FORMATS.get("gptq").check_record(record)


@pytest.mark.parametrize("rows", [1, 3, 8, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_runtime_integer_linear_matches_the_reference(rows, dtype):
    from llmopt.core.contract.activations import InputQuantizedLinear
    from llmopt.runtime.executor.linear import make_linear
    from llmopt.runtime.executor.linear.w8a8_cpu import Int8W8A8Linear

    qweight = random_qweight()
    layer = make_linear(qweight, dtype, "cpu")
    assert isinstance(layer, Int8W8A8Linear)
    reference = InputQuantizedLinear.of(qweight, torch.float32)
    x = torch.randn(rows, 64) * 3
    expected = reference(x.to(dtype).float())
    got = layer(x.to(dtype)).float()
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    assert torch.allclose(got, expected, rtol=tolerance, atol=tolerance * expected.abs().max())
    # q/k/v as one integer GEMM: exact against the parts
    parts = [make_linear(random_qweight(seed=s), dtype, "cpu") for s in (1, 2)]
    stacked = Int8W8A8Linear.stack(parts)
    assert torch.equal(stacked(x.to(dtype)), torch.cat([p(x.to(dtype)) for p in parts], dim=-1))


def test_the_integer_gemm_is_exact_where_torchs_is_not(monkeypatch):
    # more rows than the GEMV's go through torch._int_mm only where it sums exactly (int_mm_exact, checked once);
    # elsewhere through a float64 matmul: under the AVX2 simulation oneDNN's s8s8 GEMM shifted the inputs to u8 and
    # summed byte products pairwise in saturating int16 (vpmaddubsw), as `shifted_saturating` does
    from llmopt.runtime.executor.linear import w8a8_cpu

    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-128, 128, (40, 576), generator=g, dtype=torch.int8)
    weight = torch.randint(-128, 128, (96, 576), generator=g, dtype=torch.int8)
    expected = codes.long() @ weight.long().t()
    assert torch.equal(w8a8_cpu.integer_matmul(codes, weight.t()).long(), expected)
    layer = w8a8_cpu.Int8W8A8Linear(random_qweight(), torch.float32)
    x = torch.randn(12, 64, generator=g) * 3
    exact = layer(x)

    def shifted_saturating(a, b):  # [M, K] @ [K, N]
        pairs = ((a.long() + 128).unsqueeze(-1) * b.long().unsqueeze(0)).reshape(a.shape[0], -1, 2, b.shape[1])
        return (pairs.sum(2).clamp(-2 ** 15, 2 ** 15 - 1).sum(1) - 128 * b.long().sum(0)).to(torch.int32)

    assert not torch.equal(shifted_saturating(codes, weight.t()).long(), expected)  # (the fake is wrong here)
    monkeypatch.setattr(torch, "_int_mm", shifted_saturating)
    w8a8_cpu.int_mm_exact.cache_clear()
    try:
        assert not w8a8_cpu.int_mm_exact()
        assert torch.equal(w8a8_cpu.integer_matmul(codes, weight.t()).long(), expected)
        assert torch.equal(layer(x), exact)
    finally:
        monkeypatch.undo()
        w8a8_cpu.int_mm_exact.cache_clear()


@pytest.mark.parametrize("rows", [9, 64, 1024])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepacked_onednn_gemm_equals_the_int_mm_path(monkeypatch, rows, dtype):
    # the AMX-INT8 path (oneDNN on a weight prepacked at load) gives the _int_mm path's numbers bit for bit: the
    # integer sums are exact and the epilogue multiplies in the same order; forced on where torch has the op
    from llmopt.runtime.executor.linear import w8a8_cpu

    if not hasattr(torch.ops.onednn, "qlinear_pointwise"):
        pytest.skip("this torch build has no oneDNN quantized linear")
    from llmopt.core.hardware import usable_features

    if not {"amx_int8", "avx512_vnni", "avx_vnni"} & set(usable_features()):
        # without integer dot-product units oneDNN adds byte products pairwise in saturating int16 (vpmaddubsw):
        # not exact, and the runtime takes this path only with AMX-INT8 (onednn_int8_gemm)
        pytest.skip("no AMX-INT8 / VNNI: oneDNN's int8 GEMM is not exact here and the runtime does not use it")
    qweight = random_qweight()
    monkeypatch.setattr(w8a8_cpu, "onednn_int8_gemm", lambda: True)
    packed = w8a8_cpu.Int8W8A8Linear(qweight, dtype)
    monkeypatch.setattr(w8a8_cpu, "onednn_int8_gemm", lambda: False)
    plain = w8a8_cpu.Int8W8A8Linear(qweight, dtype)
    assert packed.packed is not None and plain.packed is None
    x = (torch.randn(rows, 64) * 3).to(dtype)
    assert torch.equal(packed(x), plain(x))
    monkeypatch.setattr(w8a8_cpu, "onednn_int8_gemm", lambda: True)
    stacked = w8a8_cpu.Int8W8A8Linear.stack([packed, plain])  # q/k/v: prepacked again as one weight
    assert stacked.packed is not None and torch.equal(stacked(x), torch.cat([packed(x), plain(x)], dim=-1))


@pytest.fixture(scope="module")
def w8a8_artifact(tmp_path_factory, tiny_llama_dir):
    out = tmp_path_factory.mktemp("w8a8") / "w8a8"
    # (the scheme alone, without its default pre-passes: after SmoothQuant an input can sit on an int8 rounding
    # boundary, where the runtime's and the reader's float sums, added in other orders, round it apart)
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--scheme", "w8a8-int8", "--method", "gptq",
                                      "--num-samples", "4", "--seqlen", "32", "--calib-dtype", "float32", "-o",
                                      str(out), "--smoothquant-alpha", "none"])
    assert result.exit_code == 0, result.output
    return out


def test_the_artifact_is_compressed_tensors_int_quantized(w8a8_artifact):
    qcfg = json.loads((w8a8_artifact / "config.json").read_text())["quantization_config"]
    group = qcfg["config_groups"]["group_0"]
    assert qcfg["format"] == "int-quantized" and group["format"] == "int-quantized"
    assert group["weights"]["strategy"] == "channel" and group["weights"]["num_bits"] == 8
    assert group["input_activations"] == {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                                          "group_size": None, "dynamic": True, "observer": None}


def test_transformers_loads_it_to_our_readers_logits(w8a8_artifact):
    from transformers import AutoModelForCausalLM

    from llmopt.formats.read import load_artifact_model, read_artifact

    ids = torch.tensor([[1, 5, 9, 100, 42, 7, 3, 11]])
    ours = load_artifact_model(w8a8_artifact, dtype=torch.float32)
    theirs = AutoModelForCausalLM.from_pretrained(w8a8_artifact, dtype=torch.float32)
    with torch.no_grad():
        a, b = ours(input_ids=ids).logits, theirs(input_ids=ids).logits
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    # the inputs are quantized by both: weights alone (no input quantization) give other logits
    contents = read_artifact(w8a8_artifact)
    for qweight in contents.qweights.values():
        qweight.input_activations = None
    from llmopt.formats.read import model_from_contents

    with torch.no_grad():
        weight_only = model_from_contents(contents, torch.float32)(input_ids=ids).logits
    assert not torch.allclose(weight_only, a, atol=1e-5)


def test_the_runtime_runs_it_on_integer_kernels(w8a8_artifact):
    assert_runtime_matches_reader(w8a8_artifact, {"w8a8-int8-cpu"}, [1, 5, 9, 100, 42, 7, 3], max_tokens=10)


def test_eval_and_generate_load_it(w8a8_artifact):
    runner = CliRunner()
    ppl = runner.invoke(app, ["eval", "ppl", str(w8a8_artifact), "--dataset", "pystdlib", "--seqlen", "32",
                              "--max-tokens", "128", "--dtype", "float32", "--json"])
    assert ppl.exit_code == 0, ppl.output
    generated = runner.invoke(app, ["generate", str(w8a8_artifact), "-p", "def f():", "--max-tokens", "4",
                                    "--dtype", "float32"])
    assert generated.exit_code == 0, generated.output


def test_w8a8_into_gptq_or_awq_format_is_refused_before_work(tiny_llama_dir, tmp_path):
    result = CliRunner().invoke(app, ["quantize", str(tiny_llama_dir), "--scheme", "w8a8-int8", "--method", "rtn",
                                      "--format", "gptq", "-o", str(tmp_path / "o")])
    assert result.exit_code == 1 and "cannot record quantized input activations" in result.output
    assert not (tmp_path / "o").exists()

"""A new number format end to end, defined in this file alone: a 4-bit lookup-table grid (each code stands for one
of 16 fixed values in [-1, 1], NF4's table, times a per-group absmax scale) registered as a weight grid, a
preset, a compressed-tensors layout and a linear method of its own; then quantized by RTN and GPTQ, written as an
artifact, read back by the runtime and run to tokens, without another file of the package knowing of it."""

import pytest
import torch
import torch.nn.functional as F

from llmopt.compress.api import make_config, quantize_model
from llmopt.compress.gptq import gptq_quantize_weight
from llmopt.core.contract import LinearScheme, QuantizedWeight, QuantScheme, default_g_idx, register_preset
from llmopt.core.contract import unregister_preset
from llmopt.core.contract.fp4 import pack_nibbles, unpack_nibbles
from llmopt.core.contract.grid import WEIGHT_GRIDS, GridRanges, WeightGrid, register_weight_grid
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model
from llmopt.formats.artifact import write_model_artifact
from llmopt.formats.ct_layouts import CT_LAYOUTS, CTLayout, register_ct_layout
from llmopt.formats.packing import SCALE_DTYPE
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.linear import LINEAR_METHODS, LinearMethod, register_linear_method
from llmopt.runtime.executor.loader import load_runtime_model

# NF4's 16 values (QLoRA, Dettmers et al. 2023): quantiles of a normal distribution, 0 exact at code 7
TABLE = torch.tensor([-1.0, -0.6961928, -0.5250731, -0.3949175, -0.2844414, -0.1847734, -0.0910500, 0.0,
                      0.0795803, 0.1609302, 0.2461123, 0.3379152, 0.4407098, 0.5626170, 0.7229568, 1.0])
NAME, PRESET = "toy-lut", "toy-lut4"
CALLS = {"linear": 0}
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


class LookupGrid(WeightGrid):
    """Codes index TABLE; a group's scale is its absmax (1 for an all-zero group); no zero point."""

    name = NAME

    def check(self, scheme, in_features, name):
        if scheme.bits != 4:
            raise ConfigError(f"{NAME} has 16 values: 4-bit codes only, not {scheme.bits}")

    def ranges(self, w, scheme, mse=False, global_scale=None):
        n, k = w.shape
        amax = w.float().reshape(n, scheme.num_groups(k), -1).abs().amax(dim=-1)  # [N, G]
        scales = torch.where(amax > 0, amax, torch.ones_like(amax))
        return GridRanges(scales, torch.zeros_like(scales))

    def round(self, values, scale, zero, scheme):
        return ((values / scale).unsqueeze(-1) - TABLE).abs().argmin(dim=-1).to(torch.uint8)

    def decode(self, codes, zeros, scheme):
        return TABLE[codes.long()]

    def zero_code(self, zeros):
        return torch.full_like(zeros, 7, dtype=torch.uint8)

    def stored_zeros(self, zeros, scheme):
        return zeros.to(torch.int32)


class LookupLayout(CTLayout):
    """Codes two a byte (low nibble first), scales as fp16."""

    name, marker = f"{NAME}-quantized", "weight_packed"

    def holds(self, weights, acts):
        return weights.type == NAME and acts is None

    def reads(self, tensors, scheme):
        return scheme.type == NAME

    def pack(self, qweight):
        out = {"weight_packed": pack_nibbles(qweight.q), "weight_scale": qweight.scales.to(SCALE_DTYPE)}
        return out if qweight.bias is None else {**out, "bias": qweight.bias.to(SCALE_DTYPE)}

    def unpack(self, tensors, scheme):
        q = unpack_nibbles(tensors["weight_packed"])
        scales = tensors["weight_scale"].float()
        bias = tensors.get("bias")
        return QuantizedWeight(q, scales, torch.zeros_like(scales, dtype=torch.int32), default_g_idx(q.shape[1], scheme),
                               scheme, None if bias is None else bias.float())


class LookupLinear(LinearMethod):
    """The codes kept, looked up on every call: what the grid's weights are, never dequantized at load."""

    name, device_type, compiled = "toy-lut-cpu", "cpu", False

    def __init__(self, qweight, dtype, device="cpu"):
        super().__init__(qweight, dtype, device)
        self.register_buffer("codes", qweight.q.long())
        self.register_buffer("scales", qweight.scales[:, qweight.g_idx.long()])  # [N, K]

    @classmethod
    def accepts(cls, qweight, scheme, device):
        return scheme.weights.type == NAME and scheme.input_activations is None

    def _matmul(self, x2d):
        CALLS["linear"] += 1
        return F.linear(x2d, (self.scales * TABLE[self.codes]).to(x2d.dtype))


@pytest.fixture(scope="module")
def toy_scheme():
    """The plug-ins registered for this module's tests, removed after them."""
    register_weight_grid(LookupGrid)
    register_ct_layout(LookupLayout)
    register_linear_method(LookupLinear)
    register_preset(PRESET, LinearScheme(QuantScheme(4, 32, True, type=NAME)))
    yield QuantScheme(4, 32, True, type=NAME)
    unregister_preset(PRESET)
    LINEAR_METHODS.remove(LookupLinear.name)
    CT_LAYOUTS.remove(LookupLayout.name)
    WEIGHT_GRIDS.remove(NAME)


def reference_codes(w, scheme):
    """The nearest table value of every weight over its group's absmax, by brute force."""
    n, k = w.shape
    groups = w.reshape(n, k // scheme.group_size, scheme.group_size)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    distances = ((groups / amax).unsqueeze(-1) - TABLE).abs()  # [N, G, W, 16]
    return distances.argmin(dim=-1).reshape(n, k), amax.squeeze(-1)


def test_the_grid_rounds_to_the_nearest_table_value(toy_scheme):
    w = torch.randn(24, 64, generator=torch.Generator().manual_seed(0))
    qweight = quantize_rtn(w, toy_scheme)
    codes, amax = reference_codes(w, toy_scheme)
    assert torch.equal(qweight.q.long(), codes) and torch.equal(qweight.scales, amax)
    assert torch.allclose(qweight.dequantize(), TABLE[codes] * amax.repeat_interleave(32, dim=1))
    with pytest.raises(ConfigError, match="4-bit codes only"):
        quantize_rtn(w, QuantScheme(3, 32, True, type=NAME))


def test_gptq_rounds_onto_the_grid_with_less_output_error_than_rtn(toy_scheme):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 64, generator=gen) @ torch.randn(64, 64, generator=gen)  # correlated inputs
    w = torch.randn(32, 64, generator=gen)
    hessian = 2 * x.t() @ x / x.shape[0]
    gptq = gptq_quantize_weight(w, hessian, toy_scheme, damp=0.01)
    rtn = quantize_rtn(w, toy_scheme)
    assert set(gptq.q.unique().tolist()) <= set(range(16)) and torch.equal(gptq.scales, rtn.scales)
    error = {name: (x @ (q.dequantize() - w).t()).square().sum() for name, q in (("gptq", gptq), ("rtn", rtn))}
    assert error["gptq"] < 0.8 * error["rtn"]
    pruned = torch.zeros_like(w, dtype=torch.bool)
    pruned[:, ::4] = True
    kept = gptq_quantize_weight(w * ~pruned, hessian, toy_scheme, mask=pruned)
    assert torch.all(kept.q[pruned] == 7) and torch.all(kept.dequantize()[pruned] == 0)


@pytest.fixture(scope="module")
def toy_artifact(toy_scheme, tmp_path_factory):
    model, tok = build_tiny_model("llama", seed=7)
    config = make_config("rtn", scheme=PRESET)
    result = quantize_model(model, tok, config)
    return write_model_artifact(tmp_path_factory.mktemp("toy") / "lut4", model, tok, result.qweights,
                                "compressed-tensors", config.record(), {"stages": []}, dense_dtype=torch.float32)


def test_quantize_artifact_runtime_tokens(toy_artifact):
    import json

    qcfg = json.loads((toy_artifact / "config.json").read_text())["quantization_config"]
    assert qcfg["format"] == f"{NAME}-quantized"
    assert qcfg["config_groups"]["group_0"]["weights"]["type"] == NAME
    model, tok, _ = load_runtime_model(str(toy_artifact), dtype="float32")
    assert "LookupLinear" in {type(m).__name__ for m in model.modules()}
    engine = Engine(model, tok, EngineConfig(block_size=4, fast_path=False))
    assert engine.numerics()["linear_methods"]["toy-lut-cpu"] == 7 * 2
    prompts = [tok.encode("hello there"), tok.encode("x = 1")]
    CALLS["linear"] = 0
    got = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    assert CALLS["linear"] > 0
    # the tokens of transformers on the weights the artifact's grid stands for (dequantized by the grid)
    from llmopt.eval.hf_baseline import hf_generate
    from llmopt.formats.load import load_model

    dense, _, _ = load_model(str(toy_artifact), dtype="float32")
    assert got == [list(t) for t in hf_generate(dense, tok, prompts, GREEDY)]


def test_methods_that_cannot_round_onto_the_grid_are_refused(toy_scheme):
    with pytest.raises(ConfigError, match="needs method rtn or gptq, not awq"):
        make_config("awq", scheme=PRESET)
    with pytest.raises(ConfigError, match=f"scheme type 'nope': choose one of float, int, {NAME}"):
        QuantScheme(4, 32, type="nope")

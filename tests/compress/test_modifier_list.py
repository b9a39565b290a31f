"""Several compression methods in one calibration pass (ModifierList)."""

import copy

import pytest
import torch

from llmopt.compress.api import compress_model, make_config, make_sparsity_config, quantize_configs
from tests.compress.nm import check_nm
from llmopt.core.errors import ConfigError
from llmopt.core.tiny import build_tiny_model

CAL = dict(calib="pystdlib", num_samples=4, seqlen=32, compute_dtype="float32")  # the reference Hessian is fp32


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", seed=0)


def test_wanda_then_gptq_in_one_pass_keeps_the_pattern_in_the_codes(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    configs = [make_sparsity_config(method="wanda", pattern="2:4", **CAL),
               make_config("gptq", bits=4, group_size=32, **CAL)]
    result = compress_model(model, tok, configs)
    assert set(result.masks) == set(result.qweights)
    for name, qw in result.qweights.items():
        dq = qw.dequantize()
        assert check_nm(dq, 2, 4) and (dq[result.masks[name]] == 0).all()
        assert (qw.q[result.masks[name]].long() == 2 ** (qw.scheme.bits - 1)).all()  # the zero point's code
    entry = model.config.sparsity_config
    assert entry["method"] == "wanda+gptq" and entry["sparsity_structure"] == "2:4"
    assert 0.5 <= entry["global_sparsity"] < 0.6


def test_prune_pattern_setting_is_a_sparsegpt_modifier_before_gptq(tiny):
    configs = quantize_configs("gptq", dict(bits=4, group_size=32, prune_pattern="2:4", **CAL))
    assert [c.method for c in configs] == ["sparsegpt", "gptq"]
    assert configs[0].pattern == "2:4" and configs[0].calibration == configs[1].calibration
    assert not hasattr(configs[1], "prune_pattern")
    with pytest.raises(ConfigError, match="needs sym"):
        quantize_configs("gptq", dict(bits=4, group_size=32, sym=False, prune_pattern="2:4", **CAL))
    with pytest.raises(ConfigError, match="gptq only"):
        quantize_configs("rtn", dict(bits=4, group_size=32, prune_pattern="2:4"))


def test_one_pass_equals_the_two_methods_sharing_one_hessian(tiny):
    """SparseGPT then GPTQ in one pass: each stage's linears are pruned, then quantized from the same inputs,
    so the first stage (q/k/v of layer 0, whose inputs no earlier change can touch) equals running the pure
    functions on that stage's Hessian."""
    from llmopt.compress.gptq import gptq_quantize_weight
    from llmopt.compress.hessian import HessianAccumulator
    from llmopt.compress.sparsegpt import sparsegpt_prune_weight
    from llmopt.core.calibration import capture_first_layer_inputs
    from llmopt.core.datasets import calibration_samples

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    layer = model.model.layers[0]
    q_weight = layer.self_attn.q_proj.weight.detach().clone()
    ids = calibration_samples(tok, "pystdlib", 4, 32, 0)
    hidden, _ = capture_first_layer_inputs(model, ids, 8, torch.device("cpu"))
    with torch.no_grad():
        x = layer.input_layernorm(hidden)
    acc = HessianAccumulator(x.shape[-1])
    acc.add(x)
    configs = quantize_configs("gptq", dict(bits=4, group_size=32, gptaq=False, prune_pattern="2:4", **CAL))
    result = compress_model(model, tok, configs)
    pruned, mask = sparsegpt_prune_weight(q_weight, acc.hessian, nm=(2, 4))
    gptq = configs[1]
    expected = gptq_quantize_weight(pruned, acc.hessian, gptq.weight_scheme, damp=gptq.damp, act_order=gptq.act_order,
                                    mse=gptq.mse, mask=mask)
    got = result.qweights["model.layers.0.self_attn.q_proj"]
    torch.testing.assert_close(got.dequantize(), expected.dequantize(), rtol=1e-5, atol=1e-6)


def test_order_and_count_are_checked(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    prune = make_sparsity_config(method="magnitude", sparsity=0.5, **CAL)
    rtn, gptq = make_config("rtn", bits=4, group_size=32), make_config("gptq", bits=4, group_size=32, **CAL)
    with pytest.raises(ConfigError, match="prune before quantizing"):
        compress_model(model, tok, [rtn, prune])
    with pytest.raises(ConfigError, match="one quantization method"):
        compress_model(model, tok, [rtn, gptq])
    with pytest.raises(ConfigError, match="needs symmetric"):
        compress_model(model, tok, [prune, make_config("rtn", bits=4, group_size=32, sym=False)])


def test_two_pruners_then_gptq_keep_the_zeros_of_both(tiny):
    from llmopt.compress.masks import unstructured_mask

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    name = "model.layers.0.mlp.down_proj"
    original = model.model.layers[0].mlp.down_proj.weight.detach().clone()
    magnitude = unstructured_mask(original.abs(), 0.3)  # what the first pruner removes
    configs = [make_sparsity_config(method="magnitude", sparsity=0.3, **CAL),
               make_sparsity_config(method="wanda", pattern="2:4", **CAL),
               make_config("gptq", bits=4, group_size=32, **CAL)]
    result = compress_model(model, tok, configs)
    dq = result.qweights[name].dequantize()
    assert (dq[magnitude] == 0).all()  # wanda's 2:4 alone keeps some of these (3 zeros in a group of 4)
    assert (result.masks[name] >= magnitude).all() and check_nm(dq, 2, 4)

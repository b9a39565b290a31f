import pytest
import torch

from llmopt.compress.gptq import gptq_quantize_weight
from llmopt.compress.hessian import HessianAccumulator
from llmopt.compress.quant import QuantScheme, quantize_rtn


def correlated_inputs(num_tokens=2048, k=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k**0.5
    scales = torch.linspace(0.2, 3.0, k)  # uneven channel magnitudes, as in real activations
    return (torch.randn(num_tokens, k, generator=g) @ mix) * scales


def output_error(x, w, w_hat):
    return ((x @ w.t() - x @ w_hat.t()) ** 2).mean().item()


def test_hessian_accumulator_is_two_over_n_xtx():
    x = torch.randn(300, 16)
    acc = HessianAccumulator(16)
    for chunk in x.split(70):
        acc.add(chunk.unsqueeze(0))
    torch.testing.assert_close(acc.hessian, 2 / 300 * x.t() @ x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("scheme", [QuantScheme(4, 32, True), QuantScheme(4, 32, False), QuantScheme(3, -1, True)])
@pytest.mark.parametrize("act_order,static_groups", [(False, True), (True, True), (True, False), (False, False)])
def test_gptq_beats_rtn_on_layer_output_error(scheme, act_order, static_groups):
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    x = correlated_inputs()
    acc = HessianAccumulator(128)
    acc.add(x)
    qw = gptq_quantize_weight(linear.weight.data, acc.hessian, scheme, act_order=act_order,
                              static_groups=static_groups)
    rtn = quantize_rtn(linear.weight.data, scheme)
    gptq_err = output_error(x, linear.weight.data, qw.dequantize())
    rtn_err = output_error(x, linear.weight.data, rtn.dequantize())
    assert gptq_err < 0.8 * rtn_err
    if static_groups or scheme.group_size == -1:
        assert qw.has_trivial_g_idx
    # Codes, scales and g_idx are self-consistent: every column's group has its scale.
    assert qw.g_idx.max() < qw.scales.shape[1]


def test_act_order_without_static_groups_permutes_groups():
    torch.manual_seed(1)
    w = torch.randn(32, 128)
    x = correlated_inputs(k=128)
    acc = HessianAccumulator(128)
    acc.add(x)
    qw = gptq_quantize_weight(w, acc.hessian, QuantScheme(4, 32), act_order=True, static_groups=False)
    assert not qw.has_trivial_g_idx
    assert torch.bincount(qw.g_idx.long()).tolist() == [32, 32, 32, 32]


def test_mask_keeps_pruned_weights_exactly_zero():
    torch.manual_seed(2)
    w = torch.randn(32, 64)
    mask = torch.zeros_like(w, dtype=torch.bool)
    mask.view(32, 16, 4)[:, :, :2] = True  # 2:4 pattern
    w[mask] = 0
    x = correlated_inputs(k=64)
    acc = HessianAccumulator(64)
    acc.add(x)
    qw = gptq_quantize_weight(w, acc.hessian, QuantScheme(4, 16, True), mask=mask)
    assert (qw.dequantize()[mask] == 0).all()

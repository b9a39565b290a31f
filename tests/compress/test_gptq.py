import pytest
import torch

from llmopt.core.contract import QuantScheme
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.compress.gptq import gptq_quantize_weight
from llmopt.compress.hessian import HessianAccumulator


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


def test_wide_hessians_accumulate_the_upper_triangle_and_mirror_it():
    """From HessianAccumulator.SYMMETRIC_FROM on, only the row blocks' upper trapezoids are accumulated: H
    read between batches and at the end is still the whole symmetric 2/n X^T X (K not divisible by the blocks)."""
    k = HessianAccumulator.SYMMETRIC_FROM + 77
    x = torch.randn(400, k)
    acc = HessianAccumulator(k)
    acc.add(x[:150])
    torch.testing.assert_close(acc.hessian, 2 / 150 * x[:150].t() @ x[:150], rtol=1e-5, atol=1e-5)
    acc.add(x[150:])
    expected = 2 / 400 * x.t() @ x
    torch.testing.assert_close(acc.hessian, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(acc.hessian, acc.hessian.t())


def test_bf16_inputs_accumulate_as_exactly_as_fp32():
    """bf16 calibration inputs take the bf16 matmul units with fp32 accumulation: batch by batch, H agrees
    with a float64 computation to fp32 rounding, the GPTAQ cross term to bf16 precision, and the global
    setting is restored."""
    torch.manual_seed(0)
    x = (torch.randn(3000, 96) * 3).bfloat16()
    x_ref = (x.float() + 0.05 * torch.randn(3000, 96)).bfloat16()
    acc = HessianAccumulator(96)
    for rows in (slice(0, 1000), slice(1000, 1800), slice(1800, 3000)):
        acc.add(x[rows], reference=x_ref[rows])
    x64, ref64 = x.double(), x_ref.double()
    torch.testing.assert_close(acc.hessian.double(), 2 / 3000 * x64.t() @ x64, rtol=1e-5, atol=1e-4)
    # The cross term takes the bf16 GEMM (a correction: bf16 rounding of the drift and of each product).
    expected_cross = 2 / 3000 * (ref64 - x64).t() @ x64
    assert (acc.cross.double() - expected_cross).norm() <= 5e-3 * expected_cross.norm()
    assert torch.backends.mkldnn.matmul.fp32_precision == "none"


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


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("nm", [(2, 4), (4, 8)])
def test_sparsegpt_then_gptq_gives_the_pattern_and_beats_magnitude_then_gptq(act_order, nm):
    from llmopt.compress.sparsegpt import sparsegpt_prune_weight
    from llmopt.compress.masks import nm_mask
    from tests.compress.nm import check_nm

    torch.manual_seed(3)
    w = torch.randn(64, 128)
    x = correlated_inputs()
    acc = HessianAccumulator(128)
    acc.add(x)
    scheme = QuantScheme(4, 32, True)
    # what the SparseGPT and GPTQ modifiers do to a linear in one pass: prune from the Hessian, then quantize
    # from the same Hessian, keeping the pruned weights at zero
    pruned, pruned_mask = sparsegpt_prune_weight(w, acc.hessian, nm=nm)
    both = gptq_quantize_weight(pruned, acc.hessian, scheme, act_order=act_order, mask=pruned_mask)
    dq = both.dequantize()
    assert check_nm(dq, *nm)
    assert (both.q[dq == 0].long() == 2 ** (scheme.bits - 1)).all()  # pruned weights hold the zero point's code
    assert (dq == 0).float().mean() >= 1 - nm[0] / nm[1]
    # Against pruning by magnitude, then GPTQ keeping that mask: SparseGPT's Hessian-aware mask and
    # reconstruction must give a clearly lower layer-output error.
    mask = nm_mask(w.abs(), *nm)
    two_step = gptq_quantize_weight(w.masked_fill(mask, 0), acc.hessian, scheme, act_order=act_order, mask=mask)
    assert output_error(x, w, dq) < 0.9 * output_error(x, w, two_step.dequantize())


def test_keeping_a_mask_needs_sym():
    from llmopt.core.errors import LLMOptError

    acc = HessianAccumulator(32)
    acc.add(correlated_inputs(k=32))
    with pytest.raises(LLMOptError, match="sym"):
        gptq_quantize_weight(torch.randn(8, 32), acc.hessian, QuantScheme(4, 16, False),
                             mask=torch.zeros(8, 32, dtype=torch.bool))


@pytest.mark.parametrize("act_order", [False, True])
def test_gptaq_matches_the_full_precision_outputs_better_than_gptq(act_order):
    """Inputs that drifted linearly from the full-precision model's (x_ref = x @ D): GPTQ fits W to the drifted
    inputs' own outputs; GPTAQ's correction moves W toward the full-precision outputs x_ref @ W^T."""
    torch.manual_seed(4)
    x = correlated_inputs()
    x_ref = x @ (torch.eye(128) + 0.05 * torch.randn(128, 128))
    w = torch.randn(64, 128)
    acc = HessianAccumulator(128)
    acc.add(x, reference=x_ref)
    scheme = QuantScheme(4, 32, True)
    plain = gptq_quantize_weight(w, acc.hessian, scheme, act_order=act_order)
    gptaq = gptq_quantize_weight(w, acc.hessian, scheme, act_order=act_order, cross=acc.cross)
    target = x_ref @ w.t()

    def error(qw):
        return ((x @ qw.dequantize().t() - target) ** 2).mean().item()

    assert error(gptaq) < 0.85 * error(plain)
    torch.testing.assert_close(acc.cross, 2 / 2048 * (x_ref - x).t() @ x, rtol=1e-4, atol=1e-4)



@pytest.mark.parametrize("act_order", [False, True])
def test_stacked_rows_quantize_as_they_would_alone(act_order):
    """GPTQQuantizer stacks linears that share a Hessian (q/k/v, gate/up): rows are independent given H, so
    each part of the stacked result equals quantizing that weight on its own (with the GPTAQ term too)."""
    from llmopt.compress.gptq import rows_of

    torch.manual_seed(5)
    x = correlated_inputs(k=64)
    acc = HessianAccumulator(64)
    acc.add(x, reference=x + 0.05 * torch.randn_like(x))
    scheme = QuantScheme(4, 16, True)
    w1, w2 = torch.randn(24, 64), torch.randn(8, 64)
    options = dict(act_order=act_order, mse=True, damp=0.1, cross=acc.cross)
    stacked = gptq_quantize_weight(torch.cat([w1, w2]), acc.hessian, scheme, **options)
    for w, rows in ((w1, slice(0, 24)), (w2, slice(24, 32))):
        alone = gptq_quantize_weight(w, acc.hessian, scheme, **options)
        part = rows_of(stacked, rows, None)
        assert torch.equal(part.q, alone.q) and torch.equal(part.g_idx, alone.g_idx)
        torch.testing.assert_close(part.scales, alone.scales)

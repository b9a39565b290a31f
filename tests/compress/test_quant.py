import pytest
import torch

from llmopt.core.contract import QuantScheme
from llmopt.core.contract.int_grid import fake_quantize
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.core.contract.int_grid import compute_qparams, mse_qparams
from llmopt.core.errors import ConfigError


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group_size", [-1, 16])
def test_rtn_codes_in_range_and_error_within_half_a_step(bits, sym, group_size):
    w = torch.randn(24, 48)
    qw = quantize_rtn(w, QuantScheme(bits, group_size, sym))
    assert qw.q.dtype == torch.uint8 and int(qw.q.max()) <= 2**bits - 1
    assert qw.scales.shape == (24, 1 if group_size == -1 else 3)
    if sym:
        assert (qw.zeros == 2 ** (bits - 1)).all()
    step = qw.scales[:, qw.g_idx.long()]
    err = (qw.dequantize() - w).abs()
    # Half a step inside the range; a step at its ends (sym has one code fewer on the positive side,
    # asym keeps z >= 1 for GPTQ v1).
    assert (err <= step + 1e-6).all()
    assert err.mean() <= 0.3 * step.mean()


def test_symmetric_keeps_zero_exact_and_asym_zero_is_at_least_one():
    w = torch.randn(8, 32)
    w[:, :5] = 0
    assert (quantize_rtn(w, QuantScheme(4, 16, True)).dequantize()[:, :5] == 0).all()
    positive = torch.rand(4, 16) + 0.1
    _, zero = compute_qparams(positive, QuantScheme(4, 16, False))
    assert (zero >= 1).all()


def test_mse_search_never_worse_than_minmax():
    w = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    w[0, 0] = 12.0  # an outlier stretches the min/max range
    scheme = QuantScheme(4, 64, True)
    s0, z0 = compute_qparams(w, scheme)
    s1, z1 = mse_qparams(w, scheme)
    def err(s, z):  # in the norm the search minimises (|.|^2.4, GPTQ's), where min/max is one of its candidates
        q = torch.clamp(torch.round(w / s[:, None]) + z[:, None], 0, 15)
        return (s[:, None] * (q - z[:, None]) - w).abs().pow(2.4).sum(1)
    assert (err(s1, z1) <= err(s0, z0) + 1e-6).all()
    assert err(s1, z1).sum() < err(s0, z0).sum()


def test_bad_schemes_are_clear_errors():
    with pytest.raises(ConfigError, match="does not divide .*576"):
        QuantScheme(4, 128).check(576, "model.layers.0.mlp.up_proj")
    with pytest.raises(ConfigError, match="--bits 5"):
        QuantScheme(5, 64).check(128)


@pytest.mark.parametrize("scheme", [QuantScheme(4, 16, True), QuantScheme(3, 16, False), QuantScheme(2, -1, True)])
def test_mse_qparams_picks_the_ratio_a_direct_search_picks(scheme):

    w = torch.randn(40000, 16) * torch.rand(40000, 1)  # more rows than one chunk of the in-place search
    scale, zero = mse_qparams(w, scheme)
    # The search written directly: every ratio's error, then the first minimum per row.
    ratios = [1 - i / 40 for i in range(int(0.6 * 40) + 1)]
    errors, params = [], []
    for ratio in ratios:
        s, z = compute_qparams(w, scheme, ratio)
        errors.append((fake_quantize(w, s[:, None], z[:, None], scheme.maxq) - w).abs().pow(2.4).sum(1))
        params.append((s, z))
    best = torch.stack(errors).argmin(0)
    rows = torch.arange(w.shape[0])
    torch.testing.assert_close(scale, torch.stack([p[0] for p in params])[best, rows])
    torch.testing.assert_close(zero, torch.stack([p[1] for p in params])[best, rows])

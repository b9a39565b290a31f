import copy

import pytest
import torch

from llmopt.compress.hessian import HessianAccumulator
from llmopt.compress.masks import nm_mask, unstructured_mask
from tests.compress.nm import check_nm
from llmopt.compress.sparsegpt import sparsegpt_prune_weight
from llmopt.compress.wanda import wanda_scores
from tests.compress.test_gptq import correlated_inputs


@pytest.mark.parametrize("n,m", [(2, 4), (4, 8), (1, 4)])
def test_nm_mask_exact_pattern(n, m):
    scores = torch.rand(16, 64)
    mask = nm_mask(scores, n, m)
    w = torch.randn(16, 64).masked_fill(mask, 0)
    assert check_nm(w, n, m)
    assert mask.float().mean().item() == pytest.approx(1 - n / m)
    # the kept ones are the largest in each group
    grouped_scores, grouped_mask = scores.view(16, -1, m), mask.view(16, -1, m)
    kept_min = grouped_scores.masked_fill(grouped_mask, float("inf")).amin(-1)
    pruned_max = grouped_scores.masked_fill(~grouped_mask, float("-inf")).amax(-1)
    assert (kept_min >= pruned_max).all()


@pytest.mark.parametrize("per_row", [True, False])
def test_unstructured_mask_hits_the_target_within_a_tenth_of_a_percent(per_row):
    scores = torch.rand(96, 200)
    mask = unstructured_mask(scores, 0.5, per_row=per_row)
    assert abs(mask.float().mean().item() - 0.5) < 0.001
    if per_row:
        assert (mask.sum(1) == 100).all()


def test_wanda_scores_weight_by_input_norm():
    w = torch.ones(2, 3)
    s = wanda_scores(w, torch.tensor([1.0, 4.0, 9.0]))
    assert s.tolist() == [[1.0, 2.0, 3.0]] * 2


@pytest.mark.parametrize("target", [dict(sparsity=0.5), dict(nm=(2, 4)), dict(nm=(4, 8))])
def test_sparsegpt_beats_magnitude_on_layer_output_error(target):
    torch.manual_seed(0)
    w = torch.randn(64, 128)
    x = correlated_inputs(k=128)
    acc = HessianAccumulator(128)
    acc.add(x)
    pruned, mask = sparsegpt_prune_weight(w, acc.hessian, **target)
    assert (pruned[mask] == 0).all()
    if "nm" in target:
        assert check_nm(pruned, *target["nm"])
    else:
        assert abs(mask.float().mean().item() - 0.5) < 0.001
    magnitude_mask = nm_mask(w.abs(), *target["nm"]) if "nm" in target else unstructured_mask(w.abs(), 0.5)
    err = lambda w_hat: ((x @ w.t() - x @ w_hat.t()) ** 2).mean()  # noqa: E731
    assert err(pruned) < 0.8 * err(w.masked_fill(magnitude_mask, 0))


def test_sparse_model_then_gptq_keeps_the_mask(tmp_path):
    from llmopt.compress.api import make_config, quantize_model
    from llmopt.core.tiny import build_tiny_model
    from llmopt.compress.api import make_sparsity_config, sparsify_model

    model, tok = build_tiny_model("llama", seed=0)
    masks, _ = sparsify_model(model, tok, make_sparsity_config(method="sparsegpt", pattern="2:4", calib="pystdlib",
                                                               num_samples=4, seqlen=32))
    model.config.sparsity_config = {"sparsity_structure": "2:4"}
    result = quantize_model(model, tok, make_config("gptq", bits=4, group_size=32, calib="pystdlib",
                                                    num_samples=4, seqlen=32))
    for name, mask in masks.items():
        dq = result.qweights[name].dequantize()
        assert (dq[mask] == 0).all(), name
        assert check_nm(dq, 2, 4)


def test_calibrated_pruning_beats_magnitude_on_a_tiny_model():
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.core.tiny import build_tiny_model
    from llmopt.compress.api import make_sparsity_config, sparsify_model

    base, tok = build_tiny_model("llama", seed=0)
    ids = tokenize_corpus(tok, "pystdlib", 2048).view(-1, 128)

    def hidden(model):
        with torch.no_grad():
            return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]

    reference, errors = hidden(base), {}
    for method in ("magnitude", "wanda", "sparsegpt"):
        model = copy.deepcopy(base)
        sparsify_model(model, tok, make_sparsity_config(method=method, pattern="2:4", calib="pystdlib",
                                                        num_samples=16, seqlen=128))
        errors[method] = (hidden(model) - reference).pow(2).mean().item()
    assert errors["sparsegpt"] < errors["magnitude"], errors

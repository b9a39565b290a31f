import copy

import torch

from llmopt.core.contract import QuantScheme
from llmopt.core.contract.rounding import quantize_rtn
from llmopt.compress.awq import apply_scales, clip_weight, search_clip, search_scales


def outlier_inputs(num_tokens=1024, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, k, generator=g)
    x[:, :4] *= 25  # a few channels with large activations, as in real LLMs
    return x


def test_scale_search_beats_rtn_on_outlier_channels():
    torch.manual_seed(0)
    w = torch.randn(96, 64) * 0.05
    x = outlier_inputs()
    scheme = QuantScheme(4, 32, True)
    scales, ratio = search_scales(x, x.abs().mean(0), [w], scheme)
    assert ratio is not None and ratio > 0
    w_awq = quantize_rtn(w * scales, scheme).dequantize() / scales
    w_rtn = quantize_rtn(w, scheme).dequantize()
    def err(w_hat):
        return ((x @ w.t() - x @ w_hat.t()) ** 2).mean()
    assert err(w_awq) < 0.7 * err(w_rtn)


def test_scaling_a_norm_and_its_linears_keeps_the_function():
    norm = torch.nn.LayerNorm(32)
    torch.nn.init.normal_(norm.weight)
    torch.nn.init.normal_(norm.bias)
    q, k = torch.nn.Linear(32, 16), torch.nn.Linear(32, 8)
    x = torch.randn(10, 32)
    before = [q(norm(x)), k(norm(x))]
    apply_scales(norm, [q, k], torch.rand(32) + 0.5)
    torch.testing.assert_close([q(norm(x)), k(norm(x))], before, rtol=1e-5, atol=1e-5)
    up, down = torch.nn.Linear(32, 48, bias=True), torch.nn.Linear(48, 32)
    before = down(up(x))
    apply_scales(up, [down], torch.rand(48) + 0.5)
    torch.testing.assert_close(down(up(x)), before, rtol=1e-5, atol=1e-5)


def test_clip_search_never_hurts_and_clip_weight_applies_it():
    torch.manual_seed(1)
    w = torch.randn(16, 64)
    w[:, 3] = 8.0  # an outlier weight per row stretches every group-0 range
    x = torch.randn(512, 64)
    scheme = QuantScheme(4, 32, False)
    ratios = search_clip(x, w, scheme)
    assert ratios.shape == (16, 2) and (ratios <= 1).all() and (ratios >= 0.5).all()
    clipped = clip_weight(w.clone(), ratios, scheme)
    def err(w_hat):
        return ((x @ w.t() - x @ w_hat.t()) ** 2).mean()
    assert err(quantize_rtn(clipped, scheme).dequantize()) <= err(quantize_rtn(w, scheme).dequantize()) + 1e-6
    assert (clipped.abs() <= w.abs() + 1e-6).all()


def test_gptq_and_awq_beat_rtn_on_a_tiny_models_layer_outputs():
    """Output error of the last decoder layer on held-out text, quantized model vs full precision."""
    from llmopt.compress.api import make_config, quantize_model
    from llmopt.core.datasets import tokenize_corpus
    from llmopt.core.tiny import build_tiny_model

    base, tok = build_tiny_model("llama", seed=0, num_hidden_layers=2)
    ids = tokenize_corpus(tok, "pystdlib", 4096).view(-1, 128)[:16]

    def hidden(model):
        with torch.no_grad():
            return model(input_ids=ids, output_hidden_states=True).hidden_states[-1]

    reference = hidden(base)
    errors = {}
    for method in ("rtn", "gptq", "awq"):
        model = copy.deepcopy(base)
        quantize_model(model, tok, make_config(method, bits=3, group_size=32, calib="pystdlib", num_samples=16,
                                               seqlen=128))
        errors[method] = (hidden(model) - reference).pow(2).mean().item()
    assert errors["gptq"] < errors["rtn"] and errors["awq"] < errors["rtn"], errors

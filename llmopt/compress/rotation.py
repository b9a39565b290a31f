"""Rotations folded into the weights (QuaRot, Ashkboos et al. 2024; SpinQuant's R1 and R2, Liu et al. 2024, here
random orthogonal rather than learned): the residual stream is multiplied by an orthogonal Q1 [d, d] (R1) and
each attention head's values by an orthogonal Q2 [head_dim, head_dim] (R2). In full precision the rotated model
computes the same function (up to float rounding); its weights and activations have their few large channels
spread over all of them, and its weights lie on no grid an earlier quantization left.

How it stays exact. Every RMSNorm's scale g is first folded into the linears it feeds (W[:, k] *= g[k], g := 1):
an RMSNorm without scale commutes with an orthogonal Q because ||x Q|| = ||x||. Then, with the residual r' = r Q1:
the embedding E [V, d] -> E Q1; a linear reading a norm's output (q/k/v, gate/up, the head) W [N, d] -> W Q1 (so
x' W'^T = x W^T); a linear writing to the residual (o_proj, down_proj) W [d, M] -> Q1^T W, its bias b -> b Q1.
R2: the value projection's rows of head h, W_v[h] [head_dim, d] -> Q2^T W_v[h] (b_v[h] -> b_v[h] Q2); attention
mixes values linearly per head, so o_proj's columns of that head W_o[:, h] [d, head_dim] -> W_o[:, h] Q2 undo it.
A tied lm_head is untied (it now carries the final norm's scale, which the embedding must not).
"""

from __future__ import annotations

import torch
from torch import nn

from llmopt.core.adapters import adapter_for, attention_geometry, decoder_layers, get_module
from llmopt.core.errors import ConfigError

VALUE_GROUP = ("self_attn.v_proj", ("self_attn.o_proj",))  # the adapters' marker: v's heads map 1:1 onto o's


def random_orthogonal(n: int, seed: int) -> torch.Tensor:
    """A Haar-random orthogonal matrix [n, n] in float64: QR of a Gaussian, R's diagonal signs moved into Q."""
    generator = torch.Generator().manual_seed(seed)
    q, r = torch.linalg.qr(torch.randn(n, n, generator=generator, dtype=torch.float64))
    return q * torch.sign(torch.diagonal(r))


def _set(param: nn.Parameter, value: torch.Tensor) -> None:
    param.data = value.to(param.dtype).contiguous()


def fold_norm(norm: nn.Module, linears: list[nn.Linear]) -> None:
    """W[:, k] *= g[k] for each linear fed by `norm` (W [N, K], g [K]); then g := 1."""
    if getattr(norm, "bias", None) is not None:
        raise ConfigError(f"{type(norm).__name__} has a bias: rotation needs RMSNorm-style norms (scale only)")
    g = norm.weight.data.double()
    for linear in linears:
        _set(linear.weight, linear.weight.data.double() * g)
    norm.weight.data.fill_(1)


def rotate_inputs(linear: nn.Linear, q: torch.Tensor) -> None:
    """A linear reading the rotated residual: W [N, d] -> W Q."""
    _set(linear.weight, linear.weight.data.double() @ q)


def rotate_outputs(linear: nn.Linear, q: torch.Tensor) -> None:
    """A linear writing to the rotated residual: W [d, M] -> Q^T W, b [d] -> b Q."""
    _set(linear.weight, q.t() @ linear.weight.data.double())
    if linear.bias is not None:
        _set(linear.bias, linear.bias.data.double() @ q)


def rotate_head_outputs(linear: nn.Linear, q: torch.Tensor) -> None:
    """The value projection, per head: W [heads * hd, K] -> rows of head h Q^T W[h]; b[h] -> b[h] Q."""
    hd = q.shape[0]
    w = linear.weight.data.double().reshape(-1, hd, linear.in_features)  # [heads, hd, K]
    _set(linear.weight, torch.einsum("ji,hjk->hik", q, w).reshape(-1, linear.in_features))
    if linear.bias is not None:
        _set(linear.bias, (linear.bias.data.double().reshape(-1, hd) @ q).reshape(-1))


def rotate_head_inputs(linear: nn.Linear, q: torch.Tensor) -> None:
    """The output projection, per head: W [N, heads * hd] -> columns of head h W[:, h] Q."""
    hd = q.shape[0]
    w = linear.weight.data.double().reshape(linear.out_features, -1, hd)  # [N, heads, hd]
    _set(linear.weight, (w @ q).reshape(linear.out_features, -1))


def untie_head(model: nn.Module) -> None:
    """Give the lm_head its own weight (a copy of the embedding's) and record it in the config."""
    adapter = adapter_for(model)
    head, embed = get_module(model, adapter.lm_head), get_module(model, adapter.embed)
    if head.weight.data_ptr() == embed.weight.data_ptr():
        head.weight = nn.Parameter(embed.weight.data.clone(), requires_grad=False)
    model.config.tie_word_embeddings = False


def check_rotatable(model: nn.Module, rotations: list[str]) -> None:
    """Fail before any work where a rotation cannot be folded into this family's weights."""
    adapter = adapter_for(model)
    if "R2" in rotations and VALUE_GROUP not in adapter.smooth_groups:
        raise ConfigError(f"--rotate R2 needs separate v_proj and o_proj with one value head per o_proj column "
                          f"block, which {adapter.family} models do not have: rotate R1 only")


def rotate_model(model: nn.Module, rotations: list[str], seed: int) -> dict:
    """Fold the `rotations` ("R1", "R2") into `model`'s weights in place; returns the facts to record."""
    check_rotatable(model, rotations)
    adapter = adapter_for(model)
    hidden = model.config.hidden_size
    q1 = random_orthogonal(hidden, seed) if "R1" in rotations else None
    q2 = random_orthogonal(attention_geometry(model.config).head_dim, seed + 1) if "R2" in rotations else None
    if q1 is not None:
        untie_head(model)
        fold_norm(get_module(model, adapter.final_norm), [get_module(model, adapter.lm_head)])
        rotate_inputs(get_module(model, adapter.lm_head), q1)
        embed = get_module(model, adapter.embed)
        _set(embed.weight, embed.weight.data.double() @ q1)
    for layer in decoder_layers(model):
        if q1 is not None:
            _rotate_residual(layer, adapter, q1)
        if q2 is not None:
            rotate_head_outputs(get_module(layer, VALUE_GROUP[0]), q2)
            rotate_head_inputs(get_module(layer, VALUE_GROUP[1][0]), q2)
    return {"rotations": list(rotations), "rotation_seed": seed}


def _rotate_residual(layer: nn.Module, adapter, q: torch.Tensor) -> None:
    """One decoder layer under R1: the norms folded into their readers, the readers and writers rotated."""
    for norm_name in (adapter.input_norm, adapter.post_attention_norm):
        readers = [get_module(layer, name) for name in _readers(adapter, norm_name)]
        fold_norm(get_module(layer, norm_name), readers)
        for linear in readers:
            rotate_inputs(linear, q)
    for name in adapter.residual_writers:
        rotate_outputs(get_module(layer, name), q)


def _readers(adapter, norm_name: str) -> tuple[str, ...]:
    return next(group for source, group in adapter.smooth_groups if source == norm_name)

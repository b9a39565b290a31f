"""Dynamic quantization of a linear's input activations (int8, or FP8 E4M3), as the checkpoint's `input_activations`
scheme says: the reference every kernel is tested against, and what a dequantized (reference) model applies to stay
equal to compressed-tensors' fake quantization. Symmetric int8: scale = amax / 127.5 over the scale's span (a
token's row for strategy token, a group of columns for strategy group), codes round-half-even(x / scale) clamped to
[-128, 127] — compressed-tensors' formula (bit range 255, halved)."""

from __future__ import annotations

import torch

from llmopt.core.contract.fp4 import fake_quantize_nvfp4
from llmopt.core.contract.scheme import QuantScheme
from llmopt.core.errors import ConfigError


def exact_quotient(values: torch.Tensor, divisor: float) -> torch.Tensor:
    """values / divisor, correctly rounded on every device. CUDA's torch multiplies by a Python number's reciprocal
    instead of dividing (one rounding more): a scale an ulp off, and round(x / scale) of a token's largest value,
    at +-127.5 exactly, can land on the other code (-128 against -127) than the CPU's reference gives."""
    return values / torch.full_like(values, divisor)


def _spans(x: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """x [..., K] viewed as [..., S, W]: each span of W columns shares one scale."""
    k = x.shape[-1]
    if scheme.strategy == "token":
        return x.unsqueeze(-2)
    if scheme.strategy == "group" and k % scheme.group_size == 0:
        return x.reshape(*x.shape[:-1], k // scheme.group_size, scheme.group_size)
    raise ConfigError(f"input activations with strategy {scheme.strategy} (group {scheme.group_size}) on "
                      f"{k} columns are not supported: use per-token or a group size dividing {k}")


def quantize_activations(x: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes int8 [..., S, W], scales float32 [..., S, 1]) of x [..., K] under a symmetric dynamic int scheme."""
    if scheme.type != "int" or scheme.bits != 8 or not scheme.sym or not scheme.dynamic:
        raise ConfigError(f"input activations {scheme}: only dynamic symmetric int8 is supported here")
    spans = _spans(x.float(), scheme)
    scale = exact_quotient(spans.abs().amax(dim=-1, keepdim=True), 127.5)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(spans / scale).clamp_(-128, 127).to(torch.int8)
    return codes, scale


def quantize_activations_fp8(x: torch.Tensor, scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values [..., S, W], scales float32 [..., S, 1]) of x [..., K]: scale = amax / 448 (compressed-tensors'
    float range, 896, halved), values x / scale clamped to +-448 and rounded to the nearest E4M3 (even on ties)."""
    if scheme.type != "float" or scheme.bits != 8 or not scheme.dynamic:
        raise ConfigError(f"input activations {scheme}: only dynamic FP8 (E4M3) is supported here")
    spans = _spans(x.float(), scheme)
    scale = exact_quotient(spans.abs().amax(dim=-1, keepdim=True), scheme.float_max)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    values = (spans / scale).clamp_(-scheme.float_max, scheme.float_max).to(torch.float8_e4m3fn)
    return values, scale


def fake_quantize_activations(x: torch.Tensor, scheme: QuantScheme,
                              global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] quantized and dequantized in place of the real low-precision product, in x's dtype
    (global_scale: the calibrated one of NVFP4 inputs)."""
    if scheme.scale_format == "e4m3":
        if global_scale is None:
            raise ConfigError("NVFP4 inputs need their calibrated global scale (input_global_scale)")
        return fake_quantize_nvfp4(x, global_scale, scheme.group_size).to(x.dtype)
    quantize = quantize_activations_fp8 if scheme.type == "float" else quantize_activations
    codes, scale = quantize(x, scheme)
    return (codes.float() * scale).reshape(x.shape).to(x.dtype)


class InputQuantizedLinear(torch.nn.Linear):
    """A dequantized linear whose inputs are quantized and dequantized as its checkpoint's input_activations say:
    the reference a W8A8 checkpoint computes (equal to compressed-tensors' fake quantization), for readers and
    devices without an integer kernel."""

    @classmethod
    def of(cls, qweight, dtype: torch.dtype, device: torch.device | str = "cpu") -> InputQuantizedLinear:
        n, k = qweight.shape
        with torch.device("meta"):
            module = cls(k, n, bias=qweight.bias is not None)
        module.weight = torch.nn.Parameter(qweight.dequantize(dtype).to(device), requires_grad=False)
        if qweight.bias is not None:
            module.bias = torch.nn.Parameter(qweight.bias.to(dtype).to(device), requires_grad=False)
        module.input_scheme = qweight.input_activations
        module.input_global_scale = qweight.input_global_scale
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(fake_quantize_activations(x, self.input_scheme, self.input_global_scale))

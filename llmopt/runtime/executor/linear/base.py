"""The runtime's linear methods: one way each to compute y = x W^T + b for a weight of some scheme on some device,
in a registry walked at import (every module of this package registers its methods).

A method is an nn.Module class with
- `weight_type`: the kind of weight it holds (the contract's QuantizedWeight unless it says otherwise: a compressed
  sparse weight, core.contract.sparse24); only methods of the weight's kind are asked;
- `accepts(qweight, scheme, device)`: whether it can hold this weight (shape, bits, groups, kernel present) with
  these input activations (`LinearScheme.input_activations`);
- its constructor, `Method(qweight, dtype, device)`: packs the contract's QuantizedWeight once, at load (vLLM's
  create_weights + process_weights_after_loading);
- `_matmul(x2d)`: the product for [T, in] inputs (vLLM's apply), the kernel chosen inside;
- `can_stack` / `stack(parts)`: one module for several linears fed the same input (q/k/v, gate/up);
- `shard_weight(qweight, dim, rank, world)`: a rank's share of the weight along "in" or "out" features, from which
  that rank's method is built (tensor parallelism).
`select_linear_method` takes the highest `priority` among the methods that accept; the dense method (priority
lowest) accepts everything, so a weight no kernel can hold still runs, dequantized once.
"""

from __future__ import annotations

import threading
from typing import ClassVar

import torch
from torch import nn

from llmopt.core.contract import LinearScheme, QuantizedWeight
from llmopt.core.registry import Registry

LINEAR_METHODS: Registry[type] = Registry("linear method")
FALLBACK_PRIORITY = -1  # the dense method's: it accepts every weight


def register_linear_method(cls: type) -> type:
    """Class decorator: add a LinearMethod to the registry under its `name`."""
    return LINEAR_METHODS.register(cls.name)(cls)


class LinearMethod(nn.Module):
    name: ClassVar[str] = "base"
    priority: ClassVar[int] = 0
    weight_type: ClassVar[type] = QuantizedWeight

    def __init__(self, qweight: QuantizedWeight, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.dtype = dtype
        self.bias = (None if qweight.bias is None
                     else nn.Parameter(qweight.bias.to(device=device, dtype=dtype), requires_grad=False))

    @classmethod
    def accepts(cls, qweight: QuantizedWeight, scheme: LinearScheme, device: torch.device) -> bool:
        raise NotImplementedError

    @classmethod
    def create(cls, qweight: QuantizedWeight, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
        """The module for this weight: the method itself, packed (a method may build another module instead)."""
        return cls(qweight, dtype, device)

    @staticmethod
    def shard_weight(qweight: QuantizedWeight, dim: str, rank: int, world: int) -> QuantizedWeight:
        """This rank's slice of the weight ("out": rows; "in": whole groups of columns); methods whose packing
        needs other boundaries narrow it."""
        return qweight.shard(dim, rank, world)

    @staticmethod
    def can_stack(parts: list[nn.Module]) -> bool:
        return False

    def _matmul(self, x2d: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d = x if x.dim() == 2 else x.reshape(-1, self.in_features)
        # (dtype casts only when needed: at batch-1 decode each no-op call still costs a few us, x 120 per step)
        y = self._matmul(x2d if x2d.dtype == self.dtype else x2d.to(self.dtype))
        if self.bias is not None:
            y = y + self.bias
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, method={self.name}"


def triton_on(device: torch.device) -> bool:
    """Whether the Triton methods can run on `device`: CUDA, with triton installed."""
    from llmopt.runtime.executor.kernels.triton_support import triton_available

    return device.type == "cuda" and triton_available()


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` has FP8 (E4M3) arithmetic: an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper).
    Triton compiles no float8e4nv type for an A100 (8.0), so FP8 kernels must not be chosen there."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def select_linear_method(qweight: QuantizedWeight, scheme: LinearScheme, device: torch.device | str) -> type:
    """The registered method of highest priority that accepts this weight on this device."""
    device = torch.device(device)
    ranked = sorted((LINEAR_METHODS.get(name) for name in LINEAR_METHODS), key=lambda m: -m.priority)
    return next(method for method in ranked
                if isinstance(qweight, method.weight_type) and method.accepts(qweight, scheme, device))


def make_linear(qweight: QuantizedWeight, dtype: torch.dtype, device: torch.device | str = "cpu",
                input_activations=None) -> nn.Module:
    """The runtime's module for one quantized linear of an artifact: the chosen method, built (packed) once.
    input_activations: the scheme of its inputs the engine asks for (None: the compute dtype;
    core.contract.INT8_GROUP_ACTIVATIONS: 8-bit dynamic per group); a checkpoint that states its own (W8A8:
    qweight.input_activations) is computed as it says."""
    if qweight.input_activations is not None:
        input_activations = qweight.input_activations
    scheme = LinearScheme(getattr(qweight, "scheme", None), input_activations)
    method = select_linear_method(qweight, scheme, device)
    if input_activations is not None and method.priority == FALLBACK_PRIORITY and qweight.input_activations is None:
        # quantized inputs are a request: a weight no kernel runs with them keeps inputs in the compute dtype
        method = select_linear_method(qweight, LinearScheme(getattr(qweight, "scheme", None)), device)
    return method.create(qweight, dtype, device)


def stacked_bias(parts: list[nn.Module], dtype: torch.dtype) -> nn.Parameter | None:
    """The biases of stacked parts, concatenated (zeros for parts without one); None when none has one."""
    if all(p.bias is None for p in parts):
        return None
    device = next(p.bias.device for p in parts if p.bias is not None)
    bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features, dtype=dtype, device=device)
                      for p in parts])
    return nn.Parameter(bias, requires_grad=False)


def new_stacked(cls: type, first: LinearMethod, out_features: int, parts: list[nn.Module]) -> LinearMethod:
    """An empty module of `cls` for stacking `parts` (buffers registered by the caller)."""
    fused = cls.__new__(cls)
    nn.Module.__init__(fused)
    fused.in_features, fused.out_features, fused.dtype = first.in_features, out_features, first.dtype
    fused.bias = stacked_bias(parts, first.dtype)
    return fused


_buffers = threading.local()


def dequantize_buffer(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A per-thread scratch buffer for one dequantized weight at a time (the GEMM reading it finishes before
    the next layer dequantizes): no allocation, and no page faults on fresh memory, per call."""
    buf = getattr(_buffers, "dequantized", None)
    # (one made under inference_mode, as the engine's timing of the paths runs, cannot be written outside it)
    stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
    if buf is None or stale or buf.numel() < numel or buf.dtype != dtype:
        buf = _buffers.dequantized = torch.empty(numel, dtype=dtype)
    return buf[:numel]

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
`select_linear_method` asks the methods of the weight's kind, for the device's type (`device_type`) and whose kernels
exist here (`available()`), whether they accept, and chooses among those by explicit rules, in order:
0. a method that another accepting one `overrides` (by name: a plug-in taking over a built-in method's weights)
   is out;
1. not the fallback: the dense method (`fallback`) accepts every weight and runs one no kernel can hold,
   dequantized once; it is chosen only where nothing else accepts;
2. a kernel of its own (`compiled`) over torch ops;
3. the one that uses more of what the weight and the scheme state: quantized input activations
   (`quantized_inputs`), the pruned zeros skipped (`skips_pruned`);
4. the first by name.
"""

from __future__ import annotations

import threading
from typing import ClassVar, Optional

import torch
from torch import nn

from llmopt.core.contract import LinearScheme, QuantizedWeight
from llmopt.core.registry import Registry

LINEAR_METHODS: Registry[type] = Registry("linear method")


def register_linear_method(cls: type) -> type:
    """Class decorator: add a LinearMethod to the registry under its `name`."""
    return LINEAR_METHODS.register(cls.name)(cls)


class LinearMethod(nn.Module):
    name: ClassVar[str] = "base"
    weight_type: ClassVar[type] = QuantizedWeight
    device_type: ClassVar[Optional[str]] = None  # the one device type it runs on (None: any)
    # what the selection rules read (module docstring)
    fallback: ClassVar[bool] = False
    compiled: ClassVar[bool] = True
    quantized_inputs: ClassVar[bool] = False
    skips_pruned: ClassVar[bool] = False
    overrides: ClassVar[tuple[str, ...]] = ()  # methods this one takes over from where both accept

    @classmethod
    def available(cls) -> bool:
        """Whether its kernels exist in this environment (built, installed)."""
        return True

    @classmethod
    def rank(cls) -> tuple[bool, bool, int]:
        """Its place under the selection rules 1-3 (higher first)."""
        return not cls.fallback, cls.compiled, int(cls.quantized_inputs) + int(cls.skips_pruned)

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


def triton_installed() -> bool:
    """Whether the Triton methods' kernels can run here (triton installed; looked up at each call)."""
    from llmopt.runtime.executor.kernels import triton_support

    return triton_support.triton_available()


def fp8_tensor_cores(device: torch.device) -> bool:
    """Whether `device` has FP8 (E4M3) arithmetic: an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper).
    Triton compiles no float8e4nv type for an A100 (8.0), so FP8 kernels must not be chosen there."""
    return device.type == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability(device) >= (8, 9)


def select_linear_method(qweight: QuantizedWeight, scheme: LinearScheme, device: torch.device | str) -> type:
    """The method the selection rules (module docstring) choose among those that accept this weight here."""
    device = torch.device(device)
    accepting = [method for method in (LINEAR_METHODS.get(name) for name in LINEAR_METHODS)
                 if isinstance(qweight, method.weight_type) and method.device_type in (None, device.type)
                 and method.available() and method.accepts(qweight, scheme, device)]
    overridden = {name for method in accepting for name in method.overrides}
    accepting = [method for method in accepting if method.name not in overridden]
    return max(accepting, key=lambda method: method.rank())  # (the registry lists by name; max keeps the first)


def make_linear(qweight: QuantizedWeight, dtype: torch.dtype, device: torch.device | str = "cpu",
                input_activations=None) -> nn.Module:
    """The runtime's module for one quantized linear of an artifact: the chosen method, built (packed) once.
    input_activations: the scheme of its inputs the engine asks for (None: the compute dtype;
    core.contract.INT8_GROUP_ACTIVATIONS: 8-bit dynamic per group); a checkpoint that states its own (W8A8:
    qweight.input_activations) is computed as it says."""
    if qweight.input_activations is not None:
        input_activations = qweight.input_activations
    scheme = LinearScheme(qweight.scheme, input_activations)
    method = select_linear_method(qweight, scheme, device)
    if input_activations is not None and method.fallback and qweight.input_activations is None:
        # quantized inputs are a request: a weight no kernel runs with them keeps inputs in the compute dtype
        method = select_linear_method(qweight, LinearScheme(qweight.scheme), device)
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

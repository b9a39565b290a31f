"""Load a MODEL for the runtime: quantized linears of an artifact become its packed int4 / int8 layers."""

from __future__ import annotations

from llmopt.export.load import load_model
from llmopt.runtime.executor.layers import quantized_linear


def load_runtime_model(name: str, dtype: str = "float32", device: str = "cpu", trust_remote_code: bool = False):
    """(model, tokenizer, source) as export.load.load_model gives, with the runtime's packed layers; numerics
    then follow those kernels."""
    return load_model(name, dtype=dtype, device=device, trust_remote_code=trust_remote_code,
                      linear_factory=quantized_linear)

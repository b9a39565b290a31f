"""Load any MODEL: an llmopt / GPTQ / AWQ / compressed-tensors artifact through the format readers, anything
else through transformers (core.models). Only safetensors are read; `trust_remote_code` is off unless asked."""

from __future__ import annotations

from typing import Callable

import torch

from llmopt.core.adapters import adapter_for
from llmopt.core.config_checks import check_config
from llmopt.core.contract import QuantizedWeight
from llmopt.core.models import (
    DTYPES, ModelSource, check_tensor_shapes, load_config, load_dense_model, load_tokenizer, resolve_dtype_name,
    resolve_model,
)
from llmopt.formats.read import load_artifact_model

# (quantized weight, dtype, device) -> the module that replaces the linear; the runtime passes its packed layers
LinearFactory = Callable[[QuantizedWeight, torch.dtype, str], torch.nn.Module]


def load_model(
    name_or_source: str | ModelSource,
    dtype: str = "float32",
    device: str = "cpu",
    trust_remote_code: bool = False,
    linear_factory: LinearFactory | None = None,
):
    """Load MODEL as (torch model in eval mode, tokenizer, source).

    linear_factory: builds the module for each quantized linear of an artifact (the runtime's packed int4 /
    int8 layers); without it they are dense linears holding the dequantized weights.

    >>> model, tokenizer, source = load_model("smollm2-135m")  # doctest: +SKIP
    """
    source = name_or_source if isinstance(name_or_source, ModelSource) else resolve_model(name_or_source)
    dtype = resolve_dtype_name(dtype, device)
    config = load_config(source, trust_remote_code)
    adapter_for(config)  # unsupported families fail here, naming the supported ones
    # sizes, and the memory the weights take (dense, or dequantized without a packed linear_factory)
    packed = source.kind == "artifact" and linear_factory is not None
    check_config(config, None if packed else DTYPES[dtype].itemsize, source.name)
    if source.path is not None:
        check_tensor_shapes(config, source.path, source.name)
    if source.kind == "artifact":
        factory = None
        if linear_factory is not None:
            factory = lambda qweight: linear_factory(qweight, DTYPES[dtype], device)  # noqa: E731
        model = load_artifact_model(source.path, dtype=DTYPES[dtype], device=device, linear_factory=factory)
        model.eval()
    else:
        model = load_dense_model(source, dtype, device, trust_remote_code)
    return model, load_tokenizer(source, trust_remote_code), source

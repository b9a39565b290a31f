"""The layer-by-layer calibration pipeline, written once and shared by GPTQ, AWQ, SparseGPT and Wanda.

1. Run the calibration samples up to the first decoder layer and keep its inputs (and the keyword
   arguments the model passes it: position embeddings, masks).
2. For each decoder layer: move it to the compute device; for each of the algorithm's stages (groups of
   linears), hook those linears, run the samples through the layer (stopping as soon as the last hooked
   linear has seen its input), and let the algorithm change the weights; then recompute the layer's
   outputs with the changed weights, so the next layer sees the compressed model's activations.
Only one layer's working set lives on the compute device; activations stay on the CPU in fp32.

The forwards may run under bf16 autocast (`compute_dtype`): 3x faster on CPUs with AMX. The weights stay
fp32 and algorithms accumulate their statistics (Hessians, norms) in fp32.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Callable, Protocol

import torch
from torch import nn

from llmopt.core.adapters import ArchAdapter, adapter_for, get_module


class LayerwiseAlgorithm(Protocol):
    """What an algorithm tells the pipeline; it never runs a loop of its own."""

    def stages(self, adapter: ArchAdapter) -> list[tuple[str, ...]]:
        """Groups of linear paths (relative to the layer), processed in order."""

    def add_batch(self, layer_index: int, name: str, module: nn.Linear, inputs: torch.Tensor) -> None:
        """Inputs [..., in_features] that reached linear `name` during a stage's pass. Linears fed the same
        tensor (q/k/v, gate/up) receive the same object, so an algorithm can share work between them."""

    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        """Change the weights of a stage's linears (quantize, prune, smooth...)."""


class _StopForward(Exception):
    pass


def _autocast(device: torch.device, compute_dtype: torch.dtype):
    if compute_dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


@torch.inference_mode()
def capture_first_layer_inputs(model: nn.Module, calib_ids: torch.Tensor, batch_size: int, device: torch.device):
    """Hidden states [S, T, H] (CPU) entering decoder layer 0, and the per-batch layer kwargs."""
    adapter = adapter_for(model)
    layers = get_module(model, adapter.layers)
    inputs, kwargs_per_batch = [], []

    def grab(module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        inputs.append(hidden.detach().to("cpu", torch.float32))
        kwargs_per_batch.append({k: v for k, v in kwargs.items() if k != "hidden_states"})
        raise _StopForward

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    # Everything before layer 0 (embeddings, rotary) runs on the device; the layers themselves stay put.
    base = get_module(model, adapter.layers.rsplit(".", 1)[0])
    pre_layer_modules = [m for n, m in base.named_children() if m is not layers]
    try:
        for m in pre_layer_modules:
            m.to(device)
        for first in range(0, calib_ids.shape[0], batch_size):
            try:
                model(input_ids=calib_ids[first: first + batch_size].to(device), use_cache=False)
            except _StopForward:
                pass
    finally:
        handle.remove()
        for m in pre_layer_modules:
            m.to("cpu")
    return torch.cat(inputs), kwargs_per_batch


def _layer_output(out) -> torch.Tensor:
    return out[0] if isinstance(out, (tuple, list)) else out


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@torch.inference_mode()
def run_layerwise(
    model: nn.Module,
    calib_ids: torch.Tensor,
    algorithm: LayerwiseAlgorithm,
    device: str | torch.device = "cpu",
    batch_size: int = 8,
    progress: Callable[[int, int], None] | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> dict:
    """Run `algorithm` over every decoder layer of `model` with calibration tokens [S, T].

    Returns timing facts. The model is changed in place and left on the CPU.
    """
    device = torch.device(device)
    adapter = adapter_for(model)
    layers = get_module(model, adapter.layers)
    start = time.perf_counter()
    hidden, kwargs_per_batch = capture_first_layer_inputs(model, calib_ids, batch_size, device)
    batches = [(i, slice(i * batch_size, (i + 1) * batch_size)) for i in range(len(kwargs_per_batch))]
    device_kwargs = [_to(kw, device) for kw in kwargs_per_batch]
    for index, layer in enumerate(layers):
        layer.to(device)
        for names in algorithm.stages(adapter):
            with _autocast(device, compute_dtype):
                _run_stage(layer, index, names, algorithm, hidden, batches, device_kwargs, device)
            algorithm.process(index, layer, names)
        with _autocast(device, compute_dtype):
            for b, rows in batches:  # recompute outputs with the changed weights
                out = _layer_output(layer(hidden[rows].to(device), **device_kwargs[b]))
                hidden[rows] = out.to("cpu", torch.float32)
        layer.to("cpu")
        if progress is not None:
            progress(index + 1, len(layers))
    return {"calibration_wall_s": time.perf_counter() - start, "num_layers": len(layers)}


def _run_stage(layer, index, names, algorithm, hidden, batches, device_kwargs, device) -> None:
    modules = {name: get_module(layer, name) for name in names}
    pending: set[str] = set()

    def make_hook(name):
        def hook(module, args):
            x = args[0]
            algorithm.add_batch(index, name, module, x)
            pending.discard(name)
            if not pending:  # every hooked linear has its input: the rest of the layer is not needed
                raise _StopForward

        return hook

    handles = [m.register_forward_pre_hook(make_hook(n)) for n, m in modules.items()]
    try:
        for b, rows in batches:
            pending.clear()
            pending.update(names)
            try:
                layer(hidden[rows].to(device), **device_kwargs[b])
            except _StopForward:
                pass
    finally:
        for h in handles:
            h.remove()

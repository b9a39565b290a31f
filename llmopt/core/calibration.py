"""The layer-by-layer calibration pipeline, written once and shared by GPTQ, AWQ, SparseGPT and Wanda.

1. Run the calibration samples up to the first decoder layer and keep its inputs (and the keyword
   arguments the model passes it: position embeddings, masks).
2. For each decoder layer: move it to the compute device; for each of the algorithm's stages (groups of
   linears), hook those linears, run the samples through the layer (stopping as soon as the last hooked
   linear has seen its input), and let the algorithm change the weights; then recompute the layer's
   outputs with the changed weights, so the next layer sees the compressed model's activations.
Only one layer's working set lives on the compute device; activations stay on the CPU in fp32.
An algorithm that sets `uses_reference_inputs` (GPTAQ) also gets, for every hooked linear, its input in the
original model: a second stream of hidden states runs through unchanged copies of the layers.

The forwards may run in bf16 (`compute_dtype`; 3x faster on CPUs with AMX): a bf16 copy of the layer runs
the samples, while the algorithms read and change the fp32 layer and accumulate statistics (Hessians,
norms) in fp32; the copy is refreshed from the fp32 layer after every change.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import time
from typing import Callable, Protocol

import torch
from torch import nn

from llmopt.core.adapters import ArchAdapter, adapter_for, get_module, modules_beside_layers, set_module
from llmopt.core.core_share import CoreShare
from llmopt.core.offload import LayerIO, SpilledActivations, keep_activations


class LayerwiseAlgorithm(Protocol):
    """What an algorithm tells the pipeline; it never runs a loop of its own."""

    def stages(self, adapter: ArchAdapter) -> list[tuple[str, ...]]:
        """Groups of linear paths (relative to the layer), processed in order."""

    def add_batch(self, layer_index: int, name: str, module: nn.Linear, inputs: torch.Tensor) -> None:
        """Inputs [..., in_features] that reached linear `name` during a stage's pass. Linears fed the same
        tensor (q/k/v, gate/up) receive the same object, so an algorithm can share work between them."""

    def process(self, layer_index: int, layer: nn.Module, names: tuple[str, ...]) -> None:
        """Change the weights of a stage's linears (quantize, prune, smooth...)."""

    # Optional: `uses_reference_inputs = True` makes add_batch receive `reference=`, the same linear's input
    # [..., in_features] for the same tokens in the uncompressed model.
    # Optional: `observe_inputs(layer_index, name, inputs)`, called before add_batch with the same inputs, for
    # statistics a checkpoint stores about them (the calibrated global scale of NVFP4 inputs).
    # Optional: `changes_only_stage_linears = True` promises that process() changes nothing but the weights of
    # the stage's linears, which lets later passes replay the attention from cached inputs (_ReplayedAttention).


class _StopForward(Exception):
    pass


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
    pre_layer_modules = [module for _, module in modules_beside_layers(model)]
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


def _to(obj, device, dtype):
    """Move tensors (in nested tuples/dicts) to `device`, floating ones to `dtype`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, dtype) if obj.is_floating_point() else obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to(o, device, dtype) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device, dtype) for k, v in obj.items()}
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
    layer_io: LayerIO | None = None,
    activation_budget: int | None = None,
) -> dict:
    """Run `algorithm` over every decoder layer of `model` with calibration tokens [S, T].

    Returns timing facts. The model is changed in place and left on the CPU. With `layer_io` (a model larger
    than memory) each layer's weights are onloaded before it runs and handed over when it is final; activations
    that would take more than `activation_budget` bytes are kept on disk.
    """
    device = torch.device(device)
    adapter = adapter_for(model)
    layers = get_module(model, adapter.layers)
    start = time.perf_counter()
    hidden, kwargs_per_batch = capture_first_layer_inputs(model, calib_ids, batch_size, device)
    # Kept in the compute dtype: the layers read it in that dtype and write it from that dtype, so storing it
    # wider would only cost memory (S x T x H: 75 MB less for SmolLM2 at 128 x 512 in bf16).
    hidden = hidden.to(compute_dtype)
    uses_reference = getattr(algorithm, "uses_reference_inputs", False)
    if layer_io is not None:
        layer_io.inputs_captured()
    hidden = keep_activations(hidden, activation_budget, 2 if uses_reference else 1)
    spilled = isinstance(hidden, SpilledActivations)
    batches = [(i, slice(i * batch_size, (i + 1) * batch_size)) for i in range(len(kwargs_per_batch))]
    device_kwargs = [_to(kw, device, compute_dtype) for kw in kwargs_per_batch]
    quantized = _Stream(hidden)
    original = _Stream(hidden.clone()) if uses_reference else None  # the uncompressed model's stream
    share = CoreShare() if device.type == "cpu" else None

    def calibrate(index: int, layer: nn.Module) -> None:
        if layer_io is not None:
            layer_io.onload(index, layer)
        layer.to(device)
        # The layer that runs the samples: the fp32 layer itself, or a lower-precision copy of it.
        runner = layer if compute_dtype == torch.float32 else copy.deepcopy(layer).to(compute_dtype)
        stages = algorithm.stages(adapter)
        # (no replay cache beside spilled activations: it is as large as they are)
        replay_from = None if spilled else _attention_replay_start(adapter, algorithm, stages)
        quantized.start_layer(runner)
        if original is not None:
            original.start_layer(copy.deepcopy(layer).to(compute_dtype))
        for stage, names in enumerate(stages):
            capture = replay_from is not None and stage >= replay_from
            # The last stage's reference pass runs the whole layer and leaves the uncompressed model's outputs
            # in the original stream (its inputs are not needed again).
            _run_stage(quantized, original, index, names, algorithm, batches, device_kwargs, device, compute_dtype,
                       adapter, capture, finish=stage == len(stages) - 1)
            algorithm.process(index, layer, names)
            if runner is not layer:
                runner.load_state_dict(layer.state_dict())  # copies and casts the changed weights
        observe = getattr(algorithm, "observe_layer", None)  # optional: sees each layer's input and output
        with quantized.replaying(adapter, device, len(batches)):
            for b, rows in batches:  # recompute outputs with the changed weights
                quantized.batch = (b, rows)
                inputs = hidden[rows].to(device, compute_dtype)
                out = _layer_output(runner(inputs, **device_kwargs[b]))
                if observe is not None:
                    observe(index, inputs, out)
                hidden[rows] = out.to("cpu", hidden.dtype)
        quantized.layer = runner = None
        if original is not None:
            original.layer = None
        layer.to("cpu")
        if layer_io is not None:
            layer_io.offload(index, layer)
        _release_freed_memory()
        if progress is not None:
            progress(index + 1, len(layers))

    for index, layer in enumerate(layers):
        with share.limited() if share is not None else contextlib.nullcontext():  # (the cores others leave)
            calibrate(index, layer)
    return {"calibration_wall_s": time.perf_counter() - start, "num_layers": len(layers)}


def _release_freed_memory() -> None:
    """Hand the memory freed with this layer's temporaries back to the OS: glibc keeps large freed blocks in
    its heaps, and across SmolLM2's 30 layers that fragmentation added ~370 MB to peak RSS (measured)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to do
        pass


class _Stream:
    """One stream of hidden states through the layers (the compressed model's, or the original model's for
    GPTAQ): the layer that runs it, its inputs [S, T, H], and the cached inputs of the layer's attention output
    projection [S, T, K] once they are final (see _ReplayedAttention)."""

    def __init__(self, hidden: torch.Tensor):
        self.hidden = hidden
        self.layer: nn.Module | None = None
        self.attention_inputs: torch.Tensor | None = None  # allocated once, reused by every layer
        self.captured: set[int] = set()  # batch indices whose attention inputs are cached for this layer
        self.batch: tuple[int, slice] | None = None  # (index, rows) of the batch being run

    def start_layer(self, layer: nn.Module) -> None:
        self.layer = layer
        self.captured.clear()

    def capture_hook(self, module, args) -> None:
        """A pre-hook for the attention output projection: caches its input for the batch being run."""
        b, rows = self.batch
        x = args[0]
        if self.attention_inputs is None:
            self.attention_inputs = torch.empty((self.hidden.shape[0], *x.shape[1:]), dtype=x.dtype)
        self.attention_inputs[rows] = x.to("cpu")
        self.captured.add(b)

    @contextlib.contextmanager
    def replaying(self, adapter: ArchAdapter, device: torch.device, num_batches: int):
        """Stand in for the layer's attention with its output projection over the cached inputs of the batch
        being run, when every batch's are cached; else leave the layer as it is."""
        if len(self.captured) < num_batches:
            yield
            return
        attention, input_norm = get_module(self.layer, adapter.attention), get_module(self.layer, adapter.input_norm)
        stand_in = _ReplayedAttention(get_module(self.layer, adapter.attention_output), self, device)
        set_module(self.layer, adapter.attention, stand_in)
        # The input norm feeds only the attention, which now ignores its input: skip it too (5 calls of HF's
        # RMSNorm per layer and batch saved with GPTAQ).
        set_module(self.layer, adapter.input_norm, nn.Identity())
        try:
            yield
        finally:
            set_module(self.layer, adapter.attention, attention)
            set_module(self.layer, adapter.input_norm, input_norm)


class _ReplayedAttention(nn.Module):
    """Once every attention linear but the output projection is final (an algorithm that changes only its
    stage's linears, after the q/k/v stage), the attention's output for a batch is output_proj(A) with A that
    projection's inputs, cached from one pass. Later passes (the gate/up and down stages, the output
    recompute; GPTAQ's reference stream too) then skip q/k/v, rotary and SDPA. Exact: A is the same
    tensor the full attention would produce again."""

    def __init__(self, output_proj: nn.Module, stream: _Stream, device: torch.device):
        super().__init__()
        self.output_proj = output_proj
        self.stream, self.device = stream, device

    def forward(self, *args, **kwargs):
        rows = self.stream.batch[1]
        return self.output_proj(self.stream.attention_inputs[rows].to(self.device)), None


def _attention_replay_start(adapter: ArchAdapter, algorithm, stages) -> int | None:
    """The first stage whose passes may cache the attention output projection's inputs: the one after every
    other attention linear is processed. None when the algorithm may change more than its stage's linears
    (AWQ scales norms and v_proj for o_proj), which would make the cache stale."""
    if not getattr(algorithm, "changes_only_stage_linears", False):
        return None
    prefix = adapter.attention + "."
    earlier = [i for i, names in enumerate(stages)
               if any(n.startswith(prefix) and n != adapter.attention_output for n in names)]
    return max(earlier) + 1 if earlier else 0


def _run_stage(quantized: _Stream, original: _Stream | None, index, names, algorithm, batches, device_kwargs,
               device, compute_dtype, adapter: ArchAdapter, capture: bool, finish: bool) -> None:
    """Feed each batch through the quantized stream's layer until every linear in `names` has its input,
    handing the inputs to the algorithm. With the `original` stream (GPTAQ), first collect the same linears'
    inputs in the uncompressed model and hand them over alongside; with `finish`, that pass runs to the end
    and replaces the original stream's hidden states with the layer's outputs. With `capture`, passes that
    reach the attention output projection cache its inputs (for _ReplayedAttention)."""
    pending: set[str] = set()
    reference_inputs: dict[str, torch.Tensor] = {}
    num_batches = len(batches)

    # Linears of this stage fed the same tensor get it when the first of them is reached: running that one
    # and the next just to reach their hooks would waste a matmul each (q and k for q/k/v, gate for gate/up).
    siblings = {name: [n for n in adapter.fed_same_input.get(name, (name,)) if n in names] for name in names}
    observe = getattr(algorithm, "observe_inputs", None)

    def make_hook(stream, name, collect):
        modules = {n: get_module(stream.layer, n) for n in siblings[name]}

        def hook(module, args):
            for sibling in siblings[name]:
                if sibling not in pending:
                    continue
                if not collect and observe is not None:
                    observe(index, sibling, args[0])
                if collect:
                    reference_inputs[sibling] = args[0]
                elif original is None:
                    algorithm.add_batch(index, sibling, modules[sibling], args[0])
                else:
                    algorithm.add_batch(index, sibling, modules[sibling], args[0], reference=reference_inputs[sibling])
                pending.discard(sibling)
            if not pending and not (collect and finish):  # the rest of the layer is not needed
                raise _StopForward

        return hook

    def run(stream, b, rows):
        pending.clear()
        pending.update(names)
        stream.batch = (b, rows)
        try:
            return stream.layer(stream.hidden[rows].to(device, compute_dtype), **device_kwargs[b])
        except _StopForward:
            return None

    streams = [quantized] if original is None else [original, quantized]
    handles = []
    for stream in streams:
        if capture and len(stream.captured) < num_batches:  # registered first: runs before a stopping hook
            output_proj = get_module(stream.layer, adapter.attention_output)
            handles.append(output_proj.register_forward_pre_hook(stream.capture_hook))
        handles += [get_module(stream.layer, n).register_forward_pre_hook(make_hook(stream, n, stream is original))
                    for n in names]
    try:
        with contextlib.ExitStack() as stack:
            for stream in streams:
                stack.enter_context(stream.replaying(adapter, device, num_batches))
            for b, rows in batches:
                if original is not None:
                    out = run(original, b, rows)
                    if finish:
                        original.hidden[rows] = _layer_output(out).to("cpu", original.hidden.dtype)
                run(quantized, b, rows)
                reference_inputs.clear()
    finally:
        for h in handles:
            h.remove()


def apply_algorithm(model: nn.Module, tokenizer, algorithm: LayerwiseAlgorithm, calibration=None,
                    progress: Callable[[int, int], None] | None = None, layer_io: LayerIO | None = None,
                    activation_budget: int | None = None) -> dict:
    """Run `algorithm` over every decoder layer: through the calibration pipeline when `calibration` (a
    CalibrationConfig) is given, else layer by layer with no data (RTN, magnitude). Returns facts.
    `layer_io` and `activation_budget`: see run_layerwise."""
    from llmopt.core.datasets import calibration_samples
    from llmopt.core.models import check_within_context

    if calibration is not None:
        cal = calibration
        check_within_context(cal.seqlen, model.config, "--seqlen")
        calib_ids = calibration_samples(tokenizer, cal.calib, cal.num_samples, cal.seqlen, cal.seed,
                                        cal.text_field)
        facts = run_layerwise(model, calib_ids, algorithm, cal.device, cal.batch_size, progress,
                              getattr(torch, cal.compute_dtype), layer_io, activation_budget)
        return {"calibration_tokens": calib_ids.numel(), **facts}
    adapter = adapter_for(model)
    layers = get_module(model, adapter.layers)
    with torch.inference_mode():
        if layer_io is not None:
            layer_io.inputs_captured()
        for index, layer in enumerate(layers):
            if layer_io is not None:
                layer_io.onload(index, layer)
            for names in algorithm.stages(adapter):
                algorithm.process(index, layer, names)
            if layer_io is not None:
                layer_io.offload(index, layer)
            if progress is not None:
                progress(index + 1, len(layers))
    return {}

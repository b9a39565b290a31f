"""A decode step's decoder layers as one compiled call (kernels/csrc/decode_graph_cpu.cpp), the fast CPU path's
capture of its own layer loop (`LlamaFamilyDecoder._forward_fused`).

At batch-1 decode of a small model the Python between the kernels costs about as much as the kernels: each of
~15 calls a layer pays its frame, argument parsing and the dispatcher (docs/results/code-figures.md#decode-graph).
The graph holds every layer's weights, norms and cache tensors, and each
linear as the kernel op its row plan chose for the step's row count (`graph_call`: the same op, the same
arguments), and runs them in C++: the same kernels in the same order, so the same bits as the Python loop.

Built once per engine (after the row plans are set and the KV cache is allocated) for every row count up to
GRAPH_MAX_ROWS; a step runs through one when it is decodes only, its row count has one (every linear's path
there is a kernel the graph can call: `graph_kernels`), and it is given the cache the graph was built on.
"""

from __future__ import annotations

import torch

from llmopt.runtime.executor.attention import KVCache
from llmopt.runtime.executor.attention.cpu import narrowing_cache
from llmopt.runtime.executor.attention.metadata import AttentionMetadata
from llmopt.runtime.executor.kernels.cpu_ops import decode_graph_class
from llmopt.runtime.executor.linear.kernel_plans import RowPathsMixin

# Decode steps of up to this many sequences (the 8-bit inputs' kernels' rows: q8_inputs.Q8InputsMixin); beyond,
# the kernels' own time dwarfs the calls'.
GRAPH_MAX_ROWS = 16


def graph_calls(decoder, rows: int) -> list[tuple] | None:
    """Every linear's (op, tensors, ints, bias) at `rows`, layer by layer; None if any has no graph kernel."""
    calls = []
    for block in decoder.blocks:
        for linear in block.linears():
            # (the linears whose kernel per row count is planned can say which op a graph calls)
            call = linear.graph_call(rows) if isinstance(linear, RowPathsMixin) else None
            if call is None:
                return None
            calls.append(call)
    return calls


def new_graph(decoder, calls: list[tuple], kv_cache: KVCache):
    """The compiled graph of `decoder`'s layers with these linear calls (4 per layer) over `kv_cache`."""
    first = decoder.blocks[0].input_norm
    fp8 = kv_cache.spec.dtype == torch.float8_e4m3fn
    graph = decode_graph_class()(decoder.num_heads, decoder.num_kv_heads, decoder.head_dim, decoder.scale,
                                 first.weight, first.eps, fp8)
    next_norms = [b.input_norm for b in decoder.blocks[1:]] + [decoder.norm]
    for i, (block, next_norm, cache) in enumerate(zip(decoder.blocks, next_norms, kv_cache)):
        for op, tensors, ints, bias in calls[4 * i:4 * i + 4]:
            graph.add_linear(op, list(tensors), list(ints), bias)
        graph.add_layer(block.post_norm.weight, block.post_norm.eps, next_norm.weight, next_norm.eps,
                        list(cache.tensors))
    return graph


class DecodeGraphs:
    """The graphs of one decoder over one KV cache, by row count (steps of equal paths share one)."""

    def __init__(self, decoder, kv_cache: KVCache):
        self.kv_cache = kv_cache
        self.by_rows: list = [None] * (GRAPH_MAX_ROWS + 1)
        built: dict[tuple, object] = {}
        for rows in range(1, GRAPH_MAX_ROWS + 1):
            calls = graph_calls(decoder, rows)
            if calls is None:
                continue
            key = tuple(op for op, *_ in calls)
            if key not in built:
                built[key] = new_graph(decoder, calls, kv_cache)
            self.by_rows[rows] = built[key]

    @property
    def row_counts(self) -> list[int]:
        """The step sizes that run through a graph."""
        return [rows for rows, graph in enumerate(self.by_rows) if graph is not None]

    def for_step(self, meta: AttentionMetadata, kv_cache: KVCache, rows: int):
        """The graph for this step, or None (prefill rows, a row count without one, another cache)."""
        decode = meta.decode
        if (rows > GRAPH_MAX_ROWS or kv_cache is not self.kv_cache or decode is None or meta.prefills
                or not decode.contiguous):
            return None
        return self.by_rows[rows]


def supports(decoder, kv_cache: KVCache) -> bool:
    """Whether `decoder` can run its decodes through graphs over `kv_cache`: the compiled fused path in one
    process (no all-reduce between the layers), the compiled CPU attention (the kernels the graph calls for the
    store and the decode), and a cache in the model's dtype, in 8 bits, or fp16 / bf16 under an fp32 model (what
    that store takes)."""
    spec = kv_cache.spec
    # (fused_ops: the compiled kernels are built, the graph class with them)
    return (decoder.fused_ops is not None and decoder.group is None and spec.layout == "kv"
            and decoder.attention.decode_graph
            and (spec.dtype == decoder.dtype or spec.quantized or narrowing_cache(decoder.dtype, spec.dtype)))

"""A decode step's decoder layers as one compiled call (kernels/csrc/decode_graph_cpu.cpp), recorded from the
model's own layer loop (`LlamaFamilyDecoder._layers`): the loop runs once with `GraphRecorder` standing in for its
ops, its attention backend and its linears, and each call appends an instruction to the graph's program instead of
computing. There is no second copy of the loop to keep in step with it.

At batch-1 decode of a small model the Python between the kernels costs about as much as the kernels: each of
~15 calls a layer pays its frame, argument parsing and the dispatcher (docs/results/code-figures.md#decode-graph).
The graph holds every layer's weights, norms and cache tensors, and each linear as the kernel op its row plan
chose for the step's row count (`graph_call`: the same op, the same arguments), and runs them in C++: the same
kernels in the same order as the fused ops (models/layer_ops.FusedOps), so the same bits as the Python loop.

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


class GraphRecorder:
    """The layer loop's ops (models/layer_ops.FusedOps' interface), attention backend and linears, recorded into a
    graph: each call appends its instruction and returns the registers (ints) of its results. Registers 0-5 are the
    graph's inputs (h, cos, sin, slot_mapping, block_tables, context_lens)."""

    H, COS, SIN = 0, 1, 2

    def __init__(self, graph, heads, fp8_cache: bool):
        self.graph, self.heads, self.fp8_cache = graph, heads, fp8_cache
        self.registers = 6

    def _op(self, name: str, inputs: list[int], outputs: int, tensors=(), reals=(), ints=()) -> list[int]:
        written = list(range(self.registers, self.registers + outputs))
        self.registers += outputs
        self.graph.add_op(name, inputs, written, list(tensors), [float(r) for r in reals], [int(i) for i in ints])
        return written

    # the layer ops
    def norm(self, x, norm):
        return self._op("rms_norm", [x], 1, [norm.weight], [norm.eps])[0]

    def add_norm(self, h, delta, norm):
        return h, self._op("add_rms_norm_", [h, delta], 1, [norm.weight], [norm.eps])[0]  # (h updated in place)

    def rotate(self, qkv, cos, sin, q_norm=None, k_norm=None):
        assert q_norm is None and k_norm is None, "per-head q / k norms have no graph op"
        return tuple(self._op("rotate", [qkv], 3, ints=self.heads))

    def merge_heads(self, o):
        return self._op("merge_heads", [o], 1)[0]

    def silu_mul(self, gate_up):
        return self._op("silu_mul", [gate_up], 1)[0]

    # the attention backend (the CPU backend's store then decode: one op, as its kernels run them)
    def store(self, k, v, cache, meta) -> None:
        pass

    def attend(self, q, cache, meta, scale, k, v):
        return self._op("attend", [q, k, v], 1, cache.tensors, [scale], [self.fp8_cache])[0]

    # a linear
    def linear(self, call: tuple):
        """A stand-in for the linear whose graph call (op, tensors, ints, bias) is `call`."""
        index = self.graph.add_linear(call[0], list(call[1]), list(call[2]), call[3])
        return lambda x: self._op("linear", [x], 1, ints=[index])[0]


def new_graph(decoder, calls: list[tuple], kv_cache: KVCache):
    """The compiled graph of `decoder`'s layer loop with these linear calls (4 per layer) over `kv_cache`."""
    graph = decode_graph_class()()
    recorder = GraphRecorder(graph, decoder.heads, kv_cache.spec.dtype == torch.float8_e4m3fn)
    linears = [recorder.linear(call) for call in calls]
    steps = [step._replace(qkv=linears[4 * i], o_proj=linears[4 * i + 1], gate_up=linears[4 * i + 2],
                           down_proj=linears[4 * i + 3]) for i, step in enumerate(decoder.steps)]
    _, x = decoder._layers(recorder.H, recorder.COS, recorder.SIN, None, kv_cache, recorder, recorder, steps)
    graph.set_result(x)
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

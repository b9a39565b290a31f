"""Decode steps replayed from captured graphs (CUDA graphs on a GPU): the decoder's forward for a decode-only step
of B sequences is captured once per bucket B over static input buffers, and a step of R <= B sequences copies its
inputs into those buffers, pads the rest, and replays the graph — one launch from the host instead of hundreds.

- Buckets: 1, 2, 4, 8, 16, 24, 32, 48, 64, ... up to the engine's max_num_seqs (which is always one); a step runs
  through the smallest bucket that holds it. Steps with a prefill chunk, speculative verification (several tokens
  of a sequence), more sequences than the largest bucket, a pipeline stage or a tensor-parallel rank run eagerly.
- Static buffers, sized for the largest bucket: input ids, positions and cache slots [B]; each row's block table
  [B, blocks of the longest context] and context length [B]. Every bucket's graph reads views of them, so a step
  only writes its rows; the attention backend builds a step metadata over them (`graph_metadata`: backends whose
  decode reads only those tensors, `captures = True`).
- Padding rows [R, B) compute a one-token context in a block of their own (the KV cache's sink block, one past the
  blocks the scheduler hands out): their stores never touch a sequence's cache, their outputs are dropped.
- Memory: the buffers and one forward's activations at the largest bucket are reserved out of the KV cache's
  budget before it is sized (`graph_memory_bytes`, an estimate from the model's widths); on CUDA the pool the
  graphs took is measured after capture and reported.
- `--enforce-eager` turns them off.

The graph itself is a capture backend: `CudaGraphCapture` (torch.cuda.CUDAGraph: the launches recorded on a side
stream after a warm-up, replayed as one) on CUDA, and `ReplayCapture`, which records the callable and replays it by
calling it again over the same buffers, writing the output it returned at capture (as a CUDA graph writes its
output's memory): the bucketing, padding, buffer updates and memory accounting run and are tested on CPU with it.
"""

from __future__ import annotations

import bisect

import torch

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


def graph_buckets(max_rows: int) -> list[int]:
    """The batch sizes captured for an engine of at most `max_rows` sequences a step (max_rows always one)."""
    return [b for b in BUCKETS if b < max_rows] + [max_rows]


class ReplayCapture:
    """A stand-in graph: capture runs the callable once and keeps its output; replay calls it again over the same
    buffers and writes the result into that output."""

    def capture(self, fn):
        out = fn()

        def replay() -> None:
            out.copy_(fn())

        return replay, out

    def pool_bytes(self) -> int:
        return 0


class CudaGraphCapture:
    """torch.cuda.CUDAGraph: two warm-up calls on a side stream (allocations and autotuning happen outside the
    capture), then the launches recorded; every graph shares one memory pool (captured largest first, the smaller
    ones reuse its blocks)."""

    def __init__(self, device: torch.device):
        self.device, self.pool = device, None
        self.allocated_before = torch.cuda.memory_allocated(device)

    def capture(self, fn):
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph.replay, out

    def pool_bytes(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.memory_allocated(self.device) - self.allocated_before


def graph_memory_bytes(config, max_rows: int, max_blocks: int, dtype: torch.dtype) -> int:
    """What the graphs may hold beyond the weights and the KV cache, reserved before the cache is sized: the static
    buffers (ids, positions, slots, lengths: 8 bytes each; block tables [rows, max_blocks] of 8 bytes) and twice one
    forward's activations at `max_rows` rows (the residual stream, a norm's output, q/k/v, the attention output, the
    MLP's gate/up and its product, the attention kernels' split partials), in `dtype`. An estimate from the model's
    widths: the pool measured after capture is reported beside it."""
    hidden = config.hidden_size
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    qkv = (heads + 2 * kv_heads) * head_dim
    widths = 3 * hidden + qkv + heads * head_dim + 3 * config.intermediate_size
    activations = max_rows * widths * torch.empty((), dtype=dtype).element_size()
    partials = max_rows * heads * 128 * (head_dim + 1) * 4  # (split-KV partial outputs and log-sum-exps, fp32)
    buffers = max_rows * (4 * 8 + max_blocks * 8)
    return buffers + 2 * (activations + partials)


class StepGraphs:
    """The decoder's decode-only steps replayed from one graph per bucket (module docstring)."""

    def __init__(self, decoder, kv_cache, block_size: int, max_rows: int, max_blocks: int, sink_block: int,
                 capture, device: torch.device):
        self.decoder, self.kv_cache, self.block_size = decoder, kv_cache, block_size
        self.buckets = graph_buckets(max_rows)
        self.sink_block, self.sink_slot = sink_block, sink_block * block_size
        rows = self.buckets[-1]
        self.input_ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((rows,), self.sink_slot, dtype=torch.long, device=device)
        self.block_tables = torch.full((rows, max_blocks), sink_block, dtype=torch.long, device=device)
        self.context_lens = torch.ones(rows, dtype=torch.long, device=device)
        decoder.prepare_graphs(max_blocks * block_size)
        self.graphs: dict[int, tuple] = {}
        for bucket in reversed(self.buckets):  # (largest first: the smaller ones reuse its pool)
            meta = decoder.attention.graph_metadata(bucket, self.slot_mapping[:bucket], self.block_tables[:bucket],
                                                    self.context_lens[:bucket], block_size)
            self.graphs[bucket] = capture.capture(self._forward(bucket, meta))
        self.pool_bytes = capture.pool_bytes()
        self.replays = 0

    def _forward(self, bucket: int, meta):
        ids, positions = self.input_ids[:bucket], self.positions[:bucket]
        kv_cache, decoder = self.kv_cache, self.decoder
        return lambda: decoder(ids, positions, meta, kv_cache)

    def serves(self, step) -> bool:
        """Whether a step runs through a graph: decodes only (one new token per sequence), as many as a bucket holds."""
        rows = len(step.input_ids)
        return (rows == len(step.context_lens) and rows <= self.buckets[-1]
                and max(len(t) for t in step.tables) <= self.block_tables.shape[1])

    def run(self, step) -> torch.Tensor:
        """The final hidden states [R, hidden] of a step `serves` accepted."""
        rows = len(step.input_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, rows)]
        device = self.input_ids.device
        width = max(len(t) for t in step.tables)
        tables = torch.tensor([t + [self.sink_block] * (width - len(t)) for t in step.tables], dtype=torch.long)
        for buffer, values in ((self.input_ids, step.input_ids), (self.positions, step.positions),
                               (self.slot_mapping, step.slots), (self.context_lens, step.context_lens)):
            buffer[:rows].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)
        self.block_tables[:rows, :width].copy_(tables.to(device, non_blocking=True))
        if rows < bucket:  # the padding rows: one token of context in the sink block
            self.input_ids[rows:bucket] = 0
            self.positions[rows:bucket] = 0
            self.slot_mapping[rows:bucket] = self.sink_slot
            self.context_lens[rows:bucket] = 1
            self.block_tables[rows:bucket, 0] = self.sink_block
        replay, out = self.graphs[bucket]
        replay()
        self.replays += 1
        return out[:rows]

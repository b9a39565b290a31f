"""Decode attention over the paged KV cache, from memory: the compiled kernel's time per decode step and the rate it
reads the cache at, against torch reading the same number of bytes in the same run.

SmolLM2-135M's attention shape (9 query heads, 3 KV heads of 64), 16-token blocks scattered over the cache as a
long-running engine leaves them, 30 layers' caches read in turn (so each layer's comes from memory, as in a step).
Rows: sequences x context tokens per step, per cache dtype; queries in the model's compute dtype on this CPU (fp32
over an fp32 cache).

    python benchmarks/kernels/decode_attention.py --json docs/results/data/decode_attention.json
"""

from __future__ import annotations

import random
import statistics
from pathlib import Path

import torch

from llmopt.core.hardware import best_time_of, cache_evictor, call_times, cpu_line, resolve_dtype
from llmopt.core.io import write_json
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK, LAYERS = 9, 3, 64, 16, 30
SHAPES = ((64, 192), (16, 512), (8, 1024), (1, 4096))  # sequences, context tokens: >= 2x a 32 MB L3 in all
CACHE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def layer_caches(sequences: int, context: int, dtype: torch.dtype, rng: random.Random):
    """LAYERS (k_cache, v_cache, block_tables) with each sequence's blocks at shuffled places, and context_lens."""
    per_seq = -(-context // BLOCK)
    blocks = sequences * per_seq + 8
    caches = []
    for _ in range(LAYERS):
        order = list(range(blocks))
        rng.shuffle(order)
        tables = torch.tensor(order[:sequences * per_seq]).view(sequences, per_seq)
        caches.append((torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype),
                       torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype), tables))
    lens = torch.tensor([context - rng.randrange(0, min(BLOCK * 2, context)) for _ in range(sequences)])
    return caches, lens


def row(ops, sequences: int, context: int, cache: str, q_dtype: torch.dtype, repeats: int) -> dict:
    caches, lens = layer_caches(sequences, context, CACHE_DTYPES[cache], random.Random(0))
    q = torch.randn(sequences, HEADS, HEAD_DIM).to(q_dtype)

    def step():
        for k, v, tables in caches:
            ops.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM ** -0.5)

    nbytes = int(lens.sum()) * 2 * KV_HEADS * HEAD_DIM * CACHE_DTYPES[cache].itemsize * LAYERS
    seconds = statistics.median(call_times(step, repeats, warmups=3))
    # the same bytes read by torch in the same run, from memory (the caches evicted before each read)
    buffer = torch.ones(nbytes // 4)
    read = best_time_of(buffer.sum, repeats, before=cache_evictor())
    return {"sequences": sequences, "context": context, "cache": cache, "ms_per_step": seconds * 1e3,
            "gb_per_s": nbytes / seconds / 1e9, "torch_read_ms": read * 1e3, "vs_torch_read": seconds / read}


def main() -> None:
    parser = command_line(__doc__, type=Path)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the compiled CPU kernels are not available here (no compiler?)")
    q_dtype = getattr(torch, resolve_dtype("auto", "cpu"))  # (the model's compute dtype on this CPU)
    print(cpu_line(), flush=True)
    print(f"queries {q_dtype} (float32 over the float32 cache), {LAYERS} layers per step, medians of {args.repeats}")
    print("| sequences x context | cache | ms per step | GB/s | torch's best read of the bytes, ms | kernel / read |")
    print("|---|---|---:|---:|---:|---:|")
    rows = []
    for sequences, context in SHAPES:
        for cache in CACHE_DTYPES:
            # (an fp32 cache is an fp32 model's)
            r = row(ops, sequences, context, cache, torch.float32 if cache == "float32" else q_dtype, args.repeats)
            rows.append(r)
            print(f"| {sequences} x {context} | {cache} | {r['ms_per_step']:.2f} | {r['gb_per_s']:.1f} | "
                  f"{r['torch_read_ms']:.2f} | {r['vs_torch_read']:.2f}x |", flush=True)
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "query_dtype": str(q_dtype), "rows": rows}, indent=1)


if __name__ == "__main__":
    main()

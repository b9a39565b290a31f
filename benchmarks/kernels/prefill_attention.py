"""The compiled CPU prefill attention (csrc/prefill_attention_cpu.cpp) against torch's SDPA on the same causal
prompts: SmolLM2-135M's heads (9 query heads over 3 KV heads, head_dim 64), one layer, fp32 and bf16, prompts of 128
tokens (1 and 16 at once, as a batch of fresh prompts), 512 and 2048. The two alternate within each round (neither
always runs first); each figure is the median over --rounds of the best of 3 repeats; ratio = kernel / SDPA.

    python benchmarks/kernels/prefill_attention.py --json docs/results/data/prefill-attention.json [--rounds 3]
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
CASES = [(1, 128), (16, 128), (1, 512), (1, 2048)]  # (prompts, tokens each)


def best_us(fn, calls: int) -> float:
    """Best of 3 repeats of `calls` calls, us per call (after 2 warm-up calls)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return min(times)


def case(kernel, dtype: torch.dtype, prompts: int, tokens: int, rounds: int) -> dict:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(prompts * tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
    k, v = (torch.randn(prompts * tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    qb, kb, vb = (x.view(prompts, tokens, x.shape[1], HEAD_DIM).transpose(1, 2) for x in (q, k, v))
    scale = HEAD_DIM ** -0.5
    sdpa = lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale, enable_gqa=True)
    ours = lambda: kernel(q, k, v, tokens, scale)
    expected = sdpa().transpose(1, 2).reshape(prompts * tokens, HEADS, HEAD_DIM).float()
    error = (ours().float() - expected).abs().max().item()
    calls = max(2, 2560 // (tokens * prompts))
    runs = {"sdpa_us": [], "kernel_us": []}
    for r in range(rounds):
        order = (("sdpa_us", sdpa), ("kernel_us", ours)) if r % 2 == 0 else (("kernel_us", ours), ("sdpa_us", sdpa))
        for name, fn in order:
            runs[name].append(best_us(fn, calls))
    sdpa_us, kernel_us = statistics.median(runs["sdpa_us"]), statistics.median(runs["kernel_us"])
    return {"dtype": str(dtype).removeprefix("torch."), "prompts": prompts, "tokens": tokens, **runs,
            "sdpa_us_per_prompt": sdpa_us / prompts, "kernel_us_per_prompt": kernel_us / prompts,
            "ratio": kernel_us / sdpa_us, "max_abs_error": error}


def main() -> None:
    from llmopt.core.hardware import cpu_line
    from llmopt.runtime.executor.attention.cpu import compiled_prefill_kernel

    parser = command_line(__doc__, default="docs/results/data/prefill-attention.json")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        kernel = compiled_prefill_kernel(torch.empty(1, HEADS, HEAD_DIM, dtype=dtype))
        if kernel is None:
            raise SystemExit("the compiled CPU kernels are not available here (a vector build is needed)")
        for prompts, tokens in CASES:
            rows.append(case(kernel, dtype, prompts, tokens, args.rounds))
            print(rows[-1], flush=True)
    result = {"cpu": cpu_line(), "threads": torch.get_num_threads(), "rounds": args.rounds, "rows": rows}
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\n{result['cpu']}, {result['threads']} threads; one layer, {HEADS} x {KV_HEADS} heads, "
          f"head_dim {HEAD_DIM}; medians of {args.rounds} rounds")
    print("| dtype | prompts x tokens | SDPA, us per prompt | kernel, us per prompt | kernel / SDPA |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['dtype']} | {r['prompts']} x {r['tokens']} | {r['sdpa_us_per_prompt']:.0f} | "
              f"{r['kernel_us_per_prompt']:.0f} | {r['ratio']:.2f}x |")


if __name__ == "__main__":
    main()

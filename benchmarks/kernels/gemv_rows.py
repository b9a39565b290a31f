"""The multi-row GEMV kernel (ops.gemv: 1-8 input rows, each weight row streamed once) against torch's linear, at
SmolLM2's decode shapes, per kernel build this CPU runs: microseconds per call (best of 20 after a warm-up) and
the ratio. Speculative verification multiplies 2-8 rows; prompt lookup's 6-token steps are the case that matters.

    python benchmarks/kernels/gemv_rows.py [--isa avx2] [--rows 1,4,6,8] [--json gemv_rows.json]
"""

from __future__ import annotations

import json

import torch

from llmopt.core.hardware import best_time_of, cpu_line
from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

SHAPES = {"qkv 960x576": (960, 576), "gate_up 3072x576": (3072, 576), "down 576x1536": (576, 1536),
          "lm_head 49152x576": (49152, 576)}


def best_us(fn, repeats: int = 20) -> float:
    return 1e6 * best_time_of(fn, repeats)


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--isa", default=None, help="kernel build (default: the one this CPU loads)")
    parser.add_argument("--rows", default="1,2,3,4,6,8")
    args = parser.parse_args()
    ops = cpu_ops(args.isa)
    generator = torch.Generator().manual_seed(0)
    print(f"CPU: {cpu_line()}")
    print(f"{'shape':<20} {'rows':>4} {'gemv us':>9} {'torch us':>9} {'torch/gemv':>10}")
    results = []
    for name, (n, k) in SHAPES.items():
        weight = torch.randn(n, k, generator=generator)
        for rows in map(int, args.rows.split(",")):
            x = torch.randn(rows, k, generator=generator)
            assert torch.allclose(ops.gemv(x, weight), x @ weight.T, rtol=1e-4, atol=1e-3)
            ours, theirs = best_us(lambda: ops.gemv(x, weight)), best_us(lambda: torch.nn.functional.linear(x, weight))
            results.append({"shape": name, "rows": rows, "gemv_us": ours, "torch_us": theirs})
            print(f"{name:<20} {rows:>4} {ours:>9.1f} {theirs:>9.1f} {theirs / ours:>10.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cpu": cpu_line(), "isa": args.isa, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()

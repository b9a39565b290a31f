"""The int4 kernel with 8-bit inputs (ops.int4_matmul_q8, the CPU default for int4 weights) at SmolLM2-135M's
decoder shapes, per row count: a decode step of R sequences, or a prefill chunk of R tokens. Each of the 30 layers
has codes of its own, so a step reads them from memory as the engine's does. Per shape: the median call over the
layers and rounds; per row count: a step's linears (30 layers x 4 shapes) in ms and G multiply-adds/s.

    python benchmarks/kernels/int4_q8_rows.py [--rows 1,2,8,16,32,64,256,1024] [--rounds 5] [--json int4_q8_rows.json]
"""

from __future__ import annotations

import json
import statistics
import time

import torch
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

SHAPES = {"qkv 960x576": (960, 576), "o 576x576": (576, 576), "gate_up 3072x576": (3072, 576),
          "down 576x1536": (576, 1536)}  # (outputs N, inputs K) of each decoder layer's linears
LAYERS = 30
GROUP = 32  # the Q4_1-like layout: codes in groups of 32, inputs rounded to 8 bits per 32 columns


def layer_weights(seed: int) -> dict:
    from llmopt.runtime.executor.kernels.quant_matmul import pack_int4_q8

    g = torch.Generator().manual_seed(seed)
    packed = {}
    for name, (n, k) in SHAPES.items():
        q = torch.randint(0, 16, (n, k), generator=g)
        scales = torch.rand(n, k // GROUP, generator=g) * 0.01 + 0.001
        zeros = torch.randint(0, 16, (n, k // GROUP), generator=g).float()
        packed[name] = pack_int4_q8(q, scales, zeros, GROUP, GROUP)
    return packed


def main() -> None:
    from llmopt.core.hardware import cpu_line
    from llmopt.runtime.executor.kernels.cpu_ops import cpu_ops

    parser = command_line(__doc__, default=None)
    parser.add_argument("--rows", default="1,2,8,16,32,64,256,1024")
    parser.add_argument("--rounds", type=int, default=5, help="passes over the 30 layers per row count (the "
                        "first is a warm-up)")
    args = parser.parse_args()
    ops = cpu_ops()
    if ops is None:
        raise SystemExit("the compiled CPU kernels are not available here (see the log): nothing to measure")
    layers = [layer_weights(seed) for seed in range(LAYERS)]
    print(cpu_line())
    print(f"{'rows':>5} {'shape':18} {'us/call':>9} {'G/s':>6}")
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        inputs = {name: torch.randn(rows, k) for name, (n, k) in SHAPES.items()}
        times: dict[str, list[float]] = {name: [] for name in SHAPES}
        for round_index in range(args.rounds):
            for layer in layers:
                for name in SHAPES:
                    start = time.perf_counter()
                    ops.int4_matmul_q8(inputs[name], *layer[name], GROUP, GROUP)
                    if round_index:
                        times[name].append(time.perf_counter() - start)
        step_s, macs = 0.0, 0
        for name, (n, k) in SHAPES.items():
            call = statistics.median(times[name])
            step_s += call * LAYERS
            macs += rows * n * k * LAYERS
            print(f"{rows:>5} {name:18} {call * 1e6:>9.1f} {rows * n * k / call / 1e9:>6.1f}")
            results.append({"rows": rows, "shape": name, "us_per_call": round(call * 1e6, 2)})
        print(f"{rows:>5} {'a step (30 layers)':18} {step_s * 1e3:>8.2f}ms {macs / step_s / 1e9:>6.1f}", flush=True)
        results.append({"rows": rows, "shape": "step", "ms": round(step_s * 1e3, 3),
                        "g_macs_per_s": round(macs / step_s / 1e9, 2)})
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"cpu": cpu_line(), "threads": torch.get_num_threads(), "rows": results}, out, indent=1)


if __name__ == "__main__":
    main()

"""What the compiled CPU kernels (llmopt/runtime/executor/kernels/csrc) buy: decode-step time with them on and off
(LLMOPT_CPU_KERNELS=1/0), each configuration in its own process, on and off alternating so that the machine's
drift hits both alike.

    python benchmarks/kernels/cpu_kernels.py --int4 ARTIFACT --json docs/results/data/cpu_kernels.json
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

CHILD = """
import json, sys
sys.path.insert(0, {bench_dir!r})
from decode_step import step_ms
from llmopt.runtime.executor.loader import load_runtime_model
model, tokenizer, _ = load_runtime_model({model!r}, dtype="bfloat16")
print(json.dumps([step_ms(model, tokenizer, {batch}, True, steps=20) for _ in range(3)]))
"""


def run(model: str, batch: int, kernels: bool) -> float:
    """Median ms per decode step of 3 x 20 steps in a fresh process."""
    code = CHILD.format(bench_dir=str(Path(__file__).parent), model=model, batch=batch)
    env = {**os.environ, "LLMOPT_CPU_KERNELS": "1" if kernels else "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    return statistics.median(json.loads(out.strip().splitlines()[-1]))


def main() -> None:
    parser = command_line(__doc__, default="docs/results/data/cpu_kernels.json")
    parser.add_argument("--int4", default=None, help="a GPTQ w4 artifact of SmolLM2")
    parser.add_argument("--pairs", type=int, default=2)
    args = parser.parse_args()
    configs = [("bf16", "smollm2-135m", 64)]
    if args.int4:
        configs += [("int4", args.int4, 64), ("int4", args.int4, 1)]
    rows = []
    for label, model, batch in configs:
        on, off = [], []
        for pair in range(args.pairs):  # on/off, then off/on: neither always runs first
            for kernels in ((True, False) if pair % 2 == 0 else (False, True)):
                (on if kernels else off).append(run(model, batch, kernels))
        from llmopt.core.hardware import cpu_line

        row = {"model": label, "batch": batch, "kernels_on_ms": on, "kernels_off_ms": off,
               "ratio": statistics.median(on) / statistics.median(off), "cpu": cpu_line()}
        rows.append(row)
        print(row, flush=True)
    Path(args.json).write_text(json.dumps(rows, indent=1))
    print("| model | batch | kernels on, ms/step | off, ms/step | on / off |\n|---|---:|---|---|---:|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {' / '.join(f'{x:.1f}' for x in r['kernels_on_ms'])} | "
              f"{' / '.join(f'{x:.1f}' for x in r['kernels_off_ms'])} | {r['ratio']:.2f} |")


if __name__ == "__main__":
    main()

"""Is a quantized SmolLM2 faster than the dense one at every batch size? Output tok/s of GPTQ w4g64 and RTN int8
weight-only (per channel, and with --int8-grouped in groups of 64 columns) vs fp32 dense at concurrency 1, 4, 16,
64 (128 in / 128 out), all in one run: the variants alternate within each round and each ratio is the median over
rounds. Every run records which kernel each linear shape chose per row bucket (`linear_paths`, measured at engine
start).

    llmopt quantize smollm2-135m --method gptq --bits 4 --group-size 64 -o /tmp/gptq
    llmopt quantize smollm2-135m --method rtn --bits 8 --group-size -1 -o /tmp/int8
    llmopt quantize smollm2-135m --method rtn --bits 8 --group-size 64 -o /tmp/int8-g64
    python benchmarks/runtime/int4_batch.py --gptq /tmp/gptq --int8 /tmp/int8 [--int8-grouped /tmp/int8-g64] \
        --json docs/results/data/int4_batch.json
"""

from __future__ import annotations

import statistics

from llmopt.core.hardware import cpu_line
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line, alternating_rounds, concurrency_run, emit, save_rows

DENSE = "smollm2-135m"
TARGETS = {"gptq": {1: 1.8, 4: 1.5, 16: 1.2, 64: 1.0}, "int8": {1: 1.5, 4: 1.3, 16: 1.1, 64: 1.0}}
TARGETS["int8-grouped"] = TARGETS["int8"]  # (the same bytes per weight, and 1/16 more for the scales)


def parse_args():
    parser = command_line(__doc__, default="docs/results/data/int4_batch.json")
    parser.add_argument("--gptq", required=True, help="a GPTQ w4g64 artifact of SmolLM2-135M")
    parser.add_argument("--int8", default=None, help="an RTN int8 (per channel) artifact of SmolLM2-135M")
    parser.add_argument("--int8-grouped", default=None, help="an RTN int8 artifact with groups of columns (SmolLM2: 64)")
    parser.add_argument("--dtype", default="float32", help="compute dtype of every variant (default float32)")
    parser.add_argument("--concurrency", default="1,4,16,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--linear-kernels", default="measured", choices=("measured", "fixed"))
    parser.add_argument("--markdown", default=None)
    return parser.parse_args()


def table(rows: list[dict], variants: dict[str, str], levels: list[int]) -> str:
    lines = [f"CPU: {cpu_line()}", "",
             "| concurrency | fp32 dense tok/s | " + " | ".join(f"{v} tok/s (x dense, target)" for v in variants
                                                           if v != "dense") + " |",
             "|---:|---:|" + "---:|" * (len(variants) - 1)]
    for level in levels:
        tput = {v: statistics.median(r["output_throughput"] for r in rows
                                     if r["variant"] == v and r["concurrency"] == level) for v in variants}
        cells = []
        for v in variants:
            if v == "dense":
                continue
            ratio, target = tput[v] / tput["dense"], TARGETS[v][level] if level in TARGETS[v] else None
            verdict = "" if target is None else f", >= {target}: {'met' if ratio >= target else '**missed**'}"
            cells.append(f"{tput[v]:.1f} ({ratio:.2f}x{verdict})")
        lines.append(f"| {level} | {tput['dense']:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    variants = {"dense": DENSE, "gptq": args.gptq}
    if args.int8:
        variants["int8"] = args.int8
    if args.int8_grouped:
        variants["int8-grouped"] = args.int8_grouped
    levels = [int(c) for c in args.concurrency.split(",")]

    def measure(model: str, level: int) -> dict:
        return concurrency_run(model, level, args.input_len, args.output_len, args.dtype, args.linear_kernels)

    def save(rows: list[dict]) -> None:
        save_rows(args.json, {"cpu": cpu_line(), "dtype": args.dtype, "rows": rows})

    rows = alternating_rounds(variants, levels, args.rounds, measure, save)
    emit(table(rows, variants, levels), args.markdown)


if __name__ == "__main__":
    main()

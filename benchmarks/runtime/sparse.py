"""Does a 2:4 model stored compressed run faster than the dense one? Batch-1 TPOT and 64-client throughput of
SmolLM2-135M pruned 2:4 and stored as compressed-tensors' sparse-24-bitmask (run by the sparse24-cpu linear
method), against fp32 dense and against the same 2:4 weights stored dense (zeros in place: what llmopt did
before, a control that the time saved is the layout's, not the zeros'); and, given int4 artifacts, 2:4 + int4
codes (sparse24-int4-cpu) against the int4 codes of the dense model (int4-cpu); and unstructured 50% / 70%
sparsity stored as sparse-bitmask (sparse-bitmask-cpu) against dense. All variants in one run,
alternating within each round; each ratio is the median over rounds. Which weights a method keeps, and how the
codes were found, change neither the bytes nor the kernel, so magnitude pruning and RTN (the quickest to make)
measure the speed of SparseGPT and GPTQ artifacts of the same shapes.

    llmopt prune smollm2-135m --method magnitude --pattern 2:4 -o /tmp/sp24
    llmopt prune smollm2-135m --method magnitude --pattern 2:4 --save-dense -o /tmp/sp24-dense
    llmopt quantize smollm2-135m --method rtn --bits 4 --group-size 64 -o /tmp/int4
    llmopt quantize /tmp/sp24 --method rtn --bits 4 --group-size 64 -o /tmp/sp24-int4
    llmopt prune smollm2-135m --method magnitude --sparsity 0.5 -o /tmp/u50   # (and 0.7 -o /tmp/u70)
    python benchmarks/runtime/sparse.py --sparse /tmp/sp24 --sparse-dense /tmp/sp24-dense --int4 /tmp/int4 \
        --sparse-int4 /tmp/sp24-int4 --unstructured-50 /tmp/u50 --unstructured-70 /tmp/u70 \
        --json docs/results/data/sparse.json
"""

from __future__ import annotations

import statistics

from llmopt.core.hardware import cpu_line
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line, alternating_rounds, concurrency_run, emit, save_rows

DENSE = "smollm2-135m"
TPOT_TARGET = 0.65  # batch-1 TPOT of 2:4 (fp32 values) / dense fp32, at most
THROUGHPUT_TARGET = 1.0  # 64 x 128/128 output tok/s of 2:4 / dense, at least
INT4_TPOT_TARGET = 0.8  # batch-1 TPOT of 2:4 + int4 / int4 alone, at most
BASELINE = {"dense": "dense", "sparse24": "dense", "sparse24 stored dense": "dense", "int4": "dense",
            "sparse24 int4": "int4", "unstructured 50%": "dense",
            "unstructured 70%": "dense"}  # each variant's ratio is against this one


def parse_args():
    parser = command_line(__doc__, default="docs/results/data/sparse.json")
    parser.add_argument("--sparse", required=True, help="a 2:4 artifact of SmolLM2-135M stored compressed")
    parser.add_argument("--sparse-dense", default=None, help="the same 2:4 model stored dense (--save-dense)")
    parser.add_argument("--int4", default=None, help="SmolLM2-135M quantized to int4 (compressed-tensors)")
    parser.add_argument("--sparse-int4", default=None, help="the 2:4 model quantized the same way")
    parser.add_argument("--unstructured-50", default=None, help="SmolLM2-135M pruned to 50%% unstructured")
    parser.add_argument("--unstructured-70", default=None, help="... and to 70%%")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--markdown", default=None)
    return parser.parse_args()


def median_of(rows: list[dict], variant: str, level: int, key: str) -> float:
    return statistics.median(r[key] for r in rows if r["variant"] == variant and r["concurrency"] == level)


def verdict(ratio: float, target: float, at_most: bool) -> str:
    met = ratio <= target if at_most else ratio >= target
    return f"target {'<=' if at_most else '>='} {target}: {'met' if met else '**missed**'}"


def table(rows: list[dict], variants: list[str], levels: list[int]) -> str:
    lines = [f"CPU: {cpu_line()}", "",
             "| concurrency | variant | out tok/s | median TPOT ms | mean TTFT ms | vs | tok/s ratio | TPOT ratio |",
             "|---:|---|---:|---:|---:|---|---:|---:|"]
    ratios = {}
    for level in levels:
        for variant in variants:
            tput, tpot, ttft = (median_of(rows, variant, level, k)
                                for k in ("output_throughput", "median_tpot_ms", "mean_ttft_ms"))
            base = BASELINE[variant]
            base_tput, base_tpot = (median_of(rows, base, level, k) for k in ("output_throughput", "median_tpot_ms"))
            ratios[variant, level] = (tput / base_tput, tpot / base_tpot)
            lines.append(f"| {level} | {variant} | {tput:.1f} | {tpot:.2f} | {ttft:.1f} | {base} | "
                         f"{tput / base_tput:.2f} | {tpot / base_tpot:.2f} |")
    lines.append("")
    first, last = levels[0], levels[-1]
    lines.append(f"- batch-{first} TPOT 2:4 / dense: {ratios['sparse24', first][1]:.2f} "
                 f"({verdict(ratios['sparse24', first][1], TPOT_TARGET, True)})")
    if ("sparse24 int4", first) in ratios:
        lines.append(f"- batch-{first} TPOT 2:4 + int4 / int4: {ratios['sparse24 int4', first][1]:.2f} "
                     f"({verdict(ratios['sparse24 int4', first][1], INT4_TPOT_TARGET, True)})")
    if last != first:
        lines.append(f"- {last} clients throughput 2:4 / dense: {ratios['sparse24', last][0]:.2f} "
                     f"({verdict(ratios['sparse24', last][0], THROUGHPUT_TARGET, False)})")
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    variants = {"dense": DENSE, "sparse24": args.sparse}
    if args.sparse_dense:
        variants["sparse24 stored dense"] = args.sparse_dense
    if args.int4 and args.sparse_int4:
        variants.update({"int4": args.int4, "sparse24 int4": args.sparse_int4})
    for share, path in (("50%", args.unstructured_50), ("70%", args.unstructured_70)):
        if path:
            variants[f"unstructured {share}"] = path
    levels = [int(c) for c in args.concurrency.split(",")]

    def measure(model: str, level: int) -> dict:
        return concurrency_run(model, level, args.input_len, args.output_len, args.dtype)

    def save(rows: list[dict]) -> None:
        save_rows(args.json, {"cpu": cpu_line(), "dtype": args.dtype, "rows": rows})

    rows = alternating_rounds(variants, levels, args.rounds, measure, save)
    emit(table(rows, list(variants), levels), args.markdown)


if __name__ == "__main__":
    main()

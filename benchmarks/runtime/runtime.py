"""The runtime's headline table on SmolLM2-135M (CPU), every comparison made in the same run.

(a) offline 64 requests x 128 in / 128 out: runtime fp32 / bf16 / int4 (GPTQ artifact), continuous vs static,
    and transformers' generate (static batches of 32, bf16) as the baseline;
(b) ShareGPT prompts at a request rate that loads the machine: continuous vs static;
(c) batch 1: TTFT (128 prompt tokens) and TPOT, fp32 / bf16 / int4;
(d) prefix repetition (1024-token shared prefixes): prefix cache on vs off;
(e) (a)'s headline ratio again, bf16 continuous and HF alternating (--pairs), not part of the default sections.

    python benchmarks/runtime/runtime.py --int4 /tmp/q --json docs/results/data/runtime.json \
        --markdown docs/results/runtime.md
(`--int4` is a GPTQ w4 artifact: `llmopt quantize smollm2-135m --method gptq --bits 4 --group-size 64 -o /tmp/q`.)
"""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

from llmopt.runtime.engine.config import EngineConfig
from llmopt.eval.bench import BenchConfig, bench_hf, bench_runtime
from llmopt.eval.workloads import WorkloadSpec
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line, emit, save_rows

MODEL = "smollm2-135m"
KEYS = [("output_throughput", "out tok/s", "{:.1f}"), ("request_throughput", "req/s", "{:.2f}"),
        ("mean_ttft_ms", "TTFT mean ms", "{:.0f}"), ("median_tpot_ms", "TPOT median ms", "{:.1f}"),
        ("p99_tpot_ms", "TPOT p99 ms", "{:.1f}"), ("mean_batch_size", "mean batch", "{:.1f}"),
        ("prefix_cache_hit_rate", "prefix hit", "{:.2f}"), ("mean_ttft_prefix_hit_ms", "TTFT of hits ms", "{:.0f}"),
        ("mbu", "MBU", "{:.3f}"), ("duration", "s", "{:.1f}")]


def row(label: str, run) -> dict:
    return {"name": label, "model": run.model, "config": run.config, "metrics": run.metrics}


def section_a(args, rows):
    spec = WorkloadSpec("random", num_requests=args.num_requests, input_len=128, output_len=128)
    base = BenchConfig(dtype="bfloat16", engine=EngineConfig(max_num_seqs=64, kv_cache_bytes=1 << 30))
    variants = [("fp32 continuous", MODEL, replace(base, dtype="float32")),
                ("bf16 continuous", MODEL, base),
                ("bf16 static", MODEL, replace(base, engine=replace(base.engine, policy="static",
                                                                         max_num_seqs=32)))]
    if args.int4:
        variants.append(("int4 continuous", args.int4, base))
    for label, model, config in variants:
        rows["a"].append(row(label, bench_runtime(label, model, spec, config)))
        print(label, rows["a"][-1]["metrics"]["output_throughput"], flush=True)
    rows["a"].append(row("hf generate bf16 (batch 32)", bench_hf("baseline", MODEL, spec, base)))
    print("hf", rows["a"][-1]["metrics"]["output_throughput"], flush=True)


def section_e(args, rows):
    """(a)'s headline ratio with the two runs alternating (runtime, HF, HF, runtime, ...): this machine's speed
    drifts by 15-50% within an hour, which one pass in a fixed order can turn into a wrong ratio."""
    spec = WorkloadSpec("random", num_requests=args.num_requests, input_len=128, output_len=128)
    base = BenchConfig(dtype="bfloat16", engine=EngineConfig(max_num_seqs=64, kv_cache_bytes=1 << 30))
    for i in range(2 * args.pairs):
        runtime_turn = (i % 4) in (0, 3)
        if runtime_turn:
            run = bench_runtime("bf16 continuous", MODEL, spec, base)
        else:
            run = bench_hf("baseline", MODEL, spec, base)
        label = "bf16 continuous" if runtime_turn else "hf generate bf16 (batch 32)"
        rows["e"].append(row(f"{label} #{i // 2 + 1}", run))
        print(label, rows["e"][-1]["metrics"]["output_throughput"], flush=True)
    ours = [r["metrics"]["output_throughput"] for r in rows["e"] if r["name"].startswith("bf16")]
    theirs = [r["metrics"]["output_throughput"] for r in rows["e"] if r["name"].startswith("hf")]
    print(f"ratio of medians {statistics.median(ours) / statistics.median(theirs):.2f}", flush=True)


def section_b(args, rows):
    spec = WorkloadSpec("sharegpt", num_requests=args.sharegpt_requests, input_len=256, output_len=128,
                        request_rate=args.sharegpt_rate, seed=0)
    base = BenchConfig(dtype="bfloat16", engine=EngineConfig(max_num_seqs=64, kv_cache_bytes=1 << 30))
    static = replace(base, engine=replace(base.engine, policy="static", max_num_seqs=32))
    for label, config in [("continuous", base), ("static", static)]:
        rows["b"].append(row(f"sharegpt {label}", bench_runtime(label, MODEL, spec, config)))
        print(label, rows["b"][-1]["metrics"]["output_throughput"], flush=True)


def section_c(args, rows):
    spec = WorkloadSpec("random", num_requests=4, input_len=128, output_len=64)
    variants = [("fp32", MODEL, "float32"), ("bf16", MODEL, "bfloat16")]
    if args.int4:
        variants.append(("int4", args.int4, "bfloat16"))
    for label, model, dtype in variants:
        config = BenchConfig(dtype=dtype, max_concurrency=1)
        rows["c"].append(row(f"batch 1 {label}", bench_runtime(label, model, spec, config)))
        m = rows["c"][-1]["metrics"]
        print(label, m["mean_ttft_ms"], m["median_tpot_ms"], flush=True)


def section_d(args, rows):
    spec = WorkloadSpec("prefix-repetition", num_requests=16, input_len=32, output_len=16, prefix_len=1024,
                        num_prefixes=2)
    for label, cache in [("prefix cache on", True), ("prefix cache off", False)]:
        config = BenchConfig(dtype="bfloat16", max_concurrency=1, engine=EngineConfig(enable_prefix_cache=cache))
        rows["d"].append(row(label, bench_runtime(label, MODEL, spec, config)))
        print(label, rows["d"][-1]["metrics"]["mean_ttft_ms"], flush=True)


TITLES = {"a": "(a) 64 requests, 128 in / 128 out", "b": "(b) ShareGPT at a loading request rate",
          "c": "(c) batch 1 (128-token prompts)", "d": "(d) prefix repetition, 1024-token shared prefixes",
          "e": "(e) (a)'s bf16 continuous vs HF, alternating runs"}


def markdown(rows: dict) -> str:
    lines = []
    for section, runs in rows.items():
        if not runs:
            continue
        lines += [f"### {TITLES[section]}", "", "| run | " + " | ".join(k[1] for k in KEYS) + " |",
                  "|---|" + "---:|" * len(KEYS)]
        for r in runs:
            cells = [(fmt.format(r["metrics"][key]) if r["metrics"].get(key) is not None else "-")
                     for key, _, fmt in KEYS]
            lines.append(f"| {r['name']} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = command_line(__doc__, default="docs/results/data/runtime.json")
    parser.add_argument("--int4", default=None, help="a GPTQ w4 artifact of SmolLM2")
    parser.add_argument("--sections", default="abcd")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--sharegpt-requests", type=int, default=200)
    parser.add_argument("--sharegpt-rate", type=float, default=8.0)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--pairs", type=int, default=3, help="section e: runtime/HF pairs")
    args = parser.parse_args()
    path = Path(args.json)
    rows = json.loads(path.read_text()) if path.exists() else {}
    rows = {s: rows.get(s, []) for s in "abcde"}
    for section in args.sections:
        rows[section] = []
        {"a": section_a, "b": section_b, "c": section_c, "d": section_d, "e": section_e}[section](args, rows)
        save_rows(path, rows)
    emit(markdown(rows), args.markdown)


if __name__ == "__main__":
    main()

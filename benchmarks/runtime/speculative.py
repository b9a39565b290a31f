"""Speculative decoding against plain decoding, each pair in one invocation (decode speedup = the plain run's mean
TPOT over the speculative run's), and whether greedy outputs stay identical.

Rows (each skipped when its model is not given):
  ngram-grounded-b1        prompt lookup, grounded workload, one request at a time, MODEL
  ngram-grounded-b1-int4   the same on --int4 (a GPTQ w4 artifact of MODEL)
  medusa-sharegpt-b1       Medusa heads (--medusa, from `llmopt distill --medusa-heads`), ShareGPT prompts
  draft-sharegpt-b1        a draft model (--draft, e.g. a distilled 6-layer student), ShareGPT prompts
  *-c64                    64 concurrent requests with the adaptive switch (throughput ratio)

    python benchmarks/runtime/speculative.py --int4 GPTQ_DIR --medusa HEADS_DIR --draft STUDENT_DIR \\
        --json docs/results/data/speculative.json
"""

from __future__ import annotations

from dataclasses import replace

from llmopt.core.hardware import cpu_line
from llmopt.eval.bench import BenchConfig, bench
from llmopt.eval.workloads import WorkloadSpec, build_workload
from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_runtime_model
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import load_rows, row_parser, save_rows

KEYS = ("output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "spec_acceptance_rate",
        "spec_mean_accepted_length", "spec_acceptance_per_position", "decode_speedup")


def same_greedy_outputs(model: str, workload: WorkloadSpec, speculative: SpeculativeConfig, dtype: str) -> bool:
    """Token-for-token equality of the workload's greedy outputs with and without speculation (batched)."""
    lm, tokenizer, _ = load_runtime_model(model, dtype=dtype)
    requests = build_workload(workload, tokenizer, lm.config.vocab_size)
    prompts = [r.prompt_token_ids for r in requests]
    params = [SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, detokenize=False) for r in requests]
    outputs = []
    for spec in (None, speculative):
        engine = Engine(lm, tokenizer, EngineConfig(max_num_seqs=len(prompts), speculative=spec))
        outputs.append([o.token_ids for o in engine.generate(prompts, params)])
    return outputs[0] == outputs[1]


def run_row(name: str, model: str, workload: WorkloadSpec, speculative: SpeculativeConfig, concurrency: int,
            dtype: str, check_outputs: bool) -> dict:
    config = BenchConfig(dtype=dtype, engine=EngineConfig(max_num_seqs=max(concurrency, 1), speculative=speculative),
                         max_concurrency=concurrency)
    spec_run, plain_run = bench(model, workload, config, baseline=model)
    row = {"name": name, "model": model, "speculative": speculative.__dict__, "concurrency": concurrency,
           "workload": workload.__dict__, "cpu": cpu_line(),
           "speculative_metrics": {k: spec_run.metrics.get(k) for k in KEYS},
           "plain_metrics": {k: plain_run.metrics.get(k) for k in KEYS},
           "throughput_ratio": spec_run.metrics["output_throughput"] / plain_run.metrics["output_throughput"]}
    if check_outputs:
        row["greedy_outputs_identical"] = same_greedy_outputs(model, workload, speculative, dtype)
    return row


def main() -> None:
    parser = row_parser(__doc__, "speculative.json")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--int4", default=None, help="a GPTQ int4 artifact of --model")
    parser.add_argument("--medusa", default=None, help="Medusa heads (a folder or file)")
    parser.add_argument("--draft", default=None, help="a draft model with --model's tokenizer")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--k", type=int, default=5, help="--num-speculative-tokens of ngram and draft")
    args = parser.parse_args()
    grounded = WorkloadSpec("grounded", args.requests, 192, args.output_len)
    sharegpt = WorkloadSpec("sharegpt", args.requests, 128, args.output_len, range_ratio=0.0)
    ngram = SpeculativeConfig("ngram", num_speculative_tokens=args.k)
    rows_wanted = [("ngram-grounded-b1", args.model, grounded, ngram, 1, True)]
    if args.int4:
        rows_wanted.append(("ngram-grounded-b1-int4", args.int4, grounded, ngram, 1, True))
    if args.medusa:
        medusa = SpeculativeConfig("medusa", args.medusa, num_speculative_tokens=3)
        rows_wanted.append(("medusa-sharegpt-b1", args.model, sharegpt, medusa, 1, True))
    if args.draft:
        draft = SpeculativeConfig("draft", args.draft, num_speculative_tokens=args.k)
        rows_wanted.append(("draft-sharegpt-b1", args.model, sharegpt, draft, 1, True))
    many = replace(grounded, num_requests=128)
    rows_wanted.append(("ngram-grounded-c64", args.model, many, ngram, 64, False))
    if args.medusa:
        rows_wanted.append(("medusa-sharegpt-c64", args.model, replace(sharegpt, num_requests=128), medusa, 64, False))
    rows = load_rows(args.json, args.resume)
    done = {r["name"] for r in rows}
    for name, model, workload, spec, concurrency, check in rows_wanted:
        if name in done or (args.only and not any(s in name for s in args.only.split(";"))):
            continue
        row = run_row(name, model, workload, spec, concurrency, args.dtype, check)
        rows.append(row)
        save_rows(args.json, rows)
        s, p = row["speculative_metrics"], row["plain_metrics"]
        print(f"{name}: TPOT {p['mean_tpot_ms']:.1f} -> {s['mean_tpot_ms']:.1f} ms "
              f"(decode speedup {s['decode_speedup']:.2f}x), throughput {row['throughput_ratio']:.2f}x, acceptance "
              f"{s['spec_acceptance_rate']:.2f}, tokens/verify {s['spec_mean_accepted_length']:.2f}, per position "
              f"{[round(a, 2) for a in s['spec_acceptance_per_position'] or []]}, identical "
              f"{row.get('greedy_outputs_identical', '-')}", flush=True)


if __name__ == "__main__":
    main()

"""Prefill/decode disaggregation against colocated serving on the same cores, under a mixed workload: --decoders
sequences decoding (--decode-prompt-token prompts, --decode-len tokens each) while --long-len-token prompts arrive
every --interval seconds (--num-long of them, --long-out tokens each). Colocated: one engine on all the cores
(chunked prefill: a long prompt shares steps with the decodes); disaggregated: `--disaggregate 1:1`, a prefill and a
decode worker on one core each. Rounds alternate the two (medians over --rounds).

Reported per configuration: the decoding sequences' inter-token gaps (p50, p99) and per-request TPOT (median,
p99), the long prompts' TTFT (median, p99), and output tok/s over the run (every request's tokens / wall time).

    python benchmarks/runtime/disagg.py --json docs/results/data/disagg.json [--model smollm2-135m] [--rounds 3]
"""

from __future__ import annotations

import random
import statistics
import time

from llmopt.core.hardware import cpu_line
from llmopt.core.io import write_json
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.fronts.create import create_engine
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

CONFIGS = {"colocated": {}, "disaggregated 1:1": {"disaggregate": "1:1"}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def drive(engine, args, seed: int) -> dict:
    """The mixed workload on one engine; returns its metrics (times in ms)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(200, 40000) for _ in range(n)]

    decode_params = SamplingParams(max_tokens=args.decode_len, ignore_eos=True)
    long_params = SamplingParams(max_tokens=args.long_out, ignore_eos=True)
    times: dict[int, list[float]] = {}
    arrivals: dict[int, float] = {}
    start = time.perf_counter()
    decoders = [engine.add_request(tokens(args.decode_prompt), decode_params) for _ in range(args.decoders)]
    due = [start + args.delay + i * args.interval for i in range(args.num_long)]
    longs = []
    while engine.has_unfinished() or due:
        now = time.perf_counter()
        while due and now >= due[0]:
            rid = engine.add_request(tokens(args.long_len), long_params, arrival_time=due[0])
            longs.append(rid)
            arrivals[rid] = due.pop(0)
        if not engine.has_unfinished():
            time.sleep(max(0.0, due[0] - now))
            continue
        for output in engine.step():
            times.setdefault(output.request_id, []).extend(output.new_token_times)
    wall = time.perf_counter() - start
    gaps = [(b - a) * 1e3 for rid in decoders for a, b in zip(times[rid], times[rid][1:])]
    tpots = [(times[rid][-1] - times[rid][0]) * 1e3 / (len(times[rid]) - 1) for rid in decoders]
    ttfts = [(times[rid][0] - arrivals[rid]) * 1e3 for rid in longs]
    return {"p50_itl_ms": percentile(gaps, 50), "p99_itl_ms": percentile(gaps, 99),
            "median_tpot_ms": statistics.median(tpots), "p99_tpot_ms": percentile(tpots, 99),
            "median_long_ttft_ms": statistics.median(ttfts), "p99_long_ttft_ms": percentile(ttfts, 99),
            "output_tok_s": sum(len(t) for t in times.values()) / wall, "wall_s": wall}


def run(model: str, settings: dict, args, seed: int) -> dict:
    engine = create_engine(model, EngineConfig(**settings), dtype=args.dtype)
    try:
        warm = SamplingParams(max_tokens=4, ignore_eos=True)
        engine.generate([list(range(300, 300 + args.long_len)), list(range(500, 564))], warm)  # kernels, caches
        engine.reset_stats(clear_prefix_cache=True)
        return drive(engine, args, seed)
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decoders", type=int, default=16)
    parser.add_argument("--decode-prompt", type=int, default=128)
    parser.add_argument("--decode-len", type=int, default=384)
    parser.add_argument("--long-len", type=int, default=2048)
    parser.add_argument("--long-out", type=int, default=16)
    parser.add_argument("--num-long", type=int, default=6)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between long prompts")
    parser.add_argument("--delay", type=float, default=2.0, help="seconds before the first long prompt")
    args = parser.parse_args()
    rows: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    for round_index in range(args.rounds):
        for name, settings in CONFIGS.items():
            metrics = run(args.model, settings, args, seed=round_index)
            rows[name].append(metrics)
            print(f"round {round_index} {name}: " + ", ".join(f"{k} {v:.1f}" for k, v in metrics.items()),
                  flush=True)
    summary = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in rows.items()}
    base, pd = summary["colocated"], summary["disaggregated 1:1"]
    ratios = {k: pd[k] / base[k] for k in base}
    print(f"\n{'metric':<22} {'colocated':>12} {'PD 1:1':>12} {'PD / colocated':>15}")
    for k in base:
        print(f"{k:<22} {base[k]:>12.1f} {pd[k]:>12.1f} {ratios[k]:>14.2f}x")
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "model": args.model, "dtype": args.dtype, "settings": vars(args),
                               "rounds": rows, "median": summary, "pd_over_colocated": ratios}, indent=1)


if __name__ == "__main__":
    main()

"""The cost of a speculative verification step against a decode step, on one request: the median step time by
the number of tokens the step computed (1: a plain decode; 6: the last token and 5 drafts verified), from the
engine's own step records, after a warm-up run.

    python benchmarks/kernels/verify_step.py [--model smollm2-135m] [--dtype float32] [--json verify_step.json]
"""

from __future__ import annotations

import json
import statistics

from llmopt.core.hardware import cpu_line
from llmopt.runtime.engine.config import EngineConfig, SpeculativeConfig
from llmopt.runtime.engine.engine import Engine
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_runtime_model
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def step_times(model, tokenizer, prompt: list[int], speculative: SpeculativeConfig | None) -> dict[int, float]:
    """Median step seconds by tokens computed, over one 64-token greedy generation (prefill step left out)."""
    engine = Engine(model, tokenizer, EngineConfig(speculative=speculative))
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    engine.generate([prompt], params)  # warm-up
    engine.reset_stats()
    engine.generate([prompt], params)
    by_tokens: dict[int, list[float]] = {}
    for step in engine.stats().steps[1:]:
        by_tokens.setdefault(step.num_prefill_tokens + step.num_decode_tokens, []).append(step.duration)
    return {n: statistics.median(times) for n, times in sorted(by_tokens.items())}


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    model, tokenizer, _ = load_runtime_model(args.model, dtype=args.dtype)
    prompt = tokenizer("def f(a, b):\n    return a + b\n" * 12)["input_ids"]  # prompt lookup always matches
    plain = step_times(model, tokenizer, prompt, None)
    spec = step_times(model, tokenizer, prompt, SpeculativeConfig("ngram", num_speculative_tokens=5, adaptive=False))
    result = {"cpu": cpu_line(), "model": args.model, "dtype": args.dtype,
              "plain_ms": {n: 1000 * t for n, t in plain.items()},
              "speculative_ms": {n: 1000 * t for n, t in spec.items()}}
    print(f"decode step (1 token): {1000 * plain[1]:.1f} ms; verification step (6 tokens): "
          f"{1000 * spec.get(6, float('nan')):.1f} ms ({spec.get(6, float('nan')) / plain[1]:.2f}x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

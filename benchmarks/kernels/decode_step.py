"""Decode-step time of the runtime on SmolLM2-135M at several batch sizes, with the CPU fast path on and off:
the profile-driven record of what each runtime optimisation buys (docs/results/runtime.md).

    python benchmarks/kernels/decode_step.py [--int4 ARTIFACT] --json docs/results/data/decode_step.json
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path


from llmopt.runtime.executor.loader import load_runtime_model
from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def step_ms(model, tokenizer, batch: int, fast: bool | None, steps: int = 10, prompt_len: int = 128) -> float:
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=max(batch, 1), kv_cache_bytes=1 << 29,
                                                   fast_path=fast))
    rng = random.Random(0)
    waiting = {engine.add_request([rng.randrange(100, 40000) for _ in range(prompt_len)],
                                  SamplingParams(max_tokens=steps + 8, ignore_eos=True, detokenize=False))
               for _ in range(batch)}
    while waiting:  # prefill everything: each request has its first token
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(2):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps * 1000


def main() -> None:
    parser = command_line(__doc__, default="docs/results/data/decode_step.json")
    parser.add_argument("--int4", default=None)
    parser.add_argument("--batches", default="1,16,64")
    args = parser.parse_args()
    variants = [("fp32", "smollm2-135m", "float32", None), ("bf16 plain", "smollm2-135m", "bfloat16", False),
                ("bf16 fast path", "smollm2-135m", "bfloat16", True)]
    if args.int4:
        variants += [("int4 (bf16 act.) plain", args.int4, "bfloat16", False),
                     ("int4 (bf16 act.) fast path", args.int4, "bfloat16", True)]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    for label, name, dtype, fast in variants:
        model, tokenizer, _ = load_runtime_model(name, dtype=dtype)
        row = {"variant": label, **{f"B={b} ms/step": round(step_ms(model, tokenizer, b, fast), 1) for b in batches}}
        rows.append(row)
        print(row, flush=True)
    from llmopt.core.hardware import cpu_line

    Path(args.json).write_text(json.dumps({"cpu": cpu_line(), "rows": rows}, indent=1))
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|---|" + "---:|" * (len(keys) - 1))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()

"""Where GPTQ's calibration time goes on SmolLM2-135M: total wall time over the first N decoder layers, and the
time inside the Hessian accumulation, the GPTQ solve and its MSE range search (the rest is the forwards).
Run it alternately on two checkouts to compare them under the same machine conditions (this machine's speed
drifts by 10-50% over an hour, so only paired runs compare).

    python benchmarks/studies/calibration_phases.py --layers 6 [--no-gptaq] [--json out.json]
"""

from __future__ import annotations

import collections
import json
import time
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--no-gptaq", action="store_true")
    args = parser.parse_args()

    import llmopt.compress.gptq as gptq
    import llmopt.compress.hessian as hessian
    from llmopt.compress.api import make_config, quantize_model
    from llmopt.formats.load import load_model

    phases: collections.Counter = collections.Counter()

    def timed(owner, name, phase):
        inner = getattr(owner, name)

        def wrapper(*a, **k):
            start = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                phases[phase] += time.perf_counter() - start
        setattr(owner, name, wrapper)

    timed(hessian.HessianAccumulator, "add", "hessian_s")
    timed(gptq, "gptq_quantize_weight", "gptq_solve_s")
    timed(gptq, "mse_qparams", "mse_search_s")  # inside the solve
    model, tokenizer, _ = load_model("smollm2-135m")
    model.model.layers = model.model.layers[: args.layers]
    model.config.num_hidden_layers = args.layers
    config = make_config("gptq", bits=4, group_size=64, gptaq=not args.no_gptaq)
    start = time.perf_counter()
    quantize_model(model, tokenizer, config)
    from llmopt.core.hardware import cpu_line

    print(f"CPU: {cpu_line()}")
    result = {"layers": args.layers, "gptaq": not args.no_gptaq, "total_s": time.perf_counter() - start,
              **{k: round(v, 2) for k, v in phases.items()}}
    print("| " + " | ".join(result) + " |\n|" + "---|" * len(result))
    print("| " + " | ".join(f"{v:.1f}" if isinstance(v, float) else str(v) for v in result.values()) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()

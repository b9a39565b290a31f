"""The capacity planner's predictions against what the runtime measures on this CPU: each configuration is run
with the bench driver (`llmopt bench`'s) and predicted by `llmopt plan`'s model with this machine's measured rates
(`--hardware cpu`); the table gives both and the error of each prediction (the issue's target: within 20%).

    python benchmarks/runtime/planner.py --json docs/results/data/planner.json [--model smollm2-135m]
        [--only fp32-b1,int4-b64,...] [--measured docs/results/data/planner.json: predict again, no runs]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from llmopt.core.hardware import cpu_line
from llmopt.core.io import write_json
from llmopt.eval.bench import BenchConfig, WorkloadSpec, bench_runtime
from llmopt.planner import Deployment, PlanWorkload, Slo, hardware_spec, model_shape, predict
from llmopt.runtime.engine.config import EngineConfig
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

BATCH1 = WorkloadSpec(num_requests=4, input_len=128, output_len=128)
BATCH64 = WorkloadSpec(num_requests=64, input_len=128, output_len=128)
# name -> (weights: "dense" or "int4", dtype, EngineConfig settings, workload, concurrency, planner scheme)
CONFIGS = {
    "fp32-b1": ("dense", "float32", {}, BATCH1, 1, "fp32"),
    "fp32-b64": ("dense", "float32", {}, BATCH64, 64, "fp32"),
    "fp32-kvint8-b64": ("dense", "float32", {"kv_cache_dtype": "int8"}, BATCH64, 64, "fp32"),
    "bf16-b1": ("dense", "bfloat16", {}, BATCH1, 1, "bf16"),
    "bf16-b64": ("dense", "bfloat16", {}, BATCH64, 64, "bf16"),
    "int4-b1": ("int4", "float32", {}, BATCH1, 1, "int4-g64"),
    "int4-b64": ("int4", "float32", {}, BATCH64, 64, "int4-g64"),
    "fp32-tp2-b1": ("dense", "float32", {"tensor_parallel_size": 2}, BATCH1, 1, "fp32"),
    "fp32-tp2-b64": ("dense", "float32", {"tensor_parallel_size": 2}, BATCH64, 64, "fp32"),
    "fp32-dp2-b64": ("dense", "float32", {"data_parallel_size": 2}, BATCH64, 64, "fp32"),
    "fp32-pd11-b64": ("dense", "float32", {"disaggregate": "1:1"}, BATCH64, 64, "fp32"),
}


def int4_artifact(model: str, folder: Path) -> str:
    from llmopt.compress.api import make_config
    from llmopt.jobs.quantize import quantize_to_artifact

    out = folder / "rtn-w4g64"
    quantize_to_artifact(model, out, [make_config("rtn", bits=4, group_size=64)])
    return str(out)


def prediction(model: str, name: str) -> dict:
    _, dtype, settings, spec, concurrency, scheme = CONFIGS[name]
    hardware = hardware_spec("cpu")
    hardware = hardware.model_copy(update={"activation_dtype": "fp32" if dtype == "float32" else "bf16"})
    kv = settings.get("kv_cache_dtype", "fp32" if dtype == "float32" else "bf16")
    dp = settings.get("data_parallel_size", 1)
    pd = EngineConfig(**settings).disaggregation  # (prefill, decode) workers; the decode one holds the batch
    deployment = Deployment(scheme, kv, tp=settings.get("tensor_parallel_size", 1), dp=dp,
                            batch=concurrency // (pd[1] if pd else dp), pd=pd)
    workload = PlanWorkload(name, spec.input_len, spec.output_len, concurrency, burst=concurrency > 1)
    p = predict(model_shape(model), hardware, workload, Slo(), deployment)
    return {"tpot_ms": p.tpot_ms, "ttft_ms": p.ttft_ms, "output_tok_s": p.output_tok_s}


def measurement(model: str, name: str) -> dict:
    _, dtype, settings, spec, concurrency, _ = CONFIGS[name]
    config = BenchConfig(dtype=dtype, engine=EngineConfig(**settings), max_concurrency=concurrency)
    m = bench_runtime(name, model, spec, config).metrics
    return {"tpot_ms": m["median_tpot_ms"], "ttft_ms": m["median_ttft_ms"], "output_tok_s": m["output_throughput"]}


def main() -> None:
    parser = command_line(__doc__, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--only", default=",".join(CONFIGS))
    parser.add_argument("--measured", type=Path, help="predict again against the measurements in this JSON (one "
                        "written by --json on this machine) instead of measuring")
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    names = args.only.split(",")
    before = {r["configuration"]: r["measured"] for r in json.loads(args.measured.read_text())["rows"]} \
        if args.measured else {}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        needs_int4 = any(CONFIGS[n][0] == "int4" for n in names)
        # (the planner reads only the config, the same for the int4 artifact)
        quantized = int4_artifact(args.model, Path(folder)) if needs_int4 and not args.measured else args.model
        for name in names:
            model = quantized if CONFIGS[name][0] == "int4" else args.model
            predicted = prediction(model, name)
            measured = before[name] if args.measured else measurement(model, name)
            errors = {k: predicted[k] / measured[k] - 1 for k in predicted}
            rows.append({"configuration": name, "predicted": predicted, "measured": measured, "error": errors})
            print(name, rows[-1], flush=True)
    print("\n| configuration | TPOT ms predicted / measured | error | TTFT ms predicted / measured | error | "
          "output tok/s predicted / measured | error |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        p, m, e = r["predicted"], r["measured"], r["error"]
        print(f"| {r['configuration']} | {p['tpot_ms']:.1f} / {m['tpot_ms']:.1f} | {e['tpot_ms']:+.0%} | "
              f"{p['ttft_ms']:.0f} / {m['ttft_ms']:.0f} | {e['ttft_ms']:+.0%} | "
              f"{p['output_tok_s']:.1f} / {m['output_tok_s']:.1f} | {e['output_tok_s']:+.0%} |")
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "hardware": hardware_spec("cpu").model_dump(), "rows": rows})


if __name__ == "__main__":
    main()

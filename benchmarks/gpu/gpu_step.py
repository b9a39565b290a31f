"""Decode-step time of the runtime on a GPU, and where a batch-1 step's time goes: the wall time of a step at
several batch sizes, then one batch-1 window under torch.profiler — the GPU's busy time against the step's
wall time, the kernels launched per step, the kernels that take the GPU's time and the host-side operations
that take the CPU's.

    python benchmarks/gpu/gpu_step.py MODEL [MODEL ...] --json out.json   (scripts/gpu_check.sh runs it)
    python benchmarks/gpu/gpu_step.py MODEL --device cpu --batches 1 --steps 3   (a dry run without a GPU)
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

from llmopt.runtime.engine.engine import Engine, EngineConfig
from llmopt.runtime.engine.sampling import SamplingParams
from llmopt.runtime.executor.loader import load_runtime_model
import sys

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


# the numerics paths compared: EngineConfig settings of each
PATHS = {"exact": {"fast_path": False, "enforce_eager": True}, "fused": {"fast_path": True, "enforce_eager": True},
         "graphs": {"fast_path": True, "enforce_eager": False}}


def decoding_engine(model, tokenizer, batch: int, steps: int, prompt_len: int, settings: dict) -> Engine:
    """An engine whose `batch` requests are past their prefill, each with room for 3 x `steps` + 8 more tokens
    (timed, profiled, cProfiled); settings: PATHS' EngineConfig fields of the path."""
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=batch, kv_cache_bytes=1 << 30, **settings))
    rng = random.Random(0)
    waiting = {engine.add_request([rng.randrange(engine.vocab_size) for _ in range(prompt_len)],
                                  SamplingParams(max_tokens=3 * steps + 8, ignore_eos=True, detokenize=False))
               for _ in range(batch)}
    while waiting:
        waiting -= {o.request_id for o in engine.step() if o.new_token_ids}
    for _ in range(2):  # warm-up decode steps (kernels compiled, caches allocated)
        engine.step()
    return engine


def step_ms(engine: Engine, steps: int, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    sync(device)
    return (time.perf_counter() - start) / steps * 1000


def profile_steps(engine: Engine, steps: int, device: str, top: int) -> dict:
    """One profiled window of `steps` decode steps: per-step wall and GPU-busy ms, kernels per step, the top
    kernels by GPU time and the top operations by the host's own time."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    wall = (time.perf_counter() - start) / steps * 1000
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in kernels) / steps / 1000
    averages = prof.key_averages()
    device_total = (lambda a: getattr(a, "device_time_total", getattr(a, "cuda_time_total", 0.0)))
    by_gpu = sorted((a for a in averages if device_total(a) > 0), key=device_total, reverse=True)[:top]
    by_host = sorted(averages, key=lambda a: a.self_cpu_time_total, reverse=True)[:top]
    host_ops = sum(a.self_cpu_time_total for a in averages) / steps / 1000
    return {
        "profiled_step_ms": round(wall, 3), "gpu_busy_ms": round(busy, 3), "host_ops_ms": round(host_ops, 3),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "top_gpu": [(a.key[:70], round(device_total(a) / steps / 1000, 4), a.count // steps) for a in by_gpu],
        "top_host_self": [(a.key[:70], round(a.self_cpu_time_total / steps / 1000, 4), a.count // steps)
                          for a in by_host],
    }


def python_profile(engine: Engine, steps: int, top: int) -> list:
    """The Python functions with the most own time over `steps` decode steps (cProfile): ms per step, calls."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        engine.step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # {(file, line, name): (calls, prim calls, tottime, cumtime, callers)}
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [(f"{Path(f).name}:{line} {name}"[:70], round(tt / steps * 1000, 4), calls // steps)
            for (f, line, name), (calls, _, tt, _, _) in rows]


def main() -> None:
    parser = command_line(__doc__, default=None)
    parser.add_argument("models", nargs="+", help="checkpoint folders or artifacts (dense fp16 first, say)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="float16")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--paths", default="exact,fused,graphs",
                        help="paths to run: exact (--no-fast-path --enforce-eager), fused (the fused Triton ops, "
                        "--enforce-eager), graphs (fused, decode steps replayed as CUDA graphs: the GPU's default)")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    results = []
    for name, path in ((n, p) for n in args.models for p in args.paths.split(",")):
        model, tokenizer, _ = load_runtime_model(name, dtype=args.dtype, device=args.device)
        row = {"model": name, "path": path}
        for batch in batches:
            engine = decoding_engine(model, tokenizer, batch, args.steps, args.prompt_len, PATHS[path])
            row[f"B={batch} ms/step"] = round(step_ms(engine, args.steps, args.device), 3)
            if batch == 1:
                row["profile B=1"] = profile_steps(engine, args.steps, args.device, args.top)
                row["profile B=1"]["top_python_self"] = python_profile(engine, args.steps, args.top)
            engine.close()
        results.append(row)
        steps = ", ".join(f"{k} {v}" for k, v in row.items() if k.endswith("ms/step"))
        print(f"{name} ({path} path): {steps}", flush=True)
        prof = row.get("profile B=1")
        if prof:
            print(f"  batch-1 step under the profiler: {prof['profiled_step_ms']} ms wall, GPU busy "
                  f"{prof['gpu_busy_ms']} ms, torch ops on the host {prof['host_ops_ms']} ms, "
                  f"{prof['kernels_per_step']} kernels per step")
            for title, key in (("GPU time per step (ms, calls)", "top_gpu"),
                               ("host self time per step (ms, calls)", "top_host_self"),
                               ("Python functions' own time per step (ms, calls; cProfile)", "top_python_self")):
                print(f"  {title}:")
                for op, ms, calls in prof[key]:
                    print(f"    {ms:9.4f}  {calls:5d}  {op}")
    info = {"device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
            "torch": torch.__version__, "dtype": args.dtype, "prompt_len": args.prompt_len, "rows": results}
    if args.json:
        Path(args.json).write_text(json.dumps(info, indent=1))


if __name__ == "__main__":
    main()

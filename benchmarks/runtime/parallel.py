"""Parallelism on the CPUs of one machine: 2 ranks / stages / replicas of one core each against one process on
all the cores, on the same model, alternating runs (medians of --rounds).

- tp: `--tensor-parallel-size 2`; batch 1 (one 128-token prompt at a time, 128 generated: TPOT) and batch 64
  (64 x 128/128 at once: output tok/s), with the share of rank 0's step time spent in all-reduces (waiting for
  the other rank included: an unbalanced split shows here); and the all-reduce's own cost, measured alone between
  two processes on two cores (the compiled shared-memory path, and gloo's);
- dp: `--data-parallel-size 2`; 256 short requests (64 in / 32 out, all at once): output tok/s and p99 TTFT; and
  a shared-prefix workload (64 requests, 4 prefixes of 512 tokens + 32, 16 out): the prefix-cache hit rate that
  prefix-affinity routing keeps;
- pp: `--pipeline-parallel-size 2` on 64 x 128/128: output tok/s.

    python benchmarks/runtime/parallel.py --json docs/results/data/parallel.json [--model smollm2-135m] [--rounds 2]
        [--sections tp,dp,pp] [--workloads batch1,batch64,short256,prefix]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from llmopt.core.hardware import cpu_line
from llmopt.core.io import write_json
from llmopt.eval.bench import BenchConfig, WorkloadSpec, bench_runtime
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.distributed.group import SharedMemoryAllReduce

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line  # noqa: E402

WORKLOADS = {"batch1": WorkloadSpec(num_requests=4, input_len=128, output_len=128),
             "batch64": WorkloadSpec(num_requests=64, input_len=128, output_len=128),
             "short256": WorkloadSpec(num_requests=256, input_len=64, output_len=32),
             "prefix": WorkloadSpec(dataset="prefix-repetition", num_requests=64, input_len=32, output_len=16,
                                    prefix_len=512, num_prefixes=4)}
CONCURRENCY = {"batch1": 1}
HIDDEN = 576  # SmolLM2's hidden size: a batch-1 all-reduce moves one row of it
METRICS = ("median_tpot_ms", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "all_reduce_share",
           "prefix_cache_hit_rate")
# section -> (the configurations compared, first the baseline, as EngineConfig settings; workloads)
SECTIONS = {"tp": ([{}, {"tensor_parallel_size": 2}], ["batch1", "batch64"]),
            "dp": ([{}, {"data_parallel_size": 2}], ["short256", "prefix"]),
            "pp": ([{}, {"pipeline_parallel_size": 2}], ["batch64"])}


def label(settings: dict) -> str:
    return ",".join(f"{k.split('_')[0]}={v}" for k, v in settings.items()) or "one process"


def run(model: str, settings: dict, workload: str) -> dict:
    config = BenchConfig(engine=EngineConfig(**settings), max_concurrency=CONCURRENCY.get(workload))
    m = bench_runtime(f"{label(settings)}-{workload}", model, WORKLOADS[workload], config).metrics
    return {k: m.get(k) for k in METRICS}


def _peer(name: str | None, rounds: int, numel: int, port: int) -> None:
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    torch.set_num_threads(1)
    x = torch.ones(numel)
    if name is not None:
        shm = SharedMemoryAllReduce(1, 2, name)
        for _ in range(rounds):
            shm.all_reduce_(x)
        return
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    for _ in range(rounds):
        dist.all_reduce(x)
    dist.destroy_process_group()


def all_reduce_cost(kind: str, numel: int, rounds: int) -> float:
    """Microseconds per all-reduce of `numel` fp32 values between this process (core 0) and a peer (core 1)."""
    from llmopt.runtime.executor.placement import free_port

    before = os.sched_getaffinity(0), torch.get_num_threads()
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    port = free_port()
    shm = SharedMemoryAllReduce(0, 2) if kind == "shm" else None
    peer = mp.get_context("spawn").Process(target=_peer, args=(shm.name if shm else None, rounds, numel, port))
    peer.start()
    x = torch.ones(numel)
    if shm is None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)
        reduce = dist.all_reduce
    else:
        reduce = shm.all_reduce_
    warm = rounds // 10
    for _ in range(warm):
        reduce(x)
    started = time.perf_counter()
    for _ in range(rounds - warm):
        reduce(x)
    elapsed = (time.perf_counter() - started) / (rounds - warm)
    peer.join()
    if shm is not None:
        shm.close(unlink=True)
    else:
        dist.destroy_process_group()
    os.sched_setaffinity(0, before[0])
    torch.set_num_threads(before[1])
    return elapsed * 1e6


def main() -> None:
    parser = command_line(__doc__, type=Path)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--sections", default="tp,dp,pp")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="run only these of each section's")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    cost = {f"{kind}_{rows}rows_us": all_reduce_cost(kind, rows * HIDDEN, 2000 if kind == "shm" else 300)
            for kind in ("shm", "gloo") for rows in (1, 64)}
    print(json.dumps(cost), flush=True)
    runs: dict[str, list[dict]] = {}
    for section in args.sections.split(","):
        configs, workloads = SECTIONS[section]
        workloads = [w for w in workloads if w in args.workloads.split(",")]
        for _ in range(args.rounds):  # alternating: the machine's drift falls on both sides
            for workload in workloads:
                for settings in configs:
                    key = f"{section}:{label(settings)}:{workload}"
                    runs.setdefault(key, []).append(run(args.model, settings, workload))
                    print(key, runs[key][-1], flush=True)
    medians = {key: {m: statistics.median(v) if (v := [r[m] for r in rs if r[m] is not None]) else None
                     for m in METRICS} for key, rs in runs.items()}
    table = []
    print("\n| section | configuration | workload | TPOT ms (median) | out tok/s | TTFT p99 ms | all-reduce share "
          "| prefix hit rate | vs one process |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for key, m in medians.items():
        section, config, workload = key.split(":")
        base = medians[f"{section}:one process:{workload}"]
        ratio = (m["median_tpot_ms"] / base["median_tpot_ms"] if workload == "batch1"
                 else m["output_throughput"] / base["output_throughput"])
        row = {"section": section, "configuration": config, "workload": workload, **m,
               "ratio": ratio, "ratio_of": "TPOT" if workload == "batch1" else "throughput"}
        table.append(row)
        share = "-" if m["all_reduce_share"] is None else f"{m['all_reduce_share']:.1%}"
        print(f"| {section} | {config} | {workload} | {m['median_tpot_ms']:.1f} | {m['output_throughput']:.1f} | "
              f"{m['p99_ttft_ms']:.0f} | {share} | {m['prefix_cache_hit_rate']:.3f} | "
              f"{ratio:.2f}x {row['ratio_of']} |")
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "model": args.model, "command": " ".join(sys.argv),
                               "all_reduce_cost": cost, "runs": runs, "table": table})


if __name__ == "__main__":
    main()

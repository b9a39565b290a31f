"""Tensor parallelism on the CPUs of one machine: N ranks of one core share (`--tensor-parallel-size N`) against
one process on all the cores, on the same model, alternating runs (medians of --rounds).

- batch 1: one 128-token prompt, 128 generated tokens: TPOT;
- batch 64: 64 x 128/128 requests at once: output tok/s;
each with the share of rank 0's step time spent in all-reduces (waiting for the other ranks included: an
unbalanced split shows here) and the all-reduce's own cost, measured alone between two processes on two cores
(the compiled shared-memory path, and gloo's for comparison).

    python benchmarks/parallel.py --json docs/results/data/parallel.json [--model smollm2-135m] [--rounds 2]
"""

from __future__ import annotations

import argparse
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
from llmopt.eval.speed import BenchConfig, WorkloadSpec, bench_runtime
from llmopt.runtime.engine.config import EngineConfig
from llmopt.runtime.parallel.group import SharedMemoryAllReduce

WORKLOADS = {"batch1": WorkloadSpec(num_requests=4, input_len=128, output_len=128),
             "batch64": WorkloadSpec(num_requests=64, input_len=128, output_len=128)}
CONCURRENCY = {"batch1": 1, "batch64": 64}
HIDDEN = 576  # SmolLM2's hidden size: a batch-1 all-reduce moves one row of it


def run(model: str, tp: int, workload: str) -> dict:
    config = BenchConfig(engine=EngineConfig(tensor_parallel_size=tp), max_concurrency=CONCURRENCY[workload])
    m = bench_runtime(f"tp{tp}-{workload}", model, WORKLOADS[workload], config).metrics
    return {"median_tpot_ms": m["median_tpot_ms"], "output_throughput": m["output_throughput"],
            "median_ttft_ms": m["median_ttft_ms"], "all_reduce_share": m.get("all_reduce_share")}


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
    from llmopt.runtime.parallel.workers import free_port

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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(cpu_line(), flush=True)
    cost = {f"{kind}_{rows}rows_us": all_reduce_cost(kind, rows * HIDDEN, 2000 if kind == "shm" else 300)
            for kind in ("shm", "gloo") for rows in (1, 64)}
    print(json.dumps(cost), flush=True)
    runs: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for workload in WORKLOADS:
            for tp in (1, args.tp):
                key = f"tp{tp}-{workload}"
                runs.setdefault(key, []).append(run(args.model, tp, workload))
                print(key, runs[key][-1], flush=True)

    def median(key: str, metric: str):
        values = [r[metric] for r in runs[key] if r[metric] is not None]
        return statistics.median(values) if values else None

    rows = []
    print("\n| configuration | batch-1 TPOT ms | 64 x 128/128 out tok/s | all-reduce share (b1 / b64) |")
    print("|---|---:|---:|---:|")
    for tp in (1, args.tp):
        row = {"tp": tp, "tpot_ms": median(f"tp{tp}-batch1", "median_tpot_ms"),
               "throughput": median(f"tp{tp}-batch64", "output_throughput"),
               "share_b1": median(f"tp{tp}-batch1", "all_reduce_share"),
               "share_b64": median(f"tp{tp}-batch64", "all_reduce_share")}
        rows.append(row)
        share = "-" if row["share_b1"] is None else f"{row['share_b1']:.1%} / {row['share_b64']:.1%}"
        print(f"| TP={tp} ({'1 core per rank' if tp > 1 else 'all cores'}) | {row['tpot_ms']:.1f} | "
              f"{row['throughput']:.1f} | {share} |")
    base, tp_row = rows
    ratios = {"tpot_ratio": tp_row["tpot_ms"] / base["tpot_ms"], "throughput_ratio": tp_row["throughput"] / base["throughput"]}
    print(json.dumps(ratios))
    if args.json:
        write_json(args.json, {"cpu": cpu_line(), "model": args.model, "command": " ".join(sys.argv),
                               "all_reduce_cost": cost, "runs": runs, "rows": rows, **ratios})


if __name__ == "__main__":
    main()

"""What every benchmark script shares: its command line (`command_line`: described by the script's docstring,
with `--json`, where its figures go), and for the row-by-row scripts their common options (`row_parser`) and a
JSON of rows written after every row (atomically, so an interrupted run keeps what finished; `--resume` skips rows
already there). Scripts in benchmarks/AREA/ import it after `sys.path` names this folder (their first lines)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from llmopt.core.io import write_json, write_text

ROOT = Path(__file__).resolve().parents[1]  # the repository


def command_line(doc: str, **json_option) -> argparse.ArgumentParser:
    """A parser described by the first line of a script's docstring, with `--json` (json_option: its
    add_argument keywords: default, type, required, help)."""
    parser = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    parser.add_argument("--json", **json_option)
    return parser


def row_parser(description: str, json_default: str) -> argparse.ArgumentParser:
    parser = command_line(description, default=json_default)
    parser.add_argument("--markdown", default=None)
    parser.add_argument("--eval-tokens", type=int, default=32768)
    parser.add_argument("--num-samples", type=int, default=128)
    parser.add_argument("--only", default=None, help="semicolon-separated substrings of row names")
    parser.add_argument("--resume", action="store_true")
    return parser


def load_rows(path: str | Path, resume: bool):
    path = Path(path)
    return json.loads(path.read_text()) if resume and path.exists() else []


def save_rows(path: str | Path, rows) -> None:
    write_json(path, rows, indent=1)


def emit(table: str, markdown_path: str | None) -> None:
    print(table)
    if markdown_path:
        write_text(markdown_path, table + "\n")


def concurrency_run(model: str, concurrency: int, input_len: int, output_len: int, dtype: str,
                    linear_kernels: str = "measured") -> dict:
    """One `llmopt bench`-style run of `model` with `concurrency` clients (random prompts, EOS ignored): throughput,
    TPOT, TTFT and the kernels each linear shape chose per row bucket."""
    from llmopt.eval.bench import BenchConfig, bench_runtime
    from llmopt.eval.workloads import WorkloadSpec
    from llmopt.runtime.engine.config import EngineConfig

    spec = WorkloadSpec("random", num_requests=max(4, concurrency), input_len=input_len, output_len=output_len)
    engine = EngineConfig(max_num_seqs=concurrency, kv_cache_bytes=1 << 30, linear_kernels=linear_kernels)
    run = bench_runtime(model, model, spec, BenchConfig(dtype=dtype, engine=engine, max_concurrency=concurrency))
    return {"model": model, "concurrency": concurrency, "output_throughput": run.metrics["output_throughput"],
            "median_tpot_ms": run.metrics["median_tpot_ms"], "mean_ttft_ms": run.metrics["mean_ttft_ms"],
            "linear_paths": run.config["numerics"]["linear_paths"]}


def alternating_rounds(variants: dict[str, str], levels: list[int], rounds: int, measure, save) -> list[dict]:
    """measure(model, level) for every variant at every level, `rounds` times, the variants' order reversed every
    other round (the machine's drift falls on each alike); save(rows) after each row."""
    rows = []
    for round_index in range(rounds):
        for level in levels:
            order = list(variants) if round_index % 2 == 0 else list(reversed(variants))
            for variant in order:
                row = {"variant": variant, "round": round_index, **measure(variants[variant], level)}
                rows.append(row)
                print(f"round {round_index} concurrency {level} {variant}: {row['output_throughput']:.1f} tok/s, "
                      f"TPOT {row['median_tpot_ms']:.2f} ms", flush=True)
                save(rows)
    return rows

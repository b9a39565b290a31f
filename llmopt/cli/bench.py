"""`llmopt bench`: drive the runtime with a workload; latency, throughput, goodput, utilization, engine state,
and the same for a baseline side by side."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmopt.cli.options import (
    DEFAULT_DEVICE, DeviceOpt, Dtype, DtypeOpt, ModelArg, SeedOpt, resolve_dtype_option, with_engine_options,
)

SHOWN = [  # (metric key, label) in the terminal table
    ("request_throughput", "requests/s"), ("output_throughput", "output tok/s"),
    ("total_token_throughput", "total tok/s"), ("request_goodput", "goodput req/s"),
    ("prefill_throughput", "prefill tok/s"), ("decode_throughput", "decode tok/s"),
    ("mean_ttft_ms", "TTFT mean ms"), ("median_ttft_ms", "TTFT median ms"), ("p99_ttft_ms", "TTFT p99 ms"),
    ("mean_tpot_ms", "TPOT mean ms"), ("median_tpot_ms", "TPOT median ms"), ("p99_tpot_ms", "TPOT p99 ms"),
    ("median_added_ttft_ms", "TTFT added by HTTP, median ms"),
    ("mean_itl_ms", "ITL mean ms"), ("p99_itl_ms", "ITL p99 ms"), ("mean_e2el_ms", "E2E mean ms"),
    ("spec_acceptance_rate", "spec acceptance"), ("spec_mean_accepted_length", "spec tokens/verify"),
    ("decode_speedup", "decode speedup"), ("mbu", "MBU"), ("mfu", "MFU"), ("num_preemptions", "preemptions"),
    ("prefix_cache_hit_rate", "prefix hit rate"), ("mean_batch_size", "mean batch"),
    ("max_kv_cache_usage", "max KV usage"), ("duration", "duration s"),
]


@with_engine_options
def bench(
    model: ModelArg,
    dataset: Annotated[str, typer.Option(
        "--dataset", help="random, sharegpt, grounded (prompts whose answer copies them) or prefix-repetition.")
    ] = "random",
    dataset_path: Annotated[Optional[str], typer.Option(
        "--dataset-path", help="ShareGPT-format .json file (default: the data dir's).")] = None,
    num_requests: Annotated[int, typer.Option("--num-requests")] = 64,
    input_len: Annotated[int, typer.Option("--input-len", help="Prompt tokens (suffix tokens with prefixes).")] = 128,
    output_len: Annotated[int, typer.Option("--output-len")] = 128,
    range_ratio: Annotated[float, typer.Option("--range-ratio", help="Lengths vary by +- this fraction.")] = 0.0,
    prefix_len: Annotated[int, typer.Option("--prefix-len", help="prefix-repetition: shared prefix tokens.")] = 1024,
    num_prefixes: Annotated[int, typer.Option("--num-prefixes", help="prefix-repetition: distinct prefixes.")] = 4,
    request_rate: Annotated[float, typer.Option("--request-rate", help="Poisson arrivals per second; inf = all "
                                                "at once.")] = float("inf"),
    max_concurrency: Annotated[Optional[int], typer.Option("--max-concurrency")] = None,
    baseline: Annotated[Optional[str], typer.Option(
        "--baseline", help="'hf' (transformers generate, static batches), another MODEL on the runtime (without "
        "--speculative, with the KV cache in the model's dtype), or with --base-url another server's URL.")] = None,
    hf_batch_size: Annotated[int, typer.Option("--hf-batch-size", help="Static batch size of --baseline hf.")] = 32,
    slo: Annotated[Optional[str], typer.Option("--slo", help="Goodput SLOs in ms, e.g. ttft=200,tpot=50.")] = None,
    peak_bandwidth: Annotated[Optional[float], typer.Option("--peak-bandwidth", help="GB/s (else measured).")] = None,
    peak_flops: Annotated[Optional[float], typer.Option("--peak-flops", help="TFLOP/s (else measured).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", help="torch threads (default: torch's).")] = None,
    base_url: Annotated[Optional[str], typer.Option(
        "--base-url", help="Bench an OpenAI-compatible server over HTTP (e.g. http://127.0.0.1:8000/v1) instead "
        "of the runtime in this process; MODEL then only gives the tokenizer.")] = None,
    endpoint: Annotated[str, typer.Option("--endpoint", help="With --base-url: completions or chat.")] = "completions",
    served_model: Annotated[Optional[str], typer.Option(
        "--model", help="With --base-url: the served model name (default: MODEL).")] = None,
    api_key: Annotated[Optional[str], typer.Option("--api-key", help="With --base-url: the server's key.")] = None,
    dtype: DtypeOpt = Dtype.auto,
    device: DeviceOpt = DEFAULT_DEVICE,
    seed: SeedOpt = 0,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write every run and request here.")] = None,
    engine=None,
) -> None:
    """Benchmark MODEL on the runtime (and a baseline), with vLLM's serving metrics."""
    from llmopt.cli.output import progress_bar, stderr, stdout
    from llmopt.core.errors import ConfigError
    from llmopt.eval.metrics import parse_slo
    from llmopt.eval.bench import BenchConfig, HttpTarget
    from llmopt.eval.bench import bench as run_bench
    from llmopt.eval.workloads import WorkloadSpec

    if json_out is not None:
        from llmopt.core.io import check_not_inside, check_output_file

        check_output_file(json_out, "--json file")  # before minutes of benchmarking, not after
        if Path(model).expanduser().is_dir():  # (a results file inside the model's folder would change it)
            check_not_inside(json_out, model, "benchmarked model")
    if dataset == "sharegpt" and dataset_path and not Path(dataset_path).is_file():
        raise ConfigError(f"--dataset-path {dataset_path} does not exist")
    spec = WorkloadSpec(dataset, num_requests, input_len, output_len, range_ratio, prefix_len, num_prefixes,
                        request_rate, seed, dataset_path)
    slo_pairs = tuple(parse_slo(slo).items())
    if engine.speculative is not None and base_url:
        raise ConfigError("--speculative configures the runtime in this process: give it to `llmopt serve` instead "
                          "of --base-url")
    config = BenchConfig(
        dtype=resolve_dtype_option(dtype, device), device=device, engine=engine, max_concurrency=max_concurrency,
        hf_batch_size=hf_batch_size, slo=slo_pairs,
        peak_bandwidth=peak_bandwidth * 1e9 if peak_bandwidth else None,
        peak_flops=peak_flops * 1e12 if peak_flops else None, num_threads=threads)
    from llmopt.core.hardware import cpu_line

    stderr.print(f"CPU: {cpu_line()}", highlight=False, markup=False, soft_wrap=True)
    with progress_bar("requests") as update:
        target = HttpTarget(base_url, endpoint, served_model, api_key) if base_url else None
        runs = run_bench(model, spec, config, baseline, update, target)
    for run in runs:
        if "kv_cache" in run.config:
            stderr.print(f"{run.name}: {run.config['kv_cache']}", highlight=False, markup=False, soft_wrap=True)
        for error in run.metrics.get("peak_errors") or []:
            stderr.print(f"{run.name}: {error}", highlight=False, markup=False, soft_wrap=True)
    if json_out is not None:
        from llmopt.core.io import write_json

        write_json(json_out, {"runs": [r.to_json() for r in runs]}, indent=1)
        stderr.print(f"wrote {json_out}")
    stdout.print(comparison_table(runs))


def comparison_table(runs):
    from rich.table import Table

    from llmopt.cli.output import format_value

    table = Table(title=f"llmopt bench: {runs[0].model}")
    table.add_column("metric")
    for run in runs:
        table.add_column(f"{run.name} ({run.config['backend']})", justify="right")
    if len(runs) == 2:
        table.add_column("ratio", justify="right")
    for key, label in SHOWN:
        values = [run.metrics.get(key) for run in runs]
        if all(v is None for v in values):
            continue
        cells = ["-" if v is None else format_value(v) for v in values]
        if len(runs) == 2:
            a, b = values
            cells.append(f"{a / b:.2f}x" if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else "-")
        table.add_row(label, *cells)
    return table

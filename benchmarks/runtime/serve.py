"""The HTTP server against the engine in-process, on one machine in one invocation.

Starts `llmopt serve MODEL` as a subprocess, then: (a) 64 requests x 128/128 at an unlimited rate over HTTP
vs the same workload through the engine in this process; (b) one request at a time (TTFT added by the server);
(c) 256 concurrent streams of 64 tokens (failures, p99 TTFT); (d) the server's RSS over 10,000 short requests,
after a warm-up that has written every page of its KV cache (the cache is committed lazily, block by block, so
before that RSS grows with the blocks first used, not with a leak).

    python benchmarks/runtime/serve.py [--model smollm2-135m] --json docs/results/data/serve.json
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import psutil

from llmopt.core.hardware import cpu_line
from llmopt.eval.bench import BenchConfig, HttpTarget, bench_http, bench_runtime
from llmopt.eval.workloads import WorkloadSpec
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: common.py
from common import command_line, load_rows, save_rows

KEYS = ("completed", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "duration")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, port: int, max_num_seqs: int | None = None, kv_cache_bytes: int | None = None,
                 checkout: str | None = None, quiet: bool = False) -> subprocess.Popen:
    """`llmopt serve MODEL` on the port, once /health answers; checkout: serve another checkout's llmopt."""
    options = [("--max-num-seqs", max_num_seqs), ("--kv-cache-bytes", kv_cache_bytes)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **({"PYTHONPATH": checkout} if checkout else {})}
    return started([sys.executable, "-m", "llmopt", "serve", model, "--port", str(port),
                    *(str(x) for flag, value in options if value is not None for x in (flag, value))],
                   port, env=env, cwd=checkout, quiet=quiet)


def started(command: list[str], port: int, env: dict | None = None, cwd: str | None = None,
            quiet: bool = True) -> subprocess.Popen:
    """A server process (llmopt's, or another with a /health route, as llama-server has), once /health answers
    on the port; SystemExit if it exits first or does not answer within 300 s."""
    output = subprocess.DEVNULL if quiet else None
    process = subprocess.Popen(command, env=env, cwd=cwd, stdout=output, stderr=output)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        if process.poll() is not None:
            raise SystemExit(f"{command[0]} exited with {process.returncode}")
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"{command[0]} did not answer /health within 300 s")


def server_ttft(port: int) -> tuple[float, float]:
    """(sum, count) of the server's own time-to-first-token histogram."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://127.0.0.1:{port}/metrics").text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["llmopt:time_to_first_token_seconds_sum"], values["llmopt:time_to_first_token_seconds_count"]


def section_b(model: str, port: int, target: HttpTarget) -> dict:
    """One request at a time: the engine in-process, the server over HTTP, and the same requests' TTFT as the
    client saw it against the server's own histogram (nothing else in the window) and, per request, against the
    server's Server-Timing header."""
    import statistics

    from llmopt.core.models import load_tokenizer, resolve_model
    from llmopt.eval.http_bench import run_http
    from llmopt.eval.workloads import build_workload

    spec, one = WorkloadSpec("random", 16, 128, 32, seed=3), BenchConfig(max_concurrency=1)
    out = {"b_offline": summary(bench_runtime("offline", model, spec, one)),
           "b_http": summary(bench_http("http", model, spec, one, target))}
    tokenizer = load_tokenizer(resolve_model(model))
    fresh = build_workload(WorkloadSpec("random", 16, 128, 32, seed=4), tokenizer, len(tokenizer))
    before = server_ttft(port)
    records, _ = run_http(target.base_url, "completions", model, fresh, tokenizer, 1)
    after = server_ttft(port)
    server_mean = 1000 * (after[0] - before[0]) / (after[1] - before[1])
    client = [1000 * r.ttft for r in records]
    out["b_ttft_client_ms"] = {"mean": round(statistics.mean(client), 2), "median": round(statistics.median(client), 2)}
    out["b_ttft_server_ms"] = {"mean": round(server_mean, 2), "count": after[1] - before[1]}
    out["b_ttft_added_ms"] = round(statistics.mean(client) - server_mean, 2)
    # per request, against the server's own TTFT in its Server-Timing header: the target's median
    added = [1000 * (r.ttft - r.server_ttft) for r in records]
    out["b_ttft_added_per_request_ms"] = {"mean": round(statistics.mean(added), 2),
                                          "median": round(statistics.median(added), 2),
                                          "max": round(max(added), 2)}
    return out


def summary(run) -> dict:
    return {k: round(run.metrics[k], 2) if isinstance(run.metrics.get(k), float) else run.metrics.get(k)
            for k in KEYS}


def main() -> None:
    parser = command_line(__doc__, default="docs/results/data/serve.json")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--short-requests", type=int, default=10_000)
    parser.add_argument("--kv-cache-bytes", type=int, default=2 << 30)
    parser.add_argument("--sections", default="abcd", help="a subset reruns those and keeps the JSON's others")
    args = parser.parse_args()
    port = free_port()
    target = HttpTarget(f"http://127.0.0.1:{port}/v1")
    results = load_rows(args.json, args.sections != "abcd") or {}
    results.update({"cpu": cpu_line(), "model": args.model})
    server = start_server(args.model, port, max_num_seqs=256, kv_cache_bytes=args.kv_cache_bytes)
    try:
        if "a" in args.sections:
            a = WorkloadSpec("random", 64, 128, 128)
            results["a_http"] = summary(bench_http("http", args.model, a, BenchConfig(), target))
            results["a_offline"] = summary(bench_runtime("offline", args.model, a, BenchConfig()))
        if "b" in args.sections:
            results.update(section_b(args.model, port, target))
        if "c" in args.sections:
            c = WorkloadSpec("random", 256, 32, 64)
            results["c_http_256_streams"] = summary(bench_http("http", args.model, c, BenchConfig(), target))
        if "d" in args.sections:
            rss = psutil.Process(server.pid)
            d = WorkloadSpec("random", 3000, 16, 2, seed=1)
            bench_http("http", args.model, d, BenchConfig(max_concurrency=64), target)  # every KV page written
            before = rss.memory_info().rss
            d = WorkloadSpec("random", args.short_requests, 16, 2, seed=2)
            run = bench_http("http", args.model, d, BenchConfig(max_concurrency=64), target)
            results["d_short_requests"] = {**summary(run), "rss_before": before, "rss_after": rss.memory_info().rss,
                                           "rss_growth_mb": round((rss.memory_info().rss - before) / 2**20, 1)}
    finally:
        server.terminate()
        results["server_exit_code"] = server.wait(60)
    save_rows(args.json, results)
    print(f"CPU: {results['cpu']}")
    if not {"a_http", "a_offline", "b_ttft_added_ms", "c_http_256_streams", "d_short_requests"} <= results.keys():
        for key in sorted(k for k in results if k[:2] in ("a_", "b_", "c_", "d_")):
            print(f"{key:<20} {results[key]}")
        return
    a_ratio = results["a_http"]["output_throughput"] / results["a_offline"]["output_throughput"]
    added = f"{results['b_ttft_added_ms']} / {results['b_ttft_added_per_request_ms']['median']}"
    for key in ("a_http", "a_offline", "b_http", "b_offline", "b_ttft_client_ms", "b_ttft_server_ms",
                "b_ttft_added_per_request_ms",
                "c_http_256_streams", "d_short_requests"):
        print(f"{key:<20} {results[key]}")
    print(f"(a) HTTP / offline output tok/s: {a_ratio:.3f}; "
          f"(b) TTFT added by the HTTP layer (client - server means / per-request median): {added} ms; "
          f"(c) completed {results['c_http_256_streams']['completed']} of 256; "
          f"(d) RSS growth {results['d_short_requests']['rss_growth_mb']} MB; "
          f"server exit {results['server_exit_code']}")


if __name__ == "__main__":
    main()
